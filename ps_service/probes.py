"""The probe listener: ``/healthz`` and ``/readyz`` on a port of their own (``PS_PROBE_PORT``: docs/protocol.md, Probe
port), served by a thread with its own event loop, so a probe never queues behind the training traffic (it waits only
for the interpreter lock). ``/healthz`` here reports the main loop's pulse (:meth:`ProbeListener.pulse`, every
:data:`PULSE_SECONDS`): older than :data:`STALL_SECONDS`, 503 ``stalled``. ``/readyz`` is the main port's.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ps_service import monitoring
from ps_service.http import error_response, install_error_handlers
from ps_service.runtime import Runtime
from ps_service.transport.bodysink import CheckedHead, IdleUntilHead

log = logging.getLogger("ps_service.probes")

#: how often the main loop stamps its pulse
PULSE_SECONDS = 1.0
#: a main loop whose pulse is older than this is stalled: /healthz on the probe port answers 503
STALL_SECONDS = 30.0


class ProbeProtocol(CheckedHead, IdleUntilHead, HttpToolsProtocol):
    """uvicorn's, its idle timeout (``PS_HTTP_KEEPALIVE_SECONDS``, as the main port's) running from the connection's
    start until a request's head is whole, and malformed HTTP answered as on the main port (400 ``bad_http``)."""


class ProbeListener:
    """The probe port's server (a uvicorn in a daemon thread) and the main loop's pulse."""

    def __init__(self, rt: Runtime, host: str, port: int) -> None:
        self.last_pulse = time.monotonic()
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)  # /healthz/: 404
        app.state.runtime = rt
        install_error_handlers(app)
        app.add_api_route("/healthz", self.healthz, methods=["GET"])
        app.add_api_route("/readyz", monitoring.readyz, methods=["GET"])
        # log_config / log_level None: the main server's logging stays as it is
        config = uvicorn.Config(app, host=host, port=port, loop="asyncio", lifespan="off", log_config=None,
                                log_level=None, access_log=False, http=ProbeProtocol, ws="none",
                                timeout_keep_alive=rt.settings.http_keepalive_seconds if rt is not None else 5.0)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None
        # on uvicorn's logger while this server runs: its info lines (Started server process ...) are the main's again
        self.quiet = lambda r: r.levelno >= logging.WARNING or r.threadName != f"probes-{port}"

    async def healthz(self, request: Request) -> JSONResponse:
        """Liveness: the main event loop turned in the last STALL_SECONDS."""
        quiet = time.monotonic() - self.last_pulse
        if quiet > STALL_SECONDS:
            return error_response(503, "stalled", f"the PS's event loop has not turned for {quiet:.0f} s")
        return JSONResponse({"status": "ok"})

    async def pulse(self) -> None:
        """Runs on the main loop until cancelled."""
        while True:
            self.last_pulse = time.monotonic()
            await asyncio.sleep(PULSE_SECONDS)

    async def start(self, deadline: float = 10.0) -> None:
        """Bind the port (taken: RuntimeError), start the thread; raise if not listening within ``deadline`` s."""
        config = self.server.config
        try:
            family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
            sock = socket.create_server((config.host, config.port), family=family)
        except OSError as exc:
            raise RuntimeError(f"the probe listener could not take port {config.port} ({exc.strerror})") from None
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name=f"probes-{config.port}",
                                       daemon=True)
        logging.getLogger("uvicorn.error").addFilter(self.quiet)
        self.thread.start()
        end = time.monotonic() + deadline
        while not self.server.started and self.thread.is_alive() and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the probe listener could not start on port {config.port}")

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(5)
        logging.getLogger("uvicorn.error").removeFilter(self.quiet)


@contextlib.asynccontextmanager
async def listening(rt: Runtime, host: str, port: int | None, required: bool = True
                    ) -> AsyncIterator[ProbeListener | None]:
    """The probe listener on ``port`` and the main loop's pulse while the block runs (nothing if None). A listener
    that cannot start raises if ``required``, else is said at warning level and the block runs without it."""
    if port is None:
        yield None
        return
    probes = ProbeListener(rt, host, port)
    try:
        await probes.start()
    except RuntimeError as exc:
        if required:
            raise
        log.warning("%s: probes answer on the main port only (PS_PROBE_PORT: another port, or 0 for none)", exc)
        yield None
        return
    pulse = asyncio.create_task(probes.pulse())
    try:
        yield probes
    finally:
        pulse.cancel()
        probes.stop()
