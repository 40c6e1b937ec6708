"""PS_MODE=async|ssp against real servers: a PS process and 4 worker processes (one slowed) training to done;
an in-process uvicorn PS (tests/live_ps.py) for the SSP wait released by a leave or a lease expiry, a
checkpoint restore in ssp, same-host pulls answered in the body, and the PyTorch bridge."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from shared import frame
from shared.errors import ProtocolError
from tests.live_ps import live_ps
from tests.timing import allow
from worker_service.loop import Heartbeat

W = {"w": np.zeros(4, np.float32)}
G = {"w": np.ones(4, np.float32)}
SGD = {"name": "sgd", "learning_rate": 0.1}
STEPS = 120
#: worker-3's extra seconds a step on a quiet machine. It sleeps allow(DELAY): a loaded machine slows every worker's
#: step but not a sleep, and a fixed one would no longer make worker-3 the slow one (the async test's 2x)
DELAY = 0.05


def run_slowed_job(ps_env: dict) -> tuple[dict, list[dict], list[int], str, list[int]]:
    """4 workers (linear task), worker-3 slowed by allow(DELAY) s per step, to PS_MAX_STEPS; (status, workers, exit
    codes, logs, spreads seen by polling /v1/status meanwhile)."""
    c = LocalCluster(4, ps_env={"PS_MAX_STEPS": STEPS, "PS_LEASE_SECONDS": 10, **ps_env},
                     worker_env={"WORKER_TASK": "linear", "WORKER_SHM_DIR": ""})
    spreads: list[int] = []
    try:
        c.start_ps()
        for i in range(4):
            c.start_worker(i, {"WORKER_COMPUTE_DELAY_SECONDS": allow(DELAY) if i == 3 else 0})

        def finished():
            st = c.status()
            if st["clocks"] is not None and st["clocks"]["live"]:
                spreads.append(st["clocks"]["spread"])
            return all(p.poll() is not None for p in c.workers)

        wait_for(finished, allow(120), "the workers to finish", interval=0.1)
        codes = [p.returncode for p in c.workers]
        return c.status(), c.get("/v1/workers").json()["workers"], codes, c.logs(20000), spreads
    except BaseException:
        c.mark_failed()
        raise
    finally:
        c.stop()


@pytest.mark.parametrize("mode,bound", [("async", None), ("ssp", 1)])
def test_four_workers_one_slowed_train_to_done(mode, bound):
    env = {"PS_MODE": mode} | ({"PS_SSP_STALENESS": bound} if bound is not None else {})
    st, workers, codes, logs, spreads = run_slowed_job(env)
    assert codes == [0, 0, 0, 0], logs
    assert st["state"] == "done" and st["training_mode"] == mode and st["global_step"] == STEPS
    assert st["pushes"]["accepted"] == STEPS == st["gradients_applied"] == st["staleness"]["applied"]
    for bad in ("Traceback", "retrying", "got no answer", " 500 "):
        assert bad not in logs, logs
    applied = {w["name"]: w["staleness"]["applied"] for w in workers}
    clocks = {w["name"]: w["clock"] for w in workers}
    assert sum(applied.values()) == STEPS and st["staleness"]["p50"] is not None
    fast = [applied[f"worker-{i}"] for i in range(3)]
    if mode == "async":  # nobody waits for the slow worker: it brings far fewer gradients
        assert applied["worker-3"] < min(fast) / 2, applied
        assert st["clocks"]["max_spread"] > 2
    else:  # the bound holds the fast ones: never more than s + 1 clocks apart, as the PS recorded
        assert st["clocks"]["max_spread"] <= bound + 1 and max(spreads, default=0) <= bound + 1
        assert max(clocks.values()) - min(clocks.values()) <= bound + 1, clocks
        assert any(w["pushes"]["accepted"] for w in workers if w["name"] == "worker-3")


def start_two(ps, lease_ok=True):
    """Two registered workers a, b on an ssp s=0 PS; a pushed step 0 and is one clock ahead: its pull waits."""
    a, b = ps.client(), ps.client()
    ida = a.register("a")["worker_id"]
    a.init_model(W, SGD)
    idb = b.register("b")["worker_id"]
    wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
    assert a.pull(0, ida, 5.0).step == 0
    assert a.push(ida, 0, G)["status"] == "accepted"
    return a, b, ida, idb


@pytest.mark.parametrize("release", ["leave", "expiry"])
def test_a_leave_or_an_expired_lease_releases_the_ssp_wait_at_once(release):
    # b's lease must outlast the checks of a's wait below, which a loaded machine slows down
    lease = allow(1.0) if release == "expiry" else 30.0
    with live_ps(mode="ssp", ssp_staleness=0, min_workers=2, startup_grace_seconds=0, lease_seconds=lease,
                 tick_seconds=0.05) as ps:
        a, b, ida, idb = start_two(ps)
        got: dict = {}
        longest = lease + allow(10)  # a's pull waits longer than b's lease runs
        t = threading.Thread(target=lambda: got.update(pulled=a.pull(1, ida, longest), at=time.monotonic()))
        t.start()
        with ps.http() as http:
            blocked = wait_for(lambda: next(w["blocked"] for w in http.get("/v1/workers").json()["workers"]
                                            if w["name"] == "a"), allow(5), "a's pull to wait")
            assert blocked["clock"] == 1 and blocked["needs"] == 1 and blocked["stragglers"][0]["name"] == "b"
            assert "a at clock 1 waits for clock >= 1: b at 0" in http.get("/v1/status").json()["wait_reason"]
        t0 = time.monotonic()
        if release == "leave":
            b.leave(idb)
        else:  # a's heartbeats go on while it waits, as the stock worker's: the PS hears it, so b's silence is b's
            beats = Heartbeat.of(a, ida, lease)
        try:
            t.join(longest)
        finally:
            if release != "leave":
                beats.halt.set()
                beats.join(allow(10))
        assert got["pulled"] is not None and got["pulled"].step == 1
        waited = got["at"] - t0
        assert waited < (allow(0.5) if release == "leave" else lease + allow(1.0)), waited
        assert ps.rt.core.members.by_id[idb].state == ("left" if release == "leave" else "expired")
        a.close(), b.close()


def test_ssp_checkpoint_restore_keeps_the_clocks(tmp_path):
    cfg = dict(mode="ssp", ssp_staleness=1, min_workers=2, startup_grace_seconds=0, checkpoint_dir=str(tmp_path),
               checkpoint_every_steps=1)
    with live_ps(**cfg) as ps:
        a, b, ida, idb = start_two(ps)
        assert b.pull(0, idb, 5.0) is not None and b.push(idb, 0, G)["status"] == "accepted"  # staleness 1
        assert a.pull(1, ida, 5.0).step == 1 and a.push(ida, 1, G)["status"] == "accepted"  # its push's answer
        saved = {ida: 2, idb: 1}
        a.close(), b.close()
    with live_ps(**cfg) as ps:
        st = ps.http().get("/v1/status").json()
        assert st["global_step"] == 3 and st["clocks"]["live"] == 0 and st["training_mode"] == "ssp"
        a, b = ps.client(), ps.client()
        with pytest.raises(ProtocolError) as exc:  # a push from before the restart: register first
            a.push(ida, 3, G)
        assert exc.value.code == "not_active"
        # each comes back at max(its saved clock, the slowest live clock): the slower one first keeps both
        assert b.register("b")["worker_id"] == idb and a.register("a")["worker_id"] == ida
        assert {i: ps.rt.core.modes.workers[i].clock for i in saved} == saved
        wait_for(lambda: ps.rt.core.started, allow(10), "training to resume")
        assert b.pull(3, idb, 5.0).step == 3 and b.push(idb, 3, G)["status"] == "accepted"
        assert a.pull(3, ida, 5.0).step == 4 and a.push(ida, 4, G)["status"] == "accepted"
        np.testing.assert_allclose(ps.rt.core.weights["w"], -0.5 * np.ones(4, np.float32), rtol=1e-6)
        a.close(), b.close()


def test_same_host_pulls_get_the_weights_in_the_body_in_async(tmp_path):
    """The optimizer updates the weights file in place at every push: a same-host worker gets a snapshot."""
    with live_ps(mode="async", min_workers=1, startup_grace_seconds=0, shm_dir=str(tmp_path)) as ps:
        c = ps.client(shm_dir=str(tmp_path))
        wid = c.register("a")["worker_id"]
        c.init_model(W, SGD)
        assert c.attach(wid) == "shm"
        first = c.pull(0, wid, 5.0)
        assert c.push(wid, 0, G)["status"] == "accepted" and ps.rt.tensors.shm.bytes_in > 0  # the push went by file
        second = c.pull(1, wid, 5.0)
        assert second.step == 1 and first.tensors["w"][0] == 0 and second.tensors["w"][0] == np.float32(-0.1)
        with ps.http() as http:
            body = http.get("/v1/model", params={"shm": 1, "worker_id": wid}).content
        f = frame.decode(body)
        assert "shm" not in f.meta and f.meta["ranks"] == [0] and list(f.tensors) == ["w"]
        c.close()


def test_the_pytorch_bridge_trains_in_ssp():
    torch = pytest.importorskip("torch")
    from syncps.torch import connect
    steps = 30
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[0.1], [0.2], [0.3]])
    with live_ps(mode="ssp", ssp_staleness=1, min_workers=2, startup_grace_seconds=0, max_steps=steps) as ps_:
        results: dict = {}

        def worker(name):
            model = torch.nn.Linear(3, 1)
            with connect(model, torch.optim.SGD(model.parameters(), lr=0.1), url=ps_.url, name=name,
                         retry_timeout=allow(20)) as ps:
                statuses = []
                while not ps.should_stop:
                    ps.zero_grad()
                    lo, hi = 8 * ps.position, 8 * ps.position + 8
                    torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
                    statuses.append(ps.step())
                results[name] = statuses

        threads = [threading.Thread(target=worker, args=(n,)) for n in ("p", "q")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(allow(60))
        st = httpx.get(f"{ps_.url}/v1/status", timeout=allow(5)).json()
    assert st["state"] == "done" and st["pushes"]["accepted"] == steps and st["clocks"]["max_spread"] <= 2
    assert all(s in ("accepted", "stale", "done") for r in results.values() for s in r) and len(results) == 2


def test_metrics_and_monitoring_in_async():
    """The staleness histogram (exact counts, cumulative buckets), the clock gauges and the applied counter."""
    from prometheus_client.parser import text_string_to_metric_families
    with live_ps(mode="async", min_workers=2, startup_grace_seconds=0, max_staleness=5) as ps:
        a, b = ps.client(), ps.client()
        ida = a.register("a")["worker_id"]
        a.init_model(W, SGD)
        idb = b.register("b")["worker_id"]
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        for step in range(3):  # a: staleness 0, 0, 0; then b's gradient of step 0 is 3 steps old
            assert a.push(ida, step, G)["status"] == "accepted"
        assert b.push(idb, 0, G)["status"] == "accepted"
        with ps.http() as http:
            text = http.get("/metrics").text
            st, ws = http.get("/v1/status").json(), http.get("/v1/workers").json()["workers"]
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    buckets = {s.labels["le"]: s.value for s in fam["ps_gradient_staleness_steps"].samples if s.name.endswith("_bucket")}
    assert buckets["0"] == 3 and buckets["2"] == 3 and buckets["4"] == 4 and buckets["+Inf"] == 4
    assert [s.value for s in fam["ps_gradient_staleness_steps"].samples if s.name.endswith("_sum")] == [3]
    assert [s.value for s in fam["ps_gradients_applied"].samples] == [4]
    assert [s.value for s in fam["ps_worker_clock_spread"].samples] == [2]
    assert st["training_mode"] == "async" and st["max_staleness"] == 5 and st["ssp_staleness"] is None
    assert st["clocks"] == {"slowest": 1, "fastest": 3, "spread": 2, "max_spread": 3, "live": 2,
                            "workers": {"a": 3, "b": 1}}
    assert st["staleness"] == {"applied": 4, "p50": 0, "p90": 3, "p99": 3, "max": 3}
    assert st["round"] is None and st["wait_reason"].startswith("async")
    by = {w["name"]: w for w in ws}
    assert by["b"]["staleness"] == {"last": 3, "mean": 3.0, "max": 3, "applied": 1} and by["a"]["clock"] == 3
    assert by["a"]["blocked"] is None and not by["a"]["in_current_round"]


def test_auth_and_bad_input_in_ssp_are_4xx_json_and_change_nothing():
    from tests.live_ps import state_hash
    from tests.wire import FRAME, push_frame
    with live_ps(mode="ssp", ssp_staleness=1, min_workers=1, startup_grace_seconds=0, auth_token="s3cret") as ps:
        c = ps.client(token="s3cret")
        wid = c.register("a")["worker_id"]
        c.init_model(W, SGD)
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        assert c.push(wid, 0, G)["status"] == "accepted"
        core = ps.rt.core
        before = state_hash(ps.rt), core.modes.export(), dict(core.modes.staleness_counts)
        nan = {"w": np.array([1, np.nan, 0, 0], np.float32)}
        cases = [  # (token, body, expected status, error code)
            (None, push_frame(wid, 1, G), 401, None),
            ("wrong", push_frame(wid, 1, G), 401, None),
            ("s3cret", push_frame(wid, 1, {"w": np.ones(3, np.float32)}), 422, "tensor_mismatch"),
            ("s3cret", push_frame(wid, 1, nan), 422, "nonfinite_gradient"),
            ("s3cret", push_frame(wid, 7, G), 422, "future_step"),
            ("s3cret", push_frame("nobody", 1, G), 404, "unknown_worker"),
            ("s3cret", b"not a frame", 400, None),
        ]
        for token, body, status, code in cases:
            with ps.http(token) as http:
                r = http.post("/v1/gradients", content=body, headers={"content-type": FRAME})
            assert r.status_code == status and "error" in r.json(), (r.status_code, r.text)
            assert code is None or r.json()["error"] == code
            assert (state_hash(ps.rt), core.modes.export(), dict(core.modes.staleness_counts)) == before
        with ps.http() as http:
            assert http.get("/v1/model", params={"worker_id": wid}).status_code == 401
        c.close()
