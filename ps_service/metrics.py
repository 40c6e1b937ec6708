"""Prometheus metrics of the PS: ``GET /metrics`` (prometheus-client, text or OpenMetrics format).

Contract: every name starts with ``ps_``, values are in base units (seconds, bytes), counters end in ``_total``,
labels take a fixed, small set of values (push status, worker state, job state, round close reason): never a worker
name. One registry per app: :class:`StateCollector` reads the core and the runtime's counters at scrape time;
:class:`PSMetrics` observes every closed round and checkpoint into histograms (a :attr:`Runtime.observers` hook, and
once more at each scrape).
"""
from __future__ import annotations

from itertools import takewhile

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from ps_service.core.membership import ACTIVE, EXPIRED, LEFT
from ps_service.monitoring import PUSH_KINDS
from ps_service.core.rounds import CLOSE_REASONS
from ps_service.runtime import Runtime
from shared.protocol import JobState

router = APIRouter(tags=["monitoring"])

#: seconds: from a sub-millisecond loopback round to a two-minute stall
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: global steps of staleness (async/ssp): 0 (computed on the latest weights), then powers of two
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    if value is not None:
        g.add_metric([], value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def staleness_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """The exact staleness distribution the core keeps (value -> count) as cumulative buckets, at scrape time."""
    h = HistogramMetricFamily("ps_gradient_staleness_steps", "Per applied gradient (async/ssp): global steps "
                              "between the weights it was computed on and those it was applied to.")
    buckets = [(str(le), sum(n for v, n in counts.items() if v <= le)) for le in STALENESS_BUCKETS]
    h.add_metric([], buckets + [("+Inf", sum(counts.values()))], sum_value=sum(v * n for v, n in counts.items()))
    return h


class StateCollector:
    """Gauges and counters read from the core and runtime at scrape time."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self):
        rt, core, shm = self.rt, self.rt.core, self.rt.tensors.shm
        now = rt.now()
        yield _gauge("ps_global_step", "Model version: the global step (rounds applied).", core.global_step)
        yield _gauge("ps_max_steps", "Global steps to train (absent: forever).", rt.settings.max_steps)
        state = core.state().value
        job = GaugeMetricFamily("ps_job_state", "1 for the job's current state.", labels=["state"])
        for s in JobState:
            job.add_metric([s.value], 1.0 if s.value == state else 0.0)
        yield job
        members = GaugeMetricFamily("ps_workers", "Registered workers by membership state.", labels=["state"])
        states = [m.state for m in core.members.by_id.values()]
        for s in (ACTIVE, EXPIRED, LEFT):
            members.add_metric([s], states.count(s))
        yield members
        yield _counter("ps_membership_changes", "Joins, rejoins, leaves and lease expiries.", core.members.changes)
        pushes = CounterMetricFamily("ps_pushes", "Gradient pushes by outcome.", labels=["status"])
        for k in PUSH_KINDS:
            pushes.add_metric([k], core.push_counts.get(k, 0))
        yield pushes
        yield _counter("ps_examples", "Examples behind the accepted gradients.", core.examples)
        yield _counter("ps_gradients_applied",
                       "Gradients applied since start (sync: every gradient a round summed into its one update).",
                       core.gradients_applied)
        modes = core.modes
        if modes is not None:
            yield staleness_histogram(modes.staleness_counts)
            live = bool(modes.live_count())
            yield _gauge("ps_worker_clock_slowest", "Slowest live worker's clock (async/ssp).", modes.floor if live else None)
            yield _gauge("ps_worker_clock_fastest", "Fastest live worker's clock (async/ssp).", modes.fastest if live else None)
            yield _gauge("ps_worker_clock_spread", "Fastest minus slowest live clock (ssp: <= bound + 1).", modes.spread)
        yield _counter("ps_received_bytes", "Bytes of model and gradient request bodies received.", rt.tensors.bytes_in)
        yield _counter("ps_sent_bytes", "Bytes of weight response bodies sent.", rt.tensors.bytes_out)
        yield _counter("ps_shm_received_bytes", "Gradient bytes read from same-host workers' files.", shm.bytes_in)
        yield _gauge("ps_shm_workers", "Workers whose tensors go through the same-host transport.", len(shm.attached))
        yield _counter("ps_shm_weights_copies", "Copies of a step's weights into the same-host weights file (made while "
                       "the weights live in the frame of the answers sent over HTTP).", shm.mirrored)
        intake = core.intake
        yield _counter("ps_push_reads_deferred", "Times a large push's tensors were left unread for their turn in rank "
                       "order (ps_service/core/intake.py).", intake.deferred)
        yield _counter("ps_push_reads_overdue", "Large pushes read out of turn after waiting a lease (a round held up by "
                       "a slow member: each is one more gradient held).", intake.overdue)
        yield _counter("ps_auth_failures", "Requests refused for a missing or wrong token.", rt.auth_failures)
        r = core.round
        yield _gauge("ps_round_open_seconds", "How long the open round has been open (absent: none open).",
                     None if r is None else now - r.opened_at)
        yield _gauge("ps_round_awaited_workers", "Gradients the open round still waits for.",
                     None if r is None else core.progress().needed)
        yield _gauge("ps_loss", "Loss of the last closed round.", core.loss_history[-1][1] if core.loss_history else None)
        yield _gauge("ps_start_time_seconds", "Start of the PS, Unix time.", rt.started_wall)
        info = rt.checkpoint_info or {}
        yield _counter("ps_checkpoints", "Checkpoints written since start.", info.get("count") or 0)
        yield _gauge("ps_checkpoint_last_step", "Global step of the last checkpoint.", info.get("step"))
        yield _gauge("ps_checkpoint_last_duration_seconds", "How long writing the last checkpoint took.",
                     info.get("duration_seconds"))
        if rt.shards is not None:
            yield from shard_gauges(rt.shards.view())
        if rt.ha is not None:
            yield from pair_gauges(rt.ha.status())


def pair_gauges(view: dict):
    """A hot-standby pair: this PS's role (label role, 1 for the current one), the term, the standby's lag."""
    role = GaugeMetricFamily("ps_pair_role", "1 for this PS's role in its hot-standby pair.", labels=["role"])
    for r in ("primary", "standby", "candidate"):
        role.add_metric([r], float(view["role"] == r))
    yield role
    yield _gauge("ps_pair_term", "The pair's term as this PS knows it.", view["term"])
    yield _gauge("ps_pair_standby_in_sync", "On the primary: 1 if its standby caught up (every answer waits for it).",
                 None if view["standby"] is None else float(view["standby"] == "in_sync"))
    yield _gauge("ps_pair_standby_lag_rounds", "On the primary: messages the standby has not acknowledged.",
                 view["lag_rounds"])
    yield _gauge("ps_pair_standby_lag_bytes", "On the primary: bytes of those messages.", view["lag_bytes"])
    yield _counter("ps_pair_takeovers", "Times this process took over as primary.", view["takeovers"])
    yield _counter("ps_pair_sent_bytes", "Bytes sent to the standby (states and steps).", view["bytes_sent"])


def shard_gauges(view: dict):
    """A sharded PS: this shard's index; on the coordinator each shard's step, reachability and bytes (label shard)."""
    yield _gauge("ps_shard_index", "This process's shard (0: the coordinator).", view["index"])
    yield _gauge("ps_shards", "Shards of the PS (PS_SHARDS).", view["count"])
    if "rollbacks" in view:
        yield _counter("ps_shard_rollbacks", "Live rollbacks of the job to a checkpoint every shard has (a follower "
                                             "restarted).", view["rollbacks"])
    families = [(GaugeMetricFamily(f"ps_shard_{key}", doc, labels=["shard"]), key) for key, doc in (
        ("step", "Each shard's global step, as the coordinator last heard it."),
        ("reachable", "1 if the coordinator's last exchange with the shard got an answer."),
        ("bytes_owned", "Bytes of the model the shard owns."))]
    for row in view.get("shards", []):
        for family, key in families:
            if row[key] is not None:
                family.add_metric([str(row["index"])], float(row[key]))
    for family, _ in families:
        yield family


class PSMetrics:
    """The app's registry: the scrape-time collector plus histograms fed from closed rounds."""

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
        reg.register(StateCollector(rt))
        self._last_step = rt.core.rounds[-1].step if rt.core.rounds else None
        self._checkpoints = 0
        rt.observers.append(self.observe)

    def observe(self) -> None:
        """Account the rounds closed and the checkpoint written since the last call."""
        core, last = self.rt.core, self._last_step
        if last is not None and last >= core.global_step:  # went back to a checkpoint
            last = self._last_step = core.global_step - 1
        for rec in list(takewhile(lambda r: last is None or r.step > last, reversed(core.rounds)))[::-1]:
            self.rounds.labels(rec.reason if rec.reason in CLOSE_REASONS else "full").inc()
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
            if isinstance(info.get("duration_seconds"), (int, float)):
                self.checkpoint_duration.observe(info["duration_seconds"])

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
