"""The monitoring REST API against a real PS and real worker processes: numbers, the straggler, OpenAPI,
the workers' progress logs, and ``make run``'s summary."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
from ps_service.core import ParameterServerCore
from tests.configs import core_config
from ps_service.monitoring import current_round, throughput
from ps_service.core.rounds import Arrival
from ps_service.core.rounds import straggler
from shared.protocol import ModelInit, PushRequest

STEPS = 16
BATCH = 32
SLOW = "worker-2"
DELAY = 0.25  # WORKER_COMPUTE_DELAY_SECONDS of the slow worker on a quiet machine (the job's: its "delay")


def awaiting_slow(c: LocalCluster):
    st = c.status()
    r = st["round"]
    return st if r and r["awaited"] == [SLOW] and len(r["pushed_by"]) == 2 else None


@pytest.fixture(scope="module")
def job():
    """3 workers, worker-2 slowed by allow(DELAY) per step (its lead over the others must not drown in a loaded
    machine's jitter: the others' steps slow down too); snapshots before, during and after training."""
    c = LocalCluster(3, ps_env={"PS_MAX_STEPS": STEPS, "PS_STARTUP_GRACE_SECONDS": 0},
                     worker_env={"WORKER_LOG_EVERY_SECONDS": 0.5, "WORKER_BATCH_SIZE": BATCH})
    try:
        c.start_ps()
        out = {"readyz_before": c.get("/readyz"), "status_before": c.status(), "delay": allow(DELAY)}
        for i in range(3):
            c.start_worker(i, env={"WORKER_COMPUTE_DELAY_SECONDS": out["delay"]} if f"worker-{i}" == SLOW else None)
        out["during"] = wait_for(lambda: awaiting_slow(c), allow(60), "a round awaiting only the slow worker")
        out["codes"] = c.wait_workers(allow(90))
        out["status"] = c.status()
        out["workers"] = c.get("/v1/workers").json()
        out["rounds"] = c.get("/v1/rounds", params={"limit": 1000}).json()
        out["round3"] = c.get("/v1/rounds/3")
        out["round_missing"] = c.get("/v1/rounds/999")
        out["bad_limit"] = c.get("/v1/rounds", params={"limit": 0})
        out["loss"] = c.get("/v1/loss").json()
        out["loss_since"] = c.get("/v1/loss", params={"since": STEPS - 4}).json()
        out["openapi"] = c.get("/openapi.json").json()
        out["readyz_after"] = c.get("/readyz")
        out["healthz"] = c.get("/healthz")
        out["logs"] = {f"worker-{i}": c.log(f"worker-{i}") for i in range(3)}
        out["all_logs"] = c.logs()
    except Exception as exc:
        c.stop()
        raise AssertionError(f"job failed: {exc}; logs:\n{c.logs()}") from exc
    yield out
    c.stop()


def test_readiness_and_state_before_any_worker(job):
    r = job["readyz_before"]
    assert r.status_code == 503 and r.json()["error"] == "not_ready"
    st = job["status_before"]
    assert st["state"] == "waiting_for_model" and st["global_step"] == 0 and st["round"] is None
    assert st["workers"]["registered"] == 0 and st["throughput"]["rounds_per_second"] == 0
    assert job["healthz"].json() == {"status": "ok"}
    assert job["readyz_after"].status_code == 200 and job["readyz_after"].json()["state"] == "done"


def test_open_round_shows_who_pushed_and_who_is_awaited(job):
    r = job["during"]["round"]
    assert sorted(r["pushed_by"]) == ["worker-0", "worker-1"] and r["awaited"] == [SLOW]
    assert r["still_needed"] == 1 and sorted(r["eligible"]) == ["worker-0", "worker-1", "worker-2"]
    assert job["during"]["state"] == "training" and SLOW in job["during"]["wait_reason"]


def test_status_numbers_after_the_job(job):
    assert job["codes"] == [0, 0, 0], job["all_logs"]
    st = job["status"]
    assert st["state"] == "done" and st["global_step"] == STEPS and st["progress"] == 1.0
    assert st["pushes"] == {"accepted": 3 * STEPS, "stale": 0, "late": 0, "duplicate": 0, "skipped": 0}
    assert st["examples"] == 3 * STEPS * BATCH
    assert st["mode"] == "elastic" and st["replicas_to_aggregate"] is None and st["round"] is None
    assert st["optimizer"] == {"name": "sgd", "learning_rate": 0.5}
    assert st["workers"] == {"active": 0, "expired": 0, "left": 3, "registered": 3, "membership_changes": 6,
                             "leases_held": False}
    assert st["loss"]["last"] == job["loss"]["loss"][-1]
    assert st["loss"]["moving_average"] == pytest.approx(np.mean(job["loss"]["loss"][-16:]))
    # local workers share the PS's host: gradients come through their files, weights through the PS's
    assert st["bytes_received"] > 0 and st["shm_bytes_received"] > 0 and st["checkpoint"] is None
    # 16 rounds of >= DELAY each: the mean rate is at most 1/DELAY
    assert 0 < st["throughput"]["mean_rounds_per_second"] <= 1 / job["delay"] * 1.01
    assert st["uptime_seconds"] > STEPS * job["delay"] and st["training_started_at"] > st["started_at"]


def test_rounds_name_the_straggler_and_what_it_cost(job):
    rounds = job["rounds"]["rounds"]
    assert [r["step"] for r in rounds] == list(range(STEPS - 1, -1, -1))  # one record per global step, newest first
    for r in rounds:
        assert r["aggregated"] == 3 and r["eligible"] == 3 and r["reason"] == "full"
        assert [c["order"] for c in r["contributors"]] == [1, 2, 3]
        assert r["contributors"][-1]["name"] == SLOW and r["missing"] == [] and r["late"] == []
        assert r["examples"] == 3 * BATCH
        s = r["straggler"]
        assert s["name"] == SLOW and s["kind"] == "last_arrival"
        # the slow worker pulls when the round opens and adds DELAY: the round lasts at least that
        assert r["duration_seconds"] >= job["delay"] - 1e-3
        assert s["after_seconds"] == pytest.approx(r["duration_seconds"])
        second = r["contributors"][-2]["after_seconds"]
        assert s["waited_seconds"] == pytest.approx(r["duration_seconds"] - second)
        assert s["waited_seconds"] > job["delay"] / 2
        assert s["behind_first"] >= s["behind_median"] == pytest.approx(s["waited_seconds"])
    top = job["rounds"]["stragglers"][0]
    assert top["name"] == SLOW and top["rounds"] == STEPS
    assert top["waited_seconds"] == pytest.approx(sum(r["straggler"]["waited_seconds"] for r in rounds))
    assert job["round3"].json()["step"] == 3 and job["round3"].json()["straggler"]["name"] == SLOW
    assert job["round_missing"].status_code == 404 and job["round_missing"].json()["error"] == "unknown_round"
    assert job["bad_limit"].status_code == 400 and job["bad_limit"].json()["error"] == "bad_request"


def test_workers_counts_phase_times_and_straggler(job):
    ws = job["workers"]
    assert ws["straggler"] == SLOW and ws["window_rounds"] == STEPS
    by = {w["name"]: w for w in ws["workers"]}
    assert sorted(by) == ["worker-0", "worker-1", "worker-2"] and sorted(w["rank"] for w in by.values()) == [0, 1, 2]
    for name, w in by.items():
        assert w["pushes"] == {"accepted": STEPS, "stale": 0, "late": 0, "duplicate": 0, "skipped": 0}
        assert w["state"] == "left" and w["last_step"] == STEPS - 1 and w["last_push_status"] == "accepted"
        assert w["straggler_rounds"] == (STEPS if name == SLOW else 0)
    slow, fast = by[SLOW]["mean_seconds"], [by[n]["mean_seconds"] for n in ("worker-0", "worker-1")]
    assert slow["compute"] >= 0.9 * job["delay"]
    for f in fast:  # the fast ones compute quickly, then wait for the slow one at the barrier (in push or fetch)
        assert f["compute"] < job["delay"] / 2 and f["fetch"] + f["push"] > job["delay"] / 2
    assert [e["event"] for e in ws["events"]].count("joined") == 3
    assert [e["event"] for e in ws["events"]].count("left") == 3


def test_loss_curve(job):
    curve = job["loss"]
    assert curve["steps"] == list(range(STEPS)) and curve["global_step"] == STEPS
    assert curve["loss"][-1] < curve["loss"][0]
    assert job["loss_since"]["steps"] == list(range(STEPS - 3, STEPS))


def test_openapi_documents_the_monitoring_schemas(job):
    spec = job["openapi"]
    for path, model in (("/v1/status", "Status"), ("/v1/workers", "Workers"), ("/v1/rounds", "Rounds"),
                        ("/v1/rounds/{step}", "RoundRecord"), ("/v1/loss", "LossCurve")):
        schema = spec["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith(f"/{model}")
    comps = spec["components"]["schemas"]
    assert {"waited_seconds", "behind_median", "kind"} <= set(comps["Straggler"]["properties"])
    assert comps["Straggler"]["properties"]["waited_seconds"]["description"]
    assert {"/", "/metrics", "/healthz", "/readyz"} <= set(spec["paths"])


def test_worker_logs_progress_lines_and_a_final_line(job):
    for name, text in job["logs"].items():
        progress = re.findall(r"progress: step (\d+) loss \S+ \| ([\d.]+) rounds/s \| own mean fetch ([\d.]+) ms "
                              r"compute ([\d.]+) ms push ([\d.]+) ms", text)
        assert progress, text[-2000:]
        assert all(float(p[1]) > 0 for p in progress)
        final = re.search(r"FINISHED: training done at global step (\d+) after [\d.]+ s: (\d+) pushes \(accepted (\d+)\)"
                          r", [\d.]+ rounds/s, own mean fetch [\d.]+ ms compute ([\d.]+) ms", text)
        assert final and int(final[1]) == STEPS and int(final[2]) == int(final[3]) == STEPS, text[-2000:]
        if name == SLOW:
            assert float(final[4]) >= 0.9 * job["delay"] * 1e3


def test_straggler_definition():
    a = [Arrival("ia", "a", 0, 1.0), Arrival("ib", "b", 1, 1.2), Arrival("ic", "c", 2, 2.0)]
    s = straggler(0.5, 2.0, a, [])
    assert (s.name, s.kind) == ("c", "last_arrival")
    assert s.waited_seconds == pytest.approx(0.8) and s.behind_first == pytest.approx(1.0)
    assert s.behind_median == pytest.approx(0.8) and s.after_seconds == pytest.approx(1.5)
    s = straggler(0.5, 3.0, a[:2], [("z", 5), ("y", 3)])  # closed 1.8 s after the last arrival without y and z
    assert (s.name, s.rank, s.kind) == ("y", 3, "never_arrived") and s.waited_seconds == pytest.approx(1.8)
    assert straggler(0.5, 1.0, a[:1], []) is None
    # R of N: the round closed on its R-th arrival; the dropped backup is missing but not the straggler
    assert straggler(0.5, 1.2, a[:2], [("c", 2)]).name == "b"


def test_round_deadline_records_the_member_that_never_came():
    """Sans-IO: a round that closes at its deadline names the missing member and the wait it caused."""
    core = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=0, round_timeout_seconds=2.0))
    core.init_model(ModelInit({"w": np.zeros(2, np.float32)}, {"name": "sgd", "learning_rate": 0.1}), 0.0)
    ids = [core.register(f"w{i}", 0.0)[0].worker_id for i in range(2)]
    core.push(PushRequest(ids[0], 0, {"w": np.ones(2, np.float32)}), 0.5)
    core.tick(2.5)
    rec = core.rounds[-1]
    assert rec.reason == "deadline" and rec.missing == ("w1",)
    assert asdict(rec.straggler) == {"name": "w1", "rank": 1, "kind": "never_arrived", "waited_seconds": 2.0,
                                     "after_seconds": 2.5, "behind_first": 2.0, "behind_median": 2.0}


def test_throughput_is_not_capped_by_the_kept_rounds():
    """Sans-IO, simulated clock: 2500 rounds/s for 6 s (15000 rounds, the core keeps 1000 records);
    the rates come from counters over a sliding window."""
    core = ParameterServerCore(core_config(min_workers=1, startup_grace_seconds=0, lease_seconds=100.0))
    core.init_model(ModelInit({"w": np.zeros(2, np.float32)}, {"name": "sgd", "learning_rate": 0.1}), 0.0)
    wid = core.register("w0", 0.0)[0].worker_id
    assert throughput(core, 0.0)["rounds_per_second"] == 0
    for step in range(15000):
        core.push(PushRequest(wid, step, {"w": np.ones(2, np.float32)}, num_examples=4), (step + 1) / 2500)
    assert len(core.rounds) == 1000 and core.global_step == 15000
    t = throughput(core, 6.0)
    assert t["rounds_per_second"] == pytest.approx(2500, rel=1e-3)
    assert t["examples_per_second"] == pytest.approx(10000, rel=1e-3)
    assert t["window_seconds"] == pytest.approx(6.0) and t["mean_rounds_per_second"] == pytest.approx(2500, rel=1e-3)
    for now in np.arange(6.1, 12.0, 0.1):  # idle: the ticker goes on sampling
        core.tick(float(now))
    t = throughput(core, 12.0)
    since = 12.0 - t["window_seconds"]  # the window starts at a sample of the counters, 10 s old or a bit more
    assert 10.0 <= t["window_seconds"] <= 10.2
    assert t["rounds_per_second"] == pytest.approx((6.0 - since) * 2500 / t["window_seconds"], rel=1e-3)
    core.tick(16.5)
    assert throughput(core, 16.5)["rounds_per_second"] == 0


def test_the_open_round_shows_an_unreachable_r():
    """Sans-IO: fixed R = 3, w2 leaves after w0 pushed: /v1/status's round says R is out of reach."""
    core = ParameterServerCore(core_config(min_workers=3, startup_grace_seconds=0, replicas_to_aggregate=3))
    core.init_model(ModelInit({"w": np.zeros(2, np.float32)}, {"name": "sgd", "learning_rate": 0.1}), 0.0)
    ids = [core.register(f"w{i}", 0.0)[0].worker_id for i in range(3)]
    core.push(PushRequest(ids[0], 0, {"w": np.ones(2, np.float32)}), 0.5)
    core.leave(ids[2], 1.0)
    rt = SimpleNamespace(core=core, now=lambda: 1.5, started_wall=1000.0, started_mono=0.0)
    r = current_round(rt)
    assert (r["unreachable"], r["still_needed"], r["awaited"], r["pushed_by"]) == (True, 1, ["w1"], ["w0"])
    assert r["eligible"] == ["w0", "w1", "w2"] and core.progress().effective == 2
    core.push(PushRequest(ids[1], 0, {"w": np.ones(2, np.float32)}), 2.0)
    assert core.rounds[-1].reason == "unreachable" and core.rounds[-1].replicas_to_aggregate == 3


def test_backup_workers_show_late_pushes_and_late_state():
    """R=2 of N=3: worker-2 (slower than a round) pushes late; /v1/workers says so, /v1/rounds lists where."""
    steps = 20
    c = LocalCluster(3, ps_env={"PS_MAX_STEPS": steps, "PS_REPLICAS_TO_AGGREGATE": 2, "PS_TOTAL_NUM_REPLICAS": 3},
                     worker_env={"WORKER_COMPUTE_DELAY_SECONDS": 0.1, "WORKER_LOG_EVERY_SECONDS": 60})
    try:
        c.start_ps()
        for i in range(3):
            c.start_worker(i, env={"WORKER_COMPUTE_DELAY_SECONDS": 0.15} if i == 2 else None)

        def slow_is_late():
            ws = {w["name"]: w for w in c.get("/v1/workers").json()["workers"]}
            return SLOW in ws and ws[SLOW]["state"] == "late"

        wait_for(slow_is_late, allow(60), "worker-2 to show as late")
        st_during = c.status()
        assert c.wait_workers(allow(90)) == [0, 0, 0]
        st = c.status()
        ws = {w["name"]: w for w in c.get("/v1/workers").json()["workers"]}
        rounds = c.get("/v1/rounds", params={"limit": 1000}).json()["rounds"]
    except Exception:
        raise AssertionError(f"job failed; logs:\n{c.logs()}")
    finally:
        c.stop()
    assert st_during["mode"] == "fixed" and st_during["replicas_to_aggregate"] == 2
    assert st_during["total_num_replicas"] == 3 and st_during["effective_replicas_to_aggregate"] == 2
    assert st["global_step"] == steps and len(rounds) == steps
    assert all(r["aggregated"] == 2 for r in rounds) and st["pushes"]["accepted"] == 2 * steps
    late = ws[SLOW]["pushes"]["late"]
    assert late >= 1 and st["pushes"]["late"] == sum(w["pushes"]["late"] for w in ws.values())
    # every late push is listed in the round it was late for
    assert sum(e["name"] == SLOW for r in rounds for e in r["late"]) == late
    for r in rounds:
        names = [x["name"] for x in r["contributors"]]
        assert r["straggler"]["name"] == names[-1] and sorted(r["missing"] + names) == ["worker-0", "worker-1", "worker-2"]


def test_make_run_shows_progress_and_summary_table():
    out = subprocess.run([sys.executable, "-m", "cluster", "--workers", "2", "--steps", "30",
                          "--deadline", str(allow(90))],
                         capture_output=True, text=True, timeout=allow(150), env={**os.environ, "COLUMNS": "120"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "30/30" in text and "done: every worker exited 0" in text
    assert re.search(r"global step 30, last loss \S+, [\d.]+ rounds/s", text)
    rows = re.findall(r"^\s*[01]\s+(worker-[01])(?: \*)?\s+left\s+shm\s+30\s+0\s+0\s+0\s", text, re.M)  # accepted 30, no others
    assert sorted(rows) == ["worker-0", "worker-1"], text[-3000:]
    assert "straggler: worker-" in text and "/metrics" in text
