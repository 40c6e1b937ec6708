"""The training routes: register, leave, heartbeat, initialise, pull, push, and the same-host
transport's offer and attach (docs/protocol.md; the files themselves: ps_service/shm.py).

Thin drivers of :class:`ps_service.core.ParameterServerCore`: read and decode
the body, call the core with the runtime's clock, wake the waiters, encode the
answer. Tensor routes skip pydantic and speak msgpack. Every body is read in the
endpoint with :func:`ps_service.http.read_body` (after the auth dependency that
app.py attaches to this router): bounded, typed, never buffered before auth. The
per-step push and pull are also called directly by ps_service/hotpath.py.
"""
from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from ps_service.runtime import Runtime, runtime
from shared.codec import unpack
from shared.errors import ProtocolError
from shared.shm import TENSORS_HEADER
from shared.protocol import (API, JSON, MODEL_INIT_SCHEMA, MSGPACK, PUSH_SCHEMA, PUSH_STATUS_HEADER, STEP_HEADER,
                             msgpack_body, parse_model_init, parse_push)
from ps_service.http import JSON_BODY_LIMIT, parse_json, read_body

router = APIRouter(prefix=API, tags=["training"])


async def request_body(request: Request, media_type: str, limit: int | None = None) -> bytes:
    rt = runtime(request)
    return await read_body(request, limit or rt.settings.max_body_bytes, media_type, rt.settings.body_idle_timeout_seconds)


class Registration(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$",
                      description="Stable worker name (a container's hostname); no control characters.")


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


@router.post("/workers", response_model=Registered, openapi_extra={"requestBody": {
    "required": True, "content": {JSON: {"schema": Registration.model_json_schema()}}}})
async def register(request: Request) -> Registered:
    rt = runtime(request)
    reg = parse_json(await request_body(request, JSON, JSON_BODY_LIMIT), Registration)
    m, start = rt.run_guarded(lambda: rt.core.register(reg.name, rt.now()))
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


@router.put("/model", status_code=201, responses={409: {"description": "already initialised: pull instead"}},
            openapi_extra=msgpack_body(MODEL_INIT_SCHEMA))
async def init_model(request: Request) -> dict:
    rt = runtime(request)
    raw = await request_body(request, MSGPACK)
    init = parse_model_init(unpack(raw))
    rt.bytes_in += len(raw)
    rt.run_guarded(lambda: rt.core.init_model(init, rt.now()))
    return {"step": rt.core.global_step, "optimizer": rt.core.optimizer.spec}


@router.get("/model", response_class=Response, responses={
    200: {"content": {MSGPACK: {}}, "description": 'msgpack {"step", "done", "ranks", "tensors"}'},
    204: {"description": "timeout: global_step did not reach min_step in time"}})
async def pull(request: Request, min_step: int = Query(0, ge=0), timeout: float = Query(30.0, ge=0, allow_inf_nan=False),
               worker_id: str | None = Query(None, max_length=64),
               shm: bool = Query(False, description="Same-host transport: answer without tensors (`\"shm\": true`); "
                                                    "the weights are in the weights file (GET /v1/shm).")) -> Response:
    rt = runtime(request)
    core = rt.core
    if worker_id is not None:
        core.heartbeat(worker_id, rt.now())
    if not core.initialized and not await rt.wait_until(lambda: core.initialized, min(timeout, rt.settings.pull_timeout_max_seconds)):
        raise ProtocolError(409, "not_initialized", "the model is not initialised yet (PUT /v1/model)")
    ready = lambda: core.done or (core.started and core.global_step >= min_step)  # noqa: E731
    ok = await rt.wait_until(ready, min(timeout, rt.settings.pull_timeout_max_seconds))
    waited(rt, worker_id)
    if not ok:
        return Response(status_code=204, headers={STEP_HEADER: str(core.global_step)})
    return weights_response(rt, shm=shm)


def waited(rt: Runtime, worker_id: str | None) -> None:
    """Waiting on the barrier is being alive: renew the lease of an active waiter."""
    m = rt.core.members.by_id.get(worker_id) if worker_id is not None else None
    if m is not None and m.active:
        rt.core.heartbeat(worker_id, rt.now())


def weights_response(rt: Runtime, headers: dict | None = None, shm: bool = False) -> Response:
    """The current weights (the same encoded bytes for every worker of a step), or where they are (shm)."""
    if shm and rt.shm.weights_name is not None:
        body = rt.shm_pull_body()
    else:
        body = rt.pull_body()
        rt.bytes_out += len(body)
    return Response(body, media_type=MSGPACK, headers={STEP_HEADER: str(rt.core.global_step), **(headers or {})})


@router.post("/gradients", responses={200: {"description": '{"status": accepted|stale|duplicate|late|skipped, "step"}'}},
             openapi_extra=msgpack_body(PUSH_SCHEMA))
async def push(request: Request, pull: bool = Query(False, description=(
                   "Answer with the next weights (msgpack, as GET /model) once global_step passes the pushed step, "
                   f"the push's status in {PUSH_STATUS_HEADER}; JSON as without it if `timeout` passes first.")),
               timeout: float = Query(30.0, ge=0, allow_inf_nan=False)) -> dict:
    rt = runtime(request)
    rt.drop_body()
    raw = await request_body(request, MSGPACK)
    obj = unpack(raw)
    req = parse_push(obj)
    shm = request.headers.get(TENSORS_HEADER) == "shm"
    if shm:  # the tensors are in the worker's gradient file (GET /v1/shm)
        rt.core.members.get(req.worker_id)  # 404 unknown_worker first: a restarted PS has no file of it
        req = replace(req, tensors=rt.shm.gradients(req.worker_id, obj.get("shm_seq")))
    else:
        rt.bytes_in += len(raw)
    owned = shm or isinstance(raw, memoryview) and not raw.readonly  # a buffer of our own: aggregate in place
    result = rt.run_guarded(lambda: rt.core.push(req, rt.now(), owned=owned))
    rt.shm.last_transport[req.worker_id] = "shm" if shm else "http"  # a known worker (the core raised otherwise)
    core, step, worker_id = rt.core, req.step, req.worker_id
    del raw, req, obj  # the round holds what it needs, and frees it once aggregated
    if pull and await rt.wait_until(lambda: core.done or core.global_step > step,
                                    min(timeout, rt.settings.pull_timeout_max_seconds)):
        waited(rt, worker_id)
        return weights_response(rt, {PUSH_STATUS_HEADER: result.status.value}, shm=shm)
    return {"status": result.status.value, "step": result.step, "done": core.done}


class ShmAttach(BaseModel):
    file: str = Field(max_length=64, description="Name of the worker's gradient file in the shared directory.")
    nonce: str = Field(max_length=64, description="The 16 bytes (hex) the worker wrote at the start of the file.")


@router.get("/shm", responses={409: {"description": "shm_unavailable (off) or not_initialized"}})
async def shm_offer(request: Request) -> dict:
    """The same-host transport: the weights file (name, nonce, layout) of this PS (docs/protocol.md)."""
    rt = runtime(request)
    if not rt.core.initialized:
        raise ProtocolError(409, "not_initialized", "the model is not initialised yet (PUT /v1/model)")
    return rt.shm.offer(rt.core.weights)


@router.post("/workers/{worker_id}/shm", openapi_extra={"requestBody": {
    "required": True, "content": {JSON: {"schema": ShmAttach.model_json_schema()}}}})
async def shm_attach(worker_id: str, request: Request) -> dict:
    """Use the worker's gradient file for its pushes (409 shm_unavailable: not on this host; push over HTTP)."""
    rt = runtime(request)
    body = parse_json(await request_body(request, JSON, JSON_BODY_LIMIT), ShmAttach)
    m = rt.core.members.get(worker_id)
    rt.shm.attach(m.worker_id, body.file, body.nonce)
    return {"worker_id": m.worker_id, "transport": "shm"}
