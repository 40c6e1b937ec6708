"""``python -m cluster`` (make run) and :class:`LocalCluster`'s log folder: the summary prints the task's
evaluation and a training-only rate, and the ``syncps-*`` folder is kept only when asked or when something
failed (the suite itself keeps every cluster's logs under one folder until the session ends: tests/conftest.py;
these tests point ``SYNCPS_LOG_ROOT`` at their own tmp dir and turn ``SYNCPS_KEEP_LOGS`` off)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.processes import LocalCluster
from tests.timing import allow

ROOT = Path(__file__).resolve().parent.parent
PS_ONLY = {"PS_MIN_WORKERS": 1}  # a PS and no worker (LocalCluster(0) would ask for 0)


@pytest.fixture
def log_root(tmp_path, monkeypatch):
    root = tmp_path / "logs"
    monkeypatch.setenv("SYNCPS_LOG_ROOT", str(root))
    monkeypatch.setenv("SYNCPS_KEEP_LOGS", "")
    return root


def cli(*args: str, timeout: float = 150) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "cluster", *args], capture_output=True, text=True, timeout=allow(timeout),
                         cwd=ROOT, env={**os.environ, "COLUMNS": "160"})
    return out.returncode, out.stdout + out.stderr


def test_mlp_summary_prints_the_held_out_evaluation_and_keeps_logs_when_asked(log_root):
    code, text = cli("--workers", "2", "--task", "mlp", "--steps", "60", "--deadline", "120", "--keep-logs")
    assert code == 0, text[-3000:]
    m = re.search(r"evaluation of the final weights by the mlp task \(held-out test split\): "
                  r"accuracy ([\d.]+) \(([\d.]+) %\), loss ([\d.]+)", text)
    assert m, text[-3000:]
    accuracy = float(m[1])
    assert 0.3 < accuracy <= 1.0 and float(m[2]) == pytest.approx(100 * accuracy, abs=0.01)
    # the rate is the training's own, and the line says start-up is not in it
    assert re.search(r"global step 60, last loss \S+, [\d.]+ rounds/s \(training only: 60 rounds in [\d.]+ s\)\n"
                     r"wall time [\d.]+ s in all, start-up \(PS, 2 workers, registration\) and shutdown included",
                     text), text[-3000:]
    # --keep-logs: the folder stays, named last; the workers evaluated the same weights to the same accuracy
    (kept,) = re.findall(r"logs of the PS and the workers: (\S+)", text)
    folder = Path(kept)
    assert folder.parent == log_root and folder.name.startswith("syncps-")
    assert sorted(p.name for p in folder.iterdir()) == ["ps.log", "worker-0.log", "worker-1.log"]
    for name in ("worker-0.log", "worker-1.log"):
        final = re.search(r"FINISHED: training done at global step 60 .*evaluation accuracy=([\d.]+)",
                          (folder / name).read_text())
        assert final and float(final[1]) == pytest.approx(accuracy, abs=1e-4), name


def test_a_clean_cluster_removes_its_logs_a_failed_one_keeps_them(log_root, monkeypatch):
    with LocalCluster(0, ps_env=PS_ONLY) as c:
        assert c.log("ps")  # the PS logged its start-up
    assert c.logs_removed and not c.log_dir.exists()
    assert list(log_root.iterdir()) == []
    # a PS that cannot start (invalid setting): the error propagates, the logs stay
    bad = LocalCluster(0, ps_env={**PS_ONLY, "PS_LEASE_SECONDS": "-1"})
    with pytest.raises(RuntimeError, match="PS exited"):
        bad.__enter__()
    assert bad.failed and not bad.logs_removed and "PS_LEASE_SECONDS: " in bad.log("ps")
    # an exception inside the block marks the run failed: kept (no process needed to show it)
    c2 = LocalCluster(0, ps_env=PS_ONLY)
    c2.__exit__(KeyError, KeyError("boom"), None)
    assert c2.log_dir.exists() and not c2.logs_removed
    # a caller's own folder is never removed
    own = LocalCluster(0, ps_env=PS_ONLY, log_dir=log_root / "mine")
    own.stop()
    assert own.log_dir.exists() and not own.logs_removed
    # SYNCPS_KEEP_LOGS=1 (as the suite sets it) keeps a clean run's folder too
    monkeypatch.setenv("SYNCPS_KEEP_LOGS", "1")
    kept = LocalCluster(0, ps_env=PS_ONLY)
    kept.stop()
    assert kept.log_dir.exists() and not kept.logs_removed


def test_cli_failure_keeps_the_logs_and_says_where(log_root):
    """A PS that cannot start (an invalid setting in the environment): exit 1, the reason, no traceback, and
    the log folder kept and named."""
    # no COLUMNS and a pipe for stdout, as in `make run | tee log`: the URL lines come out whole
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-m", "cluster", "--workers", "1", "--steps", "10", "--deadline", "60"],
                         capture_output=True, text=True, timeout=allow(60), cwd=ROOT, env={**env, "PS_LEASE_SECONDS": "-1"})
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "failed: PS exited with 1" in text and "PS_LEASE_SECONDS: " in text, text[-3000:]
    assert re.search(r"^dashboard http://127\.0\.0\.1:(\d+)/  metrics http://127\.0\.0\.1:\1/metrics  "
                     r"API docs http://127\.0\.0\.1:\1/docs$", out.stdout, re.M), out.stdout[:1000]
    assert "Traceback (most recent call last)" not in text.split("failed: PS exited")[0]
    (kept,) = re.findall(r"logs of the PS and the workers: (\S+)", text)
    assert Path(kept).parent == log_root and "PS_LEASE_SECONDS: " in (Path(kept) / "ps.log").read_text()


def test_output_to_a_pipe_keeps_long_lines_whole(monkeypatch):
    """Not a terminal (`make run | tee log`): rich would cut lines at 80 columns, splitting the URLs."""
    import io

    from rich.table import Table

    from cluster.__main__ import make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console = make_console(out)
    assert not console.is_terminal and console.width == 80
    url = "http://127.0.0.1:39307"
    line = f"dashboard {url}/  metrics {url}/metrics  API docs {url}/docs"
    assert len(line) > 100
    console.print(line)
    console.print("[green]done: every worker exited 0")
    table = Table("rank", "name", title="workers")
    table.add_row("0", "worker-0")
    console.print(table, soft_wrap=False)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [line, "done: every worker exited 0"], lines
    assert "workers" in lines[2] and lines[2].strip() == "workers"  # the table as before, within the width
    assert max(map(len, lines[2:])) <= 80


def test_mlp_without_scikit_learn_says_how_to_install_it(monkeypatch):
    from cluster import __main__ as cli_main

    monkeypatch.setattr(cli_main.importlib.util, "find_spec", lambda name: None)
    assert cli_main.missing_extra("mlp") == ("the mlp task needs sklearn, not installed: "
                                             "pip install -e '.[mlp]'  (scikit-learn)")
    assert cli_main.missing_extra("linear") is None
    assert cli_main.main(["--task", "mlp"]) == 2
    monkeypatch.setattr(cli_main.importlib.util, "find_spec", lambda name: None if name == "sklearn" else object())
    assert cli_main.missing_extra("cnn") == ("the cnn task needs sklearn, not installed: "
                                             "pip install -e '.[torch,mlp]'  (PyTorch, and scikit-learn: its data)")


def test_workers_that_all_fail_show_why_not_a_traceback():
    """Every worker exits 1 before the model exists: the end of each one's log, not the PS's 409 to a pull."""
    out = subprocess.run([sys.executable, "-m", "cluster", "--workers", "2", "--steps", "10", "--deadline", "60"],
                         capture_output=True, text=True, timeout=allow(90), cwd=ROOT,
                         env={**os.environ, "COLUMNS": "160", "WORKER_BATCH_SIZE": "-1"})
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "not_initialized" not in text, text[-3000:]  # (the workers' own tracebacks show)
    assert "worker-0 exited with code 1; the end of its log:" in text, text[-3000:]
    assert "python -m worker_service: WORKER_BATCH_SIZE: Input should be greater than or equal to 1" in text
    assert "Traceback" not in text and "-1" not in text.split("WORKER_BATCH_SIZE: ")[1].splitlines()[0]  # no input
    assert "failed: the job is waiting_for_model at step 0, and no worker is left" in text, text[-3000:]
