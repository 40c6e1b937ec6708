"""The README's base install (`pip install -e .`, no extras) brings everything its commands import.

A fresh venv with no site packages of ours: `python -m cluster --help` (what `make run` calls), the PS's and
the worker's entry modules import, and `python -m cluster --task mlp` (which needs the `mlp` extra) says how
to install it instead of a traceback. pip reaches packages as configured on the machine (its cache, its
index); the venv is removed afterwards. Slow (~20-30 s): `-m "not slow"` skips it; CI runs it.

The venv is made without pip and the install is run by the suite's own pip (``pip --python VENV``): that is
the up-to-date pip ``make`` installs (it upgrades pip first), and it spares ensurepip's bundled pip, which
took ~10 s to set up and then 27 s instead of 15 s for the same install on this 2-core machine (2026-11-30).
pip does not byte-compile what it installs (``--no-compile``): the three commands below then compile only the
modules they import (bytecode writing on for them), instead of pip compiling every installed package.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import degraded

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    # see the module docstring; and the real exec path of local clusters, as users get it (no fork server)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "SYNCPS_FORK_SERVER")}
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env, **kw)


def test_base_install_runs_the_documented_commands(tmp_path):
    env_dir = tmp_path / "venv"
    try:
        venv.EnvBuilder(with_pip=False, system_site_packages=False, clear=True).create(env_dir)
        py = env_dir / "bin" / "python"
        # a copy of the sources: an editable install writes its metadata next to them, and the checkout
        # (with its .venv) stays untouched
        src = tmp_path / "src"
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__",
                                                                  ".hypothesis", ".pytest_cache", "build"))
        r = run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--disable-pip-version-check",
                 "--no-compile", "-e", src], 540)
        if r.returncode != 0 and ("Could not find a version" in r.stderr or "No matching distribution" in r.stderr):
            reason = f"pip cannot reach the dependencies here: {r.stderr.strip().splitlines()[-1]}"
            degraded("fresh-venv install (test_install.py)", f"skipped: {reason}")
            pytest.skip(reason)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        # only the base dependencies: no extra came along
        missing = run([py, "-c", "import importlib.util as u; print([m for m in ('sklearn', 'pytest') if u.find_spec(m)])"], 60)
        assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr

        outside = tmp_path  # not the checkout: the installed package is what gets imported
        r = run([py, "-m", "cluster", "--help"], 120, cwd=outside)
        assert r.returncode == 0 and "--keep-logs" in r.stdout, r.stdout + r.stderr
        r = run([py, "-c", "import cluster.__main__, ps_service.__main__, worker_service.__main__, ps_service.app, "
                           "worker_service.tasks.linear, bench.run; print('ok')"], 120, cwd=outside)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
        r = run([py, "-m", "cluster", "--task", "mlp"], 120, cwd=outside)
        assert r.returncode == 2 and "pip install -e '.[mlp]'" in r.stdout and "Traceback" not in r.stdout + r.stderr, \
            r.stdout + r.stderr
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # a venv is ~100 MB: do not leave it to pytest's rotation
