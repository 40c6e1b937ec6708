"""``python -m bench.trace``: the project files one push and one pull cross on the PS, and the moves between them.

Each scenario starts real PS servers in this process (uvicorn threads, :mod:`cluster.inprocess`) with a profile hook
(``sys.setprofile``) in their threads only, and drives them with the real worker client from the main thread: one
elastic worker, so its push (``?pull=1``) also closes the round, applies the optimizer and answers the new weights;
then one pull. Scenarios: ``tcp`` (a frame in the body), ``shm`` (a same-host file), ``topk`` (top-k compressed
bodies), ``sharded`` (two shards: holds, the commit, the follower's apply; pulls from both), ``partitioned``
(``PS_PARTITION_BYTES``: rounds that close partition by partition; the push a head and its partitions' frames in one
body, with its pull alongside on a second connection, which its line counts too: the PS serves both at once).

What it counts, over the PS's project files (``ps_service/``, ``shared/``; library frames are skipped, the
nearest project frame stands for them):

- ``files``: the project files whose code ran for the request (``--files``: in the order of their first call);
- ``moves``: how often the running project file changed (a call into another file, or a return to one);
- ``route_to_optimizer``: those moves from the route's entry (``api.push``, or the commit on a sharded PS) to the
  optimizer's ``apply``;
- ``core_calls_out``: calls from ``ps_service/core/`` into the layers above it (the seam is one-way: 0; with
  partitioned rounds the runtime's ``on_partition`` hook, given to the core, once per call that closed partitions).

Prints a table with a row per scenario and request (``--json``: a JSON line each; ``--files``: the files too;
``--route``: each move of a push from the route to the optimizer).
tests/test_trace.py runs it and asserts the targets of docs/architecture.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from bench.output import Results, add_json_option
from cluster.inprocess import serve_in_thread
from cluster.processes import free_port
from ps_service.settings import PSSettings

ROOT = Path(__file__).resolve().parents[1]
_ROOTS = tuple(str(ROOT / d) + os.sep for d in ("ps_service", "shared"))
CORE = "ps_service/core/"
#: the layers the core never calls (docs/architecture.md)
OUTER = ("ps_service/transport/", "ps_service/app.py", "ps_service/api.py", "ps_service/hotpath.py",
         "ps_service/http.py", "ps_service/auth.py", "ps_service/monitoring.py", "ps_service/metrics.py",
         "ps_service/probes.py", "ps_service/dashboard.py", "ps_service/runtime.py", "ps_service/sharding/")
SCENARIOS = ("tcp", "shm", "topk", "sharded", "partitioned")
ROUTES = {("ps_service/api.py", "push"), ("ps_service/sharding/routes.py", "commit")}
OPTIMIZER = ("ps_service/core/optimizers.py", "apply")
#: the partitioned scenario's PS_PARTITION_BYTES: W0 in 3 partitions (the bias; the kernel in two halves)
PARTITION_BYTES = 8192
#: the table's columns (--json: every field)
COLUMNS = ["scenario", "transport", "request", "files", "moves", "route_to_optimizer", "core_calls_out"]


def _rel(filename: str) -> str | None:
    if filename.startswith(_ROOTS):
        return os.path.relpath(filename, ROOT)
    return None


def _project_caller(frame) -> str | None:
    f = frame.f_back
    while f is not None:
        rel = _rel(f.f_code.co_filename)
        if rel is not None:
            return rel
        f = f.f_back
    return None


class Recorder:
    """The profile hook: while :attr:`on`, each call into and return from project code, as (event, file, function,
    the file control is in afterwards, the calling project file)."""

    def __init__(self) -> None:
        self.on = False
        self.events: list[tuple[str, str, str, str | None, str | None]] = []

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event not in ("call", "return"):
            return
        rel = _rel(frame.f_code.co_filename)
        if rel is None:
            return
        caller = _project_caller(frame)
        after = rel if event == "call" else caller
        self.events.append((event, rel, frame.f_code.co_name, after, caller if event == "call" else None))

    @contextmanager
    def recording(self) -> Iterator[list]:
        self.events = []
        self.on = True
        try:
            yield self.events
        finally:
            self.on = False


def summarise(events: list) -> dict:
    """files, moves, route_to_optimizer, core_calls_out (see the module's docstring) of one request's events."""
    files, moves, current, calls_out = {}, 0, None, []
    segment, route_moves, route = None, None, []
    for event, rel, name, after, caller in events:
        if after is not None and after != current:
            moves += current is not None
            if segment is not None and route_moves is None:
                route.append(f"{_short(current)} -> {_short(after)}: {name}" + (" returns" if event == "return" else ""))
            current = after
        if event == "call":
            files.setdefault(rel)
            if caller is not None and caller.startswith(CORE) and rel.startswith(OUTER):
                calls_out.append(f"{caller} -> {rel}:{name}")
            if segment is None and (rel, name) in ROUTES:
                segment = moves
            if segment is not None and route_moves is None and (rel, name) == OPTIMIZER:
                route_moves = moves - segment
    return {"files": len(files), "moves": moves, "route_to_optimizer": route_moves,
            "core_calls_out": len(calls_out), "calls_out": sorted(set(calls_out)), "file_list": list(files),
            "route": route}


def _short(rel: str) -> str:
    """``ps_service/core/rounds.py`` as ``core/rounds``; ``shared/frame.py`` as ``shared/frame``."""
    return rel.removeprefix("ps_service/").removesuffix(".py")


W0 = {"dense/kernel": np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64),
      "dense/bias": np.zeros(64, np.float32)}


def _grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in W0.items()}


@contextmanager
def _servers(scenario: str, recorder: Recorder, shm_dir: str) -> Iterator[str]:
    """The scenario's PS servers, traced; the URL a worker starts from."""
    common = {"host": "127.0.0.1", "min_workers": 1, "startup_grace_seconds": 0, "tick_seconds": 30,
              "shm_dir": shm_dir if scenario == "shm" else ""}
    if scenario == "topk":
        common.update(compression="topk", compression_topk_warmup_steps=0)
    if scenario == "partitioned":
        common.update(partition_bytes=PARTITION_BYTES)
    ports = [free_port()] if scenario != "sharded" else [free_port(), free_port()]
    if scenario == "sharded":
        common.update(shards=2, shard_urls=",".join(f"http://127.0.0.1:{p}" for p in ports), shard_split_elements=2)
    with ExitStack() as stack:
        for index in reversed(range(len(ports))):  # the followers first: the coordinator asks them at start
            extra = {"shard_index": index} if scenario == "sharded" else {}
            app, server, thread = serve_in_thread(PSSettings(port=ports[index], **common, **extra), recorder)
            stack.callback(thread.join, 15)
            stack.callback(setattr, server, "should_exit", True)
        yield f"http://127.0.0.1:{ports[0]}"


def trace(scenario: str, patience: float = 10.0) -> list[dict]:
    """One push (closing its round, answered with the weights) and one pull of ``scenario``: a line each (each
    request given ``patience`` seconds: profiled, a loaded machine needs more)."""
    from worker_service.client import PSClient

    recorder = Recorder()
    with tempfile.TemporaryDirectory(prefix="syncps-trace-") as shm_dir, _servers(scenario, recorder, shm_dir) as url:
        client = PSClient(url, timeout=patience, attempts=1, shm_dir=shm_dir if scenario == "shm" else None)
        try:
            wid = client.register("tracer")["worker_id"]
            client.init_model(W0, {"name": "sgd", "learning_rate": 0.1})
            transport = client.attach(wid)
            client.pull(0, wid, wait=patience)
            client.push(wid, 0, _grads(0))  # warms every path once (first answers allocate)
            lines = []
            for step, kind in ((1, "push"), (2, "pull")):
                with recorder.recording() as events:
                    if kind == "push":
                        client.push(wid, step, _grads(step))
                    else:
                        client.prefetched = None  # a pull that asks the PS
                        client.pull(step, wid, wait=patience)
                lines.append({"scenario": scenario, "transport": transport, "request": kind, **summarise(events)})
            return lines
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=SCENARIOS, action="append",
                        help="trace only this scenario (repeatable; default: all)")
    parser.add_argument("--files", action="store_true", help="list the files each request crosses")
    parser.add_argument("--route", action="store_true", help="list a push's moves from the route to the optimizer")
    add_json_option(parser)
    args = parser.parse_args(argv)
    with Results(args.json, COLUMNS, parser.prog) as out:
        for row in (line for s in args.scenario or SCENARIOS for line in trace(s)):
            for flag, field in ((args.files, "file_list"), (args.route, "route")):
                if not flag:
                    row.pop(field)
            out.add(row)
    for row in out.lines if not args.json else []:
        if args.files:
            print(f"\n{row['scenario']} {row['request']}: {' '.join(map(_short, row['file_list']))}")
        if args.route and row["route"]:
            print(f"\n{row['scenario']} {row['request']}, route to optimizer:", *row["route"], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
