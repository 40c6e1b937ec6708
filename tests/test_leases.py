"""Leases, comebacks and quorum in the sans-IO core (simulated clock): a dead worker leaves the round at
once, a restarted one rejoins at the next boundary with its old rank, the status says why a round waits,
a retried push is never applied twice, and a worker waiting on the barrier keeps its lease."""
from __future__ import annotations

import numpy as np
import pytest

from ps_service.core import ParameterServerCore
from tests.configs import core_config
from ps_service.http import REFUSALS, status_of
from shared.protocol import ModelInit, PushRequest, PushStatus

W0 = {"w": np.zeros((2,), np.float32)}


def make(n=3, **cfg):
    cfg = {"min_workers": n, "startup_grace_seconds": 0.0, "lease_seconds": 5.0, **cfg}
    core = ParameterServerCore(core_config(**cfg))
    core.init_model(ModelInit({"w": W0["w"].copy()}, {"name": "sgd", "learning_rate": 1.0}), 0.0)
    return core, [core.register(f"w{i}", 0.0)[0].worker_id for i in range(n)]


def push(core, wid, step, now, value=1.0):
    return core.push(PushRequest(wid, step, {"w": np.full(2, value, np.float32)}), now).status


def test_an_expired_worker_leaves_the_round_at_once_and_the_record_says_membership():
    core, ids = make()
    push(core, ids[0], 0, 1.0)
    push(core, ids[1], 0, 4.9)
    assert "1 more gradient(s) from w2" in core.wait_reason(4.9)
    core.tick(5.01)  # w2 last seen at 0.0, lease 5 s
    assert core.global_step == 1 and core.rounds[-1].reason == "membership"
    assert core.rounds[-1].missing == ("w2",) and core.rounds[-1].closed_at == 5.01
    assert ids[2] not in core.round.eligible


def test_a_restarted_worker_rejoins_at_the_next_boundary_with_its_rank():
    core, ids = make()
    push(core, ids[0], 0, 1.0)
    core.members.touch(ids[0], 4.0)
    core.tick(5.5)  # w1 and w2 expired: round 0 closes with w0 alone
    push(core, ids[0], 1, 5.6)  # round 1: w0 only -> closes
    push(core, ids[0], 2, 5.7)
    assert core.global_step == 3
    m, start = core.register("w1", 6.0)  # the restarted process, same name
    assert (m.worker_id, m.rank, start) == (ids[1], 1, 4)
    assert ids[1] not in core.round.eligible
    assert push(core, ids[1], 3, 6.1) is PushStatus.LATE  # not in the open round
    push(core, ids[0], 3, 6.2)
    assert core.global_step == 4 and core.round.eligible == {ids[0]: 0, ids[1]: 1}


def test_a_worker_back_in_the_round_it_died_in_is_not_waited_for_again():
    core, ids = make(lease_seconds=100.0)
    push(core, ids[0], 0, 1.0)
    core.members.by_id[ids[2]].lease_until = 1.0
    core.tick(1.5)  # w2 expired, w1 still owes its gradient
    m, start = core.register("w2", 2.0)
    assert start == 1 and ids[2] in core.round.gone and core.progress().needed == 1
    assert push(core, ids[2], 0, 2.1) is PushStatus.LATE
    push(core, ids[1], 0, 2.2)
    assert core.global_step == 1 and ids[2] in core.round.eligible  # back from the boundary on


def test_a_comeback_joins_the_open_round_when_nobody_else_is_alive():
    core, ids = make(n=2)
    core.leave(ids[1], 4.0)  # w1 leaves (heard), w0 died at 0
    core.tick(6.0)
    assert core.wait_reason(6.0).startswith("no live member")
    m, start = core.register("w0", 7.0)
    assert start == 0 and push(core, ids[0], 0, 7.1) is PushStatus.ACCEPTED and core.global_step == 1


def test_the_last_worker_standing_is_held_until_another_is_heard_from():
    core, ids = make(n=1)
    core.tick(6.0)  # silent since 0: the PS cannot tell a dead worker from its own outage
    assert core.members.get(ids[0]).active and core.wait_reason(6.0).startswith("no worker heard from for 6.0 s")
    m, start = core.register("w0", 7.0)  # back (a restart under its name, or the network): the same member
    assert start == 0 and push(core, ids[0], 0, 7.1) is PushStatus.ACCEPTED and core.global_step == 1


def test_a_restart_within_the_lease_keeps_the_round_waiting_for_it():
    core, ids = make()
    push(core, ids[0], 0, 1.0)
    m, start = core.register("w1", 2.0)  # restarted before its lease ran out: still the same member
    assert start == 0 and core.progress().needed == 2
    _, start0 = core.register("w0", 2.0)
    assert start0 == 1  # its gradient for round 0 is in: pull the next step


def test_below_the_quorum_after_the_deadline_the_status_says_why():
    core, ids = make(round_timeout_seconds=2.0, min_replicas=2, lease_seconds=100.0)
    push(core, ids[0], 0, 0.5)
    core.tick(3.0)
    assert core.global_step == 0
    assert core.wait_reason(3.0) == ("round deadline passed 1.0 s ago but below the quorum: "
                                     "1 of min_replicas 2 gradients")
    push(core, ids[1], 0, 3.1)
    core.tick(3.2)
    assert core.global_step == 1 and core.rounds[-1].reason == "deadline"


def test_the_status_says_what_start_up_waits_for():
    core = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=5.0))
    assert core.wait_reason(0.0) == "waiting for a worker to initialise the model"
    core.init_model(ModelInit({"w": W0["w"].copy()}, {}), 0.0)
    core.register("a", 0.0)
    assert core.wait_reason(0.0) == "waiting for workers: 1 of min_workers 2 registered"
    core.register("b", 1.0)
    assert core.wait_reason(1.0).startswith("start-up grace")


def test_a_retried_push_is_a_duplicate_across_the_boundary_and_a_comeback():
    core, ids = make(n=2)
    assert push(core, ids[0], 0, 1.0) is PushStatus.ACCEPTED
    assert push(core, ids[1], 0, 1.0) is PushStatus.ACCEPTED
    weights = core.weights["w"].copy()
    assert push(core, ids[0], 0, 1.1) is PushStatus.DUPLICATE  # the answer was lost: retried after the boundary
    core.tick(7.0)  # both expired
    core.register("w0", 7.0)
    assert push(core, ids[0], 0, 7.1) is PushStatus.DUPLICATE  # still never applied twice
    np.testing.assert_array_equal(core.weights["w"], weights)
    assert core.push_counts["accepted"] == 2 and core.push_counts["duplicate"] == 2


def test_after_a_restore_the_restored_round_is_redone_not_a_duplicate():
    core, ids = make(n=2)
    push(core, ids[0], 0, 1.0)
    push(core, ids[1], 0, 1.0)
    state = core.export_state()
    push(core, ids[0], 1, 1.2)  # accepted, then the PS dies before round 1 closes
    back = ParameterServerCore(core.config)
    back.import_state(state, 10.0)
    assert back.state().value == "waiting_for_workers" and back.resume_expected == 2
    for i in range(2):
        back.register(f"w{i}", 10.0)
    assert back.started  # every member the checkpoint had is back: no grace
    assert push(back, ids[0], 1, 10.1) is PushStatus.ACCEPTED


def test_a_member_waiting_on_the_barrier_keeps_its_lease():
    """A long-poll pull holds its worker's lease for as long as it waits (docs/protocol.md); its heartbeats go on
    meanwhile (a wait is no sign of life: the PS's own outage looks the same)."""
    core, ids = make(n=2, lease_seconds=2.0)
    assert push(core, ids[0], 0, 0.5) is PushStatus.ACCEPTED
    core.members.begin_wait(ids[0], 0.5)  # w0 waits for round 0 to close; w1 computes, and dies
    for t in (1.2, 1.9):
        core.members.touch(ids[0], t)  # w0's heartbeats go on while it waits: the silence is w1's, not the PS's
    core.tick(2.6)  # w1, silent since 0.0, expires (the round closes without it); w0 waits on
    assert core.members.by_id[ids[1]].state == "expired" and core.global_step == 1
    core.tick(10.0)  # 9.5 s of waiting with a 2 s lease
    assert core.members.by_id[ids[0]].state == "active"
    core.members.end_wait(ids[0], 10.0)  # answered: the lease runs from now
    assert core.members.by_id[ids[0]].lease_until == 12.0
    core.tick(11.9)
    assert core.members.by_id[ids[0]].state == "active" and push(core, ids[0], 1, 11.9) is PushStatus.ACCEPTED
    # nobody was heard from 1.9 to 11.9 (a silence: w0 waited): w0's push ended it, every lease 2 + 5 s from then
    w9 = core.register("w9", 12.5)[0].worker_id  # another worker heard from: w0's silence is its own
    for t in np.arange(13.0, 19.0, 0.5):
        core.members.touch(w9, t)
        core.tick(t)
    assert core.members.by_id[ids[0]].state == "active"
    core.tick(19.0)  # not waiting, silent for 7.1 s
    assert core.members.by_id[ids[0]].state == "expired"


def test_waits_nest_and_ending_one_never_raises():
    core, ids = make(n=2, lease_seconds=2.0)
    core.members.begin_wait(ids[0], 0.0)
    core.members.begin_wait(ids[0], 1.0)  # two pulls in flight (a retry overlapping a timed-out one)
    core.members.end_wait(ids[0], 1.5)
    for t in (1.5, 2.5, 3.5, 4.5):
        core.members.touch(ids[1], t)  # w1's heartbeats: the PS is not cut off
    core.tick(5.0)
    assert core.members.by_id[ids[0]].state == "active"  # one wait still holds it
    core.members.end_wait(ids[0], 5.0)
    core.register("w9", 7.0)  # another worker heard from: w0's silence is its own
    core.tick(7.5)
    assert core.members.by_id[ids[0]].state == "expired"
    core.members.end_wait(ids[0], 8.0)  # unmatched, on an expired member, and an unknown id: no effect
    core.members.end_wait("nope", 8.0)
    assert core.members.by_id[ids[0]].state == "expired" and ids[0] not in core.members.waits


def test_begin_wait_is_a_heartbeat_that_refuses_unknown_and_inactive_workers():
    core, ids = make(n=2)
    core.leave(ids[1], 1.0)
    for wid, code in (("nope", 404), (ids[1], 409)):
        with pytest.raises(REFUSALS) as err:
            core.members.begin_wait(wid, 1.0)
        assert status_of(err.value) == code
    assert core.members.begin_wait(ids[0], 3.0).lease_until == 8.0 and core.members.waits == {ids[0]: 1}
