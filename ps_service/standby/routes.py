"""The routes of a hot-standby pair, ``/v1/ha`` (docs/protocol-standby.md: who may call each, the answers); app.py
mounts them only when ``PS_ROLE`` is set. Thin drivers of :class:`ps_service.standby.Pair`.
"""
from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.background import BackgroundTask

from ps_service.auth import from_peer
from ps_service.http import JSON_BODY_LIMIT, JsonInt, parse_json
from ps_service.runtime import runtime
from ps_service.standby import messages
from ps_service.transport.body import read_body
from shared import frame
from shared.protocol import API, FRAME_BODY, JSON, MAX_INT

router = APIRouter(prefix=f"{API}/ha", tags=["standby"])
Count = Annotated[int, Query(ge=0, le=MAX_INT)]


@router.get("")
async def info(request: Request, digest: bool = Query(False, description=(
        "Add `digest`: sha256 of the step, the optimizer's iterations, weights and slots (two PS holding the same "
        "bits have the same one; reads the whole model)."))) -> dict:
    """This PS's role, term, the primary's messages it took, its step and boot id, what replication cost it (its log's
    advert only to its peer when ``PS_PEER_TOKEN`` is set: a worker's token does not learn it)."""
    ha = runtime(request).ha
    answer = ha.answer() if from_peer(request) else {**ha.answer(), "log": None}
    return {**answer, "costs": ha.costs, **({"digest": ha.digest()} if digest else {})}


@router.put("/state", openapi_extra=FRAME_BODY)
async def state(request: Request, term: Count, seq: Count) -> dict:
    """Primary -> standby: the whole state (a checkpoint file's bytes), every step up to message ``seq`` in it."""
    rt = runtime(request)
    s = rt.settings
    body = await read_body(request, s.max_body_bytes, frame.MEDIA_TYPE, s.body_idle_timeout_seconds, recurring=False)
    got = await asyncio.to_thread(messages.decode_state, body)
    return rt.run_guarded(lambda: rt.ha.adopt(term, seq, got, len(body), rt.now()))


@router.post("/steps", openapi_extra=FRAME_BODY)
async def steps(request: Request, term: Count, seq: Count, gated: bool = Query(False, description=(
        "The primary waits for this standby's acknowledgements: it may take over."))) -> JSONResponse:
    """Primary -> standby: take message ``seq`` (one step's input, or the membership), its step applied once this
    answer (its acknowledgement) went out; a repeat is answered."""
    rt = runtime(request)
    s = rt.settings
    rt.run_guarded(lambda: rt.ha.reader.drain(rt.now()))  # the records of the log before it (a message over HTTP)
    rt.ha.from_primary(term, seq, rt.now())  # refusals before the body is read
    t = time.perf_counter()
    body = await read_body(request, s.max_body_bytes, frame.MEDIA_TYPE, s.body_idle_timeout_seconds)
    rt.ha.costs["read_s"] += time.perf_counter() - t
    answer = rt.run_guarded(lambda: rt.ha.apply(term, seq, gated, body, rt.now()))
    return JSONResponse(answer, background=BackgroundTask(_settle, rt))


async def _settle(rt) -> None:
    """The step just acknowledged, applied (a coroutine function: on the event loop, as every core call)."""
    rt.run_guarded(rt.ha.settle)


@router.post("/ping")
async def ping(request: Request, term: Count, seq: Count, gated: bool = Query(False)) -> dict:
    """Primary -> standby, idle: it is alive and has had message ``seq`` acknowledged."""
    rt = runtime(request)
    return rt.ha.ping(term, seq, gated, rt.now())


class Vote(BaseModel):
    term: Annotated[JsonInt, Field(ge=1, le=MAX_INT)]  # `true` or "2" is no term: 400
    name: str = Field(min_length=1, max_length=128)


@router.post("/vote", openapi_extra={"requestBody": {"required": True,
                                                      "content": {JSON: {"schema": Vote.model_json_schema()}}}})
async def vote(request: Request) -> dict:
    """A worker's vote for this PS in the election of ``term`` (a worker votes once per term)."""
    rt = runtime(request)
    v = parse_json(await read_body(request, JSON_BODY_LIMIT, JSON, rt.settings.body_idle_timeout_seconds), Vote)
    return rt.run_guarded(lambda: rt.ha.vote(v.term, v.name))
