"""A partitioned push, given to the core frame by frame as its body arrives (docs/protocol-partitions.md).

Contract: in a job with ``PS_PARTITION_BYTES`` > 0 the seam reads a push body with a :class:`Feed` as its
``progress`` (:func:`ps_service.transport.body.read_body`). Once the body's first frame header is in, the feed knows
whether the push is partitioned (``partitions`` > 1 in the head's meta); if not it does nothing (the seam takes the
push whole, as at 0). If so, each frame is decoded as soon as its last byte is in (:class:`shared.frame.FrameReader`)
and given to the core at once, the last one once the body has ended with it (bytes after it refuse the push first):
the head first, as the push (its status, counts, the round's rule; :func:`check_head`'s refusals before it: nothing
changed then), then frame q as ``PushRequest(partition=q)``, each frame's tensors first decoded against its partition's
pieces when the job compresses (the seam's :data:`Decode`). A frame refused after its head (its meta, its layout,
its encoding, its values) ends the read with that refusal; the frames given before it stand (the round waits for the rest from
that worker until it sends the push again, leaves or its lease ends). :meth:`Feed.finish` checks the body's end
once it is all in; :meth:`Feed.result` is the push's: the head's status, the global step after the last frame. A
body read without ``progress`` (chunked) is taken whole: the seam checks it with :func:`check_head` and gives the
core its frames in the same order. Who takes the frames is the feed's ``take`` (the core's round; on a sharded PS's
follower, its partitions: :mod:`ps_service.sharding.parts`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

import numpy as np

from ps_service.core import PushResult
from shared import compression, frame, marks
from shared.errors import ProtocolError, bad_request, unprocessable
from shared.protocol import PushRequest, check_partition_meta, parse_push_meta, push_partitions


#: bytes past a frame's start its header is looked for at (then its end is known: the feed asks to be woken there)
HEADER_BYTES = 4096

#: a partition frame's tensors as the core takes them: (partition q, its tensors, the encoding its head declared) ->
#: (the tensors decoded against partition q's pieces, whether known finite): the seam's
Decode = Callable[[int, Mapping[str, np.ndarray], Any], tuple[Mapping[str, Any], bool]]


def check_head(core, partition_bytes: int, push: PushRequest, seq: int | None, meta: dict, count: int,
               spec: compression.Spec | None, members: bool = True) -> None:
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
        if core.weights is not None and count != want:
            raise unprocessable("tensor_mismatch", f"a push of {count} partitions: this job's rounds have {want} "
                                f"(PS_PARTITION_BYTES {partition_bytes})")
    except ProtocolError:
        core.admit(push.worker_id if members else None)
        raise


def decoded_head(core, push: PushRequest, decode: Decode, meta: dict) -> PushRequest:
    """The head's push with partition 0's tensors decoded (:data:`Decode`); a refusal after the core's (docs/protocol.md's
    order), nothing changed."""
    try:
        tensors, checked = decode(0, push.tensors, meta.get("compression"))
    except ProtocolError:
        core.admit(push.worker_id)
        raise
    return replace(push, tensors=tensors, finite_checked=checked)


#: a frame's taker: (the frame's push: the head's, or partition q's with ``partition=q``; now) -> its status
Take = Callable[[PushRequest, float], object]


def to_core(core) -> Take:
    """The default taker: the core's partitioned round."""
    return lambda req, now: core.push(req, now).status


class Feed:
    def __init__(self, core, partition_bytes: int, clock: Callable[[], float], spec: compression.Spec | None = None,
                 decode: Decode | None = None, take: Take | None = None, members: bool = True) -> None:
        """``spec``/``decode``: the job's compression and the seam's decoder (None: frames taken as they are, a
        follower's); ``take``: who takes each frame (default :func:`to_core`; a sharded PS's follower:
        :func:`ps_service.sharding.parts.frame`); ``members`` False: the head names no member (a follower)."""
        self.core, self.partition_bytes, self.clock = core, partition_bytes, clock
        self.spec, self.decode = spec, decode
        self.take, self.members = take or to_core(core), members
        self.reader = frame.FrameReader()
        #: the body's frames (None: its head is not in yet; 1: not partitioned, the feed does nothing)
        self.count: int | None = None
        self.push: PushRequest | None = None
        self.frames: list[frame.Frame] = []
        self._status = None
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
                    self._give(f)
                else:
                    self._last = f
            if self.reader.count < self.count - 1:
                end = self.reader.next_end(buf, got)
                return end if end is not None else max(got, frame.aligned(self.reader.end)) + HEADER_BYTES
        return None

    def _give(self, f: frame.Frame) -> None:
        core, q = self.core, len(self.frames)
        self.frames.append(f)
        if marks.ON:
            marks.mark("frame.in", body=id(self), q=q, end=self.reader.end,
                       **({"worker": f.meta.get("worker_id"), "step": f.meta.get("step")} if q == 0 else {}))
        if q == 0:
            push, seq = parse_push_meta(f.meta, f.tensors)
            check_head(core, self.partition_bytes, push, seq, f.meta, self.count, self.spec, self.members)
            if self.decode is not None:
                push = decoded_head(core, push, self.decode, f.meta)
            self.push, self._before = push, core.global_step
            self._status = self.take(push, self.clock())
            return
        check_partition_meta(f.meta, q)
        tensors, checked = (f.tensors, False) if self.decode is None else self.decode(q, f.tensors, self.push_encoding)
        self.take(PushRequest(self.push.worker_id, self.push.step, tensors, finite_checked=checked, partition=q),
                  self.clock())

    @property
    def push_encoding(self) -> str | None:
        """The encoding the head declared (every frame's)."""
        return self.frames[0].meta.get("compression")

    def finish(self, total: int) -> None:
        """The body is all in (``total`` bytes): it must end with its last frame (400 ``bad_frame``), which then goes
        to the core (a well-formed body's last frame ends with it: no wait)."""
        self.reader.finish(total, self.count)
        self._give(self._last)

    @property
    def status(self):
        """The head's status (what :attr:`take` answered for it)."""
        return self._status

    def result(self) -> PushResult:
        """The push's result: the head's status, the global step after its last frame."""
        return PushResult(self._status, self.core.global_step, self.core.global_step != self._before)
