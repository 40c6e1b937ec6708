"""A hot-standby pair of real PS processes with real worker processes (issue 51; docs/guides/standby.md).

- every mode: after a job the standby's weights, slots, step and iterations are the primary's, bit for bit (a digest
  of both, ``GET /v1/ha?digest=1``); sync: the final weights are one process's (tests/reference.py), 0 ulp;
- the standby killed: the primary asks the workers, goes on alone (``/v1/status`` says so), takes the standby back
  when it restarts, which catches up;
- the PyTorch bridge given both URLs carries on when the primary dies;
- a partition between the two PS with workers on both sides (tests/tcp_proxy.py): the side with the majority of the
  workers wins; the other never takes a round; after the heal the loser is the standby of the new term.

The crash loop is tests/test_standby_crash.py.
"""
from __future__ import annotations

import threading
import time

import pytest

from bench import failover
from bench.failover import TASK
from cluster.processes import LocalCluster, wait_for
from tests.clusters import final_weights
from tests.reference import train_reference
from tests.tcp_proxy import Proxy
from tests.timing import allow, scale


def ha(url: str, digest: bool = False) -> dict | None:
    """bench.failover's probe of ``GET /v1/ha``, its timeout scaled with the load (a busy PS answers late: slow, not
    gone)."""
    return failover.ha(url, digest, scale())


def status(url: str) -> dict:
    """A running PS's ``GET /v1/status``, asked until it answers (each probe's timeout and the wait scaled): one
    probe that a busy PS answers late gives None, and a field read of it a TypeError instead of a check."""
    return wait_for(lambda: failover.status(url, scale()), allow(30), f"{url} to answer GET /v1/status")


def same_bits(c: LocalCluster) -> bool:
    return failover.same_bits(c, scale())


def reference(steps: int, workers: int = 3) -> dict:
    return train_reference("linear", workers, steps, batch_size=16, seed=7, dtype="float64")[1]


def assert_bit_identical(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical to an uninterrupted run (0 ulp)"


@pytest.mark.parametrize("mode,carrier", [("sync", "log"), ("async", "log"), ("ssp", "log"), ("sync", "http")])
def test_the_standby_holds_the_primarys_bits_in_every_mode(mode, carrier):
    """Both carriers of the steps: the standby's same-host log (the two PS share /dev/shm), and HTTP (no shared-memory
    directory: as between hosts)."""
    steps = 30
    env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": 3, "PS_MODE": mode,
           **({"PS_SHM_DIR": ""} if carrier == "http" else {})}
    with LocalCluster(3, ps_env=env, worker_env=TASK, standby=True) as c:
        try:
            assert c.wait_workers(allow(60)) == [0, 0, 0]
            wait_for(lambda: same_bits(c) and status(c.url)["pair"]["lag_rounds"] == 0, allow(10),
                     "the standby to hold the primary's bits")
            p, s = ha(c.url, True), ha(c.peer_url, True)
            pair, standby = status(c.url)["pair"], status(c.peer_url)
            metrics = c.get("/metrics").text
            got = final_weights(c)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    assert (p["role"], p["term"], p["step"]) == ("primary", 1, steps)
    assert (s["role"], s["term"], s["step"]) == ("standby", 1, steps)
    assert p["digest"] == s["digest"] and s["synced"] and p["gated"]
    logged = carrier == "log"  # the messages through the log (over HTTP if its reader lags by every slot), or none
    assert (s["log"] is not None) == logged and (logged or p["costs"]["logged"] == 0)
    assert s["costs"]["logged"] == p["costs"]["logged"] <= s["costs"]["messages"]  # each by one carrier
    # (on a loaded machine the standby may attach only after the last round: then it took the state, no message)
    assert (s["costs"]["read_s"] > 0) == (s["costs"]["messages"] > s["costs"]["logged"])
    assert pair["standby"] == "in_sync" and pair["lag_rounds"] == 0
    assert pair["transfers"] >= 1 and pair["bytes_sent"] > 0
    assert standby["pair"]["role"] == "standby" and standby["pair"]["synced"] and standby["pair"]["bytes_received"] > 0
    assert standby["wait_reason"].startswith("this PS is the standby (term 1)")
    for line in ('ps_pair_role{role="primary"} 1.0', 'ps_pair_role{role="standby"} 0.0', "ps_pair_term 1.0",
                 "ps_pair_standby_in_sync 1.0", "ps_pair_standby_lag_rounds 0.0", "ps_pair_standby_lag_bytes 0.0"):
        assert line in metrics.splitlines(), line
    if mode == "sync":
        assert_bit_identical(got, reference(steps))


def test_the_standby_killed_the_primary_goes_on_alone_and_takes_it_back():
    steps = 80
    env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": 3}
    with LocalCluster(3, ps_env=env, worker_env={**TASK, "WORKER_COMPUTE_DELAY_SECONDS": 0.02}, standby=True) as c:
        try:
            wait_for(lambda: (ha(c.peer_url) or {}).get("synced") and status(c.url)["global_step"] >= 5, allow(30),
                     "a standby in sync")
            c.kill(c.peer)
            wait_for(lambda: status(c.url)["pair"]["standby"] == "none" and status(c.url)["pair"]["term"] == 2,
                     allow(15), "the primary to go on alone")
            alone = status(c.url)
            step = alone["global_step"]
            wait_for(lambda: status(c.url)["global_step"] >= step + 3, allow(15), "training without a standby")
            c.start_ps(allow(30))
            wait_for(lambda: status(c.url)["pair"]["standby"] == "in_sync", allow(15), "the standby to catch up")
            assert c.wait_workers(allow(60)) == [0, 0, 0]
            wait_for(lambda: same_bits(c), allow(10), "the standby to hold the primary's bits")
            got = final_weights(c)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    pair = alone["pair"]
    assert pair["role"] == "primary" and pair["alone_seconds"] is not None
    assert "goes on without a standby" in pair["last_change"]
    assert_bit_identical(got, reference(steps))  # every worker voted, none left a round: nothing changed


class CutCluster(LocalCluster):
    """A pair whose two PS reach each other through proxies, and workers that reach one PS directly and the other
    through a proxy: :meth:`cut` partitions the PS hosts, each worker on one side."""

    def __init__(self, majority_with_primary: bool, **kw) -> None:
        super().__init__(3, standby=True, **kw)
        port = lambda url: int(url.rsplit(":", 1)[1])  # noqa: E731
        self.to_standby, self.to_primary = Proxy(port(self.peer_url)), Proxy(port(self.url))
        self.ps_env["PS_PEER_URL"] = self.to_standby.url
        sides = [True, True, False] if majority_with_primary else [False, False, True]  # with the primary?
        self.urls = [f"{self.url},{self.to_standby.url}" if side else f"{self.to_primary.url},{self.peer_url}"
                     for side in sides]

    def peer_env(self) -> dict:
        return {**super().peer_env(), "PS_PEER_URL": self.to_primary.url}

    def start(self) -> "CutCluster":
        self.start_ps(allow(30))
        for i, urls in enumerate(self.urls):
            self.start_worker(i, {"WORKER_PS_URL": urls})
        return self

    def cut(self) -> None:
        self.to_standby.cut()
        self.to_primary.cut()

    def heal(self) -> None:
        self.to_standby.heal()
        self.to_primary.heal()


#: seconds both sides of the partition are watched (3 of its leases: a loser taking rounds with the minority of the
#: workers it keeps would show it), and on until the winner trains on; what is watched is the PS's own lease clock,
#: so the window is not an allowance: on a loaded machine it used to be 6 s times the load (tests/timing.py)
WATCH = 6.0


def won(seen: list[dict], at_cut: int) -> bool:
    """The side that won the partition trains on: primary of term 2, more than 5 rounds past its step at the cut."""
    return bool(seen) and seen[-1]["role"] == "primary" and seen[-1]["term"] == 2 and seen[-1]["step"] > at_cut + 5


@pytest.mark.parametrize("majority_with_primary", [True, False], ids=["primary-side-wins", "standby-side-wins"])
def test_a_partition_between_the_two_ps_one_side_takes_rounds_never_both(majority_with_primary):
    env = {"PS_MAX_STEPS": 150, "PS_MIN_WORKERS": 1, "PS_LEASE_SECONDS": 2}
    with CutCluster(majority_with_primary, ps_env=env, worker_env={**TASK, "WORKER_COMPUTE_DELAY_SECONDS": 0.02}) as c:
        try:
            wait_for(lambda: (ha(c.peer_url) or {}).get("synced") and status(c.url)["global_step"] >= 5, allow(30),
                     "a standby in sync")
            c.cut()
            cut_at = {u: ha(u)["step"] for u in (c.url, c.peer_url)}
            winner, loser = (c.url, c.peer_url) if majority_with_primary else (c.peer_url, c.url)
            seen: dict[str, list[dict]] = {c.url: [], c.peer_url: []}
            cut, deadline = time.monotonic(), time.monotonic() + allow(30)
            watching = lambda: time.monotonic() < cut + WATCH or not won(seen[winner], cut_at[winner])  # noqa: E731
            while watching() and time.monotonic() < deadline:
                for u in seen:
                    got = ha(u)
                    if got is not None:
                        seen[u].append(got)
                time.sleep(0.05)
            w, l = seen[winner][-1], seen[loser][-1]
            c.heal()

            def standby_again() -> dict | None:  # the answer that showed it (not a second probe, which may get none)
                a = ha(loser) or {}
                return a if a.get("synced") and a["term"] == 2 else None
            after = wait_for(standby_again, allow(15), "the loser to be the winner's standby")
            c.wait_workers(allow(90))
            wait_for(lambda: same_bits(c), allow(10), "the standby to hold the primary's bits")
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
        finally:
            c.to_standby.close()
            c.to_primary.close()
    assert won([w], cut_at[winner]), (w, cut_at)  # it trains on
    # the loser never serves a term of its own, and closes at most the round that was open (never answered)
    assert all(x["term"] == 1 for x in seen[loser])
    # (bounded by the primary's step at the cut: a standby's log reader may be behind the records acknowledged then)
    assert max(x["step"] for x in seen[loser]) <= max(cut_at.values()) + 1 and l["role"] != "primary"
    assert after["role"] == "standby" and after["term"] == 2


def test_the_pytorch_bridge_carries_on_when_the_primary_dies():
    """Two ``syncps.torch`` workers given both URLs; the primary kill -9'd mid-job: they carry on on the standby, which
    finishes the job as the primary of term 2."""
    torch = pytest.importorskip("torch")
    from syncps.torch import connect
    steps = 60
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[0.1], [0.2], [0.3]])
    env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": 2, "PS_MIN_WORKERS": 2}
    c = LocalCluster(1, ps_env=env, standby=True)
    try:
        c.start_ps(allow(30))
        results: dict = {}

        def worker(name):
            model = torch.nn.Linear(3, 1)
            with connect(model, torch.optim.SGD(model.parameters(), lr=0.1), url=f"{c.url},{c.peer_url}", name=name,
                         retry_timeout=allow(30)) as ps:
                statuses = []
                while not ps.should_stop:
                    ps.zero_grad()
                    lo = 8 * ps.position
                    torch.nn.functional.mse_loss(model(x[lo:lo + 8]), y[lo:lo + 8]).backward()
                    statuses.append(ps.step())
                    time.sleep(0.02)
                results[name] = statuses

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in ("p", "q")]
        for t in threads:
            t.start()
        wait_for(lambda: (ha(c.peer_url) or {}).get("synced") and status(c.url)["global_step"] >= 10, allow(30),
                 "training with a standby in sync")
        c.kill(c.ps)
        for t in threads:
            t.join(allow(60))
        st = status(c.peer_url)
    except Exception:
        c.mark_failed()
        raise AssertionError(f"job failed; logs:\n{c.logs()}")
    finally:
        c.stop()
    assert not any(t.is_alive() for t in threads) and set(results) == {"p", "q"}
    assert st["state"] == "done" and st["global_step"] == steps
    assert st["pair"]["role"] == "primary" and st["pair"]["term"] == 2 and st["pair"]["takeovers"] == 1


def test_a_primary_restarted_while_its_peer_is_down_asks_the_workers_for_the_term_after_the_one_it_kept(tmp_path):
    """The term kept on disk (``PS_CHECKPOINT_DIR``): the standby killed, the primary goes on alone in term 2 (kept);
    then it is killed too and started again while its peer is still down, its workers frozen (SIGSTOP): a candidate
    for term 3, not the primary of term 1, refusing a push (503 ``election``); the workers, let go, vote: the primary
    of term 3 from its checkpoint, and the job ends."""
    import json
    import os
    import signal

    import httpx

    from ps_service.standby.kept import NAME
    steps = 80
    env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": 3, "PS_CHECKPOINT_DIR": str(tmp_path),
           "PS_CHECKPOINT_EVERY_STEPS": 5}
    with LocalCluster(3, ps_env=env, worker_env={**TASK, "WORKER_COMPUTE_DELAY_SECONDS": 0.02}, standby=True) as c:
        try:
            wait_for(lambda: (ha(c.peer_url) or {}).get("synced") and status(c.url)["global_step"] >= 5, allow(30),
                     "a standby in sync")
            assert json.loads((tmp_path / NAME).read_text()) == {"term": 1, "role": "primary"}
            c.kill(c.peer)
            wait_for(lambda: status(c.url)["pair"]["term"] == 2 and status(c.url)["global_step"] >= 12, allow(15),
                     "the primary to go on alone, past a checkpoint")
            assert json.loads((tmp_path / NAME).read_text()) == {"term": 2, "role": "primary"}
            for w in c.workers:
                os.kill(w.pid, signal.SIGSTOP)
            try:
                c.kill(c.ps)
                c.ps = c._spawn("ps_service", c.shard_env(0), "ps.log")  # the primary alone (start_ps: both)
                back = wait_for(lambda: ha(c.url), allow(30), "the primary to answer again")
                push = httpx.post(f"{c.url}/v1/workers", json={"name": "worker-0"}, timeout=allow(5))
            finally:
                for w in c.workers:
                    os.kill(w.pid, signal.SIGCONT)
            wait_for(lambda: (ha(c.url) or {}).get("role") == "primary", allow(30), "the workers' votes")
            won = status(c.url)["pair"]
            assert c.wait_workers(allow(90)) == [0, 0, 0]
            done = status(c.url)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    assert (back["role"], back["term"]) == ("candidate", 2)
    assert push.status_code == 503 and push.json()["error"] == "election" and push.headers["x-syncps-term"] == "2"
    assert won["term"] == 3 and "won the election after a restart" in won["last_change"]
    assert done["state"] == "done" and done["global_step"] == steps and done["pair"]["term"] == 3
    assert json.loads((tmp_path / NAME).read_text()) == {"term": 3, "role": "primary"}
