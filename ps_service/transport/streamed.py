"""A pull answered partition by partition (docs/protocol-partitions.md, Pull: the frames and their layout).

Contract: with partitioned rounds (``PS_PARTITION_BYTES`` > 0) the core calls :meth:`Partitions.closed` (its
``on_partition`` hook) after every call that closed partitions. While round s is decided and its partitions still
close, :attr:`Partitions.current` is step s + 1's :class:`StepFrames`: each partition's frame of the weights is
encoded (copied once into memory of its own) as soon as the partition closed, so an answer in flight sends bytes no
later round changes; the last one waits for the round's close (its meta names the next round's ``ranks`` and
``done``). A pull may send a :class:`StepFrames` while it fills, each frame once encoded (:meth:`StepFrames.has`).
Without partitions :meth:`closed` is not installed.
"""
from __future__ import annotations

from shared import frame, marks


class StepFrames:
    """The frames of step ``step``'s weights, partition by partition (None: not closed yet)."""

    def __init__(self, step: int, count: int) -> None:
        self.step, self.count = step, count
        self.frames: list[memoryview | None] = [None] * count

    def has(self, q: int) -> bool:
        return self.frames[q] is not None

    @property
    def complete(self) -> bool:
        return all(f is not None for f in self.frames)


class Partitions:
    def __init__(self, core) -> None:
        self.core = core
        #: the frames of the step whose round is closing (or closed last), None before the first decision
        self.current: StepFrames | None = None
        #: pulls answered partition by partition so far
        self.answered = 0

    def streamable(self, min_step: int) -> StepFrames | None:
        """The frames a pull of ``min_step`` may be answered with, partition by partition (None: round
        ``min_step - 1`` is not decided and closing: the pull waits, or is answered whole)."""
        core, cur = self.core, self.current
        if core.deciding and core.global_step + 1 == min_step and cur is not None and cur.step == min_step:
            return cur
        return None

    def answer(self, min_step: int) -> StepFrames:
        """The frames a pull of ``min_step`` is answered with now (:meth:`streamable` said so); counted."""
        self.answered += 1
        return self.streamable(min_step)

    def closed(self) -> None:
        """The core's hook: encode each partition of the open round that closed since; when the round closed (the
        step advanced), the partitions left, the last with the next round's ranks."""
        core = self.core
        plan = core.partitions
        if plan is None:
            return
        if core.deciding:
            step = core.global_step + 1
            if self.current is None or self.current.step != step:
                self.current = StepFrames(step, plan.count)
            qs = sorted(core.parts.closed)  # (partition 0 closed with the decision, or (a follower) later)
            last = False
        else:
            cur = self.current
            if cur is None or cur.step != core.global_step or cur.complete:
                return  # (a round decided and closed in one call: no pull was answered from it)
            qs, last = range(plan.count), True
        cur = self.current
        for q in qs:
            if cur.frames[q] is None and (last or q != plan.count - 1):
                if marks.ON:
                    marks.mark("part.close", q=q, step=cur.step - 1)
                cur.frames[q] = self._encode(plan, q, cur.step)

    def _encode(self, plan, q: int, step: int) -> memoryview:
        """Partition ``q``'s frame of the weights, written once into memory of its own (zeroed: the bytes up to the
        next frame's start included)."""
        core, count = self.core, plan.count
        if q == 0:
            meta = {"step": step, "partitions": count}
        elif q == count - 1:
            meta = {"partition": q, "done": core.done, "ranks": list(core.ranks())}
        else:
            meta = {"partition": q}
        tensors = plan.split(core.weights, q)
        layout = frame.Layout.of(tensors)
        n = frame.frame_bytes(layout, meta)
        buf = memoryview(bytearray(n if q == count - 1 else frame.aligned(n)))  # (pooled: no gain, docs/performance.md)
        frame.write_into(buf, tensors, meta, layout)
        return buf
