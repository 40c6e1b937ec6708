"""Start a PS and workers as local processes on loopback (``make run``, tests, benchmarks).

:class:`LocalCluster` is a context manager: it starts ``python -m ps_service`` on a free port (``shards`` > 1: S of
them, shard 0 the coordinator at :attr:`url`, each on its own port, and at an address of its own with ``hosts``;
``PS_SHARD_*`` set, a checkpoint directory each), waits for ``/healthz`` (polling with a deadline; each PS's port held
from other processes until it listens: :func:`hold_port`, also from a :meth:`~LocalCluster.kill` until it is started
again), starts N
``python -m worker_service`` processes with distinct names, and on exit stops
whatever still runs (SIGTERM, then SIGKILL after a grace period). Its own deadlines scale with :func:`patience`. Process
output goes to files under ``log_dir`` so a failing run can show it. With ``SYNCPS_FORK_SERVER=1`` (the test
suite) a process without ``prefix`` is forked from a zygote that imported its stack once when it can be
(cluster/forkserver.py: a Popen-like handle), else exec'd.

Logs: without an explicit ``log_dir`` the cluster makes a ``syncps-*`` temporary
folder (under ``$SYNCPS_LOG_ROOT`` when set, as the test suite does) and removes
it when it stops, unless ``keep_logs`` (or ``SYNCPS_KEEP_LOGS=1``) asks to keep it
or something failed: an exception out of the ``with`` block, :meth:`mark_failed`,
a process that exited non-zero without being killed by :meth:`kill`, or one that
needed SIGKILL to stop. A folder the caller gave is never removed.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from pydantic import SecretStr

from cluster import forkserver
from shared.tokens import bearer_header


#: how long :meth:`LocalCluster.status` and :meth:`LocalCluster.get` wait for the PS (times :func:`patience`): a PS on
#: a loaded machine may answer nothing for more than 5 s (1e7-parameter pushes at load 16 on 2 cores): slow, not gone
REQUEST_TIMEOUT_SECONDS = 30.0
_PORTS_FROM = 20000  # the low end of the ports free_port hands out, when the ephemeral range starts above it
_handed_out: set[int] = set()
_port_choice = random.Random(os.urandom(16))  # not the `random` module's state: a test's seed must not repeat ports


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def bindable(port: int, reuse_address: bool = False) -> bool:
    """Can a listener bind 127.0.0.1:``port`` now? ``reuse_address``: as uvicorn binds (SO_REUSEADDR: a port whose
    old connections linger in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def hold_port(host: str, port: int) -> socket.socket | None:
    """Keep ``host:port`` from other processes while nothing of ours listens there (a PS process started, or
    started again after a kill, on its port): a socket bound there with SO_REUSEADDR and never listening. A server
    that binds with SO_REUSEADDR (uvicorn, asyncio) binds beside it and listens; a plain bind, :func:`bindable`'s,
    which :func:`free_port` asks in every test process on the machine, fails meanwhile. Close it once the server
    listens. None if it cannot be bound now (something listens there, or ``host`` is not an address here)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def _lane() -> tuple[int, int]:
    """(this process's lane, the lanes): under pytest-xdist (its ``PYTEST_XDIST_WORKER`` ``gwN`` and
    ``PYTEST_XDIST_WORKER_COUNT``) worker N takes the ports ``N`` modulo the count, so two test processes never pick
    the same port between one's check and its server's bind; else (0, 1)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(worker[2:]) < int(count):
        return int(worker[2:]), int(count)
    return 0, 1


def free_port() -> int:
    """A loopback TCP port that nothing holds now and that this process has not handed out before.

    Taken below the kernel's ephemeral range when it can be read (Linux): a port from that range (what binding
    port 0 gives) can be taken, between this call and a server's bind, as the local port of any outgoing
    connection, including a connect to that very port while nothing listens there yet (TCP self-connect: the
    socket connects to itself and holds the port), so a server started, or started again, on it fails with
    EADDRINUSE. Elsewhere, the port binding port 0 gives.
    """
    ephemeral = _ephemeral_range()
    lane, lanes = _lane()
    if ephemeral is not None and ephemeral[0] - _PORTS_FROM >= 1000:
        for _ in range(200):
            port = _port_choice.randrange(_PORTS_FROM, ephemeral[0])
            port -= (port - _PORTS_FROM) % lanes - lane  # in this process's lane
            if _PORTS_FROM <= port < ephemeral[0] and port not in _handed_out and bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def patience() -> float:
    """``SYNCPS_CLUSTER_PATIENCE`` (a number >= 1; default 1), read at each call: the factor by which the waits a
    :class:`LocalCluster` bounds itself (a PS's start, the workers' exit, a stop's grace, a request) are
    multiplied. The test suite sets it as each test starts to the scale of its time allowances (tests/timing.py,
    which cluster/ does not import), for the clusters of the test and of the subprocesses it starts."""
    return max(1.0, float(os.environ.get("SYNCPS_CLUSTER_PATIENCE") or 1))


def wait_for(predicate, deadline: float, what: str, interval: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value or ``deadline`` seconds pass."""
    end = time.monotonic() + deadline
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline} s waiting for {what}")
        time.sleep(interval)


class LocalCluster:
    def __init__(self, workers: int = 4, ps_env: dict | None = None, worker_env: dict | None = None,
                 log_dir: str | Path | None = None, port: int | None = None, token: str | None = None,
                 keep_logs: bool | None = None, shards: int = 1, host: str = "127.0.0.1",
                 prefix: Callable[[str], list[str]] | None = None, hosts: list[str] | None = None,
                 pin_workers: bool = True, standby: bool = False) -> None:
        """``token``: the PS's PS_AUTH_TOKEN, given to the workers too (and used by :meth:`status`, :meth:`get`).
        ``keep_logs``: keep the temporary log folder even after a clean run (default: ``SYNCPS_KEEP_LOGS``).
        ``host``: the address the PS binds and everyone reaches it at; ``prefix``: the command prefix of the process
        whose log is named ``ps`` / ``ps-<i>`` / ``worker-<i>`` (``bench.hosts``: ``ip netns exec NS``).
        ``hosts``: one address per shard instead (shard i binds and is reached at ``hosts[i]``, e.g. each in a
        namespace of its own; ``hosts[0]`` is the coordinator's, :attr:`host`); default ``host`` for every shard.
        ``pin_workers``: when there are no more workers than CPUs this process may use, worker i runs on the i-th
        of them alone (``WORKER_CPUS``; the PS is not pinned), unless ``WORKER_CPUS`` is given (env, ``worker_env``
        or ``start_worker``'s ``env``): a worker then never waits for a CPU that another worker holds while one is
        idle, which the scheduler otherwise lets happen (docs/performance.md). :attr:`pinned` says where each went.
        ``standby``: a hot-standby pair (docs/guides/standby.md): the PS at :attr:`url` set primary, a second one
        (:attr:`peer`, log ``ps-standby``, at :attr:`peer_url`) set standby; the workers get both URLs."""
        if hosts is not None and len(hosts) != shards:
            raise ValueError(f"hosts lists {len(hosts)} address(es) for {shards} shard(s)")
        self.n_workers = workers
        self.pin_workers = pin_workers
        self.pinned: dict[int, int] = {}  # worker index -> the CPU it was given
        self.token = token
        self.headers = bearer_header(SecretStr(token) if token else None)
        self.port = port or free_port()
        self.shard_hosts = list(hosts) if hosts is not None else [host] * shards
        self.host, self.prefix = self.shard_hosts[0], prefix
        self.url = f"http://{self.host}:{self.port}"
        self.ps_env = {"PS_HOST": self.host, "PS_PORT": str(self.port), "PS_MIN_WORKERS": str(workers), "PS_STARTUP_GRACE_SECONDS": "0",
                       **{k: str(v) for k, v in (ps_env or {}).items()}}
        self.shard_ports = [self.port, *(free_port() for _ in range(shards - 1))]
        self.shard_urls = [f"http://{h}:{p}" for h, p in zip(self.shard_hosts, self.shard_ports)]  # shard 0 first
        if shards > 1:
            self.ps_env.update(PS_SHARDS=str(shards), PS_SHARD_URLS=",".join(self.shard_urls))
        self.followers: list[subprocess.Popen] = []  # shards 1..S-1
        self.peer: subprocess.Popen | None = None  # a hot-standby pair's second PS
        self.peer_port = free_port() if standby else None
        self.peer_url = f"http://{self.host}:{self.peer_port}" if standby else None
        urls = self.url if not standby else f"{self.url},{self.peer_url}"
        if standby:
            self.ps_env.update(PS_ROLE="primary", PS_PEER_URL=self.peer_url, PS_PROBE_PORT="0")
        self.worker_env = {"WORKER_PS_URL": urls, **{k: str(v) for k, v in (worker_env or {}).items()}}
        if token:
            self.ps_env["PS_AUTH_TOKEN"] = self.worker_env["WORKER_AUTH_TOKEN"] = token
        if keep_logs is None:
            keep_logs = os.environ.get("SYNCPS_KEEP_LOGS", "").lower() in ("1", "true", "yes")
        self.keep_logs = keep_logs
        self._own_log_dir = log_dir is None
        if log_dir is None:
            root = os.environ.get("SYNCPS_LOG_ROOT") or None
            if root:
                Path(root).mkdir(parents=True, exist_ok=True)
            log_dir = tempfile.mkdtemp(prefix="syncps-", dir=root)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ps: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._files: list = []
        self._killed: set[int] = set()  # pids we kill -9'd on purpose (their exit code is no failure)
        self._held: dict[tuple[str, int], socket.socket] = {}  # PS addresses kept from other processes (hold_port)
        self._failed = False
        self.logs_removed = False

    def _spawn(self, module: str, env: dict, log_name: str) -> subprocess.Popen | forkserver.ForkedProcess:
        """``python -m module``, its output appended to ``log_name``: forked by a zygote when
        ``SYNCPS_FORK_SERVER=1`` and it can be (cluster/forkserver.py), else exec'd."""
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        if not self.prefix and forkserver.enabled():
            forked = forkserver.spawn(module, full_env, str(self.log_dir / log_name))
            if forked is not None:
                return forked
        out = open(self.log_dir / log_name, "ab")
        self._files.append(out)
        prefix = self.prefix(Path(log_name).stem) if self.prefix else []
        return subprocess.Popen([*prefix, sys.executable, "-m", module], env=full_env, stdout=out, stderr=subprocess.STDOUT)

    def shard_env(self, index: int) -> dict:
        """Shard ``index``'s environment: its address, port and index, a checkpoint directory of its own."""
        env = {**self.ps_env, "PS_PORT": str(self.shard_ports[index]), "PS_SHARD_INDEX": str(index)}
        if self.shard_hosts[index] != self.host:  # ``hosts``: this shard binds an address of its own
            env["PS_HOST"] = self.shard_hosts[index]
        if len(self.shard_ports) > 1 and env.get("PS_CHECKPOINT_DIR"):
            env["PS_CHECKPOINT_DIR"] = str(Path(env["PS_CHECKPOINT_DIR"]) / f"shard-{index}")
        return env

    def peer_env(self) -> dict:
        """A pair's second PS: set standby, its own port and checkpoint directory, the primary as its peer."""
        env = {**self.ps_env, "PS_PORT": str(self.peer_port), "PS_ROLE": "standby", "PS_PEER_URL": self.url}
        if env.get("PS_CHECKPOINT_DIR"):
            env["PS_CHECKPOINT_DIR"] = str(Path(env["PS_CHECKPOINT_DIR"]) / "standby")
        return env

    def _address(self, proc) -> tuple[str, int] | None:
        """The address PS process ``proc`` (:attr:`ps`, a follower, :attr:`peer`) listens at; None for a worker."""
        if proc is not None and proc is self.peer:
            return self.host, self.peer_port
        index = next((i for i, p in enumerate([self.ps, *self.followers]) if p is not None and p is proc), None)
        return None if index is None else (self.shard_hosts[index], self.shard_ports[index])

    def _hold(self, address: tuple[str, int]) -> None:
        """Keep ``address`` from other processes until :meth:`_release` (:func:`hold_port`; as it can)."""
        if address not in self._held:
            held = hold_port(*address)
            if held is not None:
                self._held[address] = held

    def _release(self) -> None:
        for held in self._held.values():
            held.close()
        self._held.clear()

    def _start_ps(self, proc, env: dict, log_name: str, address: tuple[str, int]):
        """``proc`` if it runs, else a PS process started at ``address`` (held until it listens: :meth:`start_ps`)."""
        if proc is not None and proc.poll() is None:
            return proc
        self._hold(address)
        return self._spawn("ps_service", env, log_name)

    def start_ps(self, deadline: float | None = None) -> None:
        """Start the PS (every shard not running, followers first; a pair's standby), and wait until each answers
        /healthz, ``deadline`` s each (default 30 times :func:`patience`). The port of each one started is held from
        other processes (:func:`hold_port`; a killed one's since :meth:`kill`) until then: another test process's
        :func:`free_port` cannot hand it out meanwhile (a PS started again at its port found it taken, once, on a
        shared machine)."""
        try:
            self._start_every_ps(30.0 * patience() if deadline is None else deadline)
        finally:
            self._release()

    def _start_every_ps(self, deadline: float) -> None:
        if len(self.shard_ports) > 1:
            self.followers = [self._start_ps(p, self.shard_env(i), f"ps-{i}.log",
                                             (self.shard_hosts[i], self.shard_ports[i]))
                              for i, p in enumerate(self.followers or [None] * (len(self.shard_ports) - 1), 1)]
        self.ps = self._start_ps(self.ps, self.shard_env(0), "ps.log", (self.host, self.port))
        if self.peer_url:
            self.peer = self._start_ps(self.peer, self.peer_env(), "ps-standby.log",
                                       (self.host, self.peer_port))

        def healthy(proc, url, name):
            if proc.poll() is not None:
                raise RuntimeError(f"PS exited with {proc.returncode}:\n{self.log(name)}")
            try:
                return httpx.get(f"{url}/healthz", timeout=patience()).status_code == 200
            except httpx.TransportError:
                return False

        for i, proc in enumerate([self.ps, *self.followers]):
            wait_for(lambda proc=proc, i=i: healthy(proc, self.shard_urls[i], "ps" if i == 0 else f"ps-{i}"), deadline,
                     f"PS shard {i} to answer /healthz")
        if self.peer_url:
            wait_for(lambda: healthy(self.peer, self.peer_url, "ps-standby"), deadline,
                     "the standby to answer /healthz")

    def start_worker(self, index: int | None = None, env: dict | None = None) -> subprocess.Popen:
        index = len(self.workers) if index is None else index
        full = {"WORKER_NAME": f"worker-{index}", **self.worker_env, **{k: str(v) for k, v in (env or {}).items()}}
        cpu = self.worker_cpu(index) if "WORKER_CPUS" not in full and "WORKER_CPUS" not in os.environ else None
        if cpu is not None:
            full["WORKER_CPUS"] = str(cpu)
            self.pinned[index] = cpu
        p = self._spawn("worker_service", full, f"worker-{index}.log")
        self.workers.append(p)
        return p

    def worker_cpu(self, index: int) -> int | None:
        """The CPU worker ``index`` gets (``pin_workers``): the index-th this process may use, when there are no
        more workers than such CPUs; else None (not pinned; nor is a worker beyond the cluster's ``workers``)."""
        if not self.pin_workers or not hasattr(os, "sched_getaffinity"):
            return None
        cpus = sorted(os.sched_getaffinity(0))
        return cpus[index] if index < self.n_workers <= len(cpus) else None

    def kill(self, proc: subprocess.Popen | None = None) -> float:
        """``kill -9`` a worker process or (default) the PS, and reap it; the Unix time of the signal.
        ``start_ps()`` / ``start_worker(i)`` start it again (same port, same name, log appended); a PS's port is
        held from other processes until then (:func:`hold_port`)."""
        proc = proc or self.ps
        at = time.time()
        self._killed.add(proc.pid)
        proc.kill()
        proc.wait(10 * patience())
        address = self._address(proc)
        if address is not None:
            self._hold(address)
        return at

    def start(self) -> "LocalCluster":
        self.start_ps()
        for i in range(self.n_workers):
            self.start_worker(i)
        return self

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/status", timeout=REQUEST_TIMEOUT_SECONDS * patience(),
                         headers=self.headers).json()

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=REQUEST_TIMEOUT_SECONDS * patience(),
                         **{**kw, "headers": {**self.headers, **kw.get("headers", {})}})

    def wait_workers(self, deadline: float | None = None) -> list[int]:
        """Wait until every worker process exits (``deadline`` s; default 120 times :func:`patience`); their exit
        codes."""
        wait_for(lambda: all(p.poll() is not None for p in self.workers),
                 120.0 * patience() if deadline is None else deadline, "the workers to exit")
        return [p.returncode for p in self.workers]

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of every process log (PS first), for failure messages."""
        return "\n".join(f"--- {p.stem}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.log_dir.glob("*.log")))

    def mark_failed(self) -> None:
        """Something went wrong: keep the logs when the cluster stops."""
        self._failed = True

    @property
    def failed(self) -> bool:
        """Marked failed, or a process exited non-zero (or by a signal) that :meth:`kill` did not kill."""
        procs = [p for p in [*self.workers, self.ps, *self.followers, self.peer] if p is not None]
        return self._failed or any(p.poll() not in (None, 0) and p.pid not in self._killed for p in procs)

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM the workers, then the PS processes, SIGKILL what is still there ``grace`` s after its SIGTERM
        (default 10 times :func:`patience`); then
        remove the temporary log folder unless logs are to be kept (``keep_logs``) or something failed (:attr:`failed`).
        Workers first: a worker on SIGTERM leaves (``DELETE /v1/workers/{id}``), and retries that until killed when its
        PS has gone first."""
        stopped: list = []
        grace = 10.0 * patience() if grace is None else grace
        for group in (self.workers, [self.ps, *self.followers, self.peer]):
            procs = [p for p in group if p is not None and p.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace
            for p in procs:
                try:
                    p.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._failed = True  # it ignored SIGTERM: worth a look at its log
                    p.kill()
                    p.wait(5 * patience())
            stopped += procs
        # A process that exits by our SIGTERM (code 0, or -15 without a handler) is no failure.
        self._killed.update(p.pid for p in stopped if p.returncode == -signal.SIGTERM)
        for f in self._files:
            f.close()
        self._files.clear()
        self._release()
        if self._own_log_dir and not self.keep_logs and not self.failed and self.log_dir.exists():
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.logs_removed = True

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.mark_failed()
            self.stop()
            raise

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.mark_failed()
        self.stop()
