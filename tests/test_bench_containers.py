"""bench/containers.py without running a job: its command line, the turns the sides take, the summary (medians,
ratios, the reference side, the 10 % target) from given lines, the settings both sides share, and, where Docker
answers, that compose merges its second file as meant (``docker compose config``: nothing is started)."""
from __future__ import annotations

import json

import pytest

from bench import containers
from tests.compose_util import compose_unavailable


def test_the_defaults_are_the_target_job_and_unknown_sides_are_refused(capsys):
    args = containers.parse([])
    assert (args.workers, args.params, args.repeat, args.sides, args.json) == (
        4, 1_000_000, 3, ["local-http", "local-auto", "compose"], False)
    assert args.project.startswith("syncpsbench") and args.max_steps >= 100_000
    assert containers.parse(["--sides", "compose", "--json"]).sides == ["compose"]
    assert containers.parse(["--sides", "local-http,swarm"]).sides == ["local-http", "swarm"]  # asked for by name
    with pytest.raises(SystemExit) as exc:
        containers.parse(["--sides", "local,kubernetes"])
    assert exc.value.code == 2 and "unknown ['kubernetes', 'local']" in capsys.readouterr().err


def test_the_sides_take_turns_going_first():
    sides = list(containers.DEFAULT_SIDES)
    assert [containers.order(r, sides)[0] for r in range(4)] == ["local-http", "local-auto", "compose", "local-http"]
    assert all(sorted(containers.order(r, sides)) == sorted(sides) for r in range(3))
    every = list(containers.SIDES)
    assert [containers.order(r, every)[0] for r in range(len(every) + 1)] == [*every, "local-http"]


def _lines(compose_transport: str) -> list[dict]:
    rates = {"local-http": [10.0, 12.0, 11.0], "local-auto": [20.0, 18.0, 22.0], "compose": [19.0, 17.0, None]}
    return [{"side": side, "run": run, "steps_per_s": rate, "cpu_ms_per_step": None if rate is None else 600 / rate,
             "transport": compose_transport if side == "compose" else ("http" if side == "local-http" else "shm")}
            for side, values in rates.items() for run, rate in enumerate(values)]


def test_the_summary_is_each_sides_median_over_the_local_side_of_compose_s_transport():
    rows = {row["side"]: row for row in containers.summarize(_lines("shm"))}
    assert list(rows) == ["local-http", "local-auto", "compose"]
    assert (rows["local-http"]["median_steps_per_s"], rows["local-auto"]["median_steps_per_s"]) == (11.0, 20.0)
    compose = rows["compose"]  # a failed run (None) is not counted
    assert (compose["runs"], compose["median_steps_per_s"], compose["against"]) == (2, 18.0, "local-auto")
    assert (compose["ratio"], compose["ratio_to_local_auto"], compose["ratio_to_local_http"]) == (0.9, 0.9, 1.636)
    assert compose["within_10pct"] is True
    assert (compose["median_cpu_ms_per_step"], rows["local-http"]["median_cpu_ms_per_step"]) == (33.44, 54.55)
    over_tcp = {row["side"]: row for row in containers.summarize(_lines("http"))}["compose"]
    assert (over_tcp["against"], over_tcp["ratio"]) == ("local-http", 1.636)
    slower = [{**line, "steps_per_s": 17.9} if line["side"] == "compose" else line for line in _lines("shm")]
    assert {row["side"]: row for row in containers.summarize(slower)}["compose"]["within_10pct"] is False


def test_the_swarm_side_is_measured_against_the_local_side_of_its_transport():
    """The swarm's workers reach the PS over the overlay (TCP): local-http is its reference, whatever compose used."""
    swarm = [{"side": "swarm", "run": run, "steps_per_s": rate, "transport": "http"}
             for run, rate in enumerate([9.0, 10.5, 10.0])]
    rows = {row["side"]: row for row in containers.summarize(_lines("shm") + swarm)}
    assert list(rows) == ["local-http", "local-auto", "compose", "swarm"]
    assert (rows["swarm"]["against"], rows["swarm"]["ratio"], rows["swarm"]["within_10pct"]) == ("local-http", 0.909, True)
    assert (rows["compose"]["against"], rows["compose"]["ratio"]) == ("local-auto", 0.9)
    assert rows["local-http"]["against"] == "local-auto"  # the local sides: against compose's reference, as before
    slower = [{**line, "steps_per_s": 9.0} for line in swarm]
    assert {row["side"]: row for row in containers.summarize(_lines("shm") + slower)}["swarm"]["within_10pct"] is False


def test_the_swarm_sides_place_the_workers_and_say_how_they_reach_the_ps():
    """Each swarm side is the same stack with the workers elsewhere; the published ones change their PS URL, the
    hostnet one adds deploy/swarm/hostnet.yml with the manager's address (the file sets the URL)."""
    layouts = {side: containers.swarm_layout(side, 4, "172.17.0.1", 23456) for side in containers.SWARM_LAYOUTS}
    published = {"WORKER_PS_URL": "http://172.17.0.1:23456"}
    assert layouts["swarm"] == ({"placement": {"max_replicas_per_node": 2}}, {}, {})
    assert layouts["swarm-published"] == (layouts["swarm"][0], published, {})
    assert layouts["swarm-hostnet"] == (layouts["swarm"][0], {}, {"files": (containers.HOSTNET_FILE,),
                                                                  "env": {"SYNCPS_PS_HOST": "172.17.0.1"}})
    assert containers.HOSTNET_FILE.is_file()
    assert layouts["swarm-manager"] == ({"placement": {"constraints": ["node.role == manager"]}}, {}, {})
    assert layouts["swarm-node2"] == ({"placement": {"constraints": ["node.role == worker"]}}, {}, {})
    assert layouts["swarm-node2-published"] == (layouts["swarm-node2"][0], published, {})
    assert layouts["swarm-node2-hostnet"] == (layouts["swarm-node2"][0], {}, layouts["swarm-hostnet"][2])
    assert set(containers.SWARM_LAYOUTS) <= set(containers.CONTAINED) and not set(containers.SWARM_LAYOUTS) & set(
        containers.DEFAULT_SIDES)
    args = containers.parse(["--sides", "local-http,swarm-manager,swarm-node2-published"])
    assert args.sides == ["local-http", "swarm-manager", "swarm-node2-published"]


def test_the_table_has_a_row_per_run_and_per_median():
    from bench.output import table
    lines = _lines("shm")
    text = table(lines + containers.summarize(lines), containers.COLUMNS)
    rows = text.splitlines()
    assert rows[0].split()[:4] == ["side", "run", "steps_per_s", "median_steps_per_s"]
    assert len(rows) == 2 + 9 + 3 and rows[-1].split()[:2] == ["compose", "median"]


def test_both_sides_get_the_same_settings():
    ps, worker = containers.job_settings(1_000_000, 4, 10**6)
    assert ps["PS_TOTAL_NUM_REPLICAS"] == ps["PS_MIN_WORKERS"] == 4 and ps["PS_MAX_STEPS"] == 10**6
    assert worker["WORKER_TASK"] == "bench.task:params_1000000"
    assert all(k.startswith("PS_") for k in ps) and all(k.startswith("WORKER_") for k in worker)


@pytest.mark.skipif(compose_unavailable() is not None, reason=str(compose_unavailable()))
def test_compose_merges_the_bench_mount_into_the_workers_only(tmp_path):
    ps, worker = containers.job_settings(1000, 2, 500)
    job = containers.ComposeJob("syncpsbenchtestconfig", "syncps:bench-containers", {**ps, **worker}, tmp_path)
    config = json.loads(job.compose("config", "--format", "json", timeout=60))
    mounts = {s: [(v["source"], v["target"], v.get("read_only", False)) for v in config["services"][s]["volumes"]]
              for s in ("ps", "worker")}
    assert (str(containers.ROOT / "bench"), "/app/bench", True) in mounts["worker"]
    assert all(target != "/app/bench" for _, target, _ in mounts["ps"])
    env = config["services"]["worker"]["environment"]
    assert env["WORKER_TASK"] == "bench.task:params_1000"
    assert config["services"]["ps"]["environment"]["PS_MIN_WORKERS"] == "2"
    assert config["services"]["ps"]["ports"][0]["published"] == str(job.port)
