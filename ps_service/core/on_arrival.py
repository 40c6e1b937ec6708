"""The push path of ``PS_MODE=async|ssp``: each accepted gradient is applied when it arrives. Pure, no I/O.

:class:`ps_service.core.ParameterServerCore` calls these after its common checks (model initialised, member active,
no future step, the gradient's layout); :class:`ps_service.core.staleness.BoundedStaleness` (``core.modes``) decides.
Contract:

- :func:`classify`: refuses a push before the start (``not_started``), before any state changes; then the machine
  classifies (``duplicate``, ``skipped``, ``stale``, ``accepted``). Once the job is done a push is ``stale``.
- :func:`take`: an ``accepted`` gradient is one optimizer step, counted in ``gradients_applied``, its examples and
  loss recorded; ``accepted`` and ``skipped`` move ``global_step`` by one. No round is ever open in these modes.
- :func:`wait_reason`: what the job waits for, for humans (the SSP wait names the stragglers).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ps_service.core.membership import Member
from ps_service.core.staleness import Verdict
from shared import compression
from ps_service.core.errors import CoreError
from shared.protocol import PushRequest, PushStatus


def classify(core, m: Member, req: PushRequest, finite: bool, now: float) -> tuple[Verdict, Mapping[str, np.ndarray]]:
    """The machine's verdict on a push whose layout is valid, and the gradient the PS owns (dense)."""
    if not core.started:
        raise CoreError("not_started", "training has not started (waiting for workers)")
    grads = {k: compression.dense(g) for k, g in req.tensors.items()}
    modes = core.modes
    if core.done:
        return Verdict(PushStatus.STALE, core.global_step - req.step, modes.workers[m.worker_id].clock), grads
    return modes.push(m.worker_id, req.step, core.global_step, finite, now), grads


def take(core, req: PushRequest, v: Verdict, grads: Mapping[str, np.ndarray]) -> None:
    """Do what the verdict says: one optimizer step with ``grads`` (consumed) if it applies, after
    ``core.replica.on_step``; ``global_step += 1`` if it advances."""
    if v.advances and core.replica is not None:
        core.replica.on_step(grads if v.applies else None, 1, int(v.applies))
    if v.applies:
        core.update(grads, consume=True)
        core.gradients_applied += 1
        core.examples += req.num_examples or 0
        if req.loss is not None:
            core.loss_history.append((core.global_step, req.loss))
    if v.advances:
        core.global_step += 1


def wait_reason(core, now: float) -> str:
    """Async: no barrier. SSP: the first blocked worker, the clock it needs and the stragglers holding it."""
    modes = core.modes
    if not core.members.active_by_id and not core.done:  # every worker gone: nothing will move until one comes
        return (f"{'async' if modes.bound is None else 'ssp'}: no active worker (of {len(core.members.by_id)} "
                "registered): training resumes when one registers")
    if modes.bound is None:
        return "async: no barrier, each gradient is applied when it arrives"
    name = lambda w: core.members.by_id[w].name if w in core.members.by_id else w  # noqa: E731
    for wid in core.members.active_by_id:
        w = modes.wait(wid, now)
        if w is not None:
            held = ", ".join(f"{name(s)} at {w.slowest} for {secs:.1f} s" for s, secs in w.stragglers)
            return f"ssp: {name(wid)} at clock {w.clock} waits for clock >= {w.needs}: {held}"
    return f"ssp: no worker waits (clocks {modes.floor}..{modes.fastest}, bound s={modes.bound})"
