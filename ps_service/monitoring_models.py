"""Response schemas of the monitoring routes (``/v1/status``, ``/v1/workers``, ``/v1/rounds``, ``/v1/loss``).

Only data shapes, their documentation (they appear in the OpenAPI schema at ``/docs``; ``/metrics`` takes its HELP
lines from them) and the answers' sizes the routes and the descriptions both read (:data:`ROUNDS_KEPT`,
:data:`EVENTS_SHOWN`; the core's ``LOSS_KEPT``). The values are built in :mod:`ps_service.monitoring`, the ``shard``
and ``pair`` blocks of ``/v1/status`` by the sharding and standby layers; a round's straggler is the core's
:class:`~ps_service.core.rounds.Straggler` as it is. Times named ``*_at`` / ``time`` are Unix seconds (wall clock);
durations are seconds.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ps_service.core import LOSS_KEPT, RATE_WINDOW_SECONDS
from ps_service.core.config import CoreConfig
from ps_service.core.rounds import Straggler

#: closed rounds the core keeps (``/v1/rounds``' limit, ``/v1/rounds/{step}``); membership events ``/v1/workers`` shows
ROUNDS_KEPT, EVENTS_SHOWN = CoreConfig.max_rounds_kept, 100
WorkerState = Literal["active", "late", "left", "expired"]


class PushCounts(BaseModel):
    accepted: int = Field(description="Counted in their round and applied.")
    stale: int = Field(description="Computed on weights older than the last closed round: dropped.")
    late: int = Field(description="For a round that closed without them (backup loser, deadline): dropped.")
    duplicate: int = Field(description="A (worker, step) pushed before: not counted twice.")
    skipped: int = Field(description="Non-finite gradients under PS_NONFINITE_POLICY=skip: counted, not applied.")


class CurrentRound(BaseModel):
    step: int = Field(description="The open round's step (= global step).")
    opened_at: float = Field(description="When the round opened (Unix s).")
    open_for_seconds: float = Field(description="How long the round has been open.")
    eligible: list[str] = Field(description="Names of the members this round counts (fixed when it opened).")
    pushed_by: list[str] = Field(description="Names of accepted pushes, in arrival order.")
    awaited: list[str] = Field(description="Live eligible members that have not pushed yet.")
    late: list[str] = Field(description="Names of late pushes for this round.")
    still_needed: int = Field(description="Gradients the round still waits for before it closes.")
    unreachable: bool = Field(description="Fixed R that the round's live members can no longer meet (some left or "
                                          "expired): it closes with what they bring, if at least min_replicas.")


class Loss(BaseModel):
    last: float | None = Field(description="Loss of the last closed round (example-weighted mean of the pushes).")
    moving_average: float | None = Field(description="Mean loss of the last `moving_average_rounds` rounds.")
    moving_average_rounds: int


class Throughput(BaseModel):
    window_seconds: float = Field(description=f"Span of the two rates below: the last {RATE_WINDOW_SECONDS:g} s or "
                                              "so (less just after the start).")
    rounds_per_second: float = Field(description="Rounds closed in the window / its span (from the rounds counter).")
    examples_per_second: float = Field(description="Examples of accepted gradients in the window / its span.")
    gradients_per_second: float = Field(description="Gradients applied in the window / its span (every mode: sync "
                                                    "applies a round's gradients as one update).")
    mean_rounds_per_second: float = Field(description=f"Over the kept rounds (up to {ROUNDS_KEPT}): rounds / their "
                                                      "span.")


class Clocks(BaseModel):
    slowest: int | None = Field(description="The slowest live worker's clock (its completed iterations): the SSP "
                                            "floor.")
    fastest: int | None = Field(description="The fastest live worker's clock.")
    spread: int = Field(description="fastest - slowest (ssp keeps it <= PS_SSP_STALENESS + 1).")
    max_spread: int = Field(description="The largest spread seen since start.")
    live: int = Field(description="Live workers (registered, lease running).")
    workers: dict[str, int] = Field(description="Each live worker's clock, by name.")


class StalenessSummary(BaseModel):
    applied: int = Field(description="Gradients applied since start (their staleness is recorded).")
    p50: int | None = Field(description="Median staleness: global steps between the weights a gradient was computed "
                                        "on and the weights it was applied to (nearest rank).")
    p90: int | None
    p99: int | None
    max: int | None


class WorkerCounts(BaseModel):
    active: int
    expired: int
    left: int
    registered: int = Field(description="Every name ever registered.")
    membership_changes: int = Field(description="Joins, rejoins, leaves, expiries and recalls since start.")
    leases_held: bool = Field(description="No lease runs out now: the PS has heard from no worker for half a lease "
                                          "(it was cut off or paused, or every worker stopped), or a sharded PS's "
                                          "follower does not answer (docs/protocol.md, register).")


class CheckpointInfo(BaseModel):
    model_config = ConfigDict(extra="allow")
    step: int | None = Field(None, description="Global step of the last checkpoint written or restored.")
    path: str | None = None
    time: float | None = Field(None, description="When it was written (Unix s).")
    duration_seconds: float | None = Field(None, description="How long writing the last checkpoint took.")
    count: int | None = Field(None, description="Checkpoints written since start.")


class Election(BaseModel):
    term: int = Field(description="The term this PS asks the workers' votes for.")
    votes: list[str] = Field(description="The names that voted for it.")
    needed: int = Field(description="Votes still needed.")


class PairStatus(BaseModel):
    role: Literal["primary", "standby", "candidate"] = Field(description="This PS's role in the pair now.")
    term: int = Field(description="The pair's term as this PS knows it (every answer's x-syncps-term).")
    peer: str = Field(description="The other PS (PS_PEER_URL).")
    boot: str = Field(description="This process's boot id.")
    standby: Literal["in_sync", "catching_up", "none"] | None = Field(
        description="On the primary: its standby caught up (every answer waits for it), is getting the state, or "
                    "there is none (the primary goes on alone). Null on a standby.")
    alone_seconds: float | None = Field(description="On the primary: how long it has served without a standby that "
                                                    "caught up (null: it has one).")
    lag_rounds: int | None = Field(description="On the primary: messages (steps, membership) the standby has not "
                                               "acknowledged yet, or (same host) not yet read from its log.")
    lag_bytes: int | None = Field(description="On the primary: the bytes of those messages.")
    applied: int = Field(description="On a standby: the primary's messages taken (of this term): read, checked and "
                                     "acknowledged; the last one may still be applying (it is applied right after its "
                                     "answer, before anything else).")
    synced: bool = Field(description="On a standby: it took the state of its term (it may take over).")
    election: Election | None = Field(description="An election under way on this PS (null: none).")
    takeovers: int = Field(description="Times this process took over as primary.")
    transfers: int = Field(description="State transfers this process sent.")
    bytes_sent: int = Field(description="Bytes sent to the standby (states and steps).")
    bytes_received: int = Field(description="Bytes received from the primary (states and steps).")
    last_change: str | None = Field(description="The last change of role or term, and why.")


class ShardRow(BaseModel):
    index: int = Field(description="The shard (0: the coordinator).")
    url: str
    step: int | None = Field(description="The shard's global step, as the coordinator last heard it.")
    reachable: bool | None = Field(description="Whether the coordinator's last exchange with the shard got an "
                                               "answer.")
    bytes_owned: int | None = Field(description="Bytes of the model the shard owns.")
    error: str | None = Field(description="A refusal that stopped the coordinator's link to it.")


class FollowerRow(ShardRow):
    rounds_queued: int = Field(description="Messages (round applies) queued for it, not sent yet.")


class ShardStatus(BaseModel):
    index: int = Field(description="This process's shard (0: the coordinator).")
    count: int = Field(description="Shards of the PS (PS_SHARDS).")
    role: Literal["coordinator", "follower"] = Field(description="coordinator: shard 0.")
    step: int = Field(description="This shard's global step.")
    bytes_owned: int = Field(description="Bytes of the model this shard owns.")
    held_pushes: int = Field(description="Pushes' pieces held for a commit.")
    map_digest: str | None = Field(description="The shard map's digest (null: no model yet).")
    boot: str = Field(description="This process's boot id (another one: it restarted).")


class CoordinatorStatus(ShardStatus):
    shards: list[FollowerRow | ShardRow] = Field(description="Every shard, the coordinator's own row first.")
    blocked: str | None = Field(description="Why registration is refused (503 shards_inconsistent; null: it is not).")
    leases_held: bool = Field(description="A follower does not answer: no worker's lease runs out meanwhile.")
    rollbacks: int = Field(description="Live rollbacks of the job to a checkpoint every shard has (a follower "
                                       "restarted).")
    last_rollback: str | None = Field(description="What the last rollback did (null: none).")


class Status(BaseModel):
    state: str = Field(description="waiting_for_model | waiting_for_workers | training | done")
    global_step: int = Field(description="Model version: the global step (rounds applied).")
    max_steps: int | None = Field(description="Global steps to train (none: forever).")
    progress: float | None = Field(description="global_step / max_steps, when max_steps is set.")
    mode: Literal["elastic", "fixed"] = Field(description="elastic: R = the round's live workers; fixed: R set.")
    training_mode: Literal["sync", "async", "ssp"] = Field(
        description="PS_MODE: sync (the barrier), async (each gradient applied on arrival), ssp (async with the "
                    "pull bound PS_SSP_STALENESS).")
    ssp_staleness: int | None = Field(description="ssp: the bound s (null in the other modes).")
    max_staleness: int | None = Field(description="async/ssp: PS_MAX_STALENESS (null: no limit).")
    clocks: Clocks | None = Field(description="async/ssp: the workers' clocks (null in sync: the round is the clock).")
    staleness: StalenessSummary | None = Field(description="async/ssp: staleness of the applied gradients (null in "
                                                           "sync).")
    gradients_applied: int = Field(description="Gradients applied since this process started (every mode; sync: "
                                               "every gradient a round summed into its one update).")
    replicas_to_aggregate: int | None = Field(description="R as configured (null: elastic).")
    total_num_replicas: int | None = Field(description="N as configured (N > R: backup workers).")
    effective_replicas_to_aggregate: int | None = Field(
        description="R of the open round: the gradients it closes with (elastic, or fixed R out of reach: what its "
                    "live members bring).")
    aggregation: str
    optimizer: dict[str, Any] | None = Field(description="The optimizer the PS runs, with its hyper-parameters.")
    round: CurrentRound | None = Field(description="The open round (null before start and when done).")
    wait_reason: str | None = Field(description="What the job is waiting for right now, for humans (null: done).")
    workers: WorkerCounts
    pushes: PushCounts
    loss: Loss
    throughput: Throughput
    examples: int = Field(description="Examples behind all accepted gradients.")
    bytes_received: int = Field(description="Bytes of model and gradient bodies received.")
    bytes_sent: int = Field(description="Bytes of weight bodies sent.")
    shm_bytes_received: int = Field(description="Gradient bytes read from workers' files (same-host transport).")
    compression: dict = Field(description='The job\'s gradient compression of body pushes (PS_COMPRESSION): '
                                          '{"name", "topk_ratio", "threshold", "topk_warmup_steps"}.')
    auth_failures: int = Field(description="Requests refused for a missing or wrong token.")
    started_at: float = Field(description="PS start (Unix s).")
    training_started_at: float | None = Field(description="Round 0 opened (Unix s).")
    uptime_seconds: float
    checkpoint: CheckpointInfo | None
    shard: CoordinatorStatus | ShardStatus | None = Field(None, description=(
        "A sharded PS (PS_SHARDS > 1; null: one PS): this shard, and on the coordinator every shard "
        "(docs/protocol-shards.md)."))
    pair: PairStatus | None = Field(None, description="A hot-standby pair (PS_ROLE; null: none): this PS's role, "
                                                      "the term, the standby's lag (docs/guides/standby.md).")


class PhaseSeconds(BaseModel):
    fetch: float = Field(description="Getting the weights of the step (a pull, and any wait at the barrier in it).")
    compute: float = Field(description="Computing the gradients (WORKER_COMPUTE_DELAY_SECONDS included).")
    push: float = Field(description="Sending the gradients; a push that asks for the next weights waits there "
                                    "for its round to close (the barrier wait).")


class WorkerStaleness(BaseModel):
    last: int | None = Field(description="Staleness of its last applied gradient (global steps).")
    mean: float | None
    max: int | None
    applied: int = Field(description="Its gradients applied since start.")


class StragglerWait(BaseModel):
    name: str
    seconds: float = Field(description="How long it has been at the slowest clock.")


class Blocked(BaseModel):
    clock: int = Field(description="Its clock.")
    needs: int = Field(description="The slowest live clock it waits for: clock - s.")
    slowest: int = Field(description="The slowest live clock now.")
    stragglers: list[StragglerWait] = Field(description="The live workers at the slowest clock.")


class Worker(BaseModel):
    worker_id: str
    name: str
    rank: int
    state: WorkerState = Field(description="Membership state; `late` = active but its last push was late or stale.")
    last_seen: float = Field(description="Unix s of its last request.")
    last_seen_seconds_ago: float
    transport: Literal["shm", "http"] | None = Field(
        description="How its last push travelled: shm = through files in PS_SHM_DIR (same host), http = in the body.")
    registered_at: float
    registrations: int
    last_step: int | None = Field(description="The last step it pushed.")
    last_push_status: str | None
    in_current_round: bool
    awaited: bool = Field(description="The open round is waiting for it.")
    waiting: bool = Field(description="It waits on the barrier (a long-poll pull): its lease holds meanwhile.")
    pushes: PushCounts
    mean_seconds: PhaseSeconds = Field(description="Mean phase times the worker reported with its pushes.")
    last_loss: float | None
    straggler_rounds: int = Field(description="Rounds (of the window) it was the straggler of.")
    straggler_seconds: float = Field(description="What it cost those rounds: sum of their waited_seconds.")
    clock: int | None = Field(description="async/ssp: its clock (iterations completed, counted from the floor it "
                                          "joined at); null in sync.")
    staleness: WorkerStaleness | None = Field(description="async/ssp: staleness of its applied gradients.")
    blocked: Blocked | None = Field(description="ssp: why its next pull waits (more than s clocks ahead); null: it may "
                                                "pull.")


class MembershipEvent(BaseModel):
    time: float
    event: str = Field(description="joined | rejoined | left | expired | recalled (expired at once: a stuck round "
                                   "needs it to register again)")
    worker_id: str
    name: str
    rank: int


class Workers(BaseModel):
    workers: list[Worker] = Field(description="Every member ever registered, by rank.")
    straggler: str | None = Field(description="The member that cost the rounds of the window the most time.")
    window_rounds: int = Field(description="Rounds the straggler counts cover (the last ones).")
    events: list[MembershipEvent] = Field(description=f"The last {EVENTS_SHOWN} membership changes, oldest first.")


class Contributor(BaseModel):
    order: int = Field(description="1 = first arrival.")
    name: str
    rank: int
    worker_id: str
    after_seconds: float = Field(description="Arrival after the round opened.")


class RoundRecord(BaseModel):
    step: int
    opened_at: float
    closed_at: float
    duration_seconds: float
    reason: str = Field(description="full | membership | deadline | unreachable (fixed R out of reach: closed "
                                    "with what the live members brought)")
    aggregated: int = Field(description="Gradients applied.")
    eligible: int = Field(description="Members the round counted.")
    contributors: list[Contributor] = Field(description="Accepted pushes in arrival order.")
    late: list[Contributor] = Field(description="Late pushes for this round (after_seconds may exceed duration).")
    skipped: list[Contributor] = Field(description="Pushes skipped for NaN/Inf (PS_NONFINITE_POLICY=skip), in arrival "
                                                   "order: not applied, and the round no longer waited for them.")
    missing: list[str] = Field(description="Eligible members that never pushed (awaited but never came, or dropped "
                                           "backups); a skipped push is not missing.")
    straggler: Straggler | None = Field(description="Who slowed the round and by how much (null: one contributor).")
    loss: float | None
    examples: int
    replicas_to_aggregate: int | None = Field(None, description="The R the round aimed at (null: elastic).")


class StragglerTotal(BaseModel):
    name: str
    rounds: int = Field(description="Rounds it was the straggler of.")
    waited_seconds: float = Field(description="Sum of those rounds' waited_seconds.")


class Rounds(BaseModel):
    rounds: list[RoundRecord] = Field(description="Newest first.")
    current: CurrentRound | None
    stragglers: list[StragglerTotal] = Field(description="Over the returned rounds, most costly first.")


class LossCurve(BaseModel):
    steps: list[int] = Field(description=f"Steps of the newest {LOSS_KEPT} losses kept (one a closed round), oldest "
                                         "first.")
    loss: list[float] = Field(description="The loss at each of those steps.")
    global_step: int
