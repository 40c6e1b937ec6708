"""A same-host standby with a core of its own (issue 51, ``bench.run --pin``): the job (the PS, its shards and the
workers) on every CPU this process may use but the last, a hot standby on the last one alone.

Pinned by the launcher, before anything runs: each process is started under ``taskset -c CPUS`` (a
:class:`~cluster.processes.LocalCluster` ``prefix``), so every thread it ever starts inherits the set; the job runs the
same way with no standby (the last CPU then idle), so that the standby is all that differs between the two. The
workers' own pinning (``WORKER_CPUS``, one CPU each) is off in such a run. :func:`affinity` reads back where a
started process's threads may run (``os.sched_getaffinity`` of each).
"""
from __future__ import annotations

import os
import shutil
from typing import Callable

STANDBY_LOG = "ps-standby"  # LocalCluster's log name of a pair's standby


def cpus() -> tuple[list[int], int]:
    """The job's CPUs and the standby's: every CPU this process may use but the last, and the last. ValueError with
    fewer than two, SystemExit without ``taskset``."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise ValueError(f"pinning needs two CPUs at least; this process may use {mine}")
    if shutil.which("taskset") is None:
        raise SystemExit("--pin needs taskset (util-linux)")
    return mine[:-1], mine[-1]


def prefix(job: list[int], standby: int) -> Callable[[str], list[str]]:
    """A :class:`~cluster.processes.LocalCluster` ``prefix``: the standby (log ``ps-standby``) on ``standby``,
    every other process on ``job``."""
    def command(log_name: str) -> list[str]:
        return ["taskset", "-c", str(standby) if log_name == STANDBY_LOG else ",".join(map(str, job))]
    return command


def affinity(pid: int) -> list[int]:
    """The CPUs any thread of process ``pid`` may run on (the union over ``/proc/PID/task``), sorted."""
    found: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:  # the thread exited meanwhile
            continue
    return sorted(found)
