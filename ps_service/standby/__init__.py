"""A hot standby (``PS_ROLE`` primary|standby, ``PS_PEER_URL``): this process's part in a pair of PS processes that
hold the same bits (docs/protocol-standby.md says the roles, terms, elections and messages; docs/guides/standby.md).

Contract: the primary answers a worker only once its standby acknowledged every step taken so far
(:meth:`Pair.replicated`, from the snapshot of a state transfer on: ``gated``); the standby acknowledges a step's
message once read and checked and applies it right after the answer went out (:meth:`Pair.settle`; anything that reads
or replaces the model settles first), so a round a worker saw closed is on the standby. One link, two carriers
(:mod:`.link`): a record committed in the standby's same-host log (:mod:`.ring`, read behind by :mod:`.reader`) or a
message acknowledged over HTTP. Only a standby that took its term's state may take over (``synced``). A PS that sees a
newer term accepts no push and becomes a standby (fencing); every change of term or role is on disk before the PS
acts in it (:mod:`.kept`).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections import deque

import numpy as np

from ps_service.monitoring_models import Election as ElectionStatus, PairStatus
from ps_service.standby import messages
from ps_service.standby.election import Election, roster
from ps_service.standby.kept import KeptTerm
from ps_service.standby.link import Link
from ps_service.standby.reader import Reader
from shared.errors import ProtocolError

log = logging.getLogger("ps_service")
PRIMARY, STANDBY, CANDIDATE = "primary", "standby", "candidate"
#: a standby told by a worker that the primary lost its connection asks for votes after this much silence (a
#: primary at work sends a step or a ping at least every quarter of the failover timeout)
REPORTED_SILENCE_SECONDS = 0.4
#: the longest a worker's answer waits for the standby's acknowledgement before it is refused (503, retried)
REPLICATED_WAIT_SECONDS = 10.0
#: what replication has cost this process (``GET /v1/ha`` ``costs``, docs/protocol-standby.md)
COSTS = ("messages", "logged", "encode_s", "send_s", "writer_cpu_s", "exposed_s", "exposed", "read_s", "decode_s",
         "apply_s")


def pair(settings, core) -> "Pair | None":
    return Pair(settings, core) if settings.role else None


class Pair:
    def __init__(self, settings, core) -> None:
        self.settings, self.core = settings, core
        self.peer = settings.peer_url.rstrip("/")
        self.failover = settings.failover_timeout_seconds
        self.role, self.term = STANDBY, 0
        self.kept = KeptTerm(settings.checkpoint_dir) if settings.checkpoint_dir else None  # the term on disk
        self.stored = 0  # the newest term this PS knew (kept on disk)
        self.restarted = False  # a candidate that restarted with its own (checkpoint) state: wins, it serves that
        self.boot = secrets.token_hex(8)
        self.rt = None
        self.link = None  # the primary's sender (.link), started by start()
        # ---- as primary: the steps sent, acknowledged, and the standby's state
        self.seq = 0  # the last message queued
        self.acked = 0  # the last one the standby acknowledged
        self.feeding = False  # the standby has (or is getting) our state of this term: steps are queued for it
        self.gated = False  # every answer waits for its acknowledgement (from the snapshot on: its transfer too)
        self.transferring = False  # the snapshot taken, the standby has not acknowledged the state yet
        self.queue: deque[tuple[int, memoryview, frozenset | None]] = deque()  # (seq, body, roster)
        self.sent_changes = -1  # the membership version last queued
        self.roster_acked: frozenset[str] = frozenset()  # the roster of the last message acknowledged with one
        self.state_roster: frozenset[str] = frozenset()  # the roster of the last state sent
        self.alone_since: float | None = None  # serving without a standby that caught up, since (monotonic)
        self.bytes_sent = 0
        self.transfers = 0
        self.epoch = 0  # snapshots taken: a step answered for an older one is not this standby's
        self._acked = asyncio.Event()
        self._held_since: float | None = None  # the first answer held for message `seq`'s acknowledgement (perf)
        self.costs = dict.fromkeys(COSTS, 0.0)
        # ---- as standby
        self.applied = 0  # the last message taken (acknowledged: applied, or `pending`)
        self.pending: tuple | None = None  # (total, mean_of, contributors) of message `applied`, not applied yet
        self.heard = 0.0  # when the primary was last heard from (monotonic)
        self.synced = False  # the primary gates on us: we may take over
        self.members: list[dict] = []
        self.staleness: dict | None = None
        self.bytes_received = 0
        self.reader = Reader(self)  # the same-host log it reads (.reader)
        # ---- elections
        self.election: Election | None = None
        self.takeovers = 0
        self.last_change: str | None = None
        core.replica = self  # (:class:`ps_service.core.Replica`: on_step)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, rt) -> None:
        """The role to start in (docs/protocol-standby.md, Terms and roles): a PS set primary asks its peer first."""
        self.rt = rt
        self.heard = rt.now()
        self.link = Link(self)
        self.stored = stored = self.kept.load() if self.kept is not None else 0
        peer = await self.link.peer(self.failover * 2)
        if self.settings.role == PRIMARY and peer is None and stored:
            self._restarted(stored)
        elif self.settings.role == PRIMARY and (peer is None or not peer.get("term")):
            self._become(PRIMARY, stored + 1, "started as the primary" + (
                " (its peer does not answer)" if peer is None else f" (its peer has no term; term {stored} kept)"))
        else:
            self._become(STANDBY, 0, "started as the standby" + (
                f" (its peer is the {peer['role']} of term {peer['term']})" if peer else ""))
        self.link.start()
        self.reader.start(self.settings.shm_dir)

    async def close(self) -> None:
        await self.reader.close()
        if self.link is not None:
            await self.link.close()

    def _restarted(self, term: int) -> None:
        """Back with term ``term`` kept and a silent peer: a candidate for ``term + 1`` (its checkpoint's members vote),
        serving from its own state if it wins; no roster: it waits for its peer (:meth:`peer_answers`)."""
        self.term, self.restarted = term, True
        self._stand((roster(self.core.members.export(), kept=True),), False,
                    f"restarted with term {term} kept and its peer does not answer")

    def peer_answers(self, answer: dict) -> None:
        """The link's look at the peer while :attr:`restarted`: a peer without a term leaves the next one to this PS."""
        if self.role == CANDIDATE and self.restarted and not answer.get("term"):
            self._become(PRIMARY, self.election.term, f"its peer answers with no term (the {answer.get('role')})")

    def _become(self, role: str, term: int, why: str) -> None:
        if self.kept is not None:  # on disk before this PS acts in it (never below the term kept: a standby that
            self.stored = max(self.stored, term)  # starts is at term 0 until it gets a state)
            self.kept.save(self.stored, role)
        self.role, self.term, self.election, self.restarted = role, term, None, False
        if role == STANDBY:
            self.core.follow()  # it takes the primary's steps, no membership of its own
        self._said(f"{role} of term {term}: {why}")
        self.feeding = self.gated = self.transferring = False  # a new standby (if any) gets our state first
        self.queue.clear()
        self.alone_since = self.rt.now() if self.rt and role == PRIMARY else None
        self._held_since = None
        self._acked.set()
        if self.rt is not None:
            self.rt.abort_waits()  # waits in flight look again (a standby answers none)

    # ---- the primary ----------------------------------------------------------------------
    def on_step(self, total, mean_of: int, contributors: int) -> None:
        """The core's :class:`~ps_service.core.Replica`: queue this step's input for the standby (a copy: the core
        consumes it)."""
        if self.feeding:  # (a candidate's too: a round its deadline closes is the standby's to apply)
            self._queue(self.core.global_step, total, mean_of, contributors)

    def observe(self) -> None:
        """Runtime observer (O(1) unless membership changed): queue the membership for the standby."""
        if self.feeding and self.core.members.changes != self.sent_changes:
            self._queue(None, None, 1, 0)

    def _queue(self, step, total, mean_of: int, contributors: int) -> None:
        extra, members = {}, None
        core = self.core
        if core.members.changes != self.sent_changes:
            self.sent_changes = core.members.changes
            extra["members"] = core.members.export()
            members = roster(extra["members"])
        if core.modes is not None:
            extra["staleness"] = core.modes.export()
        self.seq += 1
        t = time.perf_counter()
        self.link.send(self.seq, messages.step_parts(step, total, mean_of, contributors, extra), members)
        self.costs["encode_s"] += time.perf_counter() - t
        self.costs["messages"] += 1

    def snapshot(self) -> tuple[int, dict]:
        """The state the standby gets (every step up to ``seq`` in it); the steps after it are queued from now on, and
        every answer waits for the standby's acknowledgements (``gated``)."""
        self.epoch += 1
        self.queue.clear()
        self.feeding = self.gated = self.transferring = True
        self.acked = self.seq
        self.sent_changes = self.core.members.changes
        state = self.core.export_state()
        self.state_roster = roster(state["members"])
        return self.seq, state

    def acknowledged(self, seq: int, members: frozenset | None) -> None:
        self.acked = max(self.acked, seq)
        if members is not None:
            self.roster_acked = members
        if self.transferring and self.feeding:  # the state is there
            self.transferring, self.alone_since = False, None
            self._said(f"{self.role} of term {self.term}: the standby took the state; every answer waits for it")
            if self.role == CANDIDATE and self.election.incumbent:  # it answers again, and has our state: no election
                self.role, self.election = PRIMARY, None
                self.rt.abort_waits()
        if self._held_since is not None and self.acked >= self.seq:
            self.costs["exposed_s"] += time.perf_counter() - self._held_since
            self.costs["exposed"] += 1
            self._held_since = None
        self._acked.set()

    def lost_standby(self, why: str) -> None:
        """The standby has not answered for the failover timeout: if it had our state (we were gating), ask the workers
        (an election for the next term, as incumbent); else go on alone."""
        was_gated = self.gated
        # the rosters the standby may hold: the last it acknowledged, and any of the messages not acknowledged
        rosters = (self.roster_acked, *((self.state_roster,) if self.transferring else ()),
                   *(m[2] for m in self.queue if m[2] is not None))
        self.feeding = self.gated = self.transferring = False
        self.queue.clear()
        if self.alone_since is None:
            self.alone_since = self.rt.now()
        if was_gated and self.role == PRIMARY:
            self._stand(rosters, True, why)
            self._acked.set()  # answers waiting for the standby: refused now (vote)
            self.rt.abort_waits()

    def deposed(self, why: str) -> None:
        """The peer has a newer term: accept no push, wait for its state as its standby."""
        if self.role == STANDBY:
            return
        self.synced = False
        self._become(STANDBY, self.term, f"deposed: {why}")

    async def replicated(self) -> None:
        """Return once the standby acknowledged every step taken so far (at once without a standby that caught up);
        503 if this PS is not the primary, or after :data:`REPLICATED_WAIT_SECONDS` (retried by workers)."""
        if self.role == PRIMARY and (not self.gated or self.acked >= self.seq):
            return
        target, loop = self.seq, asyncio.get_running_loop()
        if self._held_since is None and self.role == PRIMARY:
            self._held_since = time.perf_counter()
        end = loop.time() + REPLICATED_WAIT_SECONDS
        while True:
            self.refuse()
            if not self.gated or self.acked >= target:
                return
            self._acked.clear()
            left = end - loop.time()
            if left <= 0:
                raise ProtocolError(503, "not_replicated", "the standby has not acknowledged this step yet: retry")
            try:
                await asyncio.wait_for(self._acked.wait(), left)
            except TimeoutError:
                pass

    # ---- every role: what a worker's request meets ------------------------------------------
    @property
    def leading(self) -> bool:
        """The primary, or the incumbent candidate (it lost its standby): it feeds a standby (:mod:`.link`)."""
        return self.role == PRIMARY or (self.role == CANDIDATE and self.election.incumbent)

    def refusal(self, term: int | None = None) -> ProtocolError | None:
        """Why this PS takes no training request now (None: it does): 503 ``standby``, ``election`` or ``fenced``."""
        if term is not None and term > self.term and self.role != STANDBY:
            return ProtocolError(503, "fenced", f"a worker has seen term {term}; this PS is at term {self.term}: "
                                                "ask the other PS")
        if self.role == PRIMARY:
            return None
        if self.role == CANDIDATE:
            e = self.election
            return ProtocolError(503, "election", f"the other PS of the pair does not answer: vote for this one "
                                                  f"(POST /v1/ha/vote, term {e.term}; {e.needed} more vote(s) needed)")
        return ProtocolError(503, "standby", f"this PS is the standby (term {self.term}): the primary is {self.peer}")

    def refuse(self) -> None:
        exc = self.refusal()
        if exc is not None:
            raise exc

    def vote(self, term: int, name: str) -> dict:
        e = self.election
        if e is None or term != e.term:
            return {"term": self.term, "role": self.role, "counted": False}
        e.vote(name)
        self._check_won()
        return {"term": self.term, "role": self.role, "counted": name in e.votes, "needed": e.needed}

    def _said(self, change: str) -> None:
        self.last_change = change
        log.warning("hot standby: %s", change)

    def _stand(self, rosters: tuple, incumbent: bool, why: str) -> None:
        """Become a candidate for the next term: the workers' votes decide (:mod:`.election`)."""
        self.role, self.election = CANDIDATE, Election(self.term + 1, rosters, incumbent=incumbent)
        self._said(f"candidate for term {self.term + 1}: {why}")
        self._check_won()

    def _check_won(self) -> None:
        e = self.election
        if e is None or not e.won:
            return
        if e.incumbent:  # the standby is gone: go on alone (an election exists only while this PS is a candidate)
            self._become(PRIMARY, e.term, f"won the election ({len(e.votes)} vote(s)): goes on without a standby")
        elif self.restarted:  # back after a restart: its own state (its checkpoint's), as a primary that starts
            self._become(PRIMARY, e.term, f"won the election after a restart ({len(e.votes)} vote(s)): serves from "
                                          f"step {self.core.global_step}")
        else:  # the standby takes over: the model it holds (every step it acknowledged), the members last replicated
            if self.reader.log is not None:  # its log closed with the new term first (a record committed after is
                self.reader.log.close_for(e.term)  # refused by its writer), then every record committed before taken
            self.reader.drain(None)
            self.reader.drop_log()
            self.settle()
            if not self.synced:  # its step did not apply: it does not hold what it acknowledged
                self.role, self.election = STANDBY, None
                return
            state = {**self.core.model_state(), "members": self.members, "staleness": self.staleness}
            self.core.adopt(state, self.rt.now())
            self.takeovers += 1
            self._become(PRIMARY, e.term, f"took over at step {self.core.global_step} ({len(e.votes)} vote(s))")
        self.rt.notify()

    # ---- the standby ------------------------------------------------------------------------
    def reported(self, now: float) -> None:
        """A worker lost its connection to the primary just now: :data:`REPORTED_SILENCE_SECONDS` of silence will do."""
        self.watch(now, min(self.failover, REPORTED_SILENCE_SECONDS))

    def watch(self, now: float, silence: float | None = None) -> None:
        """The ticker: a standby that took the state of its term and has not heard from its primary for the failover
        timeout (or ``silence``) becomes a candidate for the next term."""
        if self.role == STANDBY and self.synced and now - self.heard > (silence or self.failover):
            self._stand((roster(self.members),), False, f"the primary has not been heard from for "
                                                        f"{now - self.heard:.1f} s")

    def _not_stale(self, term: int) -> None:
        """409 ``stale_term``: a primary's message of an older term (or of this primary's own)."""
        if term < self.term or (term == self.term and self.role == PRIMARY):
            raise ProtocolError(409, "stale_term", f"this PS is the {self.role} of term {self.term}")

    def from_primary(self, term: int, seq: int | None, now: float) -> None:
        """Checks of a primary's message (refusals change nothing): :meth:`_not_stale`, then 409 ``ha_gap`` when this
        PS needs the whole state first (another term, a gap in the steps)."""
        self._not_stale(term)
        if term > self.term or self.role == PRIMARY or self.restarted or (seq is not None and seq > self.applied + 1):
            raise ProtocolError(409, "ha_gap", f"this PS is at message {self.applied} of term {self.term}: send the "
                                               "state (PUT /v1/ha/state)")
        self.heard = now
        if self.role == CANDIDATE:  # the primary is back before anyone won
            self.role, self.election = STANDBY, None
            self.last_change = f"standby of term {self.term}: the primary answers again"

    def apply(self, term: int, seq: int, gated: bool, body, now: float | None) -> dict:
        """Take message ``seq``: checked (from its primary, ``now``: None, a record read at takeover; its step this PS's
        next, its tensors the model's; else 409 ``ha_gap``), the answer acknowledges it; its optimizer step is pending
        until :meth:`settle`."""
        self.settle()  # (first: a step that failed to apply leaves no message taken, and this one a gap)
        if now is not None:
            self.from_primary(term, seq, now)
        if seq <= self.applied:
            return self.answer()
        t = time.perf_counter()
        meta, total = messages.decode_step(body)
        core = self.core
        if meta["step"] is not None:
            if meta["step"] != core.global_step:
                raise ProtocolError(409, "ha_gap", f"a step of {meta['step']} for a standby at step {core.global_step}")
            messages.check_fits(total, core.weights)
            self.pending = (total, meta["mean_of"], meta["contributors"])
        if "members" in meta:
            self.members = meta["members"]
        if "staleness" in meta:
            self.staleness = meta["staleness"]
        self.applied, self.synced = seq, gated
        self.bytes_received += len(body)
        self.costs["decode_s"] += time.perf_counter() - t
        self.costs["messages"] += 1
        return self.answer()

    def settle(self) -> None:
        """Apply the pending step (of the message taken last), if any. Should it fail (it cannot, for a message that
        fits the model), this PS no longer holds the primary's bits: it may not take over, and the primary's next
        message gets 409 ``ha_gap`` (the state again). With a log, the messages taken are its header's ``applied``
        then (their slots the primary's again)."""
        if self.pending is not None:
            (total, mean_of, contributors), self.pending = self.pending, None
            t = time.perf_counter()
            try:
                self.core.apply_round(total, mean_of, contributors)
            except Exception:
                log.exception("hot standby: the step of message %d did not apply: the state again", self.applied)
                self.applied, self.synced = 0, False
            self.costs["apply_s"] += time.perf_counter() - t
        if self.reader.log is not None and self.applied:
            self.reader.log.applied = self.applied

    def ping(self, term: int, seq: int, gated: bool, now: float) -> dict:
        self.from_primary(term, None, now)
        self.reader.drain(now)
        self.settle()
        if seq > self.applied:
            raise ProtocolError(409, "ha_gap", f"the primary acknowledged message {seq}; this PS has {self.applied}")
        self.synced = gated  # (a ping comes when every message is acknowledged)
        return self.answer()

    def adopt(self, term: int, seq: int, state: dict, size: int, now: float) -> dict:
        """A primary's state (the transfer): become its standby at message ``seq`` of ``term``."""
        self._not_stale(term)
        self.pending = None  # the state holds it
        self.core.adopt(state, now)
        self.members, self.staleness = state["members"], state.get("staleness")
        self.applied, self.synced, self.heard = seq, True, now  # the primary waits for us from its snapshot on
        self.bytes_received += size
        self._become(STANDBY, term, f"got the state of step {self.core.global_step} from the primary")
        self.reader.new_log()
        return self.answer()

    def answer(self) -> dict:
        return {"role": self.role, "term": self.term, "applied": self.applied,
                "step": self.core.global_step + (self.pending is not None),
                "boot": self.boot, "synced": self.synced, "gated": self.gated,
                "log": None if self.reader.log is None else self.reader.log.advert()}

    def digest(self) -> str | None:
        """sha256 of the step, the optimizer's iterations, every weight's and slot's bytes in name order (None: no
        model): two PS with the same digest hold the same bits."""
        self.settle()
        core = self.core
        if not core.initialized:
            return None
        h = hashlib.sha256(f"{core.global_step} {core.optimizer.iterations}".encode())
        slots = core.optimizer.slots
        for prefix, arrays in [("", core.weights), *((f"{name}/", slots[name]) for name in sorted(slots))]:
            for k in sorted(arrays):
                h.update(f"{prefix}{k}".encode() + b"\0")
                h.update(np.ascontiguousarray(arrays[k]).tobytes())
        return h.hexdigest()

    # ---- monitoring -------------------------------------------------------------------------
    def status(self) -> PairStatus:
        primary, e = self.leading, self.election
        behind, logged_bytes = self.link.log_behind() if self.link is not None else (None, 0)
        return PairStatus(
            role=self.role, term=self.term, peer=self.peer, boot=self.boot,
            standby=("catching_up" if self.transferring else "in_sync" if self.gated else "none") if primary else None,
            alone_seconds=None if self.alone_since is None or not primary else self.rt.now() - self.alone_since,
            lag_rounds=self.seq - min(self.acked, self.acked if behind is None else behind) if primary else None,
            lag_bytes=sum(len(m[1]) for m in self.queue if m[0] > self.acked) + logged_bytes if primary else None,
            applied=self.applied, synced=self.synced,
            election=e and ElectionStatus(term=e.term, votes=sorted(e.votes), needed=e.needed),
            takeovers=self.takeovers, transfers=self.transfers, bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received, last_change=self.last_change)
