"""The load benchmark (bench/load.py) end to end on a tiny load: K simulated workers in one process
against a real PS process, every round full, no 5xx, the final weights equal to the numpy replay."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from bench.load import gradient, replay
from tests.timing import allow


def test_load_bench_runs_exactly_with_eight_workers():
    out = subprocess.run([sys.executable, "-m", "bench.load", "--json", "--workers", "8", "--rounds", "3"],
                         capture_output=True, text=True, timeout=allow(120))
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (line, out.stderr[-2000:])
    assert line["exact"] is True and line["errors_5xx"] == 0
    assert line["workers"] == 8 and line["rounds_done"] == 3 and line["min_contributors"] == 8
    assert line["lease_expiries"] == 0 and line["heartbeat_timeouts"] == 0
    assert line["rounds_per_s"] > 0 and line["push_p99_ms"] > 0 and line["ps_cpu_ms_per_push"] > 0
    assert line["ps_peak_rss_MB"] > 0 and line["register_p99_ms"] > 0
    assert line["settings"] == "bench" and line["healthz_p99_ms"] > 0  # the probe port the bench sets


def test_load_bench_with_the_ps_defaults_probes_where_a_plain_ps_listens():
    """``--defaults``: the PS with its default settings (but the job's size), probed where a plain PS answers."""
    out = subprocess.run([sys.executable, "-m", "bench.load", "--json", "--workers", "4", "--rounds", "2", "--defaults"],
                         capture_output=True, text=True, timeout=allow(120))
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (line, out.stderr[-2000:])
    assert line["settings"] == "default" and line["exact"] is True and line["rounds_done"] == 2
    assert line["healthz_main_p99_ms"] > 0 and line["heartbeat_timeouts"] == 0


def test_the_replay_sums_in_rank_order_and_takes_the_mean():
    contributors = [{"name": "load-1", "rank": 1, "worker_id": "b"}, {"name": "load-0", "rank": 0, "worker_id": "a"}]
    w = replay(4, [{"step": 0, "contributors": contributors}])
    g = gradient(0, 0, 4) + gradient(1, 0, 4)
    g /= 2
    start = np.random.default_rng(17).standard_normal(4, dtype=np.float32)
    assert np.array_equal(w, start - g * np.float32(0.01))
