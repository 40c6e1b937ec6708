"""Monitoring routes (JSON): status, workers, rounds, liveness and readiness.

Read-only views of the core; nothing here changes training state.
"""
from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ps_service.runtime import Runtime
from shared.protocol import API

router = APIRouter(tags=["monitoring"])


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def round_view(rt: Runtime) -> dict | None:
    core, r = rt.core, rt.core.round
    if r is None:
        return None
    names = {w: core.members.by_id[w].name for w in r.eligible}
    return {
        "step": r.step,
        "open_for_seconds": rt.now() - r.opened_at,
        "pushed": len(r.grads) if r.grads else len(r.arrivals),
        "needed": core.needed(r) + len(r.arrivals),
        "pushed_by": [a["name"] for a in r.arrivals],
        "awaited": sorted(names[w] for w in core._alive_eligible(r) if w not in {a["worker_id"] for a in r.arrivals}),
        "late": [a["name"] for a in r.late],
    }


def worker_view(m, now: float) -> dict:
    n = max(1, m.phase_reports)
    return {
        "worker_id": m.worker_id, "name": m.name, "rank": m.rank, "state": m.state,
        "last_seen_seconds_ago": now - m.last_seen, "registrations": m.registrations,
        "pushes": {k: m.pushes.get(k, 0) for k in ("accepted", "stale", "duplicate", "late", "skipped")},
        "mean_seconds": {k: v / n for k, v in m.phase_sums.items()},
        "last_loss": m.last_loss,
    }


@router.get(f"{API}/status")
async def status(request: Request) -> dict:
    rt = runtime(request)
    core = rt.core
    s = rt.settings
    now = rt.now()
    recent = [r for r in core.rounds if r["closed_at"] >= now - 10.0]
    span = (recent[-1]["closed_at"] - recent[0]["opened_at"]) if recent else 0.0
    losses = [l for _, l in list(core.loss_history)[-20:]]
    return {
        "state": core.state().value,
        "global_step": core.global_step,
        "max_steps": s.max_steps,
        "mode": "fixed" if s.replicas_to_aggregate else "elastic",
        "replicas_to_aggregate": s.replicas_to_aggregate,
        "total_num_replicas": s.total_num_replicas,
        "aggregation": s.aggregation,
        "optimizer": core.optimizer.spec if core.optimizer else None,
        "round": round_view(rt),
        "workers": {"active": len(core.members.active()), "registered": len(core.members.by_id),
                    "membership_changes": core.members.changes},
        "pushes": dict(core.push_counts),
        "loss": {"last": losses[-1] if losses else None, "mean_last_20": sum(losses) / len(losses) if losses else None},
        "throughput": {"rounds_per_second": len(recent) / span if span > 0 else 0.0},
        "examples": core.examples,
        "uptime_seconds": now - rt.started_mono,
    }


@router.get(f"{API}/workers")
async def workers(request: Request) -> dict:
    rt = runtime(request)
    now = rt.now()
    return {"workers": [worker_view(m, now) for m in rt.core.members.all()],
            "events": list(rt.core.members.events)[-100:]}


@router.get(f"{API}/rounds")
async def rounds(request: Request, limit: int = Query(20, ge=1, le=1000)) -> dict:
    rt = runtime(request)
    return {"rounds": list(rt.core.rounds)[-limit:][::-1], "current": round_view(rt)}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    core = runtime(request).core
    if core.initialized:
        return JSONResponse({"status": "ready", "state": core.state().value})
    return JSONResponse({"error": "not_ready", "detail": "the model is not initialised yet"}, status_code=503)
