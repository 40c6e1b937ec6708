"""Time allowances that scale with the machine's load, so the suite passes on a busy machine too.

A test synchronises on what it can observe (poll with :func:`cluster.processes.wait_for`), never on a sleep;
the deadline of such a wait, and any bound a test puts on wall-clock time, is an *allowance*: how long the
thing takes on a quiet machine, times :func:`scale`. What a test asserts (counts, bits, states) does not scale.

:func:`scale` is ``SYNCPS_TEST_TIME_SCALE`` when set (a number >= 1, e.g. 3 for a CI runner known to be
slow), else the machine's measured slowness: the 1-minute load average per CPU this process may use, at
least 1 (2 CPU-bound processes beside a test on 2 cores: about 2).
"""
from __future__ import annotations

import os


def scale() -> float:
    """The factor every allowance is multiplied by (>= 1), read at each call: the load changes during a run."""
    given = os.environ.get("SYNCPS_TEST_TIME_SCALE")
    if given:
        return max(1.0, float(given))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, os.getloadavg()[0] / cpus)


def allow(seconds: float) -> float:
    """``seconds`` (what it takes on a quiet machine) times :func:`scale`."""
    return seconds * scale()
