"""The README, the settings classes and docker-compose.yml agree, and the README's commands are the real ones.

- Every field of ``PSSettings`` / ``WorkerSettings`` (their env names: ``PS_*``, ``WORKER_*``) has a row in
  the README's configuration table with the class's default and description, and is passed through
  docker-compose.yml; neither lists a setting that does not exist. A new field fails here until both do.
- The compose commands the compose tests run (``tests/compose_util.DOCUMENTED``) are written in the
  README exactly so, and the install commands the README gives bring what the commands import.
- The Makefile installs what the README says: `make run` the base (`-e .`), `make test` / `bench` / `venv` the test
  extras (`-e '.[test]'`), each once per venv.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ps_service.settings import PSSettings
from tests.compose_util import COMPOSE_FIXED, DOCUMENTED
from worker_service.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CLASSES = {"ps": (PSSettings, "PS_"), "worker": (WorkerSettings, "WORKER_")}
ROW = re.compile(r"^\| `((?:PS|WORKER)_[A-Z0-9_]+)` \| `([^`]*)` \| (.*) \|$", re.M)
COMPOSE_ONLY = ("SYNCPS_PORT", "SYNCPS_BIND", "SYNCPS_IMAGE", "SYNCPS_EXTRAS", "SYNCPS_TORCH_INDEX_URL")


def env_names(service: str) -> list[str]:
    cls, prefix = CLASSES[service]
    return [prefix + name.upper() for name in cls.model_fields]


def readme_default(field) -> str:
    return "unset" if field.default is None else str(field.default)


def readme_row(service: str, env: str) -> str:
    cls, prefix = CLASSES[service]
    f = cls.model_fields[env.removeprefix(prefix).lower()]
    default = readme_default(f) if f.default_factory is None else "<computed: see its meaning>"
    return f"| `{env}` | `{default}` | {f.description} |"


def compose_env(service: str) -> dict[str, str | None]:
    """The service's environment entries: name -> value (None: passed from .env / the shell when set)."""
    out: dict[str, str | None] = {}
    for item in COMPOSE["services"][service]["environment"]:
        name, sep, value = str(item).partition("=")
        out[name] = value if sep else None
    return out


def test_readme_has_every_env_var_and_the_commands():
    missing = [n for s in CLASSES for n in env_names(s) if f"`{n}`" not in README]
    assert not missing, f"README lacks {missing}"
    for cmd in ("make run", "make test", "docker compose up --scale worker=4", "docs/protocol.md"):
        assert cmd in README


@pytest.mark.parametrize("service", ["ps", "worker"])
def test_readme_table_rows_are_the_settings_class(service):
    """One row per field, in any order, with the class's default and description (the table is the class)."""
    cls, prefix = CLASSES[service]
    rows = {name: (default, meaning) for name, default, meaning in ROW.findall(README) if name.startswith(prefix)}
    expected = env_names(service)
    missing = [readme_row(service, n) for n in expected if n not in rows]
    assert not missing, "README's configuration table lacks these rows:\n" + "\n".join(missing)
    unknown = sorted(set(rows) - set(expected))
    assert not unknown, f"README documents settings that {cls.__name__} does not have: {unknown}"
    wrong = [readme_row(service, n) for n in expected
             if rows[n][1] != cls.model_fields[n.removeprefix(prefix).lower()].description
             or (cls.model_fields[n.removeprefix(prefix).lower()].default_factory is None
                 and rows[n][0] != readme_default(cls.model_fields[n.removeprefix(prefix).lower()]))]
    assert not wrong, "README rows out of date; they should read:\n" + "\n".join(wrong)


@pytest.mark.parametrize("service", ["ps", "worker"])
def test_compose_passes_every_setting(service):
    """Every setting reaches the container: listed (passed from .env when set) or fixed by the file."""
    env = compose_env(service)
    _, prefix = CLASSES[service]
    expected = env_names(service)
    missing = [n for n in expected if n not in env]
    assert not missing, f"docker-compose.yml's {service} service does not pass {missing}"
    unknown = sorted(n for n in env if n.startswith(prefix) and n not in expected)
    assert not unknown, f"docker-compose.yml's {service} service sets unknown settings {unknown}"
    other = "WORKER_" if prefix == "PS_" else "PS_"
    assert not [n for n in env if n.startswith(other)], f"{service} gets the other service's settings"
    # what the file fixes is deliberate (and said in the README); the rest comes from .env when set
    fixed = {n: v for n, v in env.items() if v is not None and "${" not in v}
    assert fixed == {n: v for n, v in COMPOSE_FIXED.items() if n.startswith(prefix)}


def test_env_example_names_only_real_settings():
    text = (ROOT / ".env.example").read_text()
    named = set(re.findall(r"^#? ?((?:PS|WORKER|SYNCPS)_[A-Z0-9_]+)=", text, re.M))
    real = {n for s in CLASSES for n in env_names(s)} | set(COMPOSE_ONLY)
    assert named and not named - real, sorted(named - real)
    # .env is the one place for a job's settings: the example offers every one compose takes from it
    settable = {n for s in CLASSES for n in env_names(s)} - set(COMPOSE_FIXED) - {"WORKER_AUTH_TOKEN"}
    missing = sorted(settable - named)
    assert not missing, f".env.example lacks {missing} (a '# description' line and '# NAME=default' each)"
    assert "WORKER_AUTH_TOKEN=" not in text  # compose gives the workers PS_AUTH_TOKEN
    for name in COMPOSE_ONLY:
        assert f"`{name}`" in README and f"${{{name}" in (ROOT / "docker-compose.yml").read_text()


def test_compose_file_defaults_that_keep_a_job_steady():
    ps, worker = COMPOSE["services"]["ps"], COMPOSE["services"]["worker"]
    # a plain `docker compose up -d` keeps (or restores) 4 workers, never drops a job to 1
    assert worker.get("scale") == 4 or worker.get("deploy", {}).get("replicas") == 4
    # the image is built here, never pulled from a registry
    assert ps["build"] == {"context": ".", "args": {"EXTRAS": "${SYNCPS_EXTRAS:-mlp}", "TORCH_INDEX_URL":
                                                      "${SYNCPS_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"}}
    assert ps["pull_policy"] in ("never", "build") and worker["pull_policy"] == "never"
    assert ps["image"] == worker["image"]


def test_documented_compose_commands_are_in_the_readme_verbatim():
    """The compose tests run these exact commands; the README must show them exactly so."""
    spans = set(re.findall(r"`([^`\n]+)`", README)) | {line.strip() for line in README.splitlines()}
    missing = [cmd for cmd in DOCUMENTED.values() if cmd not in spans]
    assert not missing, f"README does not show {missing}"
    # no inline job settings before a compose command: .env is the one place for them
    inline = re.findall(r"`(?:[A-Z][A-Z0-9_]*=\S* )+docker compose[^`]*`", README)
    assert not inline, inline


def test_readme_install_commands_bring_what_the_commands_import():
    """`pip install -e .` is the base (make run's python -m cluster, the PS, the linear worker); the mlp task's
    scikit-learn comes with the `mlp` extra (tests/test_install.py checks a fresh venv)."""
    assert "pip install -e ." in README and "pip install -e '.[mlp]'" in README
    assert "python -m cluster --workers 4 --task linear" in README  # what make run calls
    assert "$(PY) -m cluster --workers 4 --task linear" in (ROOT / "Makefile").read_text()


def make(venv: Path, *args: str) -> str:
    # not an outer make's variables (`make test PYTEST_ARGS=...` passes them down in MAKEFLAGS) nor the caller's
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VENV", "RUN_ARGS", "PYTEST_ARGS")}
    out = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", *args], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.skipif(not shutil.which("make"), reason="no make")
def test_make_run_installs_the_base_make_test_the_test_extras(tmp_path):
    """`make run` installs `-e .` only (the base brings all that python -m cluster --task linear imports; torch and
    the other test extras are not downloaded for the demo); `make test`, `make bench` and `make venv` install
    `-e '.[test]'`. Two stamps in the venv: run then test adds the extras, test then run installs nothing more."""
    venv = tmp_path / "venv"
    install = re.compile(r"-m pip install -q -e (\S+)")
    run = make(venv, "-n", "run")
    assert f"python3 -m venv {venv}" in run and install.findall(run) == ["."], run
    for target in ("test", "bench", "venv"):
        out = make(venv, "-n", target)
        assert f"python3 -m venv {venv}" in out and install.findall(out) == ["'.[test]'"], (target, out)
    # the real sequence, with a stand-in python that only says what it was asked
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "python $*"\n')
    (venv / "bin" / "python").chmod(0o755)
    calls = lambda *targets: re.findall(r"^python (.*)$", make(venv, *targets), re.M)  # noqa: E731
    assert calls("run") == ["-m pip install -q -e .", "-m cluster --workers 4 --task linear"]
    assert calls("run") == ["-m cluster --workers 4 --task linear"]
    assert calls("test") == ["-m pip install -q -e .[test]", "-m pytest"]
    assert calls("run", "test") == ["-m cluster --workers 4 --task linear", "-m pytest"]
    for stamp in venv.glob(".installed-*"):
        stamp.unlink()
    assert calls("test") == ["-m pip install -q -e .[test]", "-m pytest"]
    assert calls("run") == ["-m cluster --workers 4 --task linear"]  # the test install includes the base
