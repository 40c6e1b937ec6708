"""Prometheus metrics of the PS: ``GET /metrics`` (prometheus-client, text or OpenMetrics format).

Contract: every name starts with ``ps_``, values are in base units (seconds, bytes), counters end in ``_total``,
labels take a fixed, small set of values (push status, worker state, job state, round close reason): never a worker
name. One registry per app: at scrape time :meth:`PSMetrics.collect` renders the ``/v1/status`` answer
(:func:`ps_service.monitoring.snapshot`: one source per figure, each family's HELP its field's description) and the
few counters only ``/metrics`` shows; :class:`PSMetrics` observes every closed round and checkpoint into histograms
(a :attr:`Runtime.observers` hook, and once more at each scrape).
"""
from __future__ import annotations

from itertools import takewhile
from typing import get_args

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel

from ps_service import monitoring
from ps_service.core.membership import ACTIVE, EXPIRED, LEFT
from ps_service.core.rounds import CLOSE_REASONS
from ps_service.monitoring_models import PairStatus, ShardRow, Status
from ps_service.runtime import Runtime
from shared.protocol import JobState

router = APIRouter(tags=["monitoring"])

#: seconds: from a sub-millisecond loopback round to a two-minute stall
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: global steps of staleness (async/ssp): 0 (computed on the latest weights), then powers of two
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def described(path: str) -> str:
    """The description of the ``/v1/status`` field at a dotted ``path`` (monitoring_models.Status)."""
    model = Status
    for key in path.split("."):
        info = model.model_fields[key]
        model = next((t for t in (info.annotation, *get_args(info.annotation))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return info.description


def pick(view: dict | None, path: str):
    """The value at a dotted ``path`` of an answer (None through a null or missing part)."""
    for key in path.split("."):
        view = None if view is None else view.get(key)
    return view


def family(name: str, doc: str, value: float | dict | None, counter: bool = False, label: str | None = None):
    """A gauge or a counter: of one unlabelled sample (a gauge's ``value`` None: no sample; a counter's: 0), or with
    ``label`` of one sample per value of it (``value`` maps each to its sample)."""
    f = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=[label] if label else None)
    if label:
        for k, v in value.items():
            f.add_metric([k], v)
    elif value is not None or counter:
        f.add_metric([], value or 0)
    return f


#: the families read from the ``/v1/status`` answer (monitoring.snapshot): (name, counter?, the answer's field as a
#: dotted path, HELP: that field's description). A null ``clocks`` (sync) or ``pair`` (no pair): no family
FROM_STATUS = tuple((name, counter, path, described(path)) for name, counter, path in (
    ("ps_global_step", False, "global_step"), ("ps_max_steps", False, "max_steps"),
    ("ps_membership_changes", True, "workers.membership_changes"), ("ps_examples", True, "examples"),
    ("ps_gradients_applied", True, "gradients_applied"), ("ps_worker_clock_slowest", False, "clocks.slowest"),
    ("ps_worker_clock_fastest", False, "clocks.fastest"), ("ps_worker_clock_spread", False, "clocks.spread"),
    ("ps_received_bytes", True, "bytes_received"), ("ps_sent_bytes", True, "bytes_sent"),
    ("ps_shm_received_bytes", True, "shm_bytes_received"), ("ps_auth_failures", True, "auth_failures"),
    ("ps_round_open_seconds", False, "round.open_for_seconds"),
    ("ps_round_awaited_workers", False, "round.still_needed"),
    ("ps_loss", False, "loss.last"), ("ps_start_time_seconds", False, "started_at"),
    ("ps_checkpoints", True, "checkpoint.count"), ("ps_checkpoint_last_step", False, "checkpoint.step"),
    ("ps_checkpoint_last_duration_seconds", False, "checkpoint.duration_seconds"),
    ("ps_pair_term", False, "pair.term"), ("ps_pair_standby_lag_rounds", False, "pair.lag_rounds"),
    ("ps_pair_standby_lag_bytes", False, "pair.lag_bytes"), ("ps_pair_takeovers", True, "pair.takeovers"),
    ("ps_pair_sent_bytes", True, "pair.bytes_sent")))
OPTIONAL = ("clocks", "pair")
ROLES = get_args(PairStatus.model_fields["role"].annotation)  # primary, standby, candidate


def staleness_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """The exact staleness distribution the core keeps (value -> count) as cumulative buckets, at scrape time."""
    h = HistogramMetricFamily("ps_gradient_staleness_steps", "Per applied gradient (async/ssp): global steps "
                              "between the weights it was computed on and those it was applied to.")
    buckets = [(str(le), sum(n for v, n in counts.items() if v <= le)) for le in STALENESS_BUCKETS]
    h.add_metric([], buckets + [("+Inf", sum(counts.values()))], sum_value=sum(v * n for v, n in counts.items()))
    return h


def shard_gauges(view: dict):
    """A sharded PS: this shard's index; on the coordinator each shard's step, reachability and bytes (label shard)."""
    yield family("ps_shard_index", described("shard.index"), view["index"])
    yield family("ps_shards", described("shard.count"), view["count"])
    if "rollbacks" in view:
        yield family("ps_shard_rollbacks", described("shard.rollbacks"), view["rollbacks"], True)
    for key in ("step", "reachable", "bytes_owned"):  # one sample a shard that has the figure
        values = {str(row["index"]): float(row[key]) for row in view.get("shards", []) if row[key] is not None}
        yield family(f"ps_shard_{key}", ShardRow.model_fields[key].description, values, label="shard")


class PSMetrics:
    """The app's registry: histograms fed from closed rounds, and itself collecting the scrape-time families."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.registry = reg = CollectorRegistry()
        self.rounds = Counter("ps_rounds", f"Rounds closed, by what closed them ({' | '.join(CLOSE_REASONS)}).",
                              ["reason"], registry=reg)
        for reason in CLOSE_REASONS:
            self.rounds.labels(reason)
        self.round_duration, self.barrier_wait, self.straggler_wait, self.checkpoint_duration = (
            Histogram(f"ps_{name}_seconds", doc, buckets=TIME_BUCKETS, registry=reg) for name, doc in (
                ("round_duration", "Round duration, open to close."),
                ("barrier_wait", "Per accepted gradient: from its arrival to the round's close."),
                ("straggler_wait", "Per round with a straggler: what the straggler cost it (waited_seconds)."),
                ("checkpoint_duration", "Checkpoint write duration.")))
        reg.register(self)  # (registered last: its collect, below)
        self._last_step = rt.core.rounds[-1].step if rt.core.rounds else None
        self._checkpoints = 0
        rt.observers.append(self.observe)

    def observe(self) -> None:
        """Account the rounds closed and the checkpoint written since the last call."""
        core, last = self.rt.core, self._last_step
        if last is not None and last >= core.global_step:  # went back to a checkpoint
            last = self._last_step = core.global_step - 1
        for rec in list(takewhile(lambda r: last is None or r.step > last, reversed(core.rounds)))[::-1]:
            self.rounds.labels(rec.reason).inc()  # (one of CLOSE_REASONS: the core closes a round for no other)
            self.round_duration.observe(rec.duration)
            for c in rec.contributors:
                self.barrier_wait.observe(max(0.0, rec.closed_at - c.at))
            if rec.straggler is not None:
                self.straggler_wait.observe(rec.straggler.waited_seconds)
            self._last_step = rec.step
        info = self.rt.checkpoint_info or {}
        count = info.get("count") or 0
        if count > self._checkpoints:
            self._checkpoints = count
            self.checkpoint_duration.observe(info["duration_seconds"])  # (a write's info: checkpoint.Checkpointer)

    def collect(self):
        """At scrape time: the ``/v1/status`` answer's figures, and the few the runtime keeps for ``/metrics`` only."""
        rt, shm, intake = self.rt, self.rt.tensors.shm, self.rt.core.intake
        st = monitoring.snapshot(rt)
        for name, counter, path, doc in FROM_STATUS:
            part = path.split(".")[0]
            if part not in OPTIONAL or st[part] is not None:
                yield family(name, doc, pick(st, path), counter)
        yield family("ps_job_state", "1 for the job's current state.",
                     {s.value: float(s.value == st["state"]) for s in JobState}, label="state")
        yield family("ps_workers", "Registered workers by membership state.",
                     {s: st["workers"][s] for s in (ACTIVE, EXPIRED, LEFT)}, label="state")
        yield family("ps_pushes", "Gradient pushes by outcome.", st["pushes"], True, "status")
        if rt.core.modes is not None:
            yield staleness_histogram(rt.core.modes.staleness_counts)
        yield family("ps_shm_workers", "Workers whose tensors go through the same-host transport.", len(shm.attached))
        yield family("ps_shm_weights_copies", "Copies of a step's weights into the same-host weights file (made while "
                     "the weights live in the frame of the answers sent over HTTP).", shm.mirrored, True)
        yield family("ps_push_reads_deferred", "Times a large push's tensors were left unread for their turn in rank "
                     "order (ps_service/core/intake.py).", intake.deferred, True)
        yield family("ps_push_reads_overdue", "Large pushes read out of turn after waiting a lease (a round held up by "
                     "a slow member: each is one more gradient held).", intake.overdue, True)
        if st["shard"] is not None:
            yield from shard_gauges(st["shard"])
        if st["pair"] is not None:
            view = st["pair"]
            yield family("ps_pair_role", "1 for this PS's role in its hot-standby pair.",
                         {r: float(view["role"] == r) for r in ROLES}, label="role")
            yield family("ps_pair_standby_in_sync", "On the primary: 1 if its standby caught up (every answer waits "
                         "for it).", None if view["standby"] is None else float(view["standby"] == "in_sync"))

    def render(self, accept: str | None) -> tuple[bytes, str]:
        self.observe()
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format (or OpenMetrics)"}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics (every name ``ps_*``)."""
    body, content_type = request.app.state.metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)
