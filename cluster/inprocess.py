"""A PS in a thread of this process (uvicorn on loopback, as ``python -m ps_service`` runs it): the tests that
look inside its core (tests/live_ps.py) and the path tracer (bench/trace.py).

:func:`serve_in_thread` starts ``ps_service.app.create_app`` under uvicorn on the settings' host and port in a daemon
thread and waits (polling, with a deadline) until it listens; ``profile``, when given, is installed with
``sys.setprofile`` in that thread before the server runs (the tracer's hook: it sees that thread's calls only).
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import uvicorn

from cluster.processes import patience, wait_for
from ps_service.app import create_app, server_options
from ps_service.settings import PSSettings


def serve_in_thread(settings: PSSettings, profile: Callable | None = None,
                    start_timeout: float | None = None) -> tuple[Any, uvicorn.Server, threading.Thread]:
    """(app, server, thread): the server started (``server.started`` False if it could not bind) within
    ``start_timeout`` s (default 20 times :func:`cluster.processes.patience`)."""
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           timeout_graceful_shutdown=2, **server_options(settings)))

    def run() -> None:
        if profile is not None:
            sys.setprofile(profile)
        server.run()

    thread = threading.Thread(target=run, name=f"ps-{settings.port}", daemon=True)
    thread.start()
    deadline = 20.0 * patience() if start_timeout is None else start_timeout
    wait_for(lambda: server.started or not thread.is_alive(), deadline, "the in-process PS to start")
    return app, server, thread
