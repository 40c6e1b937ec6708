"""The open round's order, coordinator -> followers: what keeps a follower's memory flat in the worker count.
A follower knows no membership; the coordinator's round knows who contributes and in what order. Contract:

- :class:`Tracker` (the coordinator): after every change of its core, the message a folding follower needs when the
  open round moved (``POST /v1/shard/progress``), else None; O(1) when nothing moved, each summed key and each late
  member sent once. With fixed R, ``turns`` names only members whose head came, so a follower never reads a push the
  round may not take.
- :class:`Gate`: a bounded wait for a condition, looked at again at each ``wake``. A follower's hold of the open round
  waits in one unread until :meth:`~ps_service.sharding.holds.Holds.may_read` lets it, at most its transport's
  patience (a lease), then is read out of turn (``overdue``). A late hold is read one at a time
  (:meth:`~ps_service.core.intake.Intake.claim`, ``late``) and kept nowhere.

Only followers whose pieces weigh :data:`FOLD_BYTES` or more get these messages and gate their holds (both sides
decide from the shard map). Held beyond the bound: pieces never committed (until the round's apply), a hold read out
of turn.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from ps_service.transport import GATED_BYTES

#: a follower whose pieces weigh this much or more sums as told and reads holds in their turn
FOLD_BYTES = GATED_BYTES


class Tracker:
    def __init__(self) -> None:
        self.reset()

    def reset(self, step: int = -1) -> None:
        """Nothing sent of round ``step`` (-1: a new job state, start or rollback)."""
        self._step, self._sent, self._turns, self._late, self._back = step, 0, (), 0, 0

    def message(self, core) -> dict | None:
        g, r = core.global_step, core.round
        if r is None or r.step != g:
            folded, turns, late, back, lost = (), None, (), (), ()
        else:
            folded, turns, late, back, lost = r.acc.folded, r.turns(), r.refused, r.back, r.lost
            if r.replicas is not None:  # fixed R: a member yet to push may still come after R heads (late)
                turns = tuple(w for w in turns if w in r.heads)
        if g != self._step:
            self.reset(g)
        elif len(folded) == self._sent and turns == self._turns and len(late) == self._late \
                and len(back) == self._back:
            return None
        msg = {"step": g, "start": self._sent, "folded": [list(k) for k in folded[self._sent:]],
               "turns": None if turns is None else list(turns), "late": list(late[self._late:]),
               "back": [w for w in back[self._back:] if w not in lost]}  # (late again since: it stays late)
        self._sent, self._turns, self._late, self._back = len(folded), turns, len(late), len(back)
        return msg


class Gate:
    def __init__(self) -> None:
        self._moved = asyncio.Event()
        self.overdue = 0  # holds read out of turn, having waited their patience

    def wake(self) -> None:
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def wait(self, may: Callable[[], bool], seconds: float, last: bool) -> bool:
        """True once ``may()``; after ``seconds``, False, or (``last``) True, out of turn."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not may():
            left = end - loop.time()
            if left <= 0:
                self.overdue += last
                return last
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True
