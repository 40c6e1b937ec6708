"""Start a PS and workers as local processes on loopback (``make run``, tests, benchmarks).

:class:`LocalCluster` is a context manager: it starts ``python -m ps_service`` on a
free port, waits for ``/healthz`` (polling with a deadline), starts N
``python -m worker_service`` processes with distinct names, and on exit stops
whatever still runs (SIGTERM, then SIGKILL after a grace period). Process
output goes to files under ``log_dir`` so a failing test can show it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pydantic import SecretStr

from shared.tokens import bearer_header


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                 log_dir: str | Path | None = None, port: int | None = None, token: str | None = None) -> None:
        """``token``: the PS's PS_AUTH_TOKEN, given to the workers too (and used by :meth:`status`, :meth:`get`)."""
        self.n_workers = workers
        self.token = token
        self.headers = bearer_header(SecretStr(token) if token else None)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ps_env = {"PS_HOST": "127.0.0.1", "PS_PORT": str(self.port), "PS_MIN_WORKERS": str(workers), "PS_STARTUP_GRACE_SECONDS": "0",
                       **{k: str(v) for k, v in (ps_env or {}).items()}}
        self.worker_env = {"WORKER_PS_URL": self.url, **{k: str(v) for k, v in (worker_env or {}).items()}}
        if token:
            self.ps_env["PS_AUTH_TOKEN"] = self.worker_env["WORKER_AUTH_TOKEN"] = token
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="syncps-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ps: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._files: list = []

    def _spawn(self, module: str, env: dict, log_name: str) -> subprocess.Popen:
        out = open(self.log_dir / log_name, "ab")
        self._files.append(out)
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen([sys.executable, "-m", module], env=full_env, stdout=out, stderr=subprocess.STDOUT)

    def start_ps(self, deadline: float = 30.0) -> None:
        self.ps = self._spawn("ps_service", self.ps_env, "ps.log")

        def healthy():
            if self.ps.poll() is not None:
                raise RuntimeError(f"PS exited with {self.ps.returncode}:\n{self.log('ps')}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, deadline, "the PS to answer /healthz")

    def start_worker(self, index: int | None = None, env: dict | None = None) -> subprocess.Popen:
        index = len(self.workers) if index is None else index
        p = self._spawn("worker_service", {"WORKER_NAME": f"worker-{index}", **self.worker_env,
                                            **{k: str(v) for k, v in (env or {}).items()}}, f"worker-{index}.log")
        self.workers.append(p)
        return p

    def kill(self, proc: subprocess.Popen | None = None) -> float:
        """``kill -9`` a worker process or (default) the PS, and reap it; the Unix time of the signal.
        ``start_ps()`` / ``start_worker(i)`` start it again (same port, same name, log appended)."""
        proc = proc or self.ps
        at = time.time()
        proc.kill()
        proc.wait(10)
        return at

    def start(self) -> "LocalCluster":
        self.start_ps()
        for i in range(self.n_workers):
            self.start_worker(i)
        return self

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/status", timeout=5.0, headers=self.headers).json()

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10.0, **{**kw, "headers": {**self.headers, **kw.get("headers", {})}})

    def wait_workers(self, deadline: float = 120.0) -> list[int]:
        """Wait until every worker process exits; their exit codes."""
        wait_for(lambda: all(p.poll() is not None for p in self.workers), deadline, "the workers to exit")
        return [p.returncode for p in self.workers]

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of every process log (PS first), for failure messages."""
        return "\n".join(f"--- {p.stem}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.log_dir.glob("*.log")))

    def stop(self, grace: float = 10.0) -> None:
        procs = [p for p in [*self.workers, self.ps] if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for f in self._files:
            f.close()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
