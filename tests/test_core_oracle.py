"""The incremental core against its oracle (tests/naive_core.py: the same core with plain scans instead of
kept counts, heaps and sorted frontiers), by simulation: random sequences of register, leave, heartbeat,
begin_wait, end_wait, claim and release (a push's head, its read failed), push (any step, finite or not) and tick
with time jumps (leases running out) give the same answers, statuses, closes, round records, awaited members, wait
reasons, the sum made so far, whose push is read next and final weights; every rank is one worker's. The oracle is
live: every scan it stands on is one the core calls (a scan the core no longer calls would leave it comparing the
core with itself)."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.core import membership
from ps_service.core import ParameterServerCore, PushResult
from tests.configs import core_config
from ps_service.core.membership import Member
from ps_service.http import REFUSALS, status_of
from shared.protocol import ModelInit, PushRequest
from tests.test_core import check_ranks
from tests.naive_core import NaiveCore, NaiveMembership, NaiveRound, NaiveRule, naive_progress

NAMES = ("a", "b", "c", "d", "e")
W0 = {"w": np.zeros(3, np.float32)}

configs = st.fixed_dictionaries({
    "replicas_to_aggregate": st.sampled_from([None, None, 1, 2, 3]),
    "min_replicas": st.sampled_from([1, 2]),
    "round_timeout_seconds": st.sampled_from([None, 4.0]),
    "nonfinite_policy": st.sampled_from(["reject", "skip"]),
    "min_workers": st.integers(1, 3),
    "startup_grace_seconds": st.sampled_from([0.0, 1.0]),
    "lease_seconds": st.just(3.0),
})
names = st.sampled_from(NAMES)
#: pushes for the open round dominate, as in a job; the rest moves membership and time
KINDS = ["push"] * 8 + ["register", "register", "leave", "touch", "begin_wait", "end_wait", "tick", "tick", "claim",
                        "claim", "release"]
JUMPS = (0.0, 0.5, 1.0, 2.0, 3.5, 7.0)
OFFSETS = (0, 0, 0, 0, -1, -2, 1)
#: one call, drawn as plain integers (cheap to draw and to shrink): kind, name, tick jump or push offset, finite
ops = st.tuples(st.integers(0, len(KINDS) - 1), st.integers(0, len(NAMES) - 1), st.integers(0, len(OFFSETS) - 1),
                st.integers(0, 9))


def decode(core: ParameterServerCore, kind: int, name: int, arg: int, finite: int) -> tuple:
    """The call: a push comes mostly from a member that has not pushed the open step yet (as in a job)."""
    kind = KINDS[kind]
    if kind == "tick":
        return kind, JUMPS[arg % len(JUMPS)]
    if kind == "push":
        due = [m.name for m in core.members.by_id.values() if core.global_step not in m.recent]
        who = due[name % len(due)] if due and name < 4 else NAMES[name]
        return kind, who, OFFSETS[arg], finite > 0
    return kind, NAMES[name]


class Ids:
    """Deterministic worker ids (a core's n-th new member gets the same id in both cores)."""

    def __init__(self) -> None:
        self.n = itertools.count()

    def token_hex(self, nbytes: int) -> str:
        return f"id{next(self.n):0{2 * nbytes - 2}d}"


def call(core, ids: Ids, fn):
    saved, membership.secrets = membership.secrets, ids
    try:
        return "ok", summary(fn(core))
    except REFUSALS as e:
        return "error", status_of(e), e.code
    finally:
        membership.secrets = saved


def summary(result):
    if isinstance(result, Member):
        return result.worker_id, result.name, result.rank, result.state, result.lease_until
    if isinstance(result, tuple):
        return tuple(summary(x) for x in result)
    if isinstance(result, PushResult):
        return result.status.value, result.step, result.closed
    return result


def operation(op, now: float):
    """The call ``op`` makes, as a function of the core it is made on."""
    kind, name = op[0], op[1]

    def wid(c):
        m = c.members.by_name.get(name)
        return m.worker_id if m is not None else f"unknown-{name}"

    if kind == "register":
        return lambda c: c.register(name, now)
    if kind == "push":
        offset, finite = op[2], op[3]
        value = np.float32(np.nan) if not finite else np.float32(0.1 * 3.7 ** NAMES.index(name))
        return lambda c: c.push(PushRequest(wid(c), c.global_step + offset,
                                            {"w": np.full(3, value + c.global_step, np.float32)}), now)
    if kind == "leave":
        return lambda c: c.leave(wid(c), now)
    if kind == "claim":  # a push's head, before its tensors are read (fixed R: it counts here)
        return lambda c: c.claim(wid(c), c.global_step)
    if kind == "release":  # the read failed (fixed R: the head gives its place back)
        return lambda c: c.release(wid(c))
    return lambda c: getattr(c.members, kind)(wid(c), now)  # touch (a heartbeat), begin_wait, end_wait


def snapshot(core: ParameterServerCore, now: float) -> dict:
    r = core.round
    out = {
        "step": core.global_step, "state": core.state(), "push_counts": dict(core.push_counts),
        "members": [(m.worker_id, m.name, m.state, m.rank, m.lease_until, m.registrations,
                     core.members.waits.get(m.worker_id, 0)) for m in core.members.all()],
        "events": list(core.members.events), "active": [m.worker_id for m in core.members.active()],
        "active_count": core.members.active_count, "free_rank": core.members._free_rank(),
        "rounds": [(rec.step, rec.reason, rec.aggregated, rec.eligible, rec.missing, rec.closed_at, rec.straggler,
                    [a.worker_id for a in rec.contributors], [a.worker_id for a in rec.late]) for rec in core.rounds],
        "wait_reason": core.wait_reason(now), "readers": core.readers(), "ranks": core.ranks(),
    }
    if r is not None:
        p = core.progress(now)
        out["round"] = (r.step, r.opened_at, dict(r.eligible), set(r.gone), set(r.skipped), set(r.acc.keys),
                        list(r.acc.folded), list(r.heads), set(r.lost))  # folded: the sum made so far
        out["progress"] = (p.waiting, p.needed, p.unreachable, p.reason, p.effective, p.stuck, p.awaited)
        out["needed"] = core.progress().needed
    return out


def check_counts(core: ParameterServerCore, now: float) -> None:
    """The incremental core's kept counts are what the scans find."""
    check_ranks(core)
    r = core.round
    if r is None:
        return
    live = [w for w in r.eligible if r.counts(w) and core.members.by_id[w].active]
    awaited = [w for w in live if w not in r.acc and w not in r.skipped and w not in r.lost]
    assert (r.live, r.waiting) == (len(live), len(awaited))
    ms = core.members
    naive = naive_progress(core.rule, r, lambda w: ms.by_id[w].active, None if ms.held else now,
                           max(r.opened_at, ms.released_at))
    fast = core.progress(now)
    assert (fast.waiting, fast.needed, fast.unreachable, fast.reason, fast.effective, fast.awaited) == \
        (naive.waiting, naive.needed, naive.unreachable, naive.reason, naive.effective, naive.awaited)
    assert r.ranks == tuple(sorted(r.eligible.values()))


@settings(max_examples=150, deadline=None)
@given(cfg=configs, first=st.lists(names, min_size=1, max_size=5, unique=True),
       script=st.lists(ops, min_size=10, max_size=120))
def test_the_incremental_core_decides_exactly_as_the_scans(cfg, first, script):
    cores = [ParameterServerCore(core_config(**cfg)), NaiveCore(core_config(**cfg))]
    ids = [Ids(), Ids()]
    now = 0.0
    for core in cores:
        core.init_model(ModelInit({"w": W0["w"].copy()}, {"name": "sgd", "learning_rate": 0.5}), now)
    for step in [("register", name) for name in first] + script:
        step = decode(cores[0], *step) if isinstance(step[0], int) else step
        now += step[1] if step[0] == "tick" else 0.25
        fn = (lambda c, now=now: c.tick(now)) if step[0] == "tick" else operation(step, now)
        results = [call(c, i, fn) for c, i in zip(cores, ids)]
        assert results[0] == results[1], step
        check_counts(cores[0], now)
        assert snapshot(cores[0], now) == snapshot(cores[1], now), step
    assert cores[0].weights["w"].tobytes() == cores[1].weights["w"].tobytes()


def test_every_scan_of_the_oracle_is_one_the_core_calls(monkeypatch):
    """Each method and property the naive classes override is called by a short job on NaiveCore: a rename in the
    core (a method the naive class overrides that the core no longer has) fails here."""
    calls: dict[str, int] = {}

    def spy(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for cls in (NaiveMembership, NaiveRound, NaiveRule):
        for name, attr in vars(cls).items():
            if name.startswith("__") or not (callable(attr) or isinstance(attr, property)):
                continue
            key = f"{cls.__name__}.{name}"
            calls[key] = 0
            if isinstance(attr, property):
                attr = property(spy(key, attr.fget), attr.fset and spy(key, attr.fset))
            else:
                attr = spy(key, attr)
            monkeypatch.setattr(cls, name, attr)
    core, ids, now = NaiveCore(core_config(round_timeout_seconds=4.0, lease_seconds=3.0,
                                                   startup_grace_seconds=0.0)), Ids(), 0.0
    core.init_model(ModelInit({"w": W0["w"].copy()}, {"name": "sgd", "learning_rate": 0.5}), now)
    script = [("register", "a"), ("register", "b"), ("register", "c"), ("tick", 0.0), ("push", "b", 0, True),
              ("push", "a", 0, True), ("push", "c", 0, True), ("leave", "a"), ("register", "d"), ("register", "a"),
              ("tick", 7.0)]
    for op in script:
        now += op[1] if op[0] == "tick" else 0.25
        got = call(core, ids, (lambda c, now=now: c.tick(now)) if op[0] == "tick" else operation(op, now))
        assert got[0] == "ok", (op, got)
        core.readers(), core.ranks(), core.wait_reason(now)
    assert core.global_step == 1 and core.rounds[0].reason == "full"
    assert all(calls.values()), calls
