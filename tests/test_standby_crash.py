"""The crash loop of a hot-standby pair (issue 51): real PS and worker processes, the primary kill -9'd at random
moments again and again (each time started again: it comes back as the standby of the newer term, takes the state
and is killed in turn once it took over); every job finishes bit-identical to an uninterrupted run (one process's,
tests/reference.py, 0 ulp), and no worker resumes behind the round it had open (no acknowledged round lost). The
time from each kill until a round closes again is printed (each, median, max). Both carriers of the steps: the two PS
share the host, so the steps go through the standby's same-host log (ps_service/standby/ring.py: a takeover first
applies every record committed in it; tests/test_standby_ring.py kills its writer mid-record), or over HTTP (no
shared-memory directory: as between hosts). ``python -m bench.failover`` runs the same
loop over more jobs (the 100 kills and more of issue 51: bench/results/).
"""
from __future__ import annotations

import statistics

import pytest

from bench.failover import run_job
from tests.test_standby_live import assert_bit_identical, reference
from tests.timing import scale

KILLS: list[float] = []  # seconds from each kill until a round closed again (every job of this file)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("carrier", ["log", "http"])
def test_kill_the_primary_again_and_again_and_the_job_finishes_bit_identical(carrier, seed):
    steps, workers = 400, 3
    job = run_job(workers, steps, 6, seed, patience=scale(), carrier=carrier)
    KILLS.extend(job["again"])
    assert job["kills"] >= 5 and job["exit_codes"] == [0] * workers and job["step"] == steps
    assert job["lost"] == 0  # no worker resumed behind the round it had open
    assert (job["logged"] > 0) == (carrier == "log")  # through the standby's log (ring.py), or none of them
    assert_bit_identical(job["weights"], reference(steps, workers))
    print(f"\n{carrier} {job['kills']} kills: a round closed again after {statistics.median(job['again']):.2f} s "
          f"(median), {max(job['again']):.2f} s (max); {len(KILLS)} kills so far; each: "
          f"{' '.join(f'{t:.3f}' for t in job['again'])}")


