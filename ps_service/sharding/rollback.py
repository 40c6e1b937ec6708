"""The coordinator's live rollback of a sharded PS when a follower restarted (docs/protocol-shards.md).

A follower killed and started again comes back from its newest checkpoint: maybe behind the coordinator, and
always without the pieces held for the open round. The job goes on from the newest step every shard has a
checkpoint of (or is at), without restarting anything else. :func:`roll_back` (one at a time; :class:`ShardRole`
starts it when :attr:`.links.Links.on_restart` reports a restart), in this order: registration refused (503
``shards_inconsistent``, ``shard.blocked`` and ``shard.last_rollback`` in ``/v1/status`` say why) and the links
stopped (applies in flight abandoned); the coordinator out of the job (every member expired, no round open) and a
new hold receipt key (:mod:`.receipts`); each follower's state asked until it answers; each follower sent back to the
common step (``POST /v1/shard/restore``), then the coordinator itself
(:meth:`~ps_service.core.ParameterServerCore.rewind`); checkpoints of later steps deleted on every shard; the links
started again and registration opened (one WARNING line; ``shard.rollbacks``, ``ps_shard_rollbacks_total``). No
common step, or a follower refusing: registration stays refused, saying what the operator must do; nothing mixes steps.
"""
from __future__ import annotations

import asyncio
import logging

from ps_service.sharding.links import common_step
from ps_service.sharding.receipts import new_key

log = logging.getLogger("ps_service")


async def _states(role) -> dict[int, dict]:
    """Each follower's ``GET /v1/shard/state`` answer, asked again until it answers (the reason says who is awaited)."""
    links, out = role.links, {}
    for f in links.followers:
        while f.index not in out:
            try:
                resp = await links.ask(f, "GET", "/shard/state")
                if resp.status_code == 200:
                    out[f.index] = resp.json()
                    continue
                why = f"{resp.status_code} {resp.text[:200]}"
            except TimeoutError as exc:
                why = str(exc)
            links.blocked = f"rolling back: waiting for shard {f.index}'s state ({why})"
            await asyncio.sleep(1.0)
    return out


async def roll_back(role, why: str) -> None:
    """Roll the job back live (the module's contract); any failure leaves registration refused, saying why (in
    ``shard.blocked`` and ``shard.last_rollback``)."""
    was = role.core.global_step
    try:
        await _roll_back(role, why, was)
    except Exception as exc:
        _failed(role, was, f"{why}; the rollback failed ({type(exc).__name__}: {exc}): restart every shard from "
                           "checkpoints of one step", exc_info=True)


def _failed(role, was: int, reason: str, exc_info: bool = False) -> None:
    """Registration stays refused with ``reason``; ``last_rollback`` says the rollback from step ``was`` failed."""
    role.links.blocked = reason
    role.last_rollback = f"from step {was}: failed, registration refused: {reason}"
    log.error("%s", reason, exc_info=exc_info)


async def _roll_back(role, why: str, was: int) -> None:
    links, core, rt = role.links, role.core, role.rt
    role.rollbacks += 1
    role.last_rollback = f"from step {was}: under way: {why}"
    links.blocked = f"rolling back to the newest checkpoint every shard has: {why}"
    log.info("%s: rolling the job back (registration refused meanwhile)", why)
    await links.stop()  # no apply of an abandoned round reaches a restored follower
    await role.go_back(core.model_state(), rt.now())  # the job stops here: every worker out, no round open
    role.receipt_key = new_key()  # no receipt of the abandoned steps is good again (every member is out)
    states = await _states(role)
    step = common_step(set(role.checkpoint_steps()) | {was}, states)
    if step is None:
        _failed(role, was, f"{why}, and no step is in every shard's checkpoints (the coordinator is at step {was}; "
                           + "; ".join(f"shard {i} at {st.get('step')}, checkpoints {st.get('checkpoints')}"
                                       for i, st in states.items())
                           + "): set PS_CHECKPOINT_DIR on every shard, or restart every shard from checkpoints of one "
                             "step, or all fresh")
        return
    for f in links.followers:
        resp = await links.ask(f, "POST", "/shard/restore", json=role.restore_body(step))
        if resp.status_code != 200:
            _failed(role, was, f"{why}; rolling back to step {step}, shard {f.index} refused: {resp.status_code} "
                               f"{resp.text[:300]}: restart every shard from checkpoints of step {step}")
            return
        f.step, f.boot = step, resp.json().get("boot", f.boot)
    state = await asyncio.to_thread(role.step_state, step)
    await role.go_back(state, rt.now())
    links.start()
    role.last_rollback = f"from step {was} to step {step}: {why}"
    links.blocked = None
    log.warning("rolled the job back from step %d to step %d, the newest checkpoint every shard has (%s); workers "
                "register again and redo %d round(s)", was, step, why, was - step)
