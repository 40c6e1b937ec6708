"""The model's weights store: the weights kept inside the frame their answers carry (a weights answer over TCP
copies nothing). Memory only, no I/O: the core writes to it (``ModelState.before_change``), the transports read
answers out of it (``TensorSeam``); it calls nobody.

Without it each new step's weights would be copied into a snapshot frame (one model-sized copy per step, on the
round's critical path: ~6 % of the PS's CPU at 1e6 parameters, docs/performance.md), because the optimizer changes
the weights in place while an answer may still be sending the old ones. Here the weights *are* that frame's tensors:
:class:`WeightsStore` moves the core's arrays into one frame buffer (as the same-host weights file does,
:mod:`ps_service.transport.shm`), the optimizer updates them there, and an answer is a view of the buffer with
the step's header rewritten in place.

Contract, the one rule that keeps every answer's bytes fixed once it is handed to the server:
- :meth:`answer` gives each answer its own ``memoryview`` of :attr:`_answer`, so the view's reference count
  (against the count it had when no answer existed, measured then) counts the answers not yet written out (the
  server, uvloop's write queue, holds its view until the kernel has every byte);
- :meth:`before_change` (the model's hook, called before the weights change in place: an optimizer step, a
  rewind) moves the weights to a fresh buffer first whenever an answer still holds the current one (copy on
  write: the old buffer stays, unchanged, with those answers, and goes back to the buffer pool after them,
  :mod:`ps_service.core.buffers`); a new header is written in place only under the same rule, else into a
  fresh buffer too.
In a synchronous job every worker of the round has read its answer before it can push the next step, so the
step's change finds no answer in flight and copies nothing; a pull that is slow to read (a monitor, a worker not
in the round, async/ssp pushes that change the weights at every push) costs one copy, as before.

:meth:`answer` gives None when the weights cannot live here: not this store's and not plain arrays the PS owns;
the seam copies them into a snapshot then. The same-host weights file's arrays are not plain, but the seam
``claim``s them: a job that answers over HTTP too keeps its weights here, and the file gets a copy per step
(``TensorSeam._file_current``).
"""
from __future__ import annotations

import sys
from typing import Any, Hashable

import numpy as np

from ps_service.core.buffers import POOL
from shared import frame


class WeightsStore:
    def __init__(self) -> None:
        self._buf: np.ndarray | None = None      # the frame's storage
        self._answer: np.ndarray | None = None   # the view every answer's memoryview is made from (its count)
        self._idle_refs = 0                      # its reference count with no answer alive
        self._layout: frame.Layout | None = None
        self._data_start = 0
        self._key: Hashable = None
        self._dict: dict[str, np.ndarray] | None = None  # the core's weights dict, holding ...
        self._views: dict[str, np.ndarray] = {}          # ... these arrays of the frame
        #: weights moved into a fresh frame (the first answer, a new layout, or copy on write): monitoring, tests
        self.moves = 0
        #: changes of the weights in place so far (:meth:`before_change`): what names their values, with the dict
        self.changes = 0

    def holds(self, weights: dict[str, np.ndarray] | None) -> bool:
        """The core's weights are this frame's arrays (a restore replaces the dict, the same-host file its arrays)."""
        if weights is None or weights is not self._dict or not self._views:
            return False
        first = next(iter(self._views))
        return weights.get(first) is self._views[first] and len(weights) == len(self._views)

    def in_flight(self) -> bool:
        """An answer still holds the frame (a memoryview of :attr:`_answer` is alive)."""
        return self._answer is not None and sys.getrefcount(self._answer) > self._idle_refs

    def answer(self, weights: dict[str, np.ndarray], key: Hashable, head: dict[str, Any],
               claim: bool = False) -> memoryview | None:
        """A frame of ``weights`` with ``head`` (``key`` names the head: the same key, the same bytes), moving the
        weights in first; None when they live elsewhere (see the module's contract). ``claim``: move them in even
        from elsewhere (the same-host file, whose arrays the caller knows they are: it keeps a copy from then on)."""
        if not self.holds(weights):
            if not (claim or _movable(weights)):
                self._forget()
                return None
            self._move(weights, head)
        elif key != self._key:
            prefix = frame.header(self._layout, head)
            if len(prefix) == self._data_start and not self.in_flight():
                self._answer[:len(prefix)] = np.frombuffer(prefix, np.uint8)
            else:
                self._move(weights, head)
        self._key = key
        return memoryview(self._answer)

    def before_change(self) -> None:
        """The weights are about to change in place: out of the frame first if an answer still sends it."""
        self.changes += 1
        if self._answer is None:
            return
        if not self.holds(self._dict):  # they live elsewhere now (a restore, the same-host file): let the frame go
            self._forget()
        elif self.in_flight():
            buf = _fresh(self._buf.nbytes)
            np.copyto(buf, self._buf)
            self._adopt(buf, self._dict)

    def _move(self, weights: dict[str, np.ndarray], head: dict[str, Any]) -> None:
        layout = frame.Layout.of(weights, sorted(weights))
        buf = _fresh(frame.frame_bytes(layout, head))  # the weights' own memory from now on
        frame.write_into(memoryview(buf), weights, head, layout)
        self._layout, self._data_start = layout, buf.nbytes - layout.data_bytes
        self._adopt(buf, weights)

    def _adopt(self, buf: np.ndarray, weights: dict[str, np.ndarray]) -> None:
        views = self._layout.views(buf[self._data_start:])
        for name, view in views.items():
            weights[name] = view  # the optimizer updates the frame from now on
        self._buf, self._answer, self._dict, self._views = buf, buf[:], weights, views
        self._idle_refs = sys.getrefcount(self._answer)  # measured, not assumed: the count is CPython's detail
        self.moves += 1

    def _forget(self) -> None:
        self._buf = self._answer = self._layout = self._dict = self._key = None
        self._views = {}


def _fresh(n: int) -> np.ndarray:
    """``n`` bytes nothing else uses, from the pool: the frame a move leaves serves a body once its answers are out."""
    return np.frombuffer(POOL.take(n), np.uint8)


def _movable(weights: dict[str, np.ndarray]) -> bool:
    """Plain arrays of the PS's own (owning their memory): not views of a file or of another buffer."""
    return bool(weights) and all(isinstance(a, np.ndarray) and a.base is None for a in weights.values())
