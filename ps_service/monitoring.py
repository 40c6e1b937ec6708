"""Monitoring routes (JSON): status, workers, rounds, loss curve, liveness and readiness.

Read-only views of the core; the response shapes (and their documentation in ``/docs``) are
:mod:`ps_service.monitoring_models`. Routes are ``async``: they read the core on the event loop, never during a push.
"""
from __future__ import annotations

from itertools import islice, takewhile
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ps_service.core import ParameterServerCore
from ps_service.http import DecimalInt
from ps_service.core.membership import ACTIVE, EXPIRED, LEFT
from ps_service.monitoring_models import (EVENTS_SHOWN, ROUNDS_KEPT, Blocked, Contributor, LossCurve, PushCounts,
                                         RoundRecord as RoundModel, Rounds, Status, StragglerWait, Worker,
                                         WorkerStaleness, Workers)
from ps_service.core.rounds import Arrival, RoundRecord
from ps_service.runtime import Runtime, runtime
from shared.errors import ProtocolError
from shared.protocol import API

router = APIRouter(tags=["monitoring"])  # app.py attaches auth.require_monitor
health = APIRouter(tags=["health"])  # always open: orchestrators probe it

LOSS_AVERAGE_ROUNDS = 20
STRAGGLER_WINDOW_ROUNDS = 100
PUSH_KINDS = tuple(PushCounts.model_fields)  # accepted, stale, late, duplicate, skipped


def wall(rt: Runtime, t: float) -> float:
    """A core (monotonic) time as Unix seconds."""
    return rt.started_wall + (t - rt.started_mono)


def awaited(core) -> tuple[str, ...]:
    """The ids of the members the open round waits for, in rank order: once decided (partitioned rounds), its
    contributors owing a later partition's frame; else those yet to push."""
    if core.round is None:
        return ()
    return core.parts.awaiting() if core.deciding else core.progress().awaited


def current_round(rt: Runtime) -> dict | None:
    core, r = rt.core, rt.core.round
    if r is None:
        return None
    name = {w: core.members.by_id[w].name for w in r.eligible}
    p = core.progress()
    return {
        "step": r.step, "opened_at": wall(rt, r.opened_at), "open_for_seconds": rt.now() - r.opened_at,
        "eligible": [name[w] for w in sorted(r.eligible, key=r.key) if r.counts(w)],
        "pushed_by": [a.name for a in r.arrivals],
        "awaited": [name[w] for w in awaited(core)],
        "late": [a.name for a in r.late],
        "still_needed": p.needed,
        "unreachable": p.unreachable,
    }


def arrivals_view(entries: tuple[Arrival, ...] | list[Arrival], opened_at: float) -> list[Contributor]:
    """Each arrival, its place (1: first) and its time after the round opened."""
    return [Contributor(order=i, name=a.name, rank=a.rank, worker_id=a.worker_id, after_seconds=a.at - opened_at)
            for i, a in enumerate(entries, 1)]


def round_record(rt: Runtime, rec: RoundRecord) -> RoundModel:
    """A closed round's answer: its times as Unix seconds, its arrivals as :func:`arrivals_view`."""
    return RoundModel(
        step=rec.step, opened_at=wall(rt, rec.opened_at), closed_at=wall(rt, rec.closed_at),
        duration_seconds=rec.duration, reason=rec.reason, aggregated=rec.aggregated, eligible=rec.eligible,
        contributors=arrivals_view(rec.contributors, rec.opened_at), late=arrivals_view(rec.late, rec.opened_at),
        skipped=arrivals_view(rec.skipped, rec.opened_at), missing=list(rec.missing), straggler=rec.straggler,
        loss=rec.loss, examples=rec.examples, replicas_to_aggregate=rec.replicas_to_aggregate)


def straggler_totals(records: list[RoundRecord]) -> list[dict]:
    """Per straggler name over ``records``: rounds and seconds it cost; most costly first."""
    totals: dict[str, dict] = {}
    for rec in records:
        s = rec.straggler
        if s is not None:
            t = totals.setdefault(s.name, {"name": s.name, "rounds": 0, "waited_seconds": 0.0})
            t["rounds"] += 1
            t["waited_seconds"] += s.waited_seconds
    return sorted(totals.values(), key=lambda t: (-t["waited_seconds"], t["name"]))


def throughput(core: ParameterServerCore, now: float) -> dict:
    """Rates from counters (rounds closed, examples, gradients applied) over the window, and the kept rounds' mean."""
    window, (rounds, examples, applied) = core.rates.rates(
        now, (core.rounds_closed, core.examples, core.gradients_applied))
    kept = core.rounds
    span = kept[-1].closed_at - kept[0].opened_at if kept else 0.0
    return {"window_seconds": window, "rounds_per_second": rounds, "examples_per_second": examples,
            "gradients_per_second": applied, "mean_rounds_per_second": len(kept) / span if span > 0 else 0.0}


def modes_view(core: ParameterServerCore) -> dict:
    """async/ssp: the live workers' clocks by name, slowest, fastest, spread; the applied gradients' staleness
    percentiles (both null in sync)."""
    modes = core.modes
    if modes is None:
        return {"clocks": None, "staleness": None}
    live = {core.members.by_id[w].name: rec.clock for w, rec in modes.workers.items()
            if rec.live and w in core.members.by_id}
    counts = modes.staleness_counts
    return {"clocks": {"slowest": modes.floor if live else None, "fastest": modes.fastest if live else None,
                       "spread": modes.spread, "max_spread": modes.max_spread, "live": len(live), "workers": live},
            "staleness": {"applied": modes.applied(), "p50": modes.percentile(50), "p90": modes.percentile(90),
                          "p99": modes.percentile(99), "max": max(counts) if counts else None}}


def snapshot(rt: Runtime) -> dict:
    """The ``/v1/status`` answer: the one source of the figures ``/metrics`` renders too (ps_service/metrics.py)."""
    core, s, now = rt.core, rt.settings, rt.now()
    losses = [l for _, l in list(core.loss_history)[-LOSS_AVERAGE_ROUNDS:]]
    states = [m.state for m in core.members.by_id.values()]
    refusal = None if rt.ha is None else rt.ha.refusal()  # a pair's standby, or an election: no worker trains here
    reason = refusal.detail if refusal is not None else (core if rt.shards is None else rt.shards).wait_reason(now)
    return {
        "state": core.state().value, "global_step": core.global_step, "max_steps": s.max_steps,
        "progress": core.global_step / s.max_steps if s.max_steps else None,
        "mode": "fixed" if s.replicas_to_aggregate else "elastic",
        "training_mode": core.config.mode,
        "ssp_staleness": core.config.ssp_staleness if core.config.mode == "ssp" else None,
        "max_staleness": core.config.max_staleness,
        **modes_view(core),
        "gradients_applied": core.gradients_applied,
        "replicas_to_aggregate": s.replicas_to_aggregate, "total_num_replicas": s.total_num_replicas,
        "effective_replicas_to_aggregate": None if core.round is None else core.progress().effective,
        "aggregation": s.aggregation,
        "optimizer": core.optimizer.spec if core.optimizer else None,
        "round": current_round(rt),
        "wait_reason": reason,
        "workers": {"active": states.count(ACTIVE), "expired": states.count(EXPIRED), "left": states.count(LEFT),
                    "registered": len(states), "membership_changes": core.members.changes,
                    "leases_held": core.members.held},
        "pushes": {k: core.push_counts.get(k, 0) for k in PUSH_KINDS},
        "loss": {"last": losses[-1] if losses else None,
                 "moving_average": sum(losses) / len(losses) if losses else None,
                 "moving_average_rounds": len(losses)},
        "throughput": throughput(core, now),
        "examples": core.examples, "bytes_received": rt.tensors.bytes_in, "bytes_sent": rt.tensors.bytes_out,
        "shm_bytes_received": rt.tensors.shm.bytes_in, "compression": rt.tensors.compression.to_wire(),
        "auth_failures": rt.auth_failures, "started_at": rt.started_wall,
        "training_started_at": None if core.started_at is None else wall(rt, core.started_at),
        "uptime_seconds": now - rt.started_mono,
        "checkpoint": rt.checkpoint_info,
        "shard": None if rt.shards is None else rt.shards.view().model_dump(),
        "pair": None if rt.ha is None else rt.ha.status().model_dump(),
    }


@router.get(f"{API}/status", response_model=Status)
async def status(request: Request) -> dict:
    """Job state, progress, mode, optimizer, the open round, loss, throughput, uptime, checkpoint."""
    return snapshot(runtime(request))


def worker_view(rt: Runtime, m, now: float, totals: dict[str, dict], awaited: tuple[str, ...]) -> Worker:
    r = rt.core.round
    n = max(1, m.phase_reports)
    last_step = max(m.recent) if m.recent else None
    last_status = m.recent[last_step] if m.recent else None
    in_round = r is not None and r.counts(m.worker_id)
    state = "late" if m.state == ACTIVE and last_status in ("late", "stale") else m.state
    t = totals.get(m.name, {})
    modes = rt.core.modes
    rec = None if modes is None else modes.workers.get(m.worker_id)
    blocked = None if rec is None or not rec.live else modes.wait(m.worker_id, now)
    return Worker(
        worker_id=m.worker_id, name=m.name, rank=m.rank, state=state, last_seen=wall(rt, m.last_seen),
        last_seen_seconds_ago=now - m.last_seen, transport=rt.tensors.shm.last_transport.get(m.worker_id),
        registered_at=wall(rt, m.registered_at), registrations=m.registrations, last_step=last_step,
        last_push_status=last_status, in_current_round=in_round, awaited=m.worker_id in awaited,
        waiting=rt.core.members.waits.get(m.worker_id, 0) > 0, pushes={k: m.pushes.get(k, 0) for k in PUSH_KINDS},
        mean_seconds={k: v / n for k, v in m.phase_sums.items()}, last_loss=m.last_loss,
        straggler_rounds=t.get("rounds", 0), straggler_seconds=t.get("waited_seconds", 0.0),
        clock=None if rec is None else rec.clock,
        staleness=None if rec is None else WorkerStaleness(
            last=rec.last_staleness, mean=rec.mean_staleness, max=rec.staleness_max if rec.applied else None,
            applied=rec.applied),
        blocked=None if blocked is None else Blocked(
            clock=blocked.clock, needs=blocked.needs, slowest=blocked.slowest, stragglers=[
                StragglerWait(name=rt.core.members.by_id[w].name, seconds=secs) for w, secs in blocked.stragglers]))


@router.get(f"{API}/workers", response_model=Workers)
async def workers(request: Request) -> dict:
    """Every member: state, last seen, push outcomes, mean phase times, straggler counts; membership events."""
    rt = runtime(request)
    now = rt.now()
    window = list(islice(reversed(rt.core.rounds), STRAGGLER_WINDOW_ROUNDS))
    ranked = straggler_totals(window)
    events = [{**e, "time": wall(rt, e["time"])} for e in list(rt.core.members.events)[-EVENTS_SHOWN:]]
    waits = awaited(rt.core)
    totals = {t["name"]: t for t in ranked}
    return {"workers": [worker_view(rt, m, now, totals, waits) for m in rt.core.members.all()],
            "straggler": ranked[0]["name"] if ranked else None, "window_rounds": len(window), "events": events}


@router.get(f"{API}/rounds", response_model=Rounds)
async def rounds(request: Request, limit: Annotated[DecimalInt, Query(
        ge=1, le=ROUNDS_KEPT, description="How many of the last rounds.")] = 20) -> dict:
    """The last ``limit`` closed rounds (newest first): contributors in arrival order, late pushes, missing
    members, the straggler and what it cost; plus the open round and per-straggler totals."""
    rt = runtime(request)
    records = list(islice(reversed(rt.core.rounds), limit))  # newest first
    return {"rounds": [round_record(rt, r) for r in records], "current": current_round(rt),
            "stragglers": straggler_totals(records)}


@router.get(f"{API}/rounds/{{step}}", response_model=RoundModel,
            responses={404: {"description": f"no such round kept (not closed yet, or older than the last "
                                            f"{ROUNDS_KEPT})"}})
async def one_round(step: DecimalInt, request: Request) -> dict:
    """One closed round: who slowed round ``step`` and by how much."""
    rt = runtime(request)
    for rec in rt.core.rounds:
        if rec.step == step:
            return round_record(rt, rec)
    raise ProtocolError(404, "unknown_round", f"round {step} is not among the kept closed rounds")


@router.get(f"{API}/loss", response_model=LossCurve)
async def loss(request: Request,
               since: Annotated[DecimalInt, Query(ge=-1, description="Only rounds with step > since.")] = -1) -> dict:
    """The loss curve (one point per closed round, the newest kept): what the dashboard plots."""
    core = runtime(request).core
    points = list(takewhile(lambda p: p[0] > since, reversed(core.loss_history)))[::-1]
    return {"steps": [p[0] for p in points], "loss": [p[1] for p in points], "global_step": core.global_step}


@health.get("/healthz")
async def healthz() -> dict:
    """Liveness: the process answers."""
    return {"status": "ok"}


@health.get("/readyz", responses={503: {"description": "the model is not initialised yet"}})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: the model is initialised and the PS serves it."""
    core = runtime(request).core
    if core.initialized:
        return JSONResponse({"status": "ready", "state": core.state().value})
    return JSONResponse({"error": "not_ready", "detail": "the model is not initialised yet"}, status_code=503)
