"""The routes of a sharded PS (docs/protocol-shards.md: each one, its body and its answers), mounted only when
``PS_SHARDS`` > 1: the workers' ``GET /v1/shards``, ``POST /v1/shard/gradients`` (a hold) and ``/commit``; the
coordinator's to a follower ``PUT /v1/shard/model``, ``POST /v1/shard/apply``, ``/progress``, ``/lost``, ``/restore``;
``GET /v1/shard/state``. Thin drivers, as :mod:`ps_service.api`: every barrier decision is the core's.
"""
from __future__ import annotations

from dataclasses import replace
from inspect import isawaitable
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request
from pydantic import AfterValidator, BaseModel, Field

from ps_service import api
from ps_service.http import JSON_BODY_LIMIT, JsonInt, json_body, parse_json
from ps_service.runtime import runtime
from ps_service.sharding import parts, receipts
from ps_service.core.checks import validate
from ps_service.sharding.holds import Held, passed
from ps_service.transport.body import read_body
from shared import frame
from shared.errors import ProtocolError, unprocessable, bad_request
from shared.protocol import API, FRAME_BODY, JSON, MAX_INT, PushStatus, parse_push_meta

router = APIRouter(prefix=API, tags=["shards"])
#: a follower's apply names every contributor: room for thousands of workers
APPLY_BODY_LIMIT = 1 << 22
#: how long a commit's weights answer waits at most for the followers' applies to be written (Links.sent)
APPLY_FIRST_SECONDS = 1.0


def _role(request: Request, coordinator: bool | None = None):
    rt = runtime(request)
    if coordinator is not None:
        rt.shards.need(coordinator)
    return rt, rt.shards


@router.get("/shards")
async def shards(request: Request, timeout: float = Query(0.0, ge=0, allow_inf_nan=False, description=(
        "Wait at most this long for the model to be initialised (the map exists from then on)."))) -> dict:
    """The coordinator's shard URLs and map (``map`` null until the model is initialised)."""
    rt, role = _role(request, coordinator=True)
    core = rt.core
    await rt.wait_for(lambda: core.initialized and role.map is not None, timeout)
    return {"shards": role.count, "urls": role.urls, "split_elements": role.split_elements,
            "map": None if role.map is None else role.map.to_wire()}


@router.post("/shard/gradients", openapi_extra=FRAME_BODY)
async def hold(request: Request, map: str = Query(..., max_length=64, description=(
        "The digest of the worker's shard map (GET /v1/shards): 409 shard_map_mismatch if not this shard's."))) -> dict:
    """Hold this worker's pieces for ``step`` (checked as a push is; nothing counted until the commit); a follower
    answers with its receipt of the hold, which the commit carries."""
    rt, role = _role(request)
    rt.core.admit(None)  # 409 not_initialized
    if map != role.digest:
        raise ProtocolError(409, "shard_map_mismatch", f"shard {role.index}'s map is {role.digest}, the push's "
                                                       f"{map}: fetch GET /v1/shards again")
    if role.partitioned:
        return await _hold_parts(request, rt, role)
    # a large hold is read in its turn, in rank order: the coordinator's core's (ps_service/core/intake.py: the holds of
    # the members its round awaits next), a follower's as the coordinator tells it (.turns); a follower has no members
    try:
        push, via = await rt.tensors.receive_push(request, members=role.coordinator,
                                                  turn=rt.turn if role.coordinator else role.turn)
    finally:
        if not role.coordinator and role.holds.late:
            role.gate.wake()  # a late hold waiting for the one being read may go now
    step, g = push.step, rt.core.global_step
    if step > g and role.coordinator:  # never held: a hold outlives nothing but its own round
        raise unprocessable("future_step", f"step {step} is ahead of shard {role.index}'s global step {g}")
    over = passed(g, step)  # a step ahead of a follower: 409 shard_behind (the worker registers again)
    validate(rt.core.weights, push.tensors, "reject", check_finite=not push.finite_checked)  # before any change
    answer = {"status": "late", "step": step, "shard": role.index, "global_step": g}
    # late: its round is over here, nothing to keep (the commit says late or stale); or, fixed R, the coordinator's hold
    # is the push's head, one after R heads is late there, and on every follower told so
    if over or not (rt.run_guarded(lambda: rt.core.hold(push.worker_id, step)) if role.coordinator
                    else not role.holds.late_for(push.worker_id, step)):
        return answer
    answer["status"] = "held"
    if not role.coordinator:  # 409 shard_behind before anything is kept, if it has no key (it restarted)
        answer["receipt"] = receipts.receipt(role.receipt_key, role.index, push.worker_id, step)
    if not role.holds.summed(push.worker_id, step):  # (summed: a retry of a hold whose pieces are in the sum)
        role.holds.put(push.worker_id, Held(step, push.tensors, via))
    rt.tensors.shm.last_transport[push.worker_id] = via
    return answer


async def _hold_parts(request: Request, rt, role) -> dict:
    """A follower's hold, partitioned rounds: its frames go to its partitions as they arrive (:mod:`.parts`)."""
    if role.coordinator:
        raise ProtocolError(409, "sharded", "partitioned rounds: push the coordinator's pieces (POST /v1/gradients)")
    core = rt.core
    try:
        push, status = await rt.tensors.receive_parts(request, lambda req, now: parts.frame(
            core, req.worker_id, req.step, req.partition, req.tensors, now), core.plan, rt.now)
    finally:
        rt.notify()
    return {"status": "held" if status == "duplicate" else status, "step": push.step, "shard": role.index,
            "global_step": core.global_step, "done": core.done}


@router.post("/shard/commit", openapi_extra=FRAME_BODY)
async def commit(request: Request, pull: bool = Query(False), timeout: float = Query(30.0, ge=0, allow_inf_nan=False)):
    """Count the push of (worker, step) whose pieces every shard holds (the coordinator's hold, and each follower's
    receipt in ``receipts``): answered as ``POST /v1/gradients``."""
    rt, role = _role(request, coordinator=True)
    if role.partitioned:
        raise ProtocolError(409, "sharded", "partitioned rounds have no commit: push the coordinator's pieces "
                                            "(POST /v1/gradients), hold each follower's (POST /v1/shard/gradients)")
    f = frame.decode(await read_body(request, JSON_BODY_LIMIT, frame.MEDIA_TYPE, rt.settings.body_idle_timeout_seconds))
    got = f.meta.pop("receipts", None)
    if got is not None and not (isinstance(got, list) and len(got) == role.count - 1
                                and all(r is None or isinstance(r, str) for r in got)):
        raise bad_request("bad_field", f"receipts must be a list of {role.count - 1} receipts (a string, or null for "
                                       "a shard that answered late), one per follower in shard order")
    push, seq = parse_push_meta(f.meta)
    if f.tensors or seq is not None:
        raise bad_request("bad_field", "a commit is a frame with no tensors and no shm_seq (its pieces are held by "
                                       "every shard)")
    if f.meta.get("compression") not in (None, "none"):
        raise bad_request("bad_field", "a commit has no compression field (the holds carried the pieces)")
    core = rt.core
    core.admit(None)  # 409 not_initialized
    m = core.members.get(push.worker_id)  # 404 unknown_worker
    held = role.holds.get(push.worker_id, push.step)
    # what is held matters only for a push the core would count (not a retry: duplicate; late; stale)
    if m.active and core.round is not None and push.step == core.global_step \
            and core.classify(m, push.step, True) is PushStatus.ACCEPTED:
        if held is None:
            raise ProtocolError(409, "not_held", f"no pieces of step {push.step} held here: push them to every "
                                                 "shard (POST /v1/shard/gradients) before the commit")
        receipts.check(role.receipt_key, role.count, push.worker_id, push.step, got)  # every follower holds them
    if held is None:
        # the core only classifies it (never accepted: checked above): zeros of the model's layout, no memory
        tensors, via = {k: np.broadcast_to(np.zeros((), w.dtype), w.shape) for k, w in core.weights.items()}, "http"
    else:
        tensors, via = held.tensors, held.via
    # held pieces were checked for NaN/Inf when held, into memory of the shard's own (zeros are finite): not again
    result = rt.run_guarded(lambda: core.push(replace(push, tensors=tensors, finite_checked=True), rt.now()))
    tensors = held = None  # the round holds what it needs, and frees it once aggregated
    role.holds.discard(push.worker_id, push.step)
    rt.tensors.shm.last_transport[push.worker_id] = via
    # the followers' applies of the rounds these weights come from leave before the weights (links.sent)
    before = lambda: role.links.sent(core.global_step - 1, APPLY_FIRST_SECONDS)  # noqa: E731
    return await api.answer_push(rt, result, push.step, push.worker_id, via, pull, timeout, before_weights=before)


@router.put("/shard/model", openapi_extra=FRAME_BODY)
async def init_pieces(request: Request) -> dict:
    """Coordinator -> follower: this follower's pieces of the model, the optimizer spec and the map."""
    rt, role = _role(request, coordinator=False)
    s = rt.settings
    f = frame.decode(await read_body(request, s.max_body_bytes, frame.MEDIA_TYPE, s.body_idle_timeout_seconds,
                                     recurring=False))  # once a job: its buffer is not kept
    return rt.run_guarded(lambda: role.init_follower(f, rt.now()))


#: an integer of a coordinator's message: :data:`~shared.protocol.MAX_INT` at most (a JSON ``true`` is not one)
Count = Annotated[JsonInt, Field(ge=0, le=MAX_INT)]


def _in_sum_order(keys: list[tuple[int, str]]) -> list[tuple[int, str]]:
    if any(b <= a for a, b in zip(keys, keys[1:])) or len({w for _, w in keys}) < len(keys):
        raise ValueError("keys not in sum order ((rank, worker_id) increasing), or a worker named twice")
    return keys


#: (rank, worker_id) keys of a round's sum, in sum order, each worker at most once
Keys = Annotated[list[tuple[Count, str]], AfterValidator(_in_sum_order)]


class ApplyRound(BaseModel):
    step: Count
    contributors: Keys = Field(description="(rank, worker_id) of the contributors, in sum order.")
    mean_of: Annotated[JsonInt, Field(ge=1, le=MAX_INT)]
    lost: list[str] = Field(default_factory=list, description="Partitioned rounds: contributors lost before it.")


async def _told(request: Request, model: type[BaseModel], answered: str | None, act, limit: int = APPLY_BODY_LIMIT,
                initialized: bool = True) -> dict:
    """A coordinator's message to this follower: its JSON body parsed as ``model``, 409 ``not_initialized`` (unless not
    ``initialized``), ``act(role, message, now)`` (a coroutine awaited), the holds waiting for their turn woken;
    answered ``{"step", <answered>: what act returned, "boot"}`` (``answered`` None: ``{"step", "boot"}``)."""
    rt, role = _role(request, coordinator=False)
    msg = parse_json(await read_body(request, limit, JSON, rt.settings.body_idle_timeout_seconds), model)
    if initialized:
        rt.core.admit(None)
    try:
        done = act(role, msg, rt.now())
        done = await done if isawaitable(done) else done
    finally:
        rt.notify()
        role.gate.wake()
    return {"step": rt.core.global_step, **({} if answered is None else {answered: done}), "boot": role.boot}


@router.post("/shard/apply", openapi_extra=json_body(ApplyRound))
async def apply(request: Request) -> dict:
    """Coordinator -> follower: apply round ``step`` with these contributors (partitioned rounds: its decision)."""
    return await _told(request, ApplyRound, "applied", lambda role, m, now: role.apply(
        m.step, m.contributors, m.mean_of, m.lost, now))


class Progress(BaseModel):
    step: Count
    start: Count = Field(description="The index of the first key of ``folded`` in the round's summed prefix.")
    folded: Keys = Field(description="(rank, worker_id) summed since the last message, in order.")
    turns: list[str] | None = Field(description="Whose pushes the round awaits next (null: any, no order).")
    late: list[str] = Field(default_factory=list, description="Workers whose pushes the round will not take (fixed R).")
    back: list[str] = Field(default_factory=list, description="Workers named late whom the round takes again.")


@router.post("/shard/progress", openapi_extra=json_body(Progress))
async def progress(request: Request) -> dict:
    """Coordinator -> follower: the open round summed these keys and awaits these workers next (a repeat: skipped)."""
    return await _told(request, Progress, "summed", lambda role, m, now: role.holds.progress(
        role.core.global_step, m.step, m.start, m.folded, m.turns, m.late, m.back))


class Lost(BaseModel):
    step: Count
    workers: list[str] = Field(description="Contributors of the decided round that will bring no more frames of it.")


@router.post("/shard/lost", openapi_extra=json_body(Lost))
async def lost(request: Request) -> dict:
    """Coordinator -> follower (partitioned rounds): these contributors of round ``step`` are lost mid-round."""
    return await _told(request, Lost, "dropped", lambda role, m, now: parts.drop(role.core, m.step, m.workers, now))


@router.get("/shard/state")
async def state(request: Request) -> dict:
    """This shard: index, count, whether it holds a model, its step, map digest, checkpoint steps and boot id."""
    rt, role = _role(request)
    return {"index": role.index, "shards": role.count, "initialized": rt.core.initialized,
            "step": rt.core.global_step, "digest": role.digest, "checkpoints": role.checkpoint_steps(),
            "boot": role.boot}


class RestoreStep(BaseModel):
    step: Count
    receipt_key: str = Field(pattern="^[0-9a-f]{64}$", description="The coordinator's hold receipt key, 64 hex digits.")


@router.post("/shard/restore", openapi_extra=json_body(RestoreStep))
async def restore(request: Request) -> dict:
    """Coordinator -> follower: go back live to your checkpoint of ``step`` (the step the coordinator chose)."""
    return await _told(request, RestoreStep, None, lambda role, m, now: role.restore_step(
        m.step, bytes.fromhex(m.receipt_key), now), JSON_BODY_LIMIT, initialized=False)
