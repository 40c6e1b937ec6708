"""A fork server for local clusters: ``python -m ps_service`` / ``python -m worker_service`` without paying
Python's start-up and imports for every process (the test suite; ``SYNCPS_FORK_SERVER=1``).

Contract. :func:`spawn` starts ``python -m MODULE`` with a full environment, a working directory and a log
file (fd 0 from /dev/null, fds 1 and 2 appended to the log) and returns a handle with ``subprocess.Popen``'s
surface as :class:`cluster.processes.LocalCluster` and the tests use it (``pid``, ``args``, ``returncode``,
``poll()``, ``wait(timeout)`` raising ``subprocess.TimeoutExpired``, ``send_signal()``, ``terminate()``,
``kill()``). The process is forked by a *zygote*: one per kind (:data:`ZYGOTES`), directory and environment
(below) of each parent process, started on first use, that has imported that kind's stack once (the PS's:
``ps_service.app``, uvicorn, pydantic and what ``ps_service/__main__.py`` imports, after defaulting
``OPENBLAS_NUM_THREADS`` to 1 exactly as that file does; the worker's: ``worker_service.client``, ``.loop``,
``.settings``, ``.tasks``, ``.transport.faults``, numpy; and, before forking the first ``mlp`` worker,
``sklearn.datasets``: :data:`ON_DEMAND`), never the ``__main__`` modules themselves. A zygote runs one
Python thread, no event loop and no socket (numpy's OpenBLAS may start a native pool at import; OpenBLAS
shuts it down before every fork); it answers requests on a pipe (JSON lines), forks, reaps its children and
reports each exit code as Popen gives it (``-N`` for signal N). Signals go through the zygote, which only
signals a child it has not reaped yet (a pid is never reused under us).

The forked child: ``chdir``, ``os.environ`` replaced (C environment too), fds 0/1/2 as above and new
``sys.stdin``/``stdout``/``stderr`` over them (unbuffered, as with ``PYTHONUNBUFFERED``), every other fd
closed (the zygote's pipes among them), ``SIGCHLD`` and the wakeup fd back to the interpreter's defaults,
``sys.argv``/``sys.path[0]`` as ``python -m`` gives them, then ``runpy.run_module(MODULE,
run_name="__main__", alter_sys=True)`` at the top of the zygote's own ``-c`` program, outside its loop:
``SystemExit``, an uncaught exception, ``KeyboardInterrupt``, ``atexit`` and non-daemon threads are the
interpreter's own business, exactly as in an exec'd ``python -m``.

**Which zygote**: a child is forked only by a zygote started in its working directory with its environment
but for the variables :func:`may_differ` names (prefixes ``PS_``, ``WORKER_``, ``SYNCPS_``, and
``PYTEST_CURRENT_TEST``): any other (``PYTHON*``, ``LD_*``, ``OPENBLAS_*``, ``OMP_*``, ``MKL_*``, ``KMP_*``
that importing torch sets in the parent, ...) may be read at interpreter start or import, so another value
gets another zygote (the :data:`KEEP_IDLE` most recently used of a module are kept, older ones end once
none of their children runs) and a forked child behaves as an exec'd one would.
**Fallback**: :func:`spawn` returns None (the caller execs as usual) when the module has no zygote, or its
zygote cannot start or died. What a fork cannot give: each child shares its zygote's ``str`` hash seed (an
exec'd one draws its own unless ``PYTHONHASHSEED`` is set) and its ``/proc/PID/cmdline`` is the zygote's.
``random`` is re-seeded in every child by Python itself; the project's numpy randomness is seeded.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

#: module -> the modules its zygote imports before forking
ZYGOTES: dict[str, tuple[str, ...]] = {
    "ps_service": ("uvicorn", "pydantic", "ps_service.app", "ps_service.transport.bodysink", "ps_service.settings"),
    "worker_service": ("numpy", "worker_service.client", "worker_service.transport.faults", "worker_service.loop",
                       "worker_service.settings", "worker_service.tasks"),
}
#: (module, variable, value) -> what the zygote imports (once, if it can) before forking a child whose
#: environment says so: the ``mlp`` task's data set loader, 2-3 s of imports in every such worker otherwise
ON_DEMAND: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("worker_service", "WORKER_TASK", "mlp"): ("sklearn.datasets",),
}
#: variables a child's environment may set differently from its zygote's (read after start-up, by settings)
MAY_DIFFER_PREFIXES = ("PS_", "WORKER_", "SYNCPS_")
MAY_DIFFER = frozenset({"PYTEST_CURRENT_TEST"})
ENABLE_VAR = "SYNCPS_FORK_SERVER"


def enabled() -> bool:
    """Whether local clusters fork their processes through a zygote (``SYNCPS_FORK_SERVER=1``)."""
    return os.environ.get(ENABLE_VAR, "").lower() in ("1", "true", "yes")


def may_differ(name: str) -> bool:
    return name in MAY_DIFFER or name.startswith(MAY_DIFFER_PREFIXES)


# ---------------------------------------------------------------------------------------------- parent side

class ForkedProcess:
    """A child of a zygote, with the part of ``subprocess.Popen``'s surface local clusters use."""

    def __init__(self, server: "ForkServer", pid: int, module: str) -> None:
        self._server, self.pid, self.args = server, pid, [sys.executable, "-m", module]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._server.signal(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess: returncode: {self.returncode} args: {self.args!r}>"


class ForkServer:
    """The parent's end of one zygote: requests under a lock, a daemon thread reading answers and exits."""

    def __init__(self, module: str, env: dict[str, str], cwd: str) -> None:
        """``env``: the environment of the first child; the zygote gets the part that children must share."""
        self.module, self.cwd = module, cwd
        self.env = {k: v for k, v in env.items() if not may_differ(k)}
        program = f"from cluster.forkserver import serve; serve({module!r}, {list(ZYGOTES[module])!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", program],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=cwd)
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._answers: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self._spawned: set[int] = set()
        self._send_lock = threading.Lock()
        self.alive = True
        self._reader = threading.Thread(target=self._read, name=f"forkserver-{module}", daemon=True)
        self._reader.start()
        if "ready" not in self._request({"op": "ping"}, timeout=60.0):
            self.proc.kill()
            raise RuntimeError("zygote did not start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                else:
                    self._answers[msg["id"]] = msg
                self._cond.notify_all()
        self.proc.stdout.close()
        with self._cond:
            self.alive = False
            self._cond.notify_all()

    def _request(self, msg: dict, timeout: float = 30.0) -> dict:
        msg["id"] = rid = next(self._ids)
        with self._send_lock:
            try:
                self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                return {"error": "zygote gone"}
        with self._cond:
            self._cond.wait_for(lambda: rid in self._answers or not self.alive, timeout)
            return self._answers.pop(rid, {"error": "zygote gone"})

    def spawn(self, module: str, env: dict[str, str], cwd: str, log: str) -> ForkedProcess | None:
        warm = [name for (mod, var, value), names in ON_DEMAND.items() if mod == module and env.get(var) == value
                for name in names]
        answer = self._request({"op": "spawn", "module": module, "env": env, "cwd": cwd, "log": log, "warm": warm},
                               timeout=60.0)
        if "oserror" in answer:  # as Popen would raise it (a missing cwd, a log file it cannot open)
            errno, text, path = answer["oserror"]
            raise OSError(errno, text, path)
        if "pid" not in answer:  # no answer in time: this zygote is not to be trusted with another child
            self.proc.kill()
            return None
        with self._cond:
            self._spawned.add(answer["pid"])
        return ForkedProcess(self, answer["pid"], module)

    def signal(self, pid: int, sig: int) -> None:
        if not self._request({"op": "signal", "pid": pid, "sig": int(sig)}).get("ok", True):
            return
        if not self.alive:  # the zygote died: its children are init's now, signal them directly
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid, None if self.alive or _exists(pid) else 255)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or not self.alive, timeout)
        if pid not in self._exits and not self.alive:  # an orphan now: nobody reports its exit code to us
            end = time.monotonic() + (timeout if timeout is not None else float("inf"))
            while _exists(pid) and time.monotonic() < end:
                time.sleep(0.02)
        return self.exit_code(pid)

    def running(self) -> bool:
        """Whether a child of this zygote has not been reported gone."""
        with self._cond:
            return bool(self._spawned - self._exits.keys()) and (self.alive or any(map(_exists, self._spawned)))

    def close(self) -> None:
        """End the zygote (its children run on): its pipe closed, then SIGKILL if it is still there 10 s later (a
        loaded machine's slow exit is no reason to fail the caller, a spawn retiring an old zygote among them)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_SERVERS: dict[tuple, ForkServer] = {}  # (module, cwd, the environment children must share) -> its zygote
_SERVERS_LOCK = threading.Lock()
KEEP_IDLE = 2  # zygotes kept per module (the most recently used), the others ended once none of their children runs


def server(module: str, env: dict[str, str], cwd: str) -> ForkServer | None:
    """This process's zygote for ``module`` in ``cwd`` whose environment is ``env`` but for the variables that
    :func:`may_differ` (started on first use); None if the module has none, or it could not start, or died."""
    if module not in ZYGOTES:
        return None
    key = (module, cwd, tuple(sorted((k, v) for k, v in env.items() if not may_differ(k))))
    with _SERVERS_LOCK:
        srv = _SERVERS.pop(key, None)
        if srv is None:
            try:
                srv = ForkServer(module, env, cwd)
            except (OSError, RuntimeError):
                return None
        _SERVERS[key] = srv  # last: the most recently used
        ours = [k for k in _SERVERS if k[0] == module]
        retired = [_SERVERS.pop(k) for k in ours[:-KEEP_IDLE] if not _SERVERS[k].running()]
    for old in retired:
        old.close()
    return srv if srv.alive else None


def spawn(module: str, env: dict[str, str], log: str, cwd: str | None = None) -> ForkedProcess | None:
    """``python -m module`` forked by its zygote, or None when it must be exec'd instead (see the module
    docstring, Fallback)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    srv = server(module, env, cwd)
    return None if srv is None else srv.spawn(module, env, cwd, log)


def shutdown(*modules: str) -> None:
    """End the zygotes of ``modules`` (default: every one) of this process; their children run on."""
    with _SERVERS_LOCK:
        servers = [_SERVERS.pop(k) for k in list(_SERVERS) if not modules or k[0] in modules]
    for srv in servers:
        srv.close()


# ---------------------------------------------------------------------------------------------- zygote side

def serve(module: str, imports: list[str]) -> None:
    """The zygote's program (``python -c "from cluster.forkserver import serve; serve(MODULE, IMPORTS)"``):
    import, answer requests; in a forked child, become ``python -m MODULE`` (returns only there)."""
    import runpy

    request = _zygote(module, imports)
    if request is None:
        sys.exit(0)
    _become(request)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _zygote(module: str, imports: list[str]) -> dict | None:
    """Import ``imports``, then serve requests on fds 0 (in) and 1 (out) until EOF (None) or, in a
    forked child, return its request (with ``log_fd``) once every fd of the zygote's own is closed."""
    import importlib

    requests, answers = os.dup(0), os.dup(1)  # the protocol's pipes, away from fds 0 and 1
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.path[0] = os.getcwd()  # as ``python -m`` has it
    if module == "ps_service":
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as ps_service/__main__.py, before numpy
    else:
        from worker_service.threads import one_thread_unless_set
        one_thread_unless_set()  # as worker_service/__main__.py, before numpy
    for name in imports:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    live: set[int] = set()
    pending = b""

    def send(msg: dict) -> None:
        os.write(answers, json.dumps(msg).encode() + b"\n")  # short lines: one write each

    while True:
        ready = select.select([requests, wake_r], [], [])[0]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(live, send)
        if requests not in ready:
            continue
        data = os.read(requests, 1 << 16)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            msg = json.loads(line)
            if msg["op"] == "ping":
                send({"id": msg["id"], "ready": True})
            elif msg["op"] == "signal":
                if msg["pid"] in live:
                    os.kill(msg["pid"], msg["sig"])
                send({"id": msg["id"], "ok": msg["pid"] in live})
            elif msg["op"] == "spawn":
                for name in msg["warm"]:
                    with contextlib.suppress(ImportError):  # the child will fail to import it just the same
                        importlib.import_module(name)
                try:
                    os.stat(msg["cwd"])
                    msg["log_fd"] = os.open(msg["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                except OSError as exc:
                    send({"id": msg["id"], "oserror": [exc.errno, exc.strerror, exc.filename]})
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (requests, answers, wake_r, wake_w):
                        os.close(fd)
                    return msg
                os.close(msg["log_fd"])
                live.add(pid)
                send({"id": msg["id"], "pid": pid})


def _reap(live: set[int], send) -> None:
    while live:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        live.discard(pid)
        send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict) -> None:
    """Turn a freshly forked zygote into ``python -m request['module']``'s start."""
    os.chdir(request["cwd"])
    os.environ.clear()  # putenv/unsetenv: the C environment too
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(request["log_fd"], 1)
    os.dup2(request["log_fd"], 2)
    os.closerange(3, _max_fd())  # the log's own fd, the zygote's /dev/null, whatever an import opened
    _KEEP.extend([sys.stdin, sys.stdout, sys.stderr])  # the old objects own fds 0-2: never let them close them
    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False, encoding=sys.stdin.encoding)
    sys.stdout = sys.__stdout__ = _unbuffered(1, encoding, "strict")
    sys.stderr = sys.__stderr__ = _unbuffered(2, encoding, "backslashreplace")
    sys.argv = ["-m"]  # run_module puts the module's file in argv[0]
    sys.path[0] = os.getcwd()


_KEEP: list = []


def _unbuffered(fd: int, encoding: str, errors: str):
    import io
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors, write_through=True)


def _max_fd() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")
