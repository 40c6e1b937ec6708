"""One BLAS / OpenMP thread per worker process unless the user sets otherwise.

Workers share their host: a BLAS or torch that starts a thread per core in each of them makes every step wait for
the others' threads (issue 50). :func:`one_thread_unless_set` sets each of :data:`VARS` the environment does not set
to 1: in ``python -m worker_service`` before numpy or torch is imported (they read them once, at import); the
PyTorch bridge sets torch's threads from it (:func:`torch_threads`); :func:`describe` says what applies. Imports
nothing but ``os``, so it can run first.
"""
from __future__ import annotations

import os
from typing import MutableMapping

#: the variables of OpenBLAS, OpenMP (torch's CPU kernels, MKL's) and MKL
VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_thread_unless_set(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set each of :data:`VARS` that ``environ`` lacks to ``"1"``; the names set."""
    missing = [name for name in VARS if name not in environ]
    for name in missing:
        environ[name] = "1"
    return missing


def describe(defaulted: list[str], environ: MutableMapping[str, str] = os.environ) -> str:
    """For the start line: the thread settings in force, and which are this module's default."""
    values = " ".join(f"{name}={environ.get(name)}" for name in VARS)
    if not defaulted:
        return f"threads: {values} (as set)"
    return f"threads: {values} (1 unless set: workers share their host; set {', '.join(defaulted)} to use more)"


def torch_threads(torch, environ: MutableMapping[str, str] = os.environ) -> str:
    """A worker's torch computes on ``OMP_NUM_THREADS`` threads (a positive integer), one unless set; for the start
    line. Set on torch itself, not only read from the environment: torch reads the variable once, at import, and a
    process that imported torch before the variable was set (a script that imports torch first, a process forked
    from one that had) would otherwise keep a thread per core, and its float32 results would depend on that count."""
    given = environ.get("OMP_NUM_THREADS", "")
    n = int(given) if given.isdigit() and int(given) > 0 else 1
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if not given:
        return "torch threads: 1 (OMP_NUM_THREADS unset: workers share their host; set it to use more)"
    return f"torch threads: {n} (OMP_NUM_THREADS={given})"
