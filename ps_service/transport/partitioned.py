"""A partitioned push, given to its taker frame by frame (docs/protocol-partitions.md).

Contract: in a job with ``PS_PARTITION_BYTES`` > 0 the seam reads a push body with a :class:`Feed` as its
``progress`` (:func:`ps_service.transport.body.read_body`). Once the body's first frame header is in, the feed knows
whether the push is partitioned (``partitions`` > 1 in the head's meta); if not it does nothing. If so, each frame is
decoded as soon as its last byte is in (:class:`shared.frame.FrameReader`) and given at once, the last one once the
body has ended with it (bytes after it refuse the push first): the head first, as the push (its status, counts, the
round's rule; :func:`check_head`'s refusals before it: nothing changed then), then frame q as
``PushRequest(partition=q)``, each frame's tensors first decoded against its partition's pieces when the job
compresses. A frame refused after its head (its meta, its layout, its encoding, its values) ends the read with that
refusal; the frames given before it stand (the round waits for the rest from that worker until it sends the push
again, leaves or its lease ends). A body the feed did not see arrive (chunked) is fed whole once read, the same way.
A push of one frame is cut into its partitions by the PS (:meth:`Feed.whole`) and given the same way, frame by frame.
:meth:`Feed.finish` checks the body's end once it is all in; :meth:`Feed.result` is the push's: the head's status,
the global step after the last frame. Who takes the frames is the feed's ``take`` (the core's round; on a sharded PS's
follower, its partitions: :mod:`ps_service.sharding.parts`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import numpy as np

from ps_service.core import PushResult
from ps_service.core.buffers import POOL
from shared import compression, frame, marks
from shared.errors import ProtocolError, bad_request, unprocessable
from shared.protocol import PushRequest, check_partition_meta, parse_push_meta, push_partitions


#: bytes past a frame's start its header is looked for at (then its end is known: the feed asks to be woken there)
HEADER_BYTES = 4096

#: a frame's taker: (the frame's push: the head's, or partition q's with ``partition=q``; now) -> its status
Take = Callable[[PushRequest, float], object]


def check_head(core, push: PushRequest, seq: int | None, meta: dict, count: int, spec: compression.Spec | None,
               members: bool = True) -> None:
    """A push of ``count`` > 1 frames: its tensors in its body (400 ``bad_field``), compressed as the job's (422
    ``compression_mismatch``; ``spec`` None: uncompressed, 400 ``bad_field``), as many frames as the job's rounds have
    partitions (422 ``tensor_mismatch``); the core's refusals first (docs/protocol.md's order; ``members`` False: a
    sharded PS's follower, which knows no workers)."""
    try:
        if seq is not None:
            raise bad_request("bad_field", "a partitioned push carries its tensors in its body")
        if spec is not None:
            compression.check_declared(spec, meta.get("compression"), via_body=True)
        elif meta.get("compression") not in (None, "none"):
            raise bad_request("bad_field", "a partitioned hold carries its pieces uncompressed")
        plan = core.partitions
        want = 1 if plan is None else plan.count
        if count != want:  # (before the model: the core's not_initialized first)
            raise unprocessable("tensor_mismatch", f"a push of {count} partitions: this job's rounds have {want} "
                                f"(PS_PARTITION_BYTES {core.partition_bytes})")
    except ProtocolError:
        core.admit(push.worker_id if members else None)
        raise


class Feed:
    def __init__(self, core, clock: Callable[[], float], spec: compression.Spec | None = None,
                 take: Take | None = None, members: bool = True, after: Callable[[], None] | None = None) -> None:
        """``spec``: the job's compression, each frame decoded against its partition's pieces (None: frames taken as
        they are, a follower's); ``take``: who takes each frame (default: the core's round; a sharded PS's follower:
        :func:`ps_service.sharding.parts.frame`); ``members`` False: the head names no member (a follower);
        ``after``: called after each frame taken (what the core told, delivered before the read goes on)."""
        self.core, self.clock, self.spec, self.members, self.after = core, clock, spec, members, after
        self.take = take or (lambda req, now: core.push(req, now).status)
        self.reader = frame.FrameReader()
        #: the body's frames (None: its head is not in yet; 1: not partitioned, the feed does nothing)
        self.count: int | None = None
        self.push: PushRequest | None = None
        self.frames: list[frame.Frame] = []
        #: the head's status (what :attr:`take` answered for it)
        self.status = None
        self._before = 0
        self._last: frame.Frame | None = None

    @property
    def partitioned(self) -> bool:
        return bool(self.count and self.count > 1)

    def __call__(self, buf: memoryview, got: int) -> int | None:
        """Take the frames ``buf[:got]`` completes; the byte count to be called at next: the next frame's end (its
        header's, ``HEADER_BYTES`` on, while that is not in), so each frame is taken as soon as its last byte is in
        (None: the body's end will do; not partitioned, or only the last frame left)."""
        if self.count is None:
            meta = frame.peek_meta(buf[:got])
            if isinstance(meta, int):
                return None  # its header is not all in yet
            self.count = 1 if meta is None else push_partitions(meta)  # None: not a frame, refused once read
        if self.count > 1:
            if marks.ON:
                marks.mark("body.wake", body=id(self), got=got)
            for f in self.reader.feed(buf, got, self.count):
                if len(self.frames) < self.count - 1:  # the last waits for the body's end (:meth:`finish`)
                    self._frame(f)
                else:
                    self._last = f
            if self.reader.count < self.count - 1:
                end = self.reader.next_end(buf, got)
                return end if end is not None else max(got, frame.aligned(self.reader.end)) + HEADER_BYTES
        return None

    def _frame(self, f: frame.Frame) -> None:
        q = len(self.frames)
        self.frames.append(f)
        if marks.ON:
            marks.mark("frame.in", body=id(self), q=q, end=self.reader.end,
                       **({"worker": f.meta.get("worker_id"), "step": f.meta.get("step")} if q == 0 else {}))
        declared = self.frames[0].meta.get("compression")  # (the head's: every frame's encoding)
        if q == 0:
            push, seq = parse_push_meta(f.meta, f.tensors)
            check_head(self.core, push, seq, f.meta, self.count, self.spec, self.members)
            try:
                tensors, checked = self._decoded(0, push.tensors, declared)
            except ProtocolError:
                self.core.admit(push.worker_id if self.members else None)  # the core's refusals first
                raise
            return self._head(replace(push, tensors=tensors, finite_checked=checked))
        check_partition_meta(f.meta, q)
        self._take(q, *self._decoded(q, f.tensors, declared))

    def _decoded(self, q: int, tensors: Mapping[str, np.ndarray], declared) -> tuple[Mapping, bool]:
        """Partition ``q``'s frame's tensors as the core takes them, and whether known finite: decoded against the
        partition's pieces when the job compresses; else as they are (a job without partitions: the core refuses)."""
        core, spec = self.core, self.spec
        p = core.partitions
        if spec is None or not spec.on or p is None:
            return tensors, False
        return compression.decode_push(spec, declared, tensors, p.split(core.weights, q), POOL.array)

    def _head(self, push: PushRequest) -> None:
        self.push, self._before = push, self.core.global_step
        self.status = self._give(push)

    def _take(self, q: int, tensors: Mapping, checked: bool) -> None:
        push = self.push
        self._give(PushRequest(push.worker_id, push.step, tensors, finite_checked=checked, partition=q))

    def _give(self, req: PushRequest) -> object:
        """``req`` to the taker now; then ``after()``, whatever happened."""
        try:
            return self.take(req, self.clock())
        finally:
            if self.after is not None:
                self.after()

    def whole(self, push: PushRequest, plan) -> None:
        """A push of one frame (its tensors as the core takes them: decoded, or copied out of a same-host file), cut
        by ``plan`` into its partitions and given as a partitioned push's frames (422 ``tensor_mismatch`` unless it
        holds every model tensor, of its dtype and shape: partition 0 alone would pass for a head)."""
        core, weights = self.core, self.core.weights
        if len(push.tensors) != len(weights) or not all((w := weights.get(k)) is not None and t.dtype == w.dtype
                                                        and t.shape == w.shape for k, t in push.tensors.items()):
            core.admit(push.worker_id if self.members else None)
            raise unprocessable("tensor_mismatch", "a push of one frame carries every model tensor, of its dtype "
                                f"and shape (this job's rounds have {plan.count} partitions)")
        whole = {k: compression.dense(t) for k, t in push.tensors.items()}
        self._head(replace(push, tensors=plan.split(whole, 0)))
        for q in range(1, plan.count):
            self._take(q, plan.split(whole, q), push.finite_checked)

    def finish(self, total: int) -> None:
        """The body is all in (``total`` bytes): it must end with its last frame (400 ``bad_frame``), which then goes
        to the core (a well-formed body's last frame ends with it: no wait)."""
        self.reader.finish(total, self.count)
        self._frame(self._last)

    def result(self) -> PushResult:
        """The push's result: the head's status, the global step after its last frame."""
        return PushResult(self.status, self.core.global_step, self.core.global_step != self._before)
