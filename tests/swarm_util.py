"""Drive ``docker-stack.yml`` on a real Docker Swarm from tests: this engine as a one-node swarm, or with a
second engine joined as a worker node (``../shared/docker/swarm-2node.sh``: docker-in-docker, reached over
the swarm's overlay network as another host would be).

- :data:`DOCUMENTED` holds the swarm commands of docs/guides/swarm.md; the tests run them as written, with the test's
  stack name in place of ``syncps`` and, for the deploy, one more ``-c`` file holding the test's settings.
- :func:`stack_config` merges stack files as ``docker stack deploy -c a -c b`` does (``docker stack config``).
- :func:`swarm_unavailable` says why swarm tests cannot run: :func:`compose_unavailable`'s reasons, or this
  engine already in a swarm (a test never changes a swarm it did not make).
- :class:`Swarm` is one test's swarm: ``docker swarm init`` on docker0's address, the stack's secrets
  (tokens the test knows), node 2 on demand (:meth:`Swarm.join_node2`, :meth:`Swarm.kill_node2`,
  :meth:`Swarm.cut_node2`; node 2's image and the cut are :mod:`bench.swarm`'s), and
  :meth:`Swarm.leave`, which removes the stacks (with their volumes), the secrets and node 2 (with its
  image store) and leaves the swarm, reporting what is left: a fixture calls it, also after a failure.
  The slow parts run side by side: the stacks go together, node 2's store while they do.
- :func:`start_node2` starts node 2's engine and copies images into it without joining any swarm, so a
  test module can do it in a thread while other tests run; :func:`remove_node2` removes it.
- :class:`Stack` is one deployment (unique name, its own host port, settings in an extra stack file),
  read through its published port with the monitoring token (:class:`PublishedPS`).
Every command has a timeout.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from pydantic import SecretStr

from bench.swarm import (NODE2, NODE_DOCKERFILE, NODE_IMAGE, TWO_NODE_SCRIPT, PublishedPS, cut_off, run,
                         scrubbed_env, settings_file)
from cluster.processes import free_port, wait_for
from shared.tokens import bearer_header
from tests.compose_util import IMAGE, ROOT, compose_unavailable, docker
from tests.timing import allow

STACK_FILE = ROOT / "docker-stack.yml"
#: the co-located shards' extra stack file (docs/guides/shards.md: Full precision between hosts)
COLOCATED_FILE = ROOT / "deploy" / "swarm" / "colocated.yml"
#: the hot-standby pair's extra stack file (docs/guides/standby.md: the primary and its standby on two nodes)
STANDBY_FILE = ROOT / "deploy" / "swarm" / "standby.yml"
#: the workers at the PS node's published port (docs/guides/swarm.md: Two nodes against local processes)
PUBLISHED_FILE = ROOT / "deploy" / "swarm" / "published.yml"
#: the PS and the workers on each node's `host` network (docs/guides/swarm.md: Two nodes against local processes)
HOSTNET_FILE = ROOT / "deploy" / "swarm" / "hostnet.yml"
#: the stack's Docker secrets: the training token, the monitoring token, the pair's peer token (standby.yml)
TOKEN, MONITOR_TOKEN, PEER_TOKEN = "syncps_token", "syncps_monitor_token", "syncps_peer_token"

#: The swarm commands of docs/guides/swarm.md, run by the swarm tests as written (the stack name aside).
DOCUMENTED = {
    "init": "docker swarm init",
    "deploy": "deploy/swarm/deploy.sh",  # checks the secrets, then docker stack deploy ... syncps
    "scale": "docker service scale syncps_worker=6",
    "heartbeat": "docker swarm update --dispatcher-heartbeat 20s",  # a node cut off for < 40 s keeps its tasks
    "rm": "docker stack rm syncps",
    "leave": "docker swarm leave --force",
}


def stack_config(*files: Path, **env: str) -> dict | None:
    """``docker stack config -c f1 -c f2 ...``: the stack files merged and interpolated as ``docker stack deploy`` does
    (the CLI alone: no engine, no swarm), with the files' defaults (no SYNCPS_* from the caller, only ``env``); None
    without a docker CLI; RuntimeError with the CLI's message if it refuses them."""
    if shutil.which("docker") is None:
        return None
    out = run(["docker", "stack", "config", *(a for f in files for a in ("-c", str(f)))], env=scrubbed_env(**env),
              timeout=30).stdout
    return yaml.safe_load(out)


def swarm_unavailable() -> str | None:
    """The reason swarm tests must be skipped, or None."""
    reason = compose_unavailable()
    if reason:
        return reason
    state = docker("info", "-f", "{{.Swarm.LocalNodeState}}", check=False).stdout.strip()
    if state != "inactive":
        return f"this Docker engine is already in a swarm (state {state!r}): the swarm tests leave it alone"
    return None


def two_nodes_unavailable() -> str | None:
    return None if TWO_NODE_SCRIPT.is_file() else f"no {TWO_NODE_SCRIPT} (SYNCPS_SWARM_2NODE)"


def docker0_address() -> str | None:
    """This host's address on docker0, which node 2 (a container) reaches: the swarm's advertise address."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "docker0"], capture_output=True, text=True,
                         timeout=allow(10)).stdout
    m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else None


def for_node2(stack_file: Path, into: Path, *services: str) -> Path:
    """A copy of ``stack_file`` (in the folder ``into``) without the healthchecks of ``services``, for services that
    run on node 2: its engine cannot exec into its containers ("error executing setns process"), so an exec healthcheck
    never passes there, and swarm gives a task that is not healthy no DNS name (the others could never reach it). A
    later stack file cannot remove one: its ``test`` list would be appended to."""
    stack = yaml.safe_load(stack_file.read_text())
    for name in services:
        stack["services"][name].pop("healthcheck", None)
    path = into / f"{stack_file.stem}-node2.yml"
    path.write_text(yaml.safe_dump(stack))
    return path


def node2_volume() -> str | None:
    """The volume holding node 2's image store (its container's /var/lib/docker), or None without the container."""
    r = docker("inspect", "-f", "{{json .Mounts}}", NODE2, check=False)
    mounts = json.loads(r.stdout) if r.returncode == 0 else []
    return next((m["Name"] for m in mounts if m.get("Destination") == "/var/lib/docker"), None)


def start_node2(*images: str) -> float:
    """Node 2's engine started, not joined to any swarm, with ``images`` copied into it (30-50 s here, mostly
    the copy), so that a test can do this while other tests run (a thread) and then join it at once
    (:meth:`Swarm.join_node2` with ``started``). The container is the one ``swarm-2node.sh up`` starts (its
    name, image and the rights dockerd inside needs); ``up`` finds it running and only joins it. Seconds taken."""
    t0 = time.monotonic()
    run(["docker", "build", "-q", "-t", NODE_IMAGE, "-"], input=NODE_DOCKERFILE, timeout=600)
    docker("rm", "-f", NODE2, check=False)
    docker("run", "-d", "--name", NODE2, "--hostname", NODE2, "--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN",
           "--security-opt", "seccomp=unconfined", "--cgroupns=host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw",
           NODE_IMAGE)
    wait_for(lambda: docker("exec", NODE2, "docker", "info", check=False).returncode == 0, allow(60),
             "node 2's engine to answer", interval=0.2)
    run(["bash", str(TWO_NODE_SCRIPT), "load", *images], env=scrubbed_env(), timeout=600)
    return time.monotonic() - t0


def remove_node2() -> list[str]:
    """Node 2's container and its image store gone (removing the store takes ~10 s); what is left (should be []).
    Node 2 stays listed in a swarm it joined (Down) until ``swarm-2node.sh down``."""
    volume = node2_volume()
    docker("rm", "-f", NODE2, check=False)
    if volume:
        docker("volume", "rm", volume, check=False, timeout=180)
    left = [f"container {x}" for x in docker("ps", "-aq", "--filter", f"name=^{NODE2}$").stdout.split()]
    if volume and docker("volume", "inspect", volume, check=False).returncode == 0:
        left.append(f"volume {volume}")
    return left


class Stack(PublishedPS):
    """One deployment of docker-stack.yml: ``ps`` / ``worker`` settings and ``worker_deploy`` (merged into
    the worker service's ``deploy``) go into a last stack file, as a user adds one to deploy.sh; ``files``: stack
    files to add before it (e.g. :func:`for_node2` of :data:`COLOCATED_FILE`), ``env``: variables they need (e.g.
    ``SYNCPS_PS_HOST`` for :data:`HOSTNET_FILE`)."""

    def __init__(self, swarm: "Swarm", label: str, ps: dict | None = None, worker: dict | None = None,
                 worker_deploy: dict | None = None, files: tuple[Path, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.files = files
        self.name = f"syncpstest-{label}-{os.getpid()}-{secrets.token_hex(2)}".lower()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = bearer_header(SecretStr(swarm.tokens[MONITOR_TOKEN]))
        self.settings_file = settings_file(self.name, ps, worker, worker_deploy)
        self.env = scrubbed_env(SYNCPS_STACK=self.name, SYNCPS_IMAGE=IMAGE, SYNCPS_PORT=str(self.port), **(env or {}))

    def argv(self, key: str) -> list[str]:
        """The guide's command ``DOCUMENTED[key]`` for this stack: its name in place of ``syncps``."""
        argv = shlex.split(DOCUMENTED[key])
        return [*argv[:-1], re.sub(r"^syncps(?=_|$)", self.name, argv[-1])]

    def deploy(self, check: bool = True) -> subprocess.CompletedProcess:
        """``deploy/swarm/deploy.sh -c <this test's settings>``, stack name and port from the environment."""
        extra = [a for f in self.files for a in ("-c", str(f))]
        return run([str(ROOT / DOCUMENTED["deploy"]), *extra, "-c", str(self.settings_file)], cwd=ROOT, env=self.env,
                   check=check)

    def run(self, key: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return run(self.argv(key), timeout=timeout, env=self.env)

    def tasks(self, service: str) -> list[dict]:
        """``docker service ps``: every task of the service (Name ``<stack>_worker.3``, Node, states)."""
        out = docker("service", "ps", f"{self.name}_{service}", "--no-trunc", "--format", "{{json .}}").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def placed(self, service: str) -> set[str]:
        """The nodes the service's tasks were placed on, every task (one Swarm retried, e.g. rejected while node 2 was
        still loading the image, is placed under the same constraints)."""
        return {t["Node"] for t in self.tasks(service)}

    def services(self) -> list[str]:
        """The stack's services, without the stack's prefix."""
        out = docker("stack", "services", self.name, "--format", "{{.Name}}", check=False, timeout=30).stdout
        return [line.removeprefix(f"{self.name}_") for line in out.split()]

    def history(self, service: str) -> str:
        """``docker service ps`` of the service, errors untruncated: why a task was rejected, failed or replaced."""
        r = docker("service", "ps", "--no-trunc", f"{self.name}_{service}", check=False, timeout=30)
        return r.stdout + r.stderr

    def running_on(self, service: str) -> dict[str, str]:
        """Worker name (``<stack>_worker-<slot>``, as docker-stack.yml names them) -> node, of running tasks."""
        return {f"{self.name}_{service}-{t['Name'].rsplit('.', 1)[1]}": t["Node"] for t in self.tasks(service)
                if t["DesiredState"] == "Running" and t["CurrentState"].startswith("Running")}

    def logs(self, service: str, tail: int = 60) -> str:
        r = docker("service", "logs", "--no-task-ids", "--tail", str(tail), f"{self.name}_{service}",
                   check=False, timeout=30)
        return r.stdout + r.stderr

    def rm(self) -> list[str]:
        """``docker stack rm``, then the stack's volumes once its containers are gone; what is left (should be [])."""
        self.start_rm()
        return self.finish_rm()

    def start_rm(self) -> None:
        """``docker stack rm``: the swarm starts stopping the stack's tasks (:meth:`finish_rm` waits for them)."""
        run(self.argv("rm"), env=self.env, check=False)

    def finish_rm(self) -> list[str]:
        """After :meth:`start_rm`: the stack's volumes once its containers are gone; what is left (should be [])."""
        label = f"label=com.docker.stack.namespace={self.name}"
        try:
            wait_for(lambda: not docker("ps", "-aq", "--filter", label).stdout.split(), allow(60),
                     f"the containers of stack {self.name} to go", interval=0.5)
        except TimeoutError:
            pass  # reported below
        for vol in docker("volume", "ls", "-q", "--filter", label, check=False).stdout.split():
            docker("volume", "rm", vol, check=False)
        try:  # the swarm removes the stack's network on its own schedule, after its containers
            wait_for(lambda: not docker("network", "ls", "-q", "--filter", label, check=False).stdout.split(),
                     allow(30), f"the network of stack {self.name} to go", interval=0.5)
        except TimeoutError:
            pass  # reported below
        self.settings_file.unlink(missing_ok=True)
        left = []
        for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"], ["service", "ls"]):
            left += [f"{kind[0]} {x}" for x in docker(*kind, "-q", "--filter", label, check=False).stdout.split()]
        return left


def still_there(thing: str) -> bool:
    """Whether ``"<kind> <id>"`` (as :meth:`Stack.finish_rm` lists it: ps, volume, network, service) still exists."""
    kind, _, ident = thing.partition(" ")
    what = {"ps": "container", "volume": "volume", "network": "network", "service": "service"}.get(kind)
    return what is None or docker(what, "inspect", ident, check=False).returncode == 0


class Swarm:
    """One test's swarm (this engine as the manager); :meth:`leave` undoes everything it made."""

    def __init__(self) -> None:
        self.tokens = {name: secrets.token_hex(16) for name in (TOKEN, MONITOR_TOKEN, PEER_TOKEN)}
        self.stacks: list[Stack] = []
        self.node2_up = False

    def init(self) -> None:
        """The guide's ``docker swarm init``, advertised on docker0 (the address node 2 can reach)."""
        addr = docker0_address()
        run([*shlex.split(DOCUMENTED["init"]), *(["--advertise-addr", addr] if addr else [])])

    def create_secrets(self) -> None:
        for name, token in self.tokens.items():
            run(["docker", "secret", "create", name, "-"], input=token)

    def stack(self, label: str, **settings) -> Stack:
        self.stacks.append(Stack(self, label, **settings))
        return self.stacks[-1]

    # -- node 2 --------------------------------------------------------------------------------
    def join_node2(self, *images: str, started: bool = False) -> None:
        """``swarm-2node.sh up IMAGE...``: node 2 joins this swarm, with ``images`` copied into it; ``started``:
        :func:`start_node2` already started its engine with the images in it, and ``up`` only joins it."""
        self.node2_up = True
        if not started:
            run(["docker", "build", "-q", "-t", NODE_IMAGE, "-"], input=NODE_DOCKERFILE, timeout=600)
        run(["bash", str(TWO_NODE_SCRIPT), "up", *([] if started else images)],
            env=scrubbed_env(SWARM_NODE_IMAGE=NODE_IMAGE), timeout=600)

    def kill_node2(self) -> None:
        """Node 2's engine dies at once, and every container it runs with it (a host losing power)."""
        docker("kill", NODE2)

    def cut_node2(self):
        """Node 2's link drops every packet both ways while inside (:func:`bench.swarm.cut_off`); yields [cut,
        restored] monotonic times."""
        return cut_off(NODE2)

    def nodes(self) -> dict[str, str]:
        """Hostname -> status (Ready / Down) of every node of the swarm."""
        out = docker("node", "ls", "--format", "{{.Hostname}} {{.Status}}").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    # -- teardown -------------------------------------------------------------------------------
    def leave(self) -> list[str]:
        """Remove the stacks, the secrets and node 2, and leave the swarm; what is left (should be []).
        Everything that can go at once does: every stack's tasks stop together, and node 2's container and
        its image store go (a thread) while they do; then ``swarm-2node.sh down`` and the swarm is left."""
        with ThreadPoolExecutor(1) as pool:
            node2_gone = pool.submit(remove_node2) if self.node2_up else None
            for st in self.stacks:
                st.start_rm()
            left = [x for st in self.stacks for x in st.finish_rm()]
            if node2_gone is not None:
                left += node2_gone.result()
        docker("secret", "rm", *self.tokens, check=False)
        if self.node2_up:
            run(["bash", str(TWO_NODE_SCRIPT), "down"], env=scrubbed_env(), timeout=180, check=False)
        run(shlex.split(DOCUMENTED["leave"]), check=False)
        state = docker("info", "-f", "{{.Swarm.LocalNodeState}}", check=False).stdout.strip()
        # the swarm removes a stack's network on its own schedule (once more than 30 s after its containers on a
        # loaded machine, in CI): what leaving the swarm took with it is not left
        left = [x for x in left if still_there(x)]
        return left + ([f"swarm state {state}"] if state != "inactive" else [])
