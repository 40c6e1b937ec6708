"""A two-node Docker Swarm for benches, and docker-stack.yml deployed on it.

- :class:`TwoNodes`: this engine as the manager and a second engine, in a container, joined as a worker node
  (``../shared/docker/swarm-2node.sh up``, with :data:`NODE_IMAGE`: its image store on a volume), the image copied
  into node 2 and the stack's two secrets made. :func:`cut_off` (:meth:`TwoNodes.cut`) drops every packet of node 2's
  link both ways while inside (``iptables`` in node 2's network namespace: no reset, no error, as a cable pulled
  further along); :meth:`TwoNodes.heartbeat` sets and reads the swarm's dispatcher heartbeat period; :meth:`TwoNodes.nodes`
  is ``docker node ls``. :meth:`TwoNodes.down` removes the stacks, the secrets, node 2 and its image store, and leaves the swarm: this
  engine is then in no swarm, as tests/test_swarm.py wants it. It refuses to start on an engine already in a swarm
  (a bench never changes a swarm it did not make).
- :class:`StackJob`: one deployment of docker-stack.yml by ``deploy/swarm/deploy.sh`` with the job's settings in a
  last stack file (``-c``, as a user adds one), on a free host port, read through it with the monitoring token
  (:class:`PublishedPS`: a deployment's PS over its published port, the tests' deployments' too); its tasks (``docker service ps``) and its containers' CPU seconds on both nodes (their
  cgroups: node 2's containers are in this host's cgroup tree too); :meth:`StackJob.rm` waits until they are gone.

Every command has a timeout.
"""
from __future__ import annotations

import glob
import json
import os
import re
import secrets
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from cluster.processes import free_port, patience, wait_for

ROOT = Path(__file__).resolve().parent.parent
STACK_FILE = ROOT / "docker-stack.yml"
DEPLOY = ROOT / "deploy" / "swarm" / "deploy.sh"
TWO_NODE_SCRIPT = Path(os.environ.get("SYNCPS_SWARM_2NODE", ROOT.parent / "shared" / "docker" / "swarm-2node.sh"))
NODE2 = "syncps-swarm-node2"  # the script's default node name
#: the stack's Docker secrets: the training token, the monitoring token
TOKEN, MONITOR_TOKEN = "syncps_token", "syncps_monitor_token"
#: node 2's image: the script's (python:3.11-slim + Debian's docker.io), with its image store on a volume, so
#: dockerd inside uses overlay2; on the container's own overlay root it falls back to vfs, which copies every
#: layer whole (loading our image took 2m17s instead of 33 s here)
NODE_IMAGE = "syncps-swarm-node-test:latest"
NODE_DOCKERFILE = """FROM python:3.11-slim
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io iproute2 >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
VOLUME /var/lib/docker
CMD ["dockerd", "--host", "unix:///var/run/docker.sock"]
"""
SCRUBBED = ("PS_", "WORKER_", "SYNCPS_", "COMPOSE_")
#: node 2's link inside its namespace (the container's one interface)
LINK = "eth0"


def run(argv: list[str], timeout: float = 120.0, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """``argv`` within ``timeout`` s times :func:`cluster.processes.patience` (a loaded machine's tests wait longer)."""
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout * patience(), **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def scrubbed_env(**extra: str) -> dict[str, str]:
    """The caller's environment without its PS_*, WORKER_*, SYNCPS_* and COMPOSE_* variables, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED)}, **extra}


def swarm_state() -> str:
    return run(["docker", "info", "-f", "{{.Swarm.LocalNodeState}}"], check=False).stdout.strip()


def node2_docker(*args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
    """``docker ARGS`` on node 2's engine."""
    return run(["docker", "exec", NODE2, "docker", *args], timeout=timeout, check=check)


def cgroup_cpu_seconds(container_id: str) -> float | None:
    """CPU seconds of a container's cgroup (v1 ``cpuacct.usage``, v2 ``cpu.stat``), of either node; None if not found."""
    for pattern, read in ((f"/sys/fs/cgroup/cpuacct/**/*{container_id}*/cpuacct.usage", lambda t: int(t) / 1e9),
                          (f"/sys/fs/cgroup/**/*{container_id}*/cpu.stat",
                           lambda t: int(re.search(r"usage_usec (\d+)", t).group(1)) / 1e6)):
        for path in glob.glob(pattern, recursive=True):
            try:
                return read(Path(path).read_text())
            except (OSError, ValueError, AttributeError):
                continue
    return None


@contextmanager
def cut_off(node: str = NODE2):
    """``node``'s link (a container running a Docker engine: node 2) drops every packet both ways while inside
    (``iptables`` in its network namespace); yields [cut, restored] monotonic times, the second set on the way out."""
    rules = [["INPUT", "-i", LINK, "-j", "DROP"], ["OUTPUT", "-o", LINK, "-j", "DROP"]]
    times = [0.0, 0.0]
    for rule in rules:
        run(["docker", "exec", node, "iptables", "-w", "-I", *rule], timeout=30)
    times[0] = time.monotonic()
    try:
        yield times
    finally:
        for rule in rules:
            run(["docker", "exec", node, "iptables", "-w", "-D", *rule], timeout=30, check=False)
        times[1] = time.monotonic()


class TwoNodes:
    """This engine as a swarm manager with node 2 joined; :meth:`down` undoes all of it."""

    def __init__(self) -> None:
        self.tokens = {TOKEN: secrets.token_hex(16), MONITOR_TOKEN: secrets.token_hex(16)}
        self.jobs: list[StackJob] = []
        self.manager = self.address = ""  # the manager's hostname and its address in the swarm (docker0's)

    def up(self, *images: str) -> float:
        """Swarm init, node 2 joined with ``images`` copied into it, the secrets; seconds taken."""
        if not TWO_NODE_SCRIPT.is_file():
            raise RuntimeError(f"no {TWO_NODE_SCRIPT} (SYNCPS_SWARM_2NODE)")
        state = swarm_state()
        if state != "inactive":
            raise RuntimeError(f"this Docker engine is already in a swarm (state {state!r}): left alone")
        t0 = time.monotonic()
        run(["docker", "build", "-q", "-t", NODE_IMAGE, "-"], input=NODE_DOCKERFILE, timeout=600)
        run(["bash", str(TWO_NODE_SCRIPT), "up", *images], env=scrubbed_env(SWARM_NODE_IMAGE=NODE_IMAGE), timeout=900)
        for name, token in self.tokens.items():
            run(["docker", "secret", "create", name, "-"], input=token)
        self.manager = run(["docker", "info", "-f", "{{.Name}}"]).stdout.strip()
        self.address = run(["docker", "info", "-f", "{{.Swarm.NodeAddr}}"]).stdout.strip()
        return time.monotonic() - t0

    def load(self, *images: str) -> None:
        run(["bash", str(TWO_NODE_SCRIPT), "load", *images], env=scrubbed_env(), timeout=900)

    def nodes(self) -> dict[str, str]:
        """Hostname -> status (Ready / Down / Unknown) of every node."""
        out = run(["docker", "node", "ls", "--format", "{{.Hostname}} {{.Status}}"], timeout=30, check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def heartbeat(self, seconds: float | None = None) -> float | None:
        """The dispatcher heartbeat period in seconds (a node silent for about 3 periods is marked down), set first to
        ``seconds`` when given (``docker swarm update --dispatcher-heartbeat``); None if ``docker info`` does not say."""
        if seconds:
            run(["docker", "swarm", "update", "--dispatcher-heartbeat", f"{seconds:g}s"])
        out = run(["docker", "info", "-f", "{{json .Swarm.Cluster.Spec.Dispatcher.HeartbeatPeriod}}"], check=False)
        return int(out.stdout.strip()) / 1e9 if out.stdout.strip().isdigit() else None

    def cut(self):
        """Node 2 cut off while inside (:func:`cut_off`)."""
        return cut_off(NODE2)

    def job(self, label: str, image: str, **settings) -> "StackJob":
        self.jobs.append(StackJob(self, label, image, **settings))
        return self.jobs[-1]

    def down(self) -> list[str]:
        """Stacks, secrets, node 2 (and its image store) gone, the swarm left; what is left (should be [])."""
        for job in self.jobs:
            job.rm(wait=False)
        mounts = run(["docker", "inspect", "-f", "{{json .Mounts}}", NODE2], check=False)
        volumes = [m["Name"] for m in (json.loads(mounts.stdout) if mounts.returncode == 0 else [])
                   if m.get("Destination") == "/var/lib/docker"]
        run(["docker", "secret", "rm", *self.tokens], check=False)
        run(["bash", str(TWO_NODE_SCRIPT), "down"], env=scrubbed_env(), timeout=300, check=False)
        left = []
        for job in self.jobs:
            job.settings_file.unlink(missing_ok=True)
            try:  # the stack's containers on this node go with it after `docker stack rm`
                wait_for(lambda: not run(["docker", "ps", "-aq", "--filter",
                                          f"label=com.docker.stack.namespace={job.name}"]).stdout.split(),
                         120, f"the containers of stack {job.name} to go", interval=0.5)
            except TimeoutError:
                pass  # said below: its volume stays
            left += [f"volume {v}" for v in job.rm_volumes()]
        for v in volumes:
            run(["docker", "volume", "rm", v], timeout=300, check=False)
        left += [f"volume {v}" for v in volumes if run(["docker", "volume", "inspect", v], check=False).returncode == 0]
        left += [f"container {c}" for c in run(["docker", "ps", "-aq", "--filter", f"name=^{NODE2}$"]).stdout.split()]
        state = swarm_state()
        return left + ([f"swarm state {state}"] if state != "inactive" else [])


class PublishedPS:
    """The PS of a deployment over its published port (``url``), sending ``headers`` (e.g. a token); the compose and
    swarm tests' deployments are ones too."""
    url: str
    headers: dict[str, str] = {}

    def get(self, path: str, timeout: float = 5.0) -> dict:
        return httpx.get(f"{self.url}{path}", headers=self.headers, timeout=timeout).json()

    def try_status(self) -> dict | None:
        try:
            return self.get("/v1/status")
        except (httpx.HTTPError, ValueError):
            return None

    def wait_status(self, predicate, deadline: float, what: str) -> dict:
        """Poll /v1/status until ``predicate(status)``; the status that satisfied it."""
        def check():
            s = self.try_status()
            return s if s is not None and predicate(s) else None
        return wait_for(check, deadline, what, interval=0.2)

    def workers(self) -> dict:
        return self.get("/v1/workers")


def settings_file(stack: str, ps: dict | None = None, worker: dict | None = None,
                  worker_deploy: dict | None = None) -> Path:
    """A last stack file (a temporary file, the caller removes it) holding the job's ``ps`` and ``worker`` settings
    and ``worker_deploy`` (merged into the worker service's ``deploy``), as a user adds one to deploy.sh."""
    services = {"ps": {"environment": [f"{k}={v}" for k, v in (ps or {}).items()]},
                "worker": {"environment": [f"{k}={v}" for k, v in (worker or {}).items()]}}
    if worker_deploy:
        services["worker"]["deploy"] = worker_deploy
    fd, path = tempfile.mkstemp(prefix=f"{stack}-", suffix=".yml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({"version": "3.8", "services": services}, f)
    return Path(path)


class StackJob(PublishedPS):
    """docker-stack.yml with ``ps`` / ``worker`` settings and ``worker_deploy`` (merged into the worker service's
    ``deploy``) in a last stack file, deployed by deploy/swarm/deploy.sh under a name and a host port of its own
    (``port``, else a free one); ``files``: stack files added before the last (e.g. deploy/swarm/hostnet.yml), ``env``:
    variables they need (e.g. ``SYNCPS_PS_HOST``)."""

    def __init__(self, swarm: TwoNodes, label: str, image: str, ps: dict | None = None, worker: dict | None = None,
                 worker_deploy: dict | None = None, port: int | None = None, files: tuple[Path, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.swarm = swarm
        self.name = f"syncpsbench-{label}-{secrets.token_hex(2)}".lower()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {swarm.tokens[MONITOR_TOKEN]}"}
        self.settings_file = settings_file(self.name, ps, worker, worker_deploy)
        self.env = scrubbed_env(SYNCPS_STACK=self.name, SYNCPS_IMAGE=image, SYNCPS_PORT=str(self.port), **(env or {}))
        self.files = files

    def stop_workers(self, deadline: float = 120.0) -> dict:
        """``docker service scale <stack>_worker=0``: every worker leaves (SIGTERM), the job's counts stop moving; the
        status once no worker is active."""
        run(["docker", "service", "scale", "-d", f"{self.name}_worker=0"], timeout=60)
        return self.wait_status(lambda s: s["workers"]["active"] == 0, deadline, "every worker to leave")

    def deploy(self) -> None:
        extra = [a for f in self.files for a in ("-c", str(f))]
        run([str(DEPLOY), *extra, "-c", str(self.settings_file)], cwd=ROOT, env=self.env, timeout=180)

    def tasks(self, service: str = "worker") -> list[dict]:
        """``docker service ps``: every task of the service (ID, Name ``<stack>_worker.3``, Node, states)."""
        out = run(["docker", "service", "ps", f"{self.name}_{service}", "--no-trunc", "--format", "{{json .}}"],
                  timeout=30, check=False).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def containers(self, service: str) -> list[str]:
        """Ids of the service's running containers, on both nodes."""
        label = f"label=com.docker.swarm.service.name={self.name}_{service}"
        ids = run(["docker", "ps", "-q", "--no-trunc", "--filter", label], timeout=30).stdout.split()
        return ids + node2_docker("ps", "-q", "--no-trunc", "--filter", label, timeout=30, check=False).stdout.split()

    def logs(self, service: str, tail: int = 30) -> str:
        r = run(["docker", "service", "logs", "--no-task-ids", "--tail", str(tail), f"{self.name}_{service}"],
                timeout=30, check=False)
        return (r.stdout + r.stderr)[-4000:]

    def rm(self, wait: bool = True) -> None:
        """``docker stack rm``; with ``wait``, until its containers are gone on both nodes (at most 120 s), and then
        its volumes on this node (:meth:`rm_volumes`)."""
        run(["docker", "stack", "rm", self.name], env=self.env, timeout=120, check=False)
        if not wait:
            return
        label = f"label=com.docker.stack.namespace={self.name}"

        def gone() -> bool:
            here = run(["docker", "ps", "-aq", "--filter", label], timeout=30, check=False).stdout.split()
            there = node2_docker("ps", "-aq", "--filter", label, timeout=30, check=False).stdout.split()
            return not here and not there
        try:
            wait_for(gone, 120 * patience(), f"the containers of stack {self.name} to go", interval=0.5)
        except TimeoutError:
            pass  # the swarm's teardown (TwoNodes.down) takes what is left
        self.rm_volumes()

    def rm_volumes(self) -> list[str]:
        """The stack's volumes on this node removed (``docker stack rm`` leaves them); those still there."""
        label = f"label=com.docker.stack.namespace={self.name}"
        volumes = run(["docker", "volume", "ls", "-q", "--filter", label], timeout=30, check=False).stdout.split()
        for v in volumes:
            run(["docker", "volume", "rm", v], timeout=60, check=False)
        return [v for v in volumes if run(["docker", "volume", "inspect", v], check=False).returncode == 0]
