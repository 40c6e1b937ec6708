"""``python -m worker_service`` ends a run it cannot go on with one line and exit code 1, never a traceback: a wrong
task name, no PS answering (it says at once that it waits, and for how long), a refused token; ``--help`` lists
the settings and stray arguments are refused (worker_service/__main__.py; found by a README walk)."""
from __future__ import annotations

import os
import subprocess
import sys

from cluster.processes import LocalCluster, free_port
from tests.timing import allow
from tests.live_ps import live_ps
from worker_service.settings import WorkerSettings


def worker(*args: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker_service", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=allow(timeout))


def test_help_lists_every_setting_and_arguments_are_refused():
    out = worker("--help")
    assert out.returncode == 0 and "exits" not in out.stderr
    assert all(f"WORKER_{name.upper()}" in out.stdout for name in WorkerSettings.model_fields)
    bad = worker("--task", "mlp")
    assert bad.returncode != 0 and "takes no arguments" in bad.stderr and "Traceback" not in bad.stderr


def test_an_unknown_task_and_an_absent_ps_end_in_one_line():
    out = worker(WORKER_TASK="nope")
    assert out.returncode == 1 and "WORKER_TASK=nope: unknown task 'nope'" in out.stderr
    assert "Traceback" not in out.stderr
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    out = worker(WORKER_PS_URL=url, WORKER_RETRY_TIMEOUT_SECONDS="1.5")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"waiting for the PS at {url} to answer (0 s so far, giving up after 1.5 s)" in out.stderr
    assert f"giving up: the PS at {url} did not answer within 1.5 s" in out.stderr


def test_a_refused_token_ends_in_one_line_that_says_which_setting():
    with live_ps(auth_token="s3cret", startup_grace_seconds=0) as ps:
        out = worker(WORKER_PS_URL=ps.url, WORKER_AUTH_TOKEN="wrong", WORKER_NAME="w")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "the PS refused: 401 unauthorized" in out.stderr and "WORKER_AUTH_TOKEN must be the PS's PS_AUTH_TOKEN" \
        in out.stderr


def test_a_worker_on_the_ps_host_says_its_tensors_go_uncompressed():
    """PS_COMPRESSION on, the worker beside the PS: its tensors go through same-host files, float32 (a README walk
    turned compression on under Compose and saw nothing compressed, with no word of why)."""
    with LocalCluster(1, ps_env={"PS_COMPRESSION": "bf16", "PS_MAX_STEPS": 5}) as c:
        assert c.wait_workers(allow(60)) == [0]
        log = c.log("worker-0")
    assert "(same host as the PS): float32, not compressed (the job's compression bf16 applies to request bodies; " \
           "WORKER_SHM_DIR= sends this worker's over HTTP)" in log, log[-2000:]
