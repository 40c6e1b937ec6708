"""Drive the repository's ``docker-compose.yml`` from tests: one isolated compose project per test.

:class:`ComposeProject` runs ``docker compose`` with a unique project name, its own
host port (``SYNCPS_PORT``) and the job's settings in an env file of its own, as a
user keeps them in ``.env`` (docs/guides/compose.md: the one place for settings); the process
environment is scrubbed of the caller's PS_*, WORKER_*, SYNCPS_* and COMPOSE_*
variables and a developer's ``.env`` is never read. Every command has a timeout.
``down()`` removes containers, network, volumes and the env file and reports what is left.

:data:`DOCUMENTED` holds the compose commands docs/guides/compose.md gives (tests/test_docs.py checks
that the page shows each one verbatim), :data:`DOCUMENTED_STANDBY` those of docs/guides/standby.md (the hot-standby
pair: docker-compose.yml with docker-compose.standby.yml, :data:`STANDBY_FILES`); :meth:`ComposeProject.run` runs
one of them as written, adding only the flags that isolate the test's project (a command's ``-f`` files must be the
project's ``files``).

:class:`bench.swarm.PublishedPS` reads the PS of a deployment over its published port (/v1/status polled with a
deadline, /v1/workers), with a token when one is needed; the swarm tests (tests/swarm_util.py) use it too.

:func:`build_context` copies the build context elsewhere, to hand the build wheels (the torch image).

:func:`compose_unavailable` says why compose tests cannot run (``SYNCPS_SKIP_COMPOSE``
set by ``.ci/run``, no ``docker`` CLI, no engine, no Compose v2), or None.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


from bench.swarm import PublishedPS
from cluster.processes import free_port, wait_for
from tests.timing import allow

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
#: The tests' image tag: never a user's syncps:latest, and one per test process, so two test runs on one Docker
#: engine (two checkouts, CI beside a developer) never rebuild each other's image under a running project (compose
#: recreates every container whose image changed). Removed when the process ends (:func:`_drop_image`).
IMAGE = f"syncps:compose-test-{os.getpid()}-{secrets.token_hex(3)}"
SCRUBBED_PREFIXES = ("PS_", "WORKER_", "SYNCPS_", "COMPOSE_")

#: The compose commands of docs/guides/compose.md, run by the compose tests exactly as written there.
DOCUMENTED = {
    "up": "docker compose up -d",  # start (or resume) the job in the background: 4 workers, the file's count
    "scale_up": "docker compose up -d --no-recreate --scale worker=6",  # on a running job: nothing restarted
    "scale_down": "docker compose up -d --no-recreate --scale worker=2",
    "kill_ps": "docker compose kill ps",
    "start_ps": "docker compose start ps",  # the same PS container again; the workers are left alone
    "ps": "docker compose ps",
    "stop": "docker compose stop",  # workers leave gracefully, the PS writes a final checkpoint
}

#: The hot-standby pair's extra compose file (docs/guides/standby.md), and the guide's commands for the pair.
STANDBY_FILES = ("docker-compose.standby.yml",)
_PAIR = "docker compose -f docker-compose.yml -f docker-compose.standby.yml"
DOCUMENTED_STANDBY = {
    "up": f"{_PAIR} up -d",  # the primary `ps`, the standby `ps-standby`, 4 workers given both addresses
    "kill_ps": f"{_PAIR} kill ps",  # the primary dies: the job goes on on ps-standby
    "start_ps": f"{_PAIR} start ps",  # it comes back as the standby of the newer term
    "down": f"{_PAIR} down -v",
}
#: guide -> the compose commands it shows (tests/test_docs.py checks each one is there verbatim)
GUIDES = {"docs/guides/compose.md": DOCUMENTED, "docs/guides/standby.md": DOCUMENTED_STANDBY}

#: Settings docker-compose.yml fixes (not taken from .env): the containers' addresses, the checkpoint
#: volume's path, and WORKER_NAME empty (each replica names itself after its container).
COMPOSE_FIXED = {"PS_HOST": "0.0.0.0", "PS_PORT": "8000", "PS_CHECKPOINT_DIR": "/data/checkpoints",
                 "WORKER_PS_URL": "http://ps:8000", "WORKER_NAME": ""}


def compose_unavailable() -> str | None:
    """The reason compose tests must be skipped, or None when a Docker engine with Compose v2 answers."""
    if os.environ.get("SYNCPS_SKIP_COMPOSE"):
        return f"SYNCPS_SKIP_COMPOSE={os.environ['SYNCPS_SKIP_COMPOSE']}"
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    for cmd, what in ((["docker", "info"], "docker info failed (no engine)"),
                      (["docker", "compose", "version"], "docker compose (v2) is not installed")):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=allow(30))
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{what}: {exc}"
        if r.returncode != 0:
            lines = (r.stderr or r.stdout).strip().splitlines()
            return f"{what}: {lines[-1] if lines else 'exit code %d' % r.returncode}"
    return None


def build_context(dest: Path, wheels: list[Path]) -> str:
    """Copy the repository's build context into ``dest`` (docker-compose.yml, the Dockerfile and what
    .dockerignore lets in), with ``wheels`` in ``dest/wheels/``, where a user puts them (docs/torch.md):
    a test hands the build wheels without touching the working tree. Returns a digest of the copy
    (wheels by name and size), so an image built from the same inputs can be found and reused."""
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!") and "*" not in line]
    for name in ["Dockerfile", ".dockerignore", COMPOSE_FILE.name, *allowed]:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, dest / name)
    (dest / "wheels").mkdir()
    for wheel in wheels:
        try:
            os.link(wheel, dest / "wheels" / wheel.name)  # instant on one filesystem
        except OSError:
            shutil.copy2(wheel, dest / "wheels" / wheel.name)
    digest = hashlib.sha256()
    for f in sorted(p for p in dest.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(dest)}\0".encode())
        digest.update(str(f.stat().st_size).encode() if f.suffix == ".whl" else f.read_bytes())
    return digest.hexdigest()[:12]


def build_image() -> float:
    """Build (or find up to date) the tests' image, :data:`IMAGE`, as ``docker compose build`` does; seconds taken."""
    t0 = time.monotonic()
    builder = ComposeProject("build")
    try:
        builder.build()
    finally:
        builder.env_file.unlink(missing_ok=True)
    return time.monotonic() - t0


def _drop_image() -> None:
    """Untag :data:`IMAGE` (its layers stay in the build cache); harmless when a container still uses it."""
    try:
        docker("rmi", IMAGE, check=False, timeout=30.0)
    except (OSError, subprocess.TimeoutExpired):
        pass


def docker(*args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
    """``docker ARGS`` within ``timeout`` s on a quiet machine (an allowance: tests/timing.py)."""
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=allow(timeout))
    if check and r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


class ComposeProject(PublishedPS):
    def __init__(self, label: str, env: dict | None = None, root: Path = ROOT, files: tuple[str, ...] = (),
                 documented: dict[str, str] = DOCUMENTED) -> None:
        self.root = root  # where docker-compose.yml and the build context are: ROOT, or a copy (build_context)
        self.files = (COMPOSE_FILE.name, *files)  # every `-f`, in order (e.g. STANDBY_FILES after it)
        self.documented = documented  # the guide's commands run() takes
        self.name = f"syncps-test-{label}-{os.getpid()}-{secrets.token_hex(3)}".lower()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_PREFIXES)}
        settings = {"SYNCPS_IMAGE": IMAGE, "SYNCPS_PORT": str(self.port), **{k: str(v) for k, v in (env or {}).items()}}
        fd, path = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".env")
        with os.fdopen(fd, "w") as f:  # the project's `.env`
            f.writelines(f"{k}={v}\n" for k, v in settings.items())
        self.env_file = Path(path)

    def compose(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        """``docker compose ARGS`` in this project, within ``timeout`` s on a quiet machine (an allowance)."""
        cmd = ["docker", "compose", *(x for f in self.files for x in ("-f", str(self.root / f))),
               "--project-directory", str(self.root), "--env-file", str(self.env_file), "-p", self.name, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=allow(timeout), env=self.env)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def run(self, key: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Run the guide's command ``self.documented[key]`` as written, in this test's project (its ``-f`` files, if
        it names any, are the project's)."""
        argv = shlex.split(self.documented[key])
        assert argv[:2] == ["docker", "compose"], argv
        args, named = argv[2:], []
        while args[:1] == ["-f"]:
            named, args = [*named, args[1]], args[2:]
        assert not named or tuple(named) == self.files, (named, self.files)
        return self.compose(*args, timeout=timeout)

    # -- lifecycle -------------------------------------------------------------------------
    def build(self, timeout: float = 600.0) -> None:
        """Build the image (cached layers make a rebuild take seconds); the tag is dropped when this process ends."""
        self.compose("build", "ps", timeout=timeout)
        atexit.unregister(_drop_image)  # once per process, however many builds
        atexit.register(_drop_image)

    def down(self) -> list[str]:
        """Remove containers, network and volumes; what is left of the project (should be [])."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "5", timeout=120.0, check=False)
        self.env_file.unlink(missing_ok=True)
        return self.leftovers()

    def leftovers(self) -> list[str]:
        """The project's containers, volumes and networks still there."""
        label = f"label=com.docker.compose.project={self.name}"
        left = []
        for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
            out = docker(*kind, "-q", "--filter", label, check=False).stdout.split()
            left += [f"{kind[0]} {x}" for x in out]
        return left

    def logs(self, tail: int = 60) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), check=False).stdout

    # -- containers ------------------------------------------------------------------------
    def container_ids(self, service: str) -> list[str]:
        return self.compose("ps", "-a", "-q", service).stdout.split()

    def inspect(self, service: str) -> list[dict]:
        ids = self.container_ids(service)
        return json.loads(docker("inspect", *ids).stdout) if ids else []

    def worker_name(self, container: dict) -> str:
        """The name the worker registers under: its container's name (syncps-worker-1), as `docker compose ps`."""
        return container["Name"].lstrip("/")

    def ps_names(self, service: str, all_: bool = True) -> list[str]:
        """Container names of ``service`` as the guide's `docker compose ps` lists them (``-a``: exited too)."""
        out = self.compose(*shlex.split(DOCUMENTED["ps"])[2:], *(["-a"] if all_ else []), "--format", "json",
                           service).stdout
        return sorted(json.loads(line)["Name"] for line in out.splitlines() if line.strip())

    def running(self, service: str) -> list[dict]:
        return [c for c in self.inspect(service) if c["State"]["Running"]]

    def wait_workers_exited(self, deadline: float = 60.0) -> list[dict]:
        def exited():
            cs = self.inspect("worker")
            return cs if cs and all(c["State"]["Status"] == "exited" for c in cs) else None
        return wait_for(exited, deadline, "every worker container to exit", interval=0.5)
