"""The PS's FastAPI application: routers, error handlers, the background ticker and checkpoints
(restored on start, written periodically off the event loop, and a final one on shutdown/SIGTERM); and the
uvicorn options it is served with (:func:`server_options`, for ``python -m ps_service`` and the tests' live PS)."""
from __future__ import annotations

import asyncio
import logging
import os
import contextlib

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from ps_service import api, auth, checkpoint, dashboard, metrics, monitoring, probes, sharding, standby
from ps_service.hotpath import HotPath
from ps_service.http import install_error_handlers
from ps_service.runtime import Runtime
from ps_service.sharding import routes as shard_routes
from ps_service.standby import routes as standby_routes
from ps_service.standby.gate import Gate
from ps_service.settings import PSSettings
from ps_service.transport.bodysink import BufferedSinkProtocol
from ps_service.transport.unread import CloseUnread
from shared import keepalive

log = logging.getLogger("ps_service")


def server_options(settings: PSSettings) -> dict:
    """uvicorn's options for a PS beyond host, port, loop and logging: the body-sink protocol
    (ps_service/transport/bodysink.py), the keep-alive timeout every answer announces (shared/keepalive.py), and no
    websockets (the PS has no websocket route: an Upgrade request is served as plain HTTP/1.1, not refused 403)."""
    return {"access_log": False, "http": BufferedSinkProtocol, "ws": "none",
            "timeout_keep_alive": settings.http_keepalive_seconds,
            "headers": [(keepalive.HEADER, keepalive.header_value(settings.http_keepalive_seconds))]}


def create_app(settings: PSSettings | None = None, exit_on_refusal: bool = False) -> FastAPI:
    """The PS app. ``exit_on_refusal``: a start the checkpoint refuses (checkpoint.StartRefused) ends the process with
    one logged line and exit code 2 (``python -m ps_service``); else it raises (tests, in-process servers)."""
    settings = settings or PSSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        rt = Runtime(settings)
        rt.take_parts(sharding.role(settings, rt.core), standby.pair(settings, rt.core))  # None: one PS, no pair
        app.state.runtime = rt
        try:
            checkpointer = checkpoint.attach(rt)  # restores the newest valid checkpoint first
        except checkpoint.StartRefused as exc:
            log.error("cannot resume: %s", exc)
            if exit_on_refusal:  # python -m ps_service: that one line, exit 2 (not uvicorn's traceback of it)
                logging.shutdown()
                os._exit(2)
            raise
        app.state.metrics = metrics.PSMetrics(rt)  # hooked into rt.observers
        rt.observers.append(rt.tell_done)
        rt.tell_done()  # a finished job restored from its checkpoint
        task = asyncio.create_task(rt.ticker())
        deployment = asyncio.create_task(rt.deployment())  # PS_WORKERS_DNS: until step 0 or done
        if rt.shards is not None:
            await rt.shards.start(rt, checkpointer)  # the coordinator's links to its followers (ps_service/sharding)
        if rt.ha is not None:
            await rt.ha.start(rt)  # its role (a peer that serves a term makes this one its standby) and the link
        try:
            async with probes.listening(rt, settings.host, *settings.probe_listener()):  # ps_service/probes.py
                yield
        finally:
            for background in (task, deployment):
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background
            if rt.ha is not None:
                await rt.ha.close()  # (its reader stopped: no record changes the model the last checkpoint writes)
            if checkpointer is not None:
                await asyncio.to_thread(checkpointer.finish, rt.core)
            rt.tensors.close()
            if rt.shards is not None and rt.shards.links is not None:
                await rt.shards.links.close()

    # /docs and /redoc from the package's assets (fastapi-offline: no CDN); none, nor /openapi.json, in production
    make, docs = FastAPIOffline, {}
    if settings.production:
        make, docs = FastAPI, {"docs_url": None, "redoc_url": None, "openapi_url": None}
    # redirect_slashes off: `/v1/status/` is no route (404 `not_found`), not a 307 that skips the token and the body
    app = make(title="syncps parameter server", version="0.1.0", lifespan=lifespan, **docs, redirect_slashes=False,
                  description="Synchronous parameter server (SyncReplicasOptimizer semantics). See docs/protocol.md.")
    install_error_handlers(app)
    app.add_middleware(HotPath)  # the per-step push and pull skip FastAPI's routing when plainly well-formed
    if settings.role:
        app.add_middleware(Gate)  # a hot-standby pair: the term on every answer; training only on the primary
    app.add_middleware(CloseUnread)  # outermost: an answer sent before its body arrived whole closes the connection
    # access control (ps_service/auth.py): every router but health and the static dashboard, when a token is set
    app.include_router(api.router, dependencies=auth.TRAINING)
    if settings.shards > 1:  # a sharded PS's routes (ps_service/sharding/routes.py)
        app.include_router(shard_routes.router, dependencies=auth.TRAINING)
    if settings.role:  # a hot-standby pair's routes (ps_service/standby/routes.py)
        app.include_router(standby_routes.router, dependencies=auth.TRAINING)
    app.include_router(monitoring.router, dependencies=auth.MONITORING)
    app.include_router(metrics.router, dependencies=auth.MONITORING)
    # open: the dashboard's files hold no data (its script sends the token of /#token=... to the JSON routes)
    app.include_router(dashboard.router)
    app.include_router(monitoring.health)
    return app
