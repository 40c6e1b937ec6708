"""The coordinator brings every shard to one step (docs/protocol-shards.md). :func:`check_start`: after it restored
step g, a follower at g or with a checkpoint of g restores g (``POST /v1/shard/restore``, with the receipt key); any
other keeps registration refused (503 ``shards_inconsistent``; ``shard.blocked`` names the newest common step).
:func:`roll_back` (one at a time, on :attr:`.links.Links.on_restart`): a restarted follower comes back from its newest
checkpoint, without the pieces held for the open round. In order: registration refused (``shard.blocked`` and
``shard.last_rollback`` say why), the links stopped, the coordinator out of the job (every member expired, no round
open) with a new receipt key (:mod:`.receipts`); each follower's state asked until it answers; each follower, then the
coordinator (:meth:`~ps_service.core.ParameterServerCore.rewind`), sent back to the newest step every shard has a
checkpoint of (or is at), later checkpoints deleted; links and registration open again (a WARNING line,
``shard.rollbacks``). No common step, or a follower refusing: registration stays refused, saying what to do.
"""
from __future__ import annotations

import asyncio
import logging

from ps_service.sharding.receipts import new_key

log = logging.getLogger("ps_service")


def common_step(own: set[int], states: dict[int, dict]) -> int | None:
    """The newest step every shard can go back to (``own``: the coordinator's; ``states``: each follower's
    ``GET /v1/shard/state`` answer): a checkpoint of it, or (a follower) being at it now."""
    common = set(own)
    for st in states.values():
        common &= set(st.get("checkpoints") or []) | ({st["step"]} if st.get("initialized") else set())
    return max(common, default=None)


async def _bring(role, pick, patient: bool) -> tuple[int | None, dict[int, dict], list[str]]:
    """Each follower's state asked (once, or with ``patient`` again every second until it answers, registration
    refused meanwhile saying so), the step ``pick(states)`` chosen, and each follower at it or with a checkpoint of it
    sent back to it (``POST /v1/shard/restore``, the receipt key): that step, the states, and what went wrong."""
    links, states, bad = role.links, {}, []
    for f in links.followers:
        while f.index not in states:
            try:
                states[f.index] = (await links.ask(f, "GET", "/shard/state"))[0]
            except (TimeoutError, ValueError) as exc:
                if not patient:
                    bad.append(f"shard {f.index} did not answer ({exc})")
                    break
                links.blocked = f"rolling back: waiting for shard {f.index}'s state ({exc})"
                await asyncio.sleep(1.0)
    step = pick(states)
    for f in [f for f in links.followers if step is not None and f.index in states]:
        was = f.step
        if was != step and step not in (states[f.index].get("checkpoints") or []):
            bad.append(f"shard {f.index} is at step {'none (no model)' if was is None else was}")
            continue
        try:
            await links.ask(f, "POST", "/shard/restore", json={"step": step, "receipt_key": role.receipt_key.hex()})
        except ValueError as exc:
            bad.append(f"shard {f.index} refused to restore step {step}: {exc}")
            continue
        if was != step:
            log.warning("shard %d was at step %s: it restored step %d", f.index, was, step)
    return step, states, bad


async def check_start(role) -> None:
    """Start-up after the coordinator restored its step (the module's contract); registration waits meanwhile."""
    links, step = role.links, role.core.global_step
    _, states, bad = await _bring(role, lambda states: step, patient=False)
    links.blocked = None
    if bad:
        newest = common_step(set(role.checkpoint_steps()) | {step}, states)
        links.blocked = (f"the coordinator restored step {step} but {'; '.join(bad)}: restore every shard from a "
                         f"checkpoint of the same step (the newest every shard has: {newest}), or start them all fresh")
        log.error("%s", links.blocked)


async def roll_back(role, why: str) -> None:
    """Roll the job back live (the module's contract); any failure leaves registration refused, saying why (in
    ``shard.blocked`` and ``shard.last_rollback``)."""
    links, core, rt, was = role.links, role.core, role.rt, role.core.global_step
    try:
        role.rollbacks += 1
        role.last_rollback = f"from step {was}: under way: {why}"
        links.blocked = f"rolling back to the newest checkpoint every shard has: {why}"
        log.info("%s: rolling the job back (registration refused meanwhile)", why)
        await links.stop()  # no apply of an abandoned round reaches a restored follower
        await role.go_back(core.model_state(), rt.now())  # the job stops here: every worker out, no round open
        role.receipt_key = new_key()  # no receipt of the abandoned steps is good again (every member is out)
        step, states, bad = await _bring(role, lambda states: common_step(set(role.checkpoint_steps()) | {was}, states),
                                         patient=True)
        if step is None:
            return _failed(role, was, f"{why}, and no step is in every shard's checkpoints (the coordinator is at step "
                                      f"{was}; " + "; ".join(f"shard {i} at {st.get('step')}, checkpoints "
                                                             f"{st.get('checkpoints')}" for i, st in states.items())
                           + "): set PS_CHECKPOINT_DIR on every shard, or restart every shard from checkpoints of one "
                             "step, or all fresh")
        if bad:
            return _failed(role, was, f"{why}; rolling back to step {step}, {bad[0]}: restart every shard from "
                                      f"checkpoints of step {step}")
        await role.go_back(await asyncio.to_thread(role.step_state, step), rt.now())
        links.start()
        role.last_rollback = f"from step {was} to step {step}: {why}"
        links.blocked = None
        log.warning("rolled the job back from step %d to step %d, the newest checkpoint every shard has (%s); workers "
                    "register again and redo %d round(s)", was, step, why, was - step)
    except Exception as exc:
        _failed(role, was, f"{why}; the rollback failed ({type(exc).__name__}: {exc}): restart every shard from "
                           "checkpoints of one step", exc_info=True)


def _failed(role, was: int, reason: str, exc_info: bool = False) -> None:
    """Registration stays refused with ``reason``; ``last_rollback`` says the rollback from step ``was`` failed."""
    role.links.blocked = reason
    role.last_rollback = f"from step {was}: failed, registration refused: {reason}"
    log.error("%s", reason, exc_info=exc_info)
