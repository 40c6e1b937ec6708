"""The README, the documentation site, the settings classes and docker-compose.yml agree, and the documented
commands are the real ones.

- docs/reference/configuration.md is what python -m docgen renders from ``PSSettings`` / ``WorkerSettings``
  (one row per field: env name, default, description); a setting changed without re-rendering fails here. Every
  setting is passed through docker-compose.yml, which lists none that does not exist.
- The compose commands the compose tests run (``tests/compose_util.GUIDES``) are written exactly so on
  docs/guides/compose.md and docs/guides/standby.md; the README shows the quick start (`docker compose up --scale worker=4`, `make run`,
  `make test`), and the install commands the docs give bring what the commands import.
- The site builds with ``mkdocs build --strict`` (a broken link or anchor, a page off the nav fails); the README
  has at most 250 lines of at most 120 characters; no page of docs/ has more than 600 lines.
- The Makefile installs what the docs say: `make run` the base (`-e .`), `make test` / `bench` / `venv` the test
  extras (`-e '.[test]'`), each once per venv.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from docgen import configuration
from ps_service.settings import PSSettings
from tests.compose_util import COMPOSE_FIXED, GUIDES
from tests.timing import allow
from worker_service.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
GETTING_STARTED = (DOCS / "getting-started.md").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CLASSES = {"ps": (PSSettings, "PS_"), "worker": (WorkerSettings, "WORKER_")}


COMPOSE_ONLY = tuple(configuration.COMPOSE_ONLY)


def env_names(service: str) -> list[str]:
    cls, prefix = CLASSES[service]
    return [prefix + name.upper() for name in cls.model_fields]


def compose_env(service: str) -> dict[str, str | None]:
    """The service's environment entries: name -> value (None: passed from .env / the shell when set)."""
    out: dict[str, str | None] = {}
    for item in COMPOSE["services"][service]["environment"]:
        name, sep, value = str(item).partition("=")
        out[name] = value if sep else None
    return out


def test_the_configuration_page_is_what_the_settings_classes_render():
    """docs/reference/configuration.md is python -m docgen's rendering of the classes, byte for byte: a setting
    added, removed or re-described without `python -m docgen` fails here."""
    page = (ROOT / configuration.PAGE).read_text()
    rendered = configuration.render()
    assert page == rendered, "docs/reference/configuration.md is out of date: run python -m docgen"
    # the rendering has every field's row, with its default and its description, and nothing else
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `((?:PS|WORKER)_[A-Z0-9_]+)` \| `[^`]*` \| .* \|$",
                                                      page, re.M)}
    expected = {n for s in CLASSES for n in env_names(s)}
    assert set(rows) == expected, sorted(set(rows) ^ expected)
    f = PSSettings.model_fields["lease_seconds"]
    assert rows["PS_LEASE_SECONDS"] == f"| `PS_LEASE_SECONDS` | `{f.default}` | {f.description} |"
    assert all(f"`{name}`" in page for name in COMPOSE_ONLY)


def test_a_field_without_a_group_stops_the_renderer(monkeypatch):
    """A new setting cannot reach the page without a place on it: the renderer names it."""
    groups = {k: (t, c, [(g, [n for n in names if n != "lease_seconds"]) for g, names in gs])
              for k, (t, c, gs) in configuration.GROUPS.items()}
    monkeypatch.setattr(configuration, "GROUPS", groups)
    with pytest.raises(ValueError, match="PS_LEASE_SECONDS"):
        configuration.render()


def test_the_readme_gives_the_quick_start_and_links_the_reference():
    for cmd in ("make run", "make test", "docker compose up --scale worker=4", "docs/protocol.md",
                "docs/reference/configuration.md"):
        assert cmd in README, cmd
    assert "| `PS_" not in README  # the settings live on the generated page, not in a table copied by hand


def test_the_readme_tells_a_new_user_what_a_first_run_needs():
    """What a new user following the README word for word met: a second `docker compose up` resumes the finished
    job from the checkpoints volume (done at once) unless `down -v`; the by-hand commands need the venv activated
    (the system python lacks the dependencies); the weights `make run` prints are the linear task's truth."""
    from worker_service.tasks import linear
    quick = README.split("## Your own PyTorch model")[0]
    assert "docker compose down -v" in quick and "Ctrl-C" in quick
    assert ". .venv/bin/activate" in quick
    w = ", ".join(f"{v:g}" for v in linear.W_TRUE.ravel())
    assert f"[{w}] + {linear.B_TRUE:g}" in quick and f"b = [{linear.B_TRUE:g}...]" in quick


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
    # what the file fixes is deliberate (and said on docs/reference/configuration.md); the rest comes from .env when set
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
    files = "".join((ROOT / f).read_text() for f in ("docker-compose.yml", "docker-compose.standby.yml"))
    for name in COMPOSE_ONLY:
        assert f"${{{name}" in files, name


def test_compose_file_defaults_that_keep_a_job_steady():
    ps, worker = COMPOSE["services"]["ps"], COMPOSE["services"]["worker"]
    # a plain `docker compose up -d` keeps (or restores) 4 workers, never drops a job to 1
    assert worker.get("scale") == 4 or worker.get("deploy", {}).get("replicas") == 4
    # the image is built here, never pulled from a registry
    assert ps["build"] == {"context": ".", "args": {"EXTRAS": "${SYNCPS_EXTRAS:-mlp}", "TORCH_INDEX_URL":
                                                      "${SYNCPS_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"}}
    assert ps["pull_policy"] in ("never", "build") and worker["pull_policy"] == "never"
    assert ps["image"] == worker["image"]


@pytest.mark.parametrize("guide", list(GUIDES))
def test_documented_compose_commands_are_in_the_guides_verbatim(guide):
    """The compose tests run these exact commands; docs/guides/compose.md (and standby.md, the pair's) must show
    them exactly so."""
    text = (ROOT / guide).read_text()
    spans = set(re.findall(r"`([^`\n]+)`", text)) | {line.split("  # ")[0].strip() for line in text.splitlines()}
    missing = [cmd for cmd in GUIDES[guide].values() if cmd not in spans]
    assert not missing, f"{guide} does not show {missing}"
    # no inline job settings before a compose command: .env is the one place for them
    for page in (README, GETTING_STARTED, text):
        inline = re.findall(r"`(?:[A-Z][A-Z0-9_]*=\S* )+docker compose[^`]*`", page)
        assert not inline, inline


def test_install_commands_bring_what_the_commands_import():
    """`pip install -e .` is the base (make run's python -m cluster, the PS, the linear worker); the mlp task's
    scikit-learn comes with the `mlp` extra (tests/test_install.py checks a fresh venv)."""
    assert "pip install -e ." in README and "pip install -e ." in GETTING_STARTED
    assert "pip install -e '.[mlp]'" in GETTING_STARTED
    for text in (README, GETTING_STARTED):
        assert "python -m cluster --workers 4 --task linear" in text  # what make run calls
    assert "$(PY) -m cluster --workers 4 --task linear" in (ROOT / "Makefile").read_text()


def make(venv: Path, *args: str) -> str:
    # not an outer make's variables (`make test PYTEST_ARGS=...` passes them down in MAKEFLAGS) nor the caller's
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VENV", "RUN_ARGS", "PYTEST_ARGS")}
    out = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", *args], capture_output=True, text=True,
                         timeout=allow(60), cwd=ROOT, env=env)
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
    suite = "-m pytest -n 2 --dist loadfile --no-loadscope-reorder"  # 2 xdist processes, conftest's file order
    assert calls("test") == ["-m pip install -q -e .[test]", suite]
    assert calls("run", "test") == ["-m cluster --workers 4 --task linear", suite]
    for stamp in venv.glob(".installed-*"):
        stamp.unlink()
    assert calls("test") == ["-m pip install -q -e .[test]", suite]
    assert calls("run") == ["-m cluster --workers 4 --task linear"]  # the test install includes the base


# ---- the site ---------------------------------------------------------------------------------------------
def test_the_readme_reads_in_ten_minutes():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    long = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def test_no_docs_page_is_over_600_lines():
    pages = sorted(DOCS.rglob("*.md"))
    assert pages
    long = {p.relative_to(ROOT).as_posix(): n for p in pages if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"pages over 600 lines (split them): {long}"


def test_every_page_is_in_the_nav():
    """mkdocs --strict reports pages missing from the nav only as INFO: checked here."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = sorted(p for p in pages if f": {p}\n" not in nav)
    assert not missing, f"mkdocs.yml's nav lacks {missing}"


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (what `make docs` and .ci/run run): a broken link or anchor fails."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs or mkdocs-material is not installed (pip install -e '.[docs]'): the site was not built")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=allow(300),
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_resolve():
    """mkdocs checks the site's links; the README is outside it: its relative links name files that exist, and
    their anchors headings of those files."""
    links = re.findall(r"\]\(([^)\s]+)\)", README) + re.findall(r"^\[[^\]]+\]: (\S+)$", README, re.M)
    assert links
    for link in (x for x in links if not x.startswith(("http://", "https://"))):
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"README links to {link}: no such heading"


def test_the_services_read_their_variables_only_through_the_settings_classes():
    """``PS_*``, ``WORKER_*`` and ``SYNCPS_*`` are read by the pydantic-settings classes only (docgen/configuration.py's
    ``settings_classes``: ps_service/settings.py, worker_service/settings.py, shared/settings.py), so
    docs/reference/configuration.md lists every variable the PS, the workers and the shared code read; one read from
    ``os.environ`` or ``os.getenv`` in those packages would be on no page (``SYNCPS_MARKS_DIR`` was)."""
    read = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\s*\()\s*["'](PS|WORKER|SYNCPS)_""")
    hits = [f"{path.relative_to(ROOT)}:{n}" for pkg in ("ps_service", "worker_service", "shared", "syncps")
            for path in sorted((ROOT / pkg).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if read.search(line)]
    assert not hits, hits
    page = (ROOT / configuration.PAGE).read_text()
    assert "| `SYNCPS_MARKS_DIR` | `unset` |" in page
