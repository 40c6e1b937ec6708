"""The PS's one tensor seam: every tensor that reaches the core, and every weights answer, passes here.

The push route calls :meth:`TensorSeam.push`, which reads the push and gives the core a request whose tensors are
*owned by the PS* (writable memory nothing else uses: a body's buffer, or a copy out of a same-host worker's file),
whatever carried the bytes (a shard's holds: :meth:`receive_push`; a model: :meth:`receive_model`); routes answer
pulls with :meth:`weights_response`. No route knows which transport carried a push: the seam says only which one to
answer through (``via``), so a same-host worker gets its weights through the file.

Transports (docs/protocol.md): ``http``, the tensors are the request body, one frame (:mod:`shared.frame`, read by
:mod:`ps_service.transport.body`); ``shm``, the body is a frame with no tensors and ``meta.shm_seq``, the tensors are
in the worker's gradient file (:mod:`ps_service.transport.shm`). With ``PS_COMPRESSION`` a body push's float32
gradients are compressed (:mod:`shared.compression`) and decoded here (422 ``compression_mismatch`` /
``bad_encoding``); a top-k push with finite values, or a 2-bit one, is finite by construction (not read for NaN/Inf
again). Weights go back as a float32 frame: the weights themselves, kept in that frame
(:class:`ps_service.core.model.WeightsStore`), or the same-host weights file (:meth:`TensorSeam._file_current`);
in a ``topk`` / ``2bit`` job (``PS_WEIGHT_DELTAS``) a body answer to a worker that holds the previous served step
(``since``) carries the tensors that changed in few entries as entries (:mod:`ps_service.transport.deltas`).
Whether tensors fit the model is the core's check, made on exactly the arrays it then applies.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from ps_service.transport.body import declared_length, read_body, read_prefix
from ps_service.core import PushResult
from ps_service.core.buffers import POOL
from ps_service.transport.deltas import WeightDeltas
from ps_service.transport.partitioned import Feed, Take, check_head
from ps_service.transport.streamed import Partitions
from ps_service.transport.shm import ShmHub
from shared import compression, frame, liveness
from shared.errors import ProtocolError, bad_request
from shared.protocol import (STEP_HEADER, ModelInit, PushRequest, parse_model_meta, parse_push_meta,
                             push_partitions)


#: a push's tensors from this size on are read in their turn (ps_service/core/intake.py); smaller ones at once
GATED_BYTES = 1 << 20
#: a body waiting for its turn has what the server holds of it taken this often: well within the clients' TCP user
#: timeout, which ends a connection whose peer keeps its window shut that long (shared/liveness.py)
TRICKLE_SECONDS = liveness.USER_TIMEOUT_SECONDS / 2.5
#: the runtime's wait for a push's turn (:meth:`ps_service.runtime.Runtime.turn`)
Turn = Callable[[str, int, float, bool], Awaitable[bool]]


class TensorSeam:
    def __init__(self, settings, core) -> None:
        self.settings = settings
        self.core = core
        self.shm = ShmHub(settings.shm_dir or None)
        #: the job's gradient compression (told to workers at registration, shown in /v1/status)
        self.compression = compression.Spec(settings.compression, settings.compression_topk_ratio,
                                            settings.compression_2bit_threshold, settings.compression_topk_warmup_steps)
        #: exact weight deltas for workers that hold the previous step (None: every body answer is dense)
        self.deltas = (WeightDeltas(self.compression.compresses) if settings.weight_deltas and settings.shards == 1
                       and self.compression.name in ("topk", "2bit") else None)
        #: (the weights dict, its changes in place) when the same-host file last got a copy
        self._mirrored: tuple | None = None
        #: the last step a dense body answer was made for (where the weights live: :meth:`_file_current`)
        self._body_step = -2
        self.bytes_in = 0
        self.bytes_out = 0
        #: form ("dense", "delta" or "shm") -> (key, the encoded answer)
        self._bodies: dict[str, tuple[tuple, bytes | memoryview]] = {}
        #: one large model upload read at a time (:meth:`receive_model`)
        self._model_reads = asyncio.Lock()
        #: step s + 1's weights as round s's partitions close (None: the job's rounds are not partitioned)
        self.partitions = Partitions(core) if settings.partition_bytes else None

    async def _body(self, request: Request, recurring: bool = True, turn: Turn | None = None,
                    claimed: list | None = None, progress: Feed | None = None) -> memoryview | bytearray:
        """The body (``progress``: :func:`read_body`'s). With ``turn``, a large body's frame header is read first, the
        rest once ``turn`` returns (its worker id appended to ``claimed``); a malformed meta: read at once, refused."""
        s = self.settings
        prefix = None
        if turn is not None and _length(request) >= GATED_BYTES:
            declared_length(request, s.max_body_bytes, frame.MEDIA_TYPE)  # refusals before any byte is read
            prefix = await read_prefix(request, _meta_needs, s.body_idle_timeout_seconds)
            meta = frame.peek_meta(prefix[0])
            who = (meta.get("worker_id"), meta.get("step")) if isinstance(meta, dict) else (None, None)
            if isinstance(who[0], str) and type(who[1]) is int:
                prefix = await self._claimed(who[0], self._body_turn(request, turn, who, prefix), claimed)
        return await read_body(request, s.max_body_bytes, frame.MEDIA_TYPE, s.body_idle_timeout_seconds, recurring,
                               prefix, progress)

    async def _claimed(self, worker_id: str, waiting: Awaitable, claimed: list):
        """What a push's wait for its turn returns once claimed (its id then in ``claimed``); else core.withdraw."""
        try:
            out = await waiting
        except BaseException:
            self.core.withdraw(worker_id)
            raise
        claimed.append(worker_id)
        return out

    async def _body_turn(self, request: Request, turn: Turn, who: tuple[str, int], prefix: tuple[bytearray, bool]
                         ) -> tuple[bytearray, bool]:
        """Wait for a body's turn (at most a lease), taking what the server holds of it every :data:`TRICKLE_SECONDS`
        (the sender's window opens before the TCP user timeout). What was read of the body."""
        got, ended = prefix
        times = max(1, math.ceil(self.settings.lease_seconds / TRICKLE_SECONDS))
        for i in range(times):
            if await turn(*who, TRICKLE_SECONDS, i == times - 1):
                break
            if not ended:  # one receive: whatever the server holds
                more, ended = await read_prefix(request, lambda _: 0, self.settings.body_idle_timeout_seconds)
                got += more
        return got, ended

    async def _file_turn(self, push: PushRequest, seq: int | None, turn: Turn | None, claimed: list) -> None:
        """A large same-host push's turn, once its body (no tensors) is read: its file is read after it."""
        if seq is not None and turn is not None and not claimed and self.shm.layout is not None \
                and self.shm.layout.data_bytes >= GATED_BYTES:
            await self._claimed(push.worker_id, turn(push.worker_id, push.step, self.settings.lease_seconds), claimed)

    async def push(self, request: Request, clock: Callable[[], float], turn: Turn | None = None,
                   after: Callable[[], None] | None = None) -> tuple[PushResult, PushRequest, str]:
        """A worker's push read and given to the core at ``clock()``: (the core's result, the push, the transport to
        answer through); one core call, or, with partitioned rounds, one per partition (its frames, or a push of one
        frame cut into them: :mod:`ps_service.transport.partitioned`), each followed by ``after()`` (the body read
        goes on after it). ``turn``: a large push's tensors are read only once it returns."""
        claimed: list[str] = []
        try:
            feed = Feed(self.core, clock, self.compression, after=after) if self.settings.partition_bytes else None
            push, seq, f = await self._push_frame(request, turn, claimed, feed)
            await self._file_turn(push, seq, turn, claimed)
            via = "http" if seq is None else "shm"
            if f is None:  # its frames went to the core as they came
                result = feed.result()
            else:
                if feed is None and _count(f.meta) > 1:  # several frames to a job without partitions: refused
                    check_head(self.core, push, seq, f.meta, _count(f.meta), self.compression)
                if seq is not None or self.compression.name != "none" or "compression" in f.meta:
                    push = self._tensors(push, seq, f)  # (a nil compression decodes as none)
                plan = None if feed is None else self.core.partitions
                if plan is None:
                    result = self.core.push(push, clock())
                else:
                    feed.whole(push, plan)
                    result = feed.result()
        finally:
            for worker_id in claimed:
                self.core.release(worker_id)
        self.shm.last_transport[push.worker_id] = via  # monitoring: how its tensors travel
        return result, push, via

    async def receive_parts(self, request: Request, take: Take, plan, clock: Callable[[], float]
                            ) -> tuple[PushRequest, object]:
        """A sharded follower's hold with partitioned rounds (sharding/parts.py): its frames given to ``take`` as
        they arrive (no member checks), or one frame of its pieces whole cut by ``plan``; (its head's push, the head's
        status). In the body only, uncompressed (400 ``bad_field``)."""
        feed = Feed(self.core, clock, take=take, members=False)
        push, seq, f = await self._push_frame(request, feed=feed)
        if f is not None:
            if seq is not None or f.meta.get("compression") not in (None, "none"):
                raise bad_request("bad_field", "a hold of a job with partitioned rounds carries its pieces in its "
                                               "body, uncompressed")
            feed.whole(push, plan)
        return push, feed.status

    async def receive_push(self, request: Request, members: bool = True, turn: Turn | None = None
                           ) -> tuple[PushRequest, str]:
        """A shard's held pieces (ps_service/sharding): the push, and its transport; 404/409 for a worker that must
        register (``members`` False: no membership check, a follower). ``turn``: as :meth:`push`'s."""
        claimed: list[str] = []
        try:
            push, seq, f = await self._push_frame(request, turn, claimed)
            self.core.admit(push.worker_id if members else None)  # no core.push follows a hold: the core's refusals
            if _count(f.meta) > 1:
                raise bad_request("bad_field", "a shard's hold is one frame (partitions: a PS_SHARDS=1 job's)")
            await self._file_turn(push, seq, turn, claimed)
            return self._tensors(push, seq, f, admitted=True), "http" if seq is None else "shm"
        finally:
            for worker_id in claimed:
                self.core.release(worker_id)

    async def _push_frame(self, request: Request, turn: Turn | None = None, claimed: list | None = None,
                          feed: Feed | None = None) -> tuple[PushRequest, int | None, frame.Frame | None]:
        """(the push of the body's first frame, its ``shm_seq``, that frame: None when ``feed`` took the body's
        frames), the body counted in :attr:`bytes_in` if it carries the tensors. ``feed``: a partitioned push's frames
        go to it as they arrive, or once the body is read (chunked)."""
        self.drop_body()  # its buffer may serve this push's body (bounds the PS's memory)
        body = await self._body(request, turn=turn, claimed=claimed, progress=feed)
        if feed is not None and feed.count is None:  # not seen as it came (chunked): fed whole
            feed(body, len(body))
        if feed is not None and feed.partitioned:
            feed.finish(len(body))
            push, seq, f = feed.push, None, None
        else:
            f = frame.decode(body, exact=False)
            count = _count(f.meta)
            if count > 1:
                frame.decode_following(body, count)  # (a job without partitions: refused, each frame checked first)
            elif f.data_start + f.layout.data_bytes != len(body):
                frame.decode(body)  # refused as one frame, as ever
            push, seq = parse_push_meta(f.meta, f.tensors)
        if seq is None:
            self.bytes_in += len(body)
        return push, seq, f

    def _tensors(self, push: PushRequest, seq: int | None, f: frame.Frame, admitted: bool = False) -> PushRequest:
        """The push with the arrays the core takes: decoded, or copied out of the worker's same-host file. When the
        transport refuses it, the core's refusals are asked for first (``admitted``: the caller had them made)."""
        declared = f.meta.get("compression")
        try:
            if seq is None:
                # decoded, and known finite (top-k values, 2-bit) or not
                tensors, checked = compression.decode_push(self.compression, declared, f.tensors,
                                                           self.core.weights or {}, POOL.array)
            else:
                if declared not in (None, "none"):  # same-host pushes are never compressed
                    compression.check_declared(self.compression, declared, via_body=False)
                if f.tensors:
                    raise bad_request("bad_field", "a push with shm_seq carries no tensors in its body")
                tensors, checked = self.shm.gradients(push.worker_id, seq)
        except ProtocolError:
            if not admitted:
                self.core.admit(push.worker_id)  # docs/protocol.md's order: the core's refusals first
            raise
        return replace(push, tensors=tensors, finite_checked=checked)

    async def receive_model(self, request: Request) -> ModelInit:
        """A model's upload: a large one read one at a time, none once the model is in (409 before its body)."""
        if _length(request) < GATED_BYTES:
            body = await self._body(request, recurring=False)  # once a job: its buffer is not kept
        else:
            declared_length(request, self.settings.max_body_bytes, frame.MEDIA_TYPE)  # 415, 413 first
            async with self._model_reads:
                self.core.refuse_init()
                body = await self._body(request, recurring=False)
        self.bytes_in += len(body)
        f = frame.decode(body)
        return parse_model_meta(f.meta, f.tensors)

    def via(self, shm: bool) -> str:
        """The transport a pull answers through: the file when asked for and offered, else the body."""
        return "shm" if shm and self.shm.weights_name is not None else "http"

    def weights_response(self, via: str, headers: dict | None = None, since: int | None = None) -> Response:
        """The current weights: a frame of them (the same bytes for every worker of a step), or, same-host, a frame
        with no tensors. ``since``: the step whose weights the worker holds (a delta when offered, else dense)."""
        if via == "shm":
            self._file_current()
        body = self._weights_frame(since, via == "shm")
        if via != "shm":
            self.bytes_out += len(body)
        return Response(body, media_type=frame.MEDIA_TYPE,
                        headers={STEP_HEADER: str(self.core.global_step), **(headers or {})})

    def file_behind(self) -> bool:
        """The next same-host answer copies the weights into the file first (:meth:`_file_current`)."""
        weights = self.core.weights
        return (self.shm.weights_name is not None and not self.shm.holds(weights)
                and self._mark(weights) != self._mirrored)

    def _mark(self, weights: dict) -> tuple:
        """What names the weights' values: the dict (a restore makes a new one) and its changes in place so far."""
        return id(weights), self.core.store.changes

    def _file_current(self) -> None:
        """Make the same-host weights file hold the current weights. In a job that also answers over HTTP, the
        weights live in the body answers' frame and the file gets a copy once per step, at its first same-host answer
        (the body answers go first: ps_service.runtime); the file takes them back once no body answer was made for
        this step or the one before."""
        core, hub = self.core, self.shm
        if not hub.holds(core.weights):
            mark = self._mark(core.weights)
            if mark != self._mirrored:
                hub.mirror(core.weights, core.global_step)
                self._mirrored = mark
            if self._body_step < core.global_step - 1:
                hub.adopt(core.weights, copy=False)
        hub.published(core.global_step)

    def _weights_frame(self, since: int | None, shm: bool = False) -> bytes | memoryview:
        """The weights' frame (dense, a delta from ``since``, or ``shm``: a frame with no tensors, the weights in the
        same-host file), each form encoded once per (step, membership)."""
        core, deltas = self.core, self.deltas
        # the open round's ranks, else (async/ssp, or no round) the active members': a cached sorted tuple
        head = {"step": core.global_step, "done": core.done, "ranks": core.ranks()}
        key = (head["step"], head["done"], tuple(head["ranks"]), core.optimizer.iterations)
        if shm:  # the same small frame for every same-host worker of a step
            return self._encoded("shm", key, {**head, "shm": True}, {})
        if deltas is not None:
            deltas.observe(core.global_step, core.optimizer.iterations, core.weights, core.optimizer.touched)
            head["lineage"] = deltas.lineage
            if deltas.offers(since):
                try:
                    delta = {**head, "since": deltas.base, "sparse": sorted(deltas.changes)}
                    return self._encoded("delta", key, delta, {**core.weights, **deltas.changes})
                except ValueError:  # thousands of long names: the header would pass its limit; dense then
                    pass
        return self._encoded("dense", key, head, core.weights)

    def _encoded(self, form: str, key: tuple, head: dict, tensors: dict) -> bytes | memoryview:
        if form == "dense":
            # the core's weights dict itself, moved out of the same-host file if there (see _file_current)
            claim = self.shm.holds(tensors)
            body = self.core.store.answer(tensors, key, head, claim=claim)
            if claim:  # the file keeps the values the frame now has
                self._mirrored = self._mark(tensors)
            if body is not None:
                self._body_step = self.core.global_step
                return body
        cached = self._bodies.get(form)
        if cached is not None and cached[0] == key:
            return cached[1]
        self._bodies.pop(form, None)  # the old buffer goes back to the pool once no answer sends it
        layout = frame.Layout.of(tensors, sorted(tensors))
        view = POOL.take(frame.frame_bytes(layout, head))
        frame.write_into(view, tensors, head, layout)
        self._bodies[form] = (key, view)
        return view

    def drop_body(self) -> None:
        """Forget the encoded weights (a push is coming in, its round re-encodes them)."""
        self._bodies.clear()

    def close(self) -> None:
        self.shm.close()


def _length(request: Request) -> int:
    """The body's Content-Length when it is plainly one (else 0: :func:`read_body` judges it)."""
    length = request.headers.get("content-length", "")
    return int(length) if length.isascii() and length.isdigit() else 0


def _count(meta: dict) -> int:
    """The frames of a push body, by its head's meta (:func:`push_partitions`, called only when it says)."""
    return 1 if meta.get("partitions") is None else push_partitions(meta)


def _meta_needs(got: bytearray) -> int:
    """The bytes of a body :func:`frame.peek_meta` needs to read its frame's meta (0: it has them, or never will)."""
    need = frame.peek_meta(got)
    return need if isinstance(need, int) else 0

