"""The training routes: register, leave, heartbeat, initialise, pull, push, and the same-host transport's offer and
attach (docs/protocol.md).

Thin drivers of :class:`ps_service.core.ParameterServerCore`: the request's tensors come from the seam
(:class:`ps_service.transport.TensorSeam`: no route knows which transport carried them), the core is called with the
runtime's clock, the waiters woken. JSON bodies are read in the endpoint, after the auth dependency, bounded
(:func:`ps_service.transport.body.read_body`). ps_service/hotpath.py calls the per-step push and pull directly.
"""
from __future__ import annotations

from typing import Annotated, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, field_validator

from ps_service.core.membership import refuse_blank
from ps_service.http import JSON_BODY_LIMIT, REFUSALS, DecimalInt, json_body, parse_json
from ps_service.runtime import runtime
from ps_service.transport.body import read_body
from shared import marks
from shared.errors import ProtocolError
from shared.protocol import API, FRAME, FRAME_BODY, JSON, PUSH_STATUS_HEADER, STEP_HEADER, PushStatus

router = APIRouter(prefix=API, tags=["training"])
PARTITIONED = ("In a job with partitioned rounds (PS_PARTITION_BYTES > 0): a pull of step s + 1 made while round s is "
               "decided and its partitions still close is answered partition by partition, each frame as its "
               "partition closes (docs/protocol-partitions.md); else, and for a same-host answer, as without it.")
SINCE = ("The step whose weights this worker holds, as a previous answer of this PS gave them (meta `lineage`): "
         "the answer may then carry the tensors that changed in few entries as those entries (meta `since`, "
         "`sparse`; docs/protocol.md, Weight deltas). Any other value: the dense weights.")


async def read_json(request: Request, model):
    rt = runtime(request)
    return parse_json(await read_body(request, JSON_BODY_LIMIT, JSON, rt.settings.body_idle_timeout_seconds), model)


class Registration(BaseModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f-\x9f]+$",  # no C0 or C1 control
                      description="Stable worker name (a container's hostname); no control characters.")

    @field_validator("name", mode="before")
    @classmethod
    def _not_blank(cls, name: object) -> object:
        refuse_blank(name)  # only whitespace: 400 bad_name before the other checks' bad_request
        return name


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
    compression: dict = Field(description='The job\'s gradient compression of body pushes (PS_COMPRESSION): '
                                          '{"name", "topk_ratio", "threshold", "topk_warmup_steps"} (docs/protocol.md, Compression).')
    shards: int = Field(description="PS processes the model is spread over (PS_SHARDS); > 1: push and pull every "
                                    "shard (GET /v1/shards; docs/protocol-shards.md).")
    mode: str = Field(description='The job\'s mode (PS_MODE): "sync", "async" or "ssp" (a task may bring another '
                                  "learning rate for async and SSP, which apply every gradient on its own).")
    partition_bytes: int = Field(0, description="The job's partition size (PS_PARTITION_BYTES; 0: one partition): a "
                                                "push may carry its partitions as frames "
                                                "(docs/protocol-partitions.md).")


@router.post("/workers", response_model=Registered, openapi_extra=json_body(Registration))
async def register(request: Request) -> Registered:
    rt = runtime(request)
    reg = await read_json(request, Registration)
    if rt.shards is not None:
        rt.shards.admit()  # 503 while the shards are not at one step (a restore that mixes steps)
    m, start = rt.run_guarded(lambda: rt.core.register(reg.name, rt.now()))
    if rt.ha is not None:
        await rt.ha.replicated()  # the standby knows this member (its id and rank) before the worker does
    return Registered(worker_id=m.worker_id, name=m.name, rank=m.rank, start_step=start,
                      global_step=rt.core.global_step, model_initialized=rt.core.initialized,
                      rejoined=m.registrations > 1, lease_seconds=rt.settings.lease_seconds,
                      state=rt.core.state().value, compression=rt.tensors.compression.to_wire(),
                      shards=rt.settings.shards, mode=rt.settings.mode,
                      partition_bytes=rt.settings.partition_bytes)


def coordinator_only(rt, what: str) -> None:
    """409 ``not_coordinator`` on a sharded PS's follower: membership and the model's init are shard 0's."""
    if rt.shards is not None:
        rt.shards.need(True, f"{what} to shard 0, the coordinator")


@router.delete("/workers/{worker_id}")
async def leave(worker_id: str, request: Request) -> dict:
    rt = runtime(request)
    coordinator_only(rt, "leaves go")
    m = rt.run_guarded(lambda: rt.core.leave(worker_id, rt.now()))
    return {"worker_id": m.worker_id, "state": m.state}


@router.post("/workers/{worker_id}/heartbeat")
async def heartbeat(worker_id: str, request: Request) -> dict:
    rt = runtime(request)
    coordinator_only(rt, "heartbeats go")
    m = rt.core.members.touch(worker_id, rt.now())
    return {"worker_id": m.worker_id, "state": m.state, "global_step": rt.core.global_step}


@router.put("/model", status_code=201, responses={409: {"description": "already initialised: pull instead"}},
            openapi_extra=FRAME_BODY)
async def init_model(request: Request) -> dict:
    rt = runtime(request)
    coordinator_only(rt, "the model goes")  # before the body: a follower gets its pieces from shard 0
    init = await rt.tensors.receive_model(request)
    if rt.shards is not None:  # plan the shard map, give every follower its pieces; keep ours
        init = await rt.shards.init_model(init)
    rt.run_guarded(lambda: rt.core.init_model(init, rt.now()))
    return {"step": rt.core.global_step, "optimizer": rt.core.optimizer.spec}


@router.get("/model", response_class=Response, responses={
    200: {"content": {FRAME: {}}, "description": 'a frame; meta {"step", "done", "ranks"} (and "shm": true)'},
    204: {"description": "timeout: global_step did not reach min_step in time"}})
async def pull(request: Request, min_step: Annotated[DecimalInt, Query(ge=0)] = 0,
               timeout: float = Query(30.0, ge=0, allow_inf_nan=False),
               worker_id: str | None = Query(None, max_length=64),
               shm: bool = Query(False, description="Same-host transport: answer without tensors (meta `\"shm\": true`); "
                                                    "the weights are in the weights file (GET /v1/shm)."),
               since: Annotated[DecimalInt | None, Query(ge=0, description=SINCE)] = None,
               partitioned: bool = Query(False, description=PARTITIONED)) -> Response:
    rt = runtime(request)
    core = rt.core
    ready = lambda: core.initialized and (core.done or (  # noqa: E731
        core.started and core.global_step >= min_step and core.may_pull(worker_id)))  # SSP: the bound
    body = answer_via(core, rt.tensors.via(shm)) == "http"  # answered with the weights in the body: woken first
    parts = rt.tensors.partitions if partitioned and body else None
    streamable = (lambda: False) if parts is None else (lambda: parts.streamable(min_step) is not None)  # noqa: E731
    ok = await rt.wait_for(lambda: ready() or streamable(), timeout, worker_id, first=body)
    core.admit(None)  # 409 not_initialized
    if not ok:
        return Response(status_code=204, headers={STEP_HEADER: str(core.global_step)})
    if not ready() and streamable():
        return StreamingResponse(_partition_by_partition(rt, parts.answer(min_step), worker_id,
                                                         request.client.host if request.client else None),
                                 media_type=FRAME, headers={STEP_HEADER: str(core.global_step)})
    return await answer_weights(rt, answer_via(core, rt.tensors.via(shm)), {}, since)


async def _partition_by_partition(rt, frames, worker_id: str | None, peer: str | None = None
                                  ) -> AsyncIterator[bytes]:
    """Step s + 1's frames in partition order, each once its partition closed (docs/protocol-partitions.md): the
    worker's lease held meanwhile; if a partition does not close within ``PS_PULL_TIMEOUT_MAX_SECONDS``, the body
    ends short. ``peer``: the client's address, in the timeline's marks (:mod:`shared.marks`)."""
    core, held = rt.core, False
    if worker_id is not None:
        try:
            held = core.members.begin_wait(worker_id, rt.now()) is not None
        except REFUSALS:  # it left or expired since its wait: the weights go out all the same
            pass
    try:
        for q in range(frames.count):
            if not frames.has(q) and not await rt.wait_until(lambda: frames.has(q),
                                                             rt.settings.pull_timeout_max_seconds):
                return
            rt.tensors.bytes_out += len(frames.frames[q])
            if marks.ON:
                marks.mark("pull.yield", q=q, step=frames.step - 1, peer=peer,
                           shard=0 if rt.shards is None else rt.shards.index)
            yield frames.frames[q]
            if marks.ON:
                marks.mark("pull.resumed", q=q, step=frames.step - 1, peer=peer)
    finally:
        if held:
            core.members.end_wait(worker_id, rt.now())


@router.post("/gradients", responses={200: {"description": '{"status": accepted|stale|duplicate|late|skipped, "step", "done"}'}},
             openapi_extra=FRAME_BODY)
async def push(request: Request, pull: bool = Query(False, description=(
                   "Answer with the next weights (a frame, as GET /model) once global_step passes the pushed step, "
                   f"the push's status in {PUSH_STATUS_HEADER}; JSON as without it if `timeout` passes first.")),
               timeout: float = Query(30.0, ge=0, allow_inf_nan=False),
               since: Annotated[DecimalInt | None, Query(ge=0, description=SINCE)] = None) -> dict:
    rt = request.app.state.runtime  # (runtime(request), without a call: the per-step route)
    if rt.shards is not None and not (rt.shards.coordinator and rt.shards.partitioned):
        raise ProtocolError(409, "sharded", f"this PS is shard {rt.shards.index} of {rt.shards.count}: push pieces "
                                            "to every shard "
                                            "(POST /v1/shard/gradients), then commit (POST /v1/shard/commit)"
                                            if not rt.shards.partitioned else
                                            "push the coordinator's pieces to shard 0, hold each follower's pieces "
                                            "there (POST /v1/shard/gradients)")
    # a sharded coordinator's partitioned pushes are read as they come, as its followers' holds (docs/partitions.md,
    # Shards): its decision then comes with the last head, not after the pushes before it in rank order
    turn = rt.turn if rt.shards is None else None
    try:
        result, got, via = await rt.tensors.push(request, rt.now, turn, rt.deliver)
    finally:
        rt.notify()  # as run_guarded: the waiters woken whatever happened
    step, worker_id = got.step, got.worker_id
    del got  # the round holds what it needs, and frees it once aggregated
    return await answer_push(rt, result, step, worker_id, via, pull, timeout, since)


async def answer_push(rt, result, step: int, worker_id: str, via: str, pull: bool, timeout: float,
                      since: int | None = None, before_weights: Callable[[], Awaitable[None]] | None = None):
    """A push's answer: with ``pull``, the next weights once the pushed step's round closed (the status in a
    header; a delta from ``since`` when offered; ``before_weights`` awaited first); else, or when ``timeout``
    passes first, JSON ``{"status", "step", "done"}``."""
    core, via = rt.core, answer_via(rt.core, via)
    ready = lambda: core.done or (core.global_step > step and core.may_pull(worker_id))  # noqa: E731
    try:
        woke = pull and await rt.wait_for(ready, timeout, worker_id, first=via == "http")  # a body answer: first
    except REFUSALS:  # the worker left, or was expired, while its push waited
        if result.status not in (PushStatus.ACCEPTED, PushStatus.SKIPPED):
            raise
        woke = False  # its push counted (the round, or in async/ssp the model, takes it): say so, not a refusal
    if woke:
        if before_weights is not None:
            await before_weights()
        return await answer_weights(rt, via, {PUSH_STATUS_HEADER: result.status.value}, since)
    return {"status": result.status.value, "step": result.step, "done": core.done}


async def answer_weights(rt, via: str, headers: dict, since: int | None) -> Response:
    """The weights answer through ``via``, once no partitioned round is between partitions (an answer never mixes
    two steps), a hot standby holds them and, for a same-host one, the body answers went first."""
    core = rt.core
    while core.deciding:  # a partitioned round between partitions: its weights are of no one step until it closes
        await rt.wait_until(lambda: not core.deciding, rt.settings.pull_timeout_max_seconds)
    if rt.ha is not None:
        await rt.ha.replicated()  # a hot standby holds these weights before a worker sees them
    if via == "shm":
        await rt.body_answers_first()
    return rt.tensors.weights_response(via, headers, since)


def answer_via(core, via: str) -> str:
    """The transport weights go back through: in async/ssp always the body (the optimizer updates the same-host
    weights file in place at every push: a worker would read it torn)."""
    return via if core.modes is None else "http"


class ShmAttach(BaseModel):
    file: str = Field(max_length=64, description="Name of the worker's gradient file in the shared directory.")
    nonce: str = Field(max_length=64, description="The 16 bytes (hex) the worker wrote at the start of the file.")


@router.get("/shm", responses={409: {"description": "shm_unavailable (off) or not_initialized"}})
async def shm_offer(request: Request) -> dict:
    """The same-host transport: the weights file (name, nonce, layout) of this PS (docs/protocol.md)."""
    rt = runtime(request)
    rt.core.admit(None)  # 409 not_initialized
    return rt.tensors.shm.offer(rt.core.weights, rt.core.global_step)


@router.post("/workers/{worker_id}/shm", openapi_extra=json_body(ShmAttach))
async def shm_attach(worker_id: str, request: Request) -> dict:
    """Use the worker's gradient file for its pushes (409 shm_unavailable: not on this host; push over HTTP)."""
    rt = runtime(request)
    body = await read_json(request, ShmAttach)
    nonce = rt.tensors.shm.attach_fields(body.file, body.nonce)  # 400 bad_field: the body's form first
    if rt.shards is None or rt.shards.coordinator:  # a follower has no membership: any worker id may attach
        rt.core.members.active_member(worker_id)  # 404 unknown_worker, 409 not_active
    rt.tensors.shm.attach(worker_id, body.file, nonce)
    return {"worker_id": worker_id, "transport": "shm"}
