"""ps_service/heap.py: after :func:`keep_freed_memory`, a round's temporaries reuse the pages the last round freed
(counted as the process's minor page faults) instead of faulting them in afresh; glibc's own variables win; the PS's
``main`` calls it before it serves."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest


ROUNDS = """
import resource, numpy as np
from ps_service.heap import keep_freed_memory
kept = keep_freed_memory() if {keep} else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm: the first rounds map what the later ones reuse
    parts = [np.ones(400_000, np.int64) for _ in range(4)]; del parts
before = faults()
for _ in range(20):  # a round's temporaries: four 3.2 MB arrays made and freed
    parts = [np.ones(400_000, np.int64) for _ in range(4)]; del parts
print(kept, faults() - before)
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def rounds(keep: bool, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS.format(keep=keep)], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}, check=True)
    kept, faults = out.stdout.split()
    return kept, int(faults)


@glibc
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    env = {"MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": None}
    kept, faults = rounds(True, env)
    assert kept == "True"
    assert faults < 200  # 80 arrays of 782 pages each: (nearly) none faulted in again
    _, plain = rounds(False, env)
    assert plain > 20 * 782  # glibc's defaults give each round's blocks back and fault them in again


@glibc
def test_glibc_variables_in_the_environment_win():
    kept, faults = rounds(True, {"MALLOC_TRIM_THRESHOLD_": "0"})
    assert kept == "False" and faults > 20 * 782


def test_the_ps_sets_it_before_it_serves(monkeypatch):
    import ps_service.__main__ as ps_main
    calls = []
    monkeypatch.setattr(ps_main, "keep_freed_memory", lambda: calls.append("keep"))
    monkeypatch.setattr(ps_main.uvicorn, "run", lambda *a, **k: calls.append("serve"))
    ps_main.main(["--port", "0"])
    assert calls == ["keep", "serve"]
