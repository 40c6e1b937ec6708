"""``python -m bench.load --workers 16 64 256 1024``: many workers on one PS, a table with a column (``--json``: a
JSON line) per K.

K simulated workers run as asyncio tasks in this one process and speak the real protocol
(docs/protocol.md) to a real PS process (``python -m ps_service``, started here through
:class:`cluster.processes.LocalCluster`, elastic mode, request bodies only). The model is one float32
tensor of ``--params`` elements trained with SGD for ``--rounds`` rounds. Each worker registers (a
fresh connection), then every round pulls with the long-poll wait and pushes, both on its own
keep-alive connection; its gradient is a deterministic function of (worker, step). Every worker also
heartbeats on a connection of its own, kept alive, as the stock worker does: whenever lease/3 passed with no push
or pull answered (they renew the lease), a pull that waits for the round included. While the
workers train, a prober (a thread with its own event loop) keeps asking ``GET /healthz`` on fresh
connections, on ``PS_PROBE_PORT`` and on the main port, and every fifth time registers a new name and
leaves again (registration under load). A worker that is told it expired (404/409) registers again.

The line: ``rounds_per_s``; push and pull latency p50/p99 (a pull includes its wait for the round);
registration p99 (``register_p99_ms``: the K workers' start-up burst; ``register_load_p99_ms``: the
prober's, under load); ``healthz_p99_ms`` (probe port) and ``healthz_main_p99_ms`` under load;
``heartbeat_p99_ms``, ``heartbeat_timeouts`` (no answer within 10 s) and ``heartbeat_connects`` (connections the
heartbeats made); ``lost_connections`` (by kind:
the PS had closed the connection, e.g. its keep-alive ran out); ``lease_expiries`` (from the PS's /v1/workers: re-registrations plus members
left expired); ``ps_cpu_ms_per_push`` (the PS's CPU time over the training, per push: its threads' schedstat, to the
nanosecond, as a short run's CPU can be less than one 10 ms clock tick;
the probes' and heartbeats' cost is in it); ``ps_peak_rss_MB`` (VmHWM); ``min_contributors`` (the
smallest round); ``errors_5xx``; ``exact``: the final weights equal a numpy replay (the pushed gradients
of each round summed in rank order, divided by their count, one SGD step).

``--defaults`` starts the PS with its default settings but for the job's size (``PS_MIN_WORKERS``,
``PS_MAX_STEPS``), as a plain ``python -m ps_service`` does, instead of the bench's (asyncio's loop, a probe port,
warnings only); ``--ps-env NAME=VALUE`` adds settings on top. ``--idle N`` instead measures the PS's memory per idle
keep-alive connection: its RSS with N open connections (each has made one request) against none.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import threading
import time

import httpx
import numpy as np

from bench.loadclient import Conn, Samples, fresh
from bench.output import Results, add_json_option
from bench.run import _cpu_seconds_fine, _proc_status
from cluster.processes import LocalCluster, free_port
from ps_service.settings import PSSettings
from shared import frame
from shared.protocol import FRAME

SEED = 17
LEARNING_RATE = 0.01
#: a heartbeat (or registration) that has no answer in this time counts as timed out
HEARTBEAT_TIMEOUT = 10.0
REGISTER_TIMEOUT = 60.0
PULL_WAIT = 30.0


def initial_weights(params: int) -> np.ndarray:
    return np.random.default_rng(SEED).standard_normal(params, dtype=np.float32)


def gradient(index: int, step: int, params: int) -> np.ndarray:
    return np.random.default_rng([SEED, index, step]).standard_normal(params, dtype=np.float32)


def replay(params: int, rounds: list[dict]) -> np.ndarray:
    """The weights SGD reaches from the rounds' contributors: each round's gradients summed in rank order
    (the PS's order), divided by their count, ``w -= g * lr`` in float32."""
    w = initial_weights(params)
    for rec in sorted(rounds, key=lambda r: r["step"]):
        acc = None
        for c in sorted(rec["contributors"], key=lambda c: (c["rank"], c["worker_id"])):
            g = gradient(int(c["name"].removeprefix("load-")), rec["step"], params)
            acc = g if acc is None else np.add(acc, g, out=acc)
        if len(rec["contributors"]) > 1:
            acc /= len(rec["contributors"])
        w -= acc * np.float32(LEARNING_RATE)
    return w


class Load:
    """The K workers and the prober of one run against the PS at ``host:port``."""

    def __init__(self, host: str, port: int, k: int, params: int, probe_port: int | None) -> None:
        self.host, self.port, self.k, self.params, self.probe_port = host, port, k, params, probe_port
        self.samples = Samples()
        self.probes = Samples()  # the prober's (its own thread)
        self.registered = asyncio.Event()
        self.n_registered = 0
        self.stop = threading.Event()
        self.final: np.ndarray | None = None
        self.rejoins = 0
        self.heartbeat_connects = 0  # connections the workers' heartbeats opened

    async def register(self, name: str) -> dict:
        body = json.dumps({"name": name}).encode()
        while True:
            a = await fresh(self.host, self.port, self.samples, "register", "POST", "/v1/workers", body,
                            REGISTER_TIMEOUT)
            if a is not None and a.status == 200:
                return a.json()

    async def call(self, conn: Conn, name: str, method: str, target: str, body: bytes = b"",
                   timeout: float = 30.0):
        """An exchange on a worker's kept connection, its latency recorded under ``name``; repeated on a new
        connection if the PS had closed it or did not answer in time (a push is safe to repeat: duplicate)."""
        for attempt in range(3):
            t0 = time.perf_counter()
            try:
                answer = await conn.request(method, target, body, FRAME, timeout)
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
                self.samples.failed(name, exc)
                if attempt == 2:
                    raise
                continue
            self.samples.add(name, time.perf_counter() - t0)
            return answer

    async def worker(self, index: int) -> None:
        me = {"name": f"load-{index}"}
        me.update(await self.register(me["name"]))
        self.n_registered += 1
        if self.n_registered == self.k:
            self.registered.set()
        beat = asyncio.create_task(self.heartbeats(me))
        conn, step = Conn(self.host, self.port, self.samples), me["start_step"]
        try:
            while True:
                a = await self.call(conn, "pull", "GET", f"/v1/model?min_step={step}&timeout={PULL_WAIT:g}"
                                                 f"&worker_id={me['worker_id']}", timeout=PULL_WAIT + 15)
                me["renewed"] = time.monotonic()
                if a.status == 204:  # the long poll timed out: ask again
                    continue
                if a.status in (404, 409):
                    step = await self.rejoin(me)
                    continue
                pulled = frame.decode(a.body)
                meta = pulled.meta
                if meta["done"]:
                    self.final = np.array(pulled.tensors["w"])
                    return
                if me["rank"] not in meta["ranks"]:  # joined mid-round
                    step = meta["step"] + 1
                    continue
                body = frame.encode_bytes({"w": gradient(index, meta["step"], self.params)},
                                          {"worker_id": me["worker_id"], "step": meta["step"]})
                a = await self.call(conn, "push", "POST", "/v1/gradients", body)
                me["renewed"] = time.monotonic()
                if a.status in (404, 409):
                    step = await self.rejoin(me)
                    continue
                if a.status != 200:
                    raise RuntimeError(f"push answered {a.status}: {a.body[:300]!r}")
                step = meta["step"] + 1
        finally:
            beat.cancel()
            conn.close()

    async def rejoin(self, me: dict) -> int:
        """Register again (the PS expired the worker); the step to pull next."""
        self.rejoins += 1
        me.update(await self.register(me["name"]))
        return me["start_step"]

    async def heartbeats(self, me: dict) -> None:
        """As the stock worker (worker_service/loop.Heartbeat): whenever lease/3 passed with no push or pull answered
        (a pull that waits for the round included), on a connection of their own, kept alive; a kept connection the
        PS had closed is tried once more on a new one (counted as ``heartbeat_stale_lost``)."""
        conn, period = Conn(self.host, self.port, self.samples), me["lease_seconds"] / 3
        last = time.monotonic()
        try:
            while True:
                await asyncio.sleep(max(0.0, last + period - time.monotonic()))
                last = max(last, me.get("renewed", last))
                if time.monotonic() - last < period:
                    continue
                last = time.monotonic()
                t0 = time.perf_counter()
                for again in (conn.kept(), False):
                    try:
                        await conn.request("POST", f"/v1/workers/{me['worker_id']}/heartbeat",
                                           timeout=HEARTBEAT_TIMEOUT)
                    except (ConnectionError, asyncio.IncompleteReadError) as exc:
                        self.samples.failed("heartbeat_stale" if again else "heartbeat", exc)
                        if again:
                            continue
                    except TimeoutError as exc:
                        self.samples.failed("heartbeat", exc)
                    else:
                        self.samples.add("heartbeat", time.perf_counter() - t0)
                    break
        finally:
            self.heartbeat_connects += conn.opened
            conn.close()

    def probing(self) -> None:
        """The prober on a thread and event loop of its own: its latencies are the PS's, not the workers' loop's."""
        asyncio.run(self.prober())

    async def prober(self) -> None:
        """``GET /healthz`` on fresh connections, on the probe port then on the main port, until stopped;
        every fifth time also a registration (fresh connection) and a leave."""
        for n in itertools.count():
            if self.stop.is_set():
                return
            if self.probe_port is not None:
                await fresh(self.host, self.probe_port, self.probes, "healthz", "GET", "/healthz")
            await fresh(self.host, self.port, self.probes, "healthz_main", "GET", "/healthz")
            if n % 5 == 4:
                conn = Conn(self.host, self.port, self.probes)
                t0 = time.perf_counter()
                try:
                    a = await conn.request("POST", "/v1/workers", json.dumps({"name": f"probe-{n}"}).encode(),
                                           timeout=REGISTER_TIMEOUT)
                    self.probes.add("register_load", time.perf_counter() - t0)
                    await conn.request("DELETE", f"/v1/workers/{a.json()['worker_id']}", timeout=REGISTER_TIMEOUT)
                except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
                    self.probes.failed("register_load", exc)
                finally:
                    conn.close()
            await asyncio.sleep(0.05)

    async def run(self, pid: int) -> dict:
        """Every worker to the end; the PS's CPU seconds from all registered to the end."""
        workers = [asyncio.create_task(self.worker(i)) for i in range(self.k)]
        await self.registered.wait()
        cpu0, t0 = _cpu_seconds_fine(pid), time.perf_counter()
        probe = threading.Thread(target=self.probing, name="prober", daemon=True)
        probe.start()
        try:
            await asyncio.gather(*workers)
        finally:
            self.stop.set()
            for w in workers:
                w.cancel()
        cpu1 = _cpu_seconds_fine(pid)
        await asyncio.to_thread(probe.join, 60)
        return {"ps_cpu_s": cpu1 - cpu0, "train_wall_s": time.perf_counter() - t0}


def run_loop(coro):
    """Run ``coro`` on uvloop when it is installed (less of the shared CPU for the client)."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def init_model(url: str, params: int) -> None:
    body = frame.encode_bytes({"w": initial_weights(params)}, {"optimizer": {"name": "sgd", "learning_rate": LEARNING_RATE}})
    r = httpx.put(f"{url}/v1/model", content=body, headers={"content-type": FRAME}, timeout=30)
    r.raise_for_status()


def measure(k: int, rounds: int = 30, params: int = 1000, ps_env: dict | None = None, defaults: bool = False) -> dict:
    """One run of K workers; the result line as a dict. ``defaults``: the PS runs with its default settings but
    for the job's size (``PS_MIN_WORKERS``, ``PS_MAX_STEPS``), as a plain ``python -m ps_service`` would."""
    out: dict = {"bench": "load", "workers": k, "rounds": rounds, "params": params,
                 "settings": "default" if defaults else "bench", **({"ps_env": ps_env} if ps_env else {})}
    if defaults:
        env = {"PS_MIN_WORKERS": k, "PS_MAX_STEPS": rounds, **(ps_env or {})}
    else:
        env = {"PS_MIN_WORKERS": k, "PS_MAX_STEPS": rounds, "PS_SHM_DIR": "", "PS_PROBE_PORT": free_port(),
               "PS_LOG_LEVEL": "warning", "PS_EVENT_LOOP": "asyncio", **(ps_env or {})}
    cluster = LocalCluster(0, ps_env=env)
    # where the PS listens for probes: its own rule (PS_PROBE_PORT, else the main port + 1)
    given = env.get("PS_PROBE_PORT")
    probe_port = PSSettings.model_construct(port=cluster.port, probe_port=None if given is None else int(given)
                                            ).probe_listener()[0]
    try:
        cluster.start()
        init_model(cluster.url, params)
        load = Load("127.0.0.1", cluster.port, k, params, probe_port)
        spent = run_loop(load.run(cluster.ps.pid))
        records = cluster.get(f"/v1/rounds?limit={rounds}").json()["rounds"]
        members = [m for m in cluster.get("/v1/workers").json()["workers"] if m["name"].startswith("load-")]
        status = cluster.status()
        pushes = sum(status["pushes"].values())
        span = max(r["closed_at"] for r in records) - min(r["opened_at"] for r in records)
        s, p = load.samples, load.probes
        out.update({
            "rounds_per_s": round(len(records) / span, 3),
            "push_p50_ms": s.quantile("push", 0.5), "push_p99_ms": s.quantile("push", 0.99),
            "pull_p50_ms": s.quantile("pull", 0.5), "pull_p99_ms": s.quantile("pull", 0.99),
            "register_p99_ms": s.quantile("register", 0.99), "register_max_ms": s.quantile("register", 1.0),
            "register_load_p99_ms": p.quantile("register_load", 0.99),
            "healthz_p50_ms": p.quantile("healthz", 0.5), "healthz_p99_ms": p.quantile("healthz", 0.99),
            "healthz_max_ms": p.quantile("healthz", 1.0), "healthz_probes": len(p.ms.get("healthz", ())),
            "healthz_main_p50_ms": p.quantile("healthz_main", 0.5), "healthz_main_p99_ms": p.quantile("healthz_main", 0.99),
            "heartbeat_p99_ms": s.quantile("heartbeat", 0.99), "heartbeats": len(s.ms.get("heartbeat", ())),
            "heartbeat_timeouts": s.timeouts.get("heartbeat", 0), "heartbeat_connects": load.heartbeat_connects,
            "register_timeouts": s.timeouts.get("register", 0),
            "push_timeouts": s.timeouts.get("push", 0), "pull_timeouts": s.timeouts.get("pull", 0),
            "lease_expiries": sum(m["registrations"] - 1 for m in members) + sum(m["state"] == "expired" for m in members),
            "ps_cpu_ms_per_push": round(1e3 * spent["ps_cpu_s"] / max(1, pushes), 3),
            "ps_peak_rss_MB": round(_proc_status(cluster.ps.pid, "VmHWM") or 0.0, 1),
            "min_contributors": min(len(r["contributors"]) for r in records),
            "rounds_done": len(records), "errors_5xx": s.errors_5xx + p.errors_5xx, "rejoins": load.rejoins,
            "lost_connections": {k: v for k, v in {**s.timeouts, **p.timeouts}.items() if k.endswith("_lost")},
            "exact": len(records) == rounds and load.final is not None
                     and np.array_equal(load.final, replay(params, records)),
            "train_wall_s": round(spent["train_wall_s"], 2), "load_avg": round(os.getloadavg()[0], 2),
        })
    except Exception as exc:  # a failed run is a line too
        cluster.mark_failed()
        out.update({"exact": False, "error": f"{type(exc).__name__}: {exc}"[:500], "log_dir": str(cluster.log_dir)})
    finally:
        cluster.stop()
    return out


async def _open_idle(port: int, n: int, samples: Samples) -> list[Conn]:
    conns = [Conn("127.0.0.1", port, samples) for _ in range(n)]
    for i in range(0, n, 100):
        await asyncio.gather(*(c.request("GET", "/healthz") for c in conns[i:i + 100]))
    return conns


def idle_memory(n: int) -> dict:
    """The PS's RSS with ``n`` idle keep-alive connections (each made one request) against none."""
    cluster = LocalCluster(0, ps_env={"PS_MIN_WORKERS": 1, "PS_HTTP_KEEPALIVE_SECONDS": 600, "PS_LOG_LEVEL": "warning"})
    try:
        cluster.start()

        async def measure_idle() -> dict:
            samples = Samples()
            for c in await _open_idle(cluster.port, 20, samples):  # warm the PS's allocator and code paths
                c.close()
            await asyncio.sleep(0.5)
            before = _proc_status(cluster.ps.pid, "VmRSS")
            conns = await _open_idle(cluster.port, n, samples)
            await asyncio.sleep(0.5)
            after = _proc_status(cluster.ps.pid, "VmRSS")
            for c in conns:
                c.close()
            return {"bench": "idle", "connections": n, "rss_before_MB": round(before, 1),
                    "rss_after_MB": round(after, 1), "kib_per_connection": round((after - before) * 1024 / n, 1)}
        return run_loop(measure_idle())
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256, 1024], help="K, one run (line) each")
    ap.add_argument("--rounds", type=int, default=30, help="rounds trained per K")
    ap.add_argument("--params", type=int, default=1000, help="elements of the model's one float32 tensor")
    ap.add_argument("--defaults", action="store_true",
                    help="run the PS with its default settings (event loop, probe port, log level) instead of the "
                         "bench's (asyncio's loop, a probe port, warnings only)")
    ap.add_argument("--ps-env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="PS settings on top (e.g. PS_LEASE_SECONDS=3: heartbeats needed at every round)")
    ap.add_argument("--idle", type=int, default=0, help="measure the PS's memory per idle connection instead (N)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    with Results(args.json, prog=ap.prog) as out:
        if args.idle:
            out.add(idle_memory(args.idle))
            return 0
        for k in args.workers:
            out.add(measure(k, args.rounds, args.params, dict(kv.split("=", 1) for kv in args.ps_env), args.defaults))
    return 0 if all(line["exact"] and line.get("errors_5xx") == 0 for line in out.lines) else 1


if __name__ == "__main__":
    sys.exit(main())
