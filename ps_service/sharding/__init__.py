"""A sharded PS (``PS_SHARDS`` = S > 1): this process's part in it (docs/protocol-shards.md); :func:`role` is None
on an unsharded PS, and nothing here runs then.

Shard 0, the *coordinator*, alone holds membership, the barrier and the round records, and owns a share of the
tensors; shards 1..S-1, the *followers*, own their share (:mod:`shared.shards`) and its optimizer slots, hold pushes
(:mod:`.holds`) and decide nothing. A commit counts only with every follower's receipt of its hold (:mod:`.receipts`).
When round s is decided (the core tells it: ``core.told``, read by :meth:`ShardRole.tell` after every core call),
"apply round s with C" is queued for every follower (:mod:`.links`), who sums the held pieces of C in rank order and
steps the same optimizer, bit for bit the coordinator's. A follower whose pieces are large sums a round as it fills
and reads a hold only in its worker's turn (:mod:`.turns`), so its memory stays flat in the worker count. A follower
that restarted makes the coordinator roll the job back live to the newest checkpoint step every shard has
(:mod:`.rollback`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
from pathlib import Path

import numpy as np

from ps_service.auth import peer_token
from ps_service.checkpoint import CheckpointError, checkpoint_name, decode, list_checkpoints, step_of
from ps_service.core import Lost, rounds
from ps_service.core.membership import FOLLOWER
from ps_service.core.model import check_weights
from ps_service.monitoring_models import CoordinatorStatus, FollowerRow, ShardRow, ShardStatus
from ps_service.sharding import parts, receipts, rollback
from ps_service.sharding.holds import Holds, passed
from ps_service.sharding.links import APPLY, Links
from ps_service.sharding.turns import FOLD_BYTES, Gate, Tracker
from shared import frame, marks
from shared.errors import ProtocolError, unprocessable
from shared.protocol import ModelInit
from shared.shards import ShardMap, from_wire, plan, spec_of, split

log = logging.getLogger("ps_service")
SIDECAR = "shard-map.json"


def role(settings, core) -> "ShardRole | None":
    return ShardRole(settings, core) if settings.shards > 1 else None


class ShardRole:
    def __init__(self, settings, core) -> None:
        self.index, self.count = settings.shard_index, settings.shards
        self.urls = settings.shard_url_list
        self.split_elements = settings.shard_split_elements
        self.core = core
        self.holds = Holds(lambda key, tensors: parts.fold(core, key, tensors))  # a follower's sums: its round's
        self.map: ShardMap | None = None
        self.initialising = False
        self.links = (Links(self.urls, peer_token(settings), settings.http_keepalive_seconds) if self.coordinator
                      else None)
        self.sidecar = Path(settings.checkpoint_dir) / SIDECAR if settings.checkpoint_dir else None
        self.boot = secrets.token_hex(8)  # this process: a follower answering with another one restarted
        self.rt, self.checkpointer = None, None  # set by start: the runtime and this shard's checkpoint writer
        self.rollbacks, self.last_rollback = 0, None  # the coordinator's live rollbacks, and what the last one did
        # the hold receipts' key (.receipts): the coordinator's own; a follower's as the coordinator last gave it
        self.receipt_key: bytes | None = receipts.new_key() if self.coordinator else None
        self._rolling: asyncio.Task | None = None
        self.tracker = Tracker()  # the coordinator: the open round's order, as its folding followers last heard it
        self.gate = Gate()  # a follower: holds waiting for their turn
        self._folding: list[int] = []  # the coordinator: the followers that sum as told (:meth:`folds`)
        self._folds_here = False  # a follower that sums as told
        self.partitioned = settings.partition_bytes > 0  # (.parts): no receipts, no commits, no progress
        if not self.coordinator:
            core.follow()
        else:
            core.told = []  # (:meth:`tell`)

    @property
    def coordinator(self) -> bool:
        return self.index == 0

    @property
    def digest(self) -> str | None:
        return None if self.map is None else self.map.digest

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, rt, checkpointer=None) -> None:
        """App start, after a checkpoint restore: the kept map; the coordinator's links, and its start-up check."""
        core = self.core
        self.rt, self.checkpointer = rt, checkpointer
        if core.initialized:
            self._load_map()
        if not self.coordinator:
            return
        self.links.on_restart = self._follower_restarted
        self.links.start()
        if core.initialized:  # restored: registration waits (503) until every follower is at our step
            self.links.blocked = "checking that every shard restored the same step"
            self.links.tasks.append(asyncio.create_task(rollback.check_start(self)))

    def _load_map(self) -> None:
        if self.sidecar is not None and self.sidecar.exists():
            self._set_map(from_wire(json.loads(self.sidecar.read_text())), keep=False)

    def _set_map(self, m: ShardMap, keep: bool = True) -> None:
        """Take the map (``keep``: and write it next to the checkpoints)."""
        self.map = m
        self._folding = [i for i in range(1, self.count) if self.folds(i)]
        self._folds_here = not self.coordinator and self.folds(self.index)
        if keep and self.sidecar is not None:
            self.sidecar.parent.mkdir(parents=True, exist_ok=True)
            self.sidecar.write_text(json.dumps(m.to_wire()))

    def folds(self, index: int) -> bool:
        """Follower ``index`` sums a round as told and reads holds in their turn (:mod:`.turns`): its pieces weigh
        :data:`.turns.FOLD_BYTES` or more, and rounds are not partitioned."""
        return not self.partitioned and self.map is not None and self.map.bytes_owned(index) >= FOLD_BYTES

    def need(self, coordinator: bool, what: str = "ask shard 0") -> None:
        """409 ``not_coordinator`` unless this shard is the coordinator (``coordinator``), or 409 ``not_follower``
        unless it is a follower."""
        if coordinator and not self.coordinator:
            raise ProtocolError(409, "not_coordinator", f"this is shard {self.index} of {self.count}: {what}")
        if not coordinator and self.coordinator:
            raise ProtocolError(409, "not_follower", "this is the coordinator (shard 0)")

    def admit(self) -> None:
        """Registration: the coordinator's (:meth:`need`), 503 while the shards are not at one step."""
        self.need(True, "workers register with shard 0, the coordinator")
        if self.links is not None and self.links.blocked:
            raise ProtocolError(503, "shards_inconsistent", self.links.blocked)

    # ---- the coordinator ----------------------------------------------------------------
    def tell(self) -> None:
        """What the core told (``core.told``, read after every core call, before any await: :meth:`Runtime.deliver`),
        queued for the followers: a decided round's apply (partitioned rounds: its decision, with its contributors lost
        before it), while the coordinator steps its own share, then the pieces held for it dropped; a contributor lost
        mid-round (partitioned rounds). Plain values onto unbounded queues first: nothing before can fail, so no
        decision is lost."""
        core = self.core
        told, core.told = core.told, []
        for t in told:
            if isinstance(t, Lost):  # the followers close round t.step without that worker
                if self.partitioned:  # (one partition: no round is decided across calls)
                    self.links.queue("/shard/lost", {"step": t.step, "workers": [t.worker_id]})
                continue
            rec = t.record
            contributors = sorted([a.rank, a.worker_id] for a in rec.contributors)
            self.links.queue(APPLY, {"step": rec.step, "contributors": contributors, "mean_of": rounds.mean_of(
                core.config.aggregation, len(contributors))} | ({"lost": sorted(t.lost)} if self.partitioned else {}))
            self.holds.drop_through(rec.step)  # pieces held for the round and never committed
            if marks.ON:
                marks.mark("decision.queued", step=rec.step)

    def observe(self) -> None:
        """Runtime observer: the open round's progress if it moved, for the followers that sum as told
        (:mod:`.turns`)."""
        if self._folding and self.links.tasks:
            msg = self.tracker.message(self.core)
            if msg is not None:
                self.links.queue("/shard/progress", msg, self._folding)

    async def init_model(self, init: ModelInit) -> ModelInit:
        """Plan the map, give every follower its pieces, return the coordinator's own (409 while another init runs)."""
        core = self.core
        if self.initialising or core.initialized:
            raise ProtocolError(409, "already_initialized", "the model is initialised (or being initialised); pull it")
        check_weights(init.tensors)
        try:
            m = plan(spec_of(init.tensors), self.count, self.split_elements)
        except ValueError as exc:
            raise unprocessable("too_few_pieces", str(exc)) from None
        spec = core.optimizer_spec(init.optimizer)
        self.initialising = True
        try:
            meta = {"optimizer": spec, "map": m.to_wire(), "receipt_key": self.receipt_key.hex()}
            await self.links.init_followers({i: frame.encode_bytes(split(init.tensors, m.pieces[i]), meta)
                                             for i in range(1, self.count)})
        finally:
            self.initialising = False
        self._set_map(m)
        return ModelInit(split(init.tensors, m.pieces[0]), spec)

    # ---- a follower ---------------------------------------------------------------------
    def init_follower(self, f: frame.Frame, now: float) -> dict:
        """``PUT /v1/shard/model``: this follower's pieces and the receipt key (the same map again at step 0: 200)."""
        core = self.core
        key = receipts.parse_key(f.meta.get("receipt_key"))
        if key is None:
            raise ProtocolError(400, "bad_field", "receipt_key must be 64 hex digits")
        try:
            m = from_wire(f.meta["map"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(409, "shard_map_mismatch",
                                f"the coordinator's shard map does not check here: {exc}") from None
        if (m.shards, m.split_elements) != (self.count, self.split_elements):
            raise ProtocolError(409, "shard_map_mismatch",
                                f"the coordinator plans {m.shards} shards split at {m.split_elements} elements; "
                                f"this shard runs PS_SHARDS={self.count}, "
                                f"PS_SHARD_SPLIT_ELEMENTS={self.split_elements}")
        if set(f.tensors) != {p.key for p in m.pieces[self.index]}:
            raise ProtocolError(409, "shard_map_mismatch", f"the pieces sent are not shard {self.index}'s")
        if core.initialized and (self.digest != m.digest or core.global_step != 0):
            raise ProtocolError(409, "already_initialized", f"shard {self.index} holds a model at step "
                                                            f"{core.global_step} (map {self.digest})")
        if not core.initialized:  # (else the same map at step 0: a coordinator started afresh, and its key)
            optimizer = f.meta.get("optimizer")
            if not isinstance(optimizer, dict):
                raise ProtocolError(400, "bad_field", "optimizer must be a map")
            core.optimizer_overrides = {}  # the coordinator resolved the spec with its settings
            core.init_model(ModelInit(dict(f.tensors), optimizer), now)
            self._set_map(m)
        self.receipt_key = key
        return {"step": core.global_step, "digest": m.digest}

    async def turn(self, worker_id: str, step: int, seconds: float, last: bool = True) -> bool:
        """A follower's hold waits for its turn (the seam's ``turn``; :class:`.turns.Gate`), at once if this shard
        does not sum as told or has no receipt key (it restarted: the hold is refused once read)."""
        if not self._folds_here or self.receipt_key is None:
            return True
        holds, core = self.holds, self.core

        def may() -> bool:  # a late hold: one read at a time (the follower core's intake; the seam releases it)
            return holds.may_read(worker_id, step, core.global_step) and (
                not holds.late_for(worker_id, step) or core.intake.claim(worker_id, late=True))
        return await self.gate.wait(may, seconds, last)

    def apply(self, step: int, contributors, mean_of: int, lost, now: float) -> bool:
        """``POST /v1/shard/apply``: round ``step``'s decision (:func:`.parts.decide`): unpartitioned, its held pieces
        summed first (:meth:`.holds.Holds.fold`); partitioned, with ``lost``."""
        core = self.core
        if marks.ON and self.partitioned:
            marks.mark("decision.in", step=step, shard=self.index)
        if passed(core.global_step, step):
            return False
        if contributors and not self.partitioned:
            self.holds.fold(step, 0, contributors, whole=True)
            own = rounds.mean_of(core.config.aggregation, len(contributors))
            if mean_of != own:  # (the coordinator's PS_AGGREGATION is not this shard's)
                log.warning("round %d: the coordinator divides by %d, this shard by %d: set PS_AGGREGATION alike on "
                            "every shard", step, mean_of, own)
        done = parts.decide(core, step, contributors, now)
        parts.drop(core, step, lost, now)
        self.holds.drop_through(step)
        return done

    # ---- checkpoints (the coordinator's choice of one step for every shard) --------------------
    def checkpoint_steps(self) -> list[int]:
        """The steps of this shard's checkpoints on disk, newest first ([] without PS_CHECKPOINT_DIR)."""
        return [step_of(p) for p in list_checkpoints(self.sidecar.parent)] if self.sidecar else []

    def step_state(self, step: int) -> dict:
        """The model of ``step``: its checkpoint's, else the live one at ``step``; 404/409 ``unknown_checkpoint``."""
        if self.sidecar is not None and step in self.checkpoint_steps():
            path = self.sidecar.parent / checkpoint_name(step)
            try:
                return decode(path.read_bytes(), step)
            except (OSError, CheckpointError) as exc:
                raise ProtocolError(409, "unknown_checkpoint",
                                    f"shard {self.index}: {path.name} is unusable: {exc}") from None
        if self.core.initialized and self.core.global_step == step:
            return self.core.model_state()
        raise ProtocolError(404, "unknown_checkpoint", f"shard {self.index} has no checkpoint of step {step} "
                                                       f"(it has {self.checkpoint_steps()})")

    async def go_back(self, state: dict, now: float) -> None:
        """Rewind the core live to ``state``, drop every held push, wait for the checkpoint writes in flight and
        delete the checkpoints of later steps (a future the job abandoned: never mixed with the redone steps')."""
        step = state["global_step"]
        self.core.rewind(state, now)
        self.holds = Holds(self.holds.into)
        self.gate.wake()  # holds waiting for their turn: their step is gone
        if self.coordinator:
            self.tracker.reset()
        else:
            self.core.follow()
        if self.rt is not None:
            self.rt.tensors.drop_body()  # the weights answer encoded for the step left behind
            self.rt.notify()  # waits in flight answer now (the barrier counts rewinds)
        if self.checkpointer is not None:
            for write in self.checkpointer.rewound(step):
                await asyncio.wrap_future(write)
        for newer in self.checkpoint_steps():
            if newer > step:
                (self.sidecar.parent / checkpoint_name(newer)).unlink(missing_ok=True)

    async def restore_step(self, step: int, key: bytes, now: float) -> None:
        """``POST /v1/shard/restore``: back to ``step``, with the coordinator's receipt ``key``."""
        await self.go_back(self.step_state(step), now)
        self.receipt_key = key
        self._load_map()
        log.warning("shard %d: back at step %d at the coordinator's request", self.index, step)

    def _follower_restarted(self, f, why: str) -> None:
        """:attr:`Links.on_restart`: roll the job back live, one rollback at a time (before the model exists the link
        goes on)."""
        if not self.core.initialized:
            f.error = None
            return
        if self._rolling is None or self._rolling.done():
            self._rolling = asyncio.create_task(rollback.roll_back(self, why))

    def hold_leases(self, now: float) -> None:
        """The coordinator's tick: no lease runs out and no round closes by its deadline while a follower is silent
        (:meth:`.links.Links.silent`)."""
        if self.links is not None:
            (self.core.members.hold if self.links.silent() else self.core.members.release)(FOLLOWER, now)

    # ---- monitoring ---------------------------------------------------------------------
    def wait_reason(self, now: float) -> str | None:
        """What this shard waits for (``/v1/status``)."""
        core = self.core
        if self.coordinator:
            silent = ", ".join(f"shard {f.index} at {f.url}" for f in self.links.silent())
            return self.links.blocked or (silent and f"{silent} does not answer: no round can be applied without it "
                                          "(no worker's lease runs out meanwhile)") or core.wait_reason(now)
        if not core.initialized:
            return "follower: waiting for the coordinator to give it its pieces of the model"
        return None if core.done else f"follower: waiting for the coordinator to close round {core.global_step}"

    def view(self) -> ShardStatus:
        """``/v1/status``'s ``shard`` block: this shard, and on the coordinator every shard."""
        core = self.core
        own = sum(int(np.asarray(w).nbytes) for w in (core.weights or {}).values())
        this = dict(index=self.index, count=self.count, role="coordinator" if self.coordinator else "follower",
                    step=core.global_step, bytes_owned=own, held_pushes=len(self.holds), map_digest=self.digest,
                    boot=self.boot)
        if not self.coordinator:
            return ShardStatus(**this)
        rows = [ShardRow(index=0, url=self.urls[0], step=core.global_step, reachable=True, bytes_owned=own, error=None)]
        rows += [FollowerRow(index=f.index, url=f.url, step=f.step, reachable=f.reachable, error=f.error,
                             bytes_owned=self.map and self.map.bytes_owned(f.index), rounds_queued=f.queue.qsize())
                 for f in self.links.followers]
        return CoordinatorStatus(**this, shards=rows, blocked=self.links.blocked, rollbacks=self.rollbacks,
                                 leases_held=FOLLOWER in core.members.holds, last_rollback=self.last_rollback)
