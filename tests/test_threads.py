"""worker_service/threads.py: a worker computes on one BLAS/OpenMP thread unless the user set otherwise, set before
numpy is imported, and says so in its start line; the PyTorch bridge's torch likewise."""
from __future__ import annotations

import os
import subprocess
import sys

from worker_service import threads
from tests.timing import allow


def test_unset_variables_become_one_and_set_ones_stay():
    env = {"OMP_NUM_THREADS": "4"}
    assert threads.one_thread_unless_set(env) == ["OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"]
    assert env == {"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    line = threads.describe(["OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"], env)
    assert line.startswith("threads: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=4 MKL_NUM_THREADS=1 (1 unless set")
    assert threads.describe([], env).endswith("(as set)")


def test_torch_runs_one_thread_unless_omp_num_threads_is_set():
    class FakeTorch:
        n = 8

        def set_num_threads(self, n):
            self.n = n

        def get_num_threads(self):
            return self.n

    t = FakeTorch()
    assert threads.torch_threads(t, {}).startswith("torch threads: 1 (OMP_NUM_THREADS unset") and t.n == 1
    t.n = 3
    assert threads.torch_threads(t, {"OMP_NUM_THREADS": "3"}) == "torch threads: 3 (OMP_NUM_THREADS=3)" and t.n == 3
    # torch imported before the variable was set (its pool already a thread per core): set on torch all the same
    t.n = 8
    assert threads.torch_threads(t, {"OMP_NUM_THREADS": "1"}) == "torch threads: 1 (OMP_NUM_THREADS=1)" and t.n == 1


def test_python_m_worker_service_sets_them_before_numpy_loads():
    env = {k: v for k, v in os.environ.items() if k not in threads.VARS}
    code = ("import os, sys, worker_service.__main__; assert 'numpy' in sys.modules; "
            "print([os.environ[v] for v in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS')])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=allow(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['1', '1', '1']"
