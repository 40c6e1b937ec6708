"""The PS's FastAPI application: routers, error handlers and the background ticker."""
from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ps_service import api, monitoring
from ps_service.http import install_error_handlers
from ps_service.runtime import Runtime
from ps_service.settings import PSSettings


def create_app(settings: PSSettings | None = None) -> FastAPI:
    settings = settings or PSSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt = Runtime(settings)
        app.state.runtime = rt
        task = asyncio.create_task(rt.ticker())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="syncps parameter server", version="0.1.0", lifespan=lifespan,
                  description="Synchronous parameter server (SyncReplicasOptimizer semantics). See docs/protocol.md.")
    install_error_handlers(app)
    app.include_router(api.router)
    app.include_router(monitoring.router)
    return app
