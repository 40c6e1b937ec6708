"""bench/partition.py without a swarm: its command line and what it makes of the samples it takes (the stall, when
every worker is back); the cut itself runs in tests/test_swarm.py's two-node test and in the bench."""
from __future__ import annotations

from bench import partition


def test_the_defaults_are_the_two_cuts_of_the_issue_on_the_stack_as_shipped():
    args = partition.parse([])
    assert (args.cuts, args.repeat, args.heartbeat, args.lease, args.json) == ([10.0, 20.0], 1, None, None, False)
    assert partition.parse(["--cuts", "5", "--heartbeat", "20", "--json"]).cuts == [5.0]


def test_the_stall_is_the_longest_time_without_a_new_step_from_the_cut_on():
    # (time, global step, active workers): steps every 0.1 s, none from 1.2 to 11.0 (the lease), then on with 2
    samples = [(0.1 * i, i, 4) for i in range(13)] + [(11.0, 13, 2), (11.1, 14, 2), (12.0, 15, 2), (12.5, 15, 4)]
    assert round(partition.stalled(samples, since=1.0), 2) == 9.8
    assert round(partition.stalled(samples, since=11.05), 2) == 0.9  # from 11.1 to 12.0
    assert round(partition.stalled([(0.0, 5, 4), (3.0, 5, 4)], since=0.5), 2) == 2.5  # stalled to the last sample


def test_every_worker_is_back_from_the_first_sample_of_the_last_run_of_full_ones():
    samples = [(0.0, 1, 2), (1.0, 2, 4), (2.0, 3, 3), (3.0, 4, 4), (4.0, 5, 4)]
    assert partition.all_back(samples, since=0.5, workers=4) == 2.5  # 4 at 1.0, but 3 again at 2.0
    assert partition.all_back(samples[:3], since=0.5, workers=4) is None  # not all back at the end
    assert partition.all_back(samples, since=5.0, workers=4) is None  # no sample after
