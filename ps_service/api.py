"""The training routes: register, leave, heartbeat, initialise, pull, push (docs/protocol.md).

Thin drivers of :class:`ps_service.core.ParameterServerCore`: read and decode
the body, call the core with the runtime's clock, wake the waiters, encode the
answer. Tensor routes skip pydantic and speak msgpack.
"""
from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from ps_service.runtime import Runtime
from shared.codec import unpack
from shared.errors import ProtocolError
from shared.protocol import API, MSGPACK, STEP_HEADER, parse_model_init, parse_push
from ps_service.http import read_body

router = APIRouter(prefix=API, tags=["training"])


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


class Registration(BaseModel):
    name: str = Field(min_length=1, max_length=128, description="Stable worker name (a container's hostname).")


class Registered(BaseModel):
    worker_id: str
    name: str
    rank: int
    start_step: int = Field(description="Pull this step first (the next round boundary when joining mid-round).")
    global_step: int
    model_initialized: bool
    rejoined: bool
    lease_seconds: float
    state: str


@router.post("/workers", response_model=Registered)
async def register(body: Registration, request: Request) -> Registered:
    rt = runtime(request)
    m, start = rt.run_guarded(lambda: rt.core.register(body.name, rt.now()))
    return Registered(worker_id=m.worker_id, name=m.name, rank=m.rank, start_step=start,
                      global_step=rt.core.global_step, model_initialized=rt.core.initialized,
                      rejoined=m.registrations > 1, lease_seconds=rt.settings.lease_seconds,
                      state=rt.core.state().value)


@router.delete("/workers/{worker_id}")
async def leave(worker_id: str, request: Request) -> dict:
    rt = runtime(request)
    m = rt.run_guarded(lambda: rt.core.leave(worker_id, rt.now()))
    return {"worker_id": m.worker_id, "state": m.state}


@router.post("/workers/{worker_id}/heartbeat")
async def heartbeat(worker_id: str, request: Request) -> dict:
    rt = runtime(request)
    m = rt.core.heartbeat(worker_id, rt.now())
    return {"worker_id": m.worker_id, "state": m.state, "global_step": rt.core.global_step}


@router.put("/model", status_code=201, responses={409: {"description": "already initialised: pull instead"}})
async def init_model(request: Request) -> dict:
    rt = runtime(request)
    body = await read_body(request, rt.settings.max_body_bytes, MSGPACK)
    init = parse_model_init(unpack(body))
    rt.bytes_in += len(body)
    rt.run_guarded(lambda: rt.core.init_model(init, rt.now()))
    return {"step": rt.core.global_step, "optimizer": rt.core.optimizer.spec}


@router.get("/model", response_class=Response, responses={
    200: {"content": {MSGPACK: {}}, "description": 'msgpack {"step", "done", "ranks", "tensors"}'},
    204: {"description": "timeout: global_step did not reach min_step in time"}})
async def pull(request: Request, min_step: int = Query(0, ge=0), timeout: float = Query(30.0, ge=0),
               worker_id: str | None = Query(None, max_length=64)) -> Response:
    rt = runtime(request)
    core = rt.core
    if worker_id is not None:
        core.heartbeat(worker_id, rt.now())
    if not core.initialized and not await rt.wait_until(lambda: core.initialized, min(timeout, rt.settings.pull_timeout_max_seconds)):
        raise ProtocolError(409, "not_initialized", "the model is not initialised yet (PUT /v1/model)")
    ready = lambda: core.done or (core.started and core.global_step >= min_step)  # noqa: E731
    ok = await rt.wait_until(ready, min(timeout, rt.settings.pull_timeout_max_seconds))
    if worker_id is not None and worker_id in core.members.by_id and core.members.by_id[worker_id].active:
        core.heartbeat(worker_id, rt.now())  # waiting on the barrier is being alive
    if not ok:
        return Response(status_code=204, headers={STEP_HEADER: str(core.global_step)})
    body = rt.pull_body()
    rt.bytes_out += len(body)
    return Response(body, media_type=MSGPACK, headers={STEP_HEADER: str(core.global_step)})


@router.post("/gradients", responses={200: {"description": '{"status": accepted|stale|duplicate|late, "step"}'}})
async def push(request: Request) -> dict:
    rt = runtime(request)
    body = await read_body(request, rt.settings.max_body_bytes, MSGPACK)
    req = parse_push(unpack(body))
    rt.bytes_in += len(body)
    result = rt.run_guarded(lambda: rt.core.push(req, rt.now()))
    return {"status": result.status.value, "step": result.step, "done": rt.core.done}
