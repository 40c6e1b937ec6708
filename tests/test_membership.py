"""Membership's kept structures (issue 17): the lease heap, the active set and the free ranks give what the
scans gave (tests/naive_core.py), and a member that rejoins a stuck round keeps its rank, a newcomer joining it
taking one the round does not list."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.core import ParameterServerCore
from tests.configs import core_config
from ps_service.core.membership import EXPIRED, FOLLOWER, LEFT, RECONNECT_SECONDS, SILENCE, Membership
from ps_service.http import REFUSALS
from shared.protocol import ModelInit, PushRequest
from tests.naive_core import NaiveMembership


def test_renewing_a_lease_costs_no_heap_entry_and_a_lease_ends_on_time():
    ms = Membership(lease_seconds=2.0)
    a, _ = ms.register("a", 0.0)
    b, _ = ms.register("b", 0.0)
    for t in range(1, 50):
        ms.touch(a.worker_id, t * 0.1)
    assert len(ms.leases.heap) == 2  # one entry per member, whatever the renewals
    assert ms.expire(2.0, False) == [] and ms.expire(2.01, False) == [b]  # b's lease is [0, 2]
    assert ms.expire(6.9, False) == [] and ms.expire(6.91, False) == [a]  # a's last renewal at 4.9
    assert (a.state, b.state, ms.active_count, ms.leases.heap) == (EXPIRED, EXPIRED, 0, [])


def test_simultaneous_expiries_come_in_registration_order_and_waits_hold_the_lease():
    ms = Membership(lease_seconds=1.0)
    members = [ms.register(name, t)[0] for name, t in (("z", 0.5), ("y", 0.0), ("x", 0.2))]
    ms.begin_wait(members[2].worker_id, 0.9)  # x waits on the barrier
    assert [m.name for m in ms.expire(5.0, False)] == ["z", "y"]
    assert ms.expire(50.0, False) == [] and members[2].active
    ms.end_wait(members[2].worker_id, 50.0)  # its lease runs from the end of the wait
    assert ms.expire(51.0, False) == [] and [m.name for m in ms.expire(51.01, False)] == ["x"]


def test_held_leases_run_out_for_nobody_and_run_whole_from_the_release():
    """Held, no lease runs out; released, each runs a lease and the reconnect allowance (5 s) from then."""
    assert RECONNECT_SECONDS == 5.0
    ms = Membership(lease_seconds=10.0)
    ms.register("a", 0.0)
    ms.register("b", 5.0)
    ms.hold(FOLLOWER, 8.0)
    ms.hold(FOLLOWER, 9.0)  # held since 8: holding again changes nothing
    assert ms.holds == {FOLLOWER: 8.0} and ms.expire(100.0, False) == []
    ms.release(FOLLOWER, 100.0)
    assert ms.holds == {} and ms.expire(114.9, False) == []
    assert [m.name for m in ms.expire(115.1, False)] == ["a", "b"]
    ms.release(FOLLOWER, 200.0)  # not held: nothing renewed
    ms.register("c", 200.0)
    ms.hold(FOLLOWER, 201.0)
    ms.release(FOLLOWER, 201.5)
    assert ms.expire(216.4, False) == [] and [m.name for m in ms.expire(216.6, False)] == ["c"]


def test_a_lease_set_earlier_by_hand_is_honoured():
    ms = Membership(lease_seconds=100.0)
    m, _ = ms.register("a", 0.0)
    m.lease_until = 1.0
    assert ms.expire(1.5, False) == [m]


def test_free_ranks_are_the_lowest_ones_not_held_by_a_present_member():
    ms = Membership(lease_seconds=10.0)
    ms.load([{"worker_id": "p", "name": "p", "rank": 4, "state": "active"},
             {"worker_id": "q", "name": "q", "rank": 1, "state": "left"}], 0.0)
    ranks = [ms.register(n, 0.0)[0].rank for n in ("a", "b", "c", "d")]
    assert ranks == [0, 1, 2, 3]  # 4 is p's (expired, present); q left: its rank is free
    ms.leave(ms.by_name["b"].worker_id, 1.0)
    ms.leave(ms.by_name["a"].worker_id, 1.0)
    assert ms.register("e", 2.0)[0].rank == 0
    assert ms.register("q", 2.0)[0].rank == 1  # q's old rank was free again: it gets it back
    assert ms.register("b", 2.0)[0].rank == 5  # b's rank 1 is q's now


def test_a_silence_of_every_worker_expires_nobody_and_the_first_heard_gives_each_a_whole_lease():
    """No worker heard from for half a lease (the PS cut off, or paused): nobody expires, whatever the leases;
    the first worker heard from ends the silence and every other gets a lease and the reconnect allowance from then."""
    ms = Membership(lease_seconds=10.0)
    a, b, c = (ms.register(n, 0.0)[0] for n in "abc")
    for t in (3.0, 6.0):
        for m in (a, b, c):
            ms.touch(m.worker_id, t)
    assert ms.expire(10.9) == [] and ms.holds == {}  # heard 4.9 s ago: not silent
    assert ms.expire(11.0) == [] and (ms.holds, ms.held) == ({SILENCE: 6.0}, True)
    assert ms.expire(60.0) == [] and all(m.active for m in (a, b, c))
    ms.touch(b.worker_id, 60.0)  # the first one back
    assert (ms.holds, ms.held, ms.released_at) == ({}, False, 60.0)
    ms.touch(a.worker_id, 63.0)  # each heard within half a lease of the last: no silence
    ms.touch(b.worker_id, 67.0)
    ms.touch(a.worker_id, 71.0)
    ms.touch(b.worker_id, 74.0)
    assert ms.expire(74.9) == [] and ms.expire(75.1) == [c]  # c never came back: 10 + 5 s from 60, then out
    assert a.active and b.active


def test_a_silence_while_workers_wait_on_the_barrier_is_the_ps_outage_too():
    """The PS's host cut off just after a and b pushed and began their waits for the round, c still computing (CI,
    issue 48's follow-up): a wait is no sign of life, so c is not expired in the silence (it was at its lease end
    while a and b waited, and lost its place in the round). A worker's host cut off instead: the waiting ones'
    heartbeats are heard, and c expires on time."""
    for cut in ("the PS's host", "c's host"):
        ms = Membership(lease_seconds=3.0)
        a, b, c = (ms.register(n, 0.0)[0] for n in "abc")
        for m in (a, b):
            ms.begin_wait(m.worker_id, 0.9)  # their pushes: in, waiting for c's
        ms.touch(c.worker_id, 0.95)  # c's heartbeat; it computes on
        for t in (1.9, 2.9, 3.9):  # their heartbeats, every lease/3
            if cut == "c's host":
                for m in (a, b):
                    ms.touch(m.worker_id, t)
            assert ms.expire(t + 0.05) == []
        if cut == "c's host":
            assert ms.expire(3.96) == [c] and ms.holds == {}
            continue
        assert ms.holds == {SILENCE: 0.95} and ms.expire(9.0) == [] and c.active
        ms.touch(a.worker_id, 9.5)  # the network back: a's heartbeat first
        assert ms.holds == {} and c.lease_until == 17.5 and ms.expire(12.6) == [] and c.active


def test_a_stalled_ps_expires_nobody_until_it_hears_from_a_worker_again():
    """A PS that did not run (stopped, paused) may read its requests before its ticker runs: whoever it hears from
    first, the stall is a silence, ended by the next worker heard from."""
    ms = Membership(lease_seconds=10.0)
    a, b = (ms.register(n, 0.0)[0] for n in "ab")
    ms.touch(a.worker_id, 30.0)  # read before the tick: nothing is silent yet
    ms.stalled(29.0, 30.0)  # a tick 1 s after the last one: not half a lease
    assert ms.holds == {}
    ms.stalled(1.0, 30.0)  # the ticker: the process did not run from 1 s to now
    assert ms.holds == {SILENCE: 1.0} and ms.expire(30.1) == []
    ms.touch(a.worker_id, 31.0)
    assert ms.released_at == 31.0 and b.lease_until == 46.0
    for t in (35.0, 39.0, 43.0):
        ms.touch(a.worker_id, t)
    assert ms.expire(45.9) == [] and ms.expire(46.1) == [b]
    ms.leave(a.worker_id, 47.0)
    ms.stalled(48.0, 60.0)  # nobody active: nothing to hold
    assert ms.holds == {}


def test_workers_heard_back_within_the_reconnect_allowance_after_a_silence_are_not_expired():
    """A 3 s lease, the PS cut off 10 s (CI, issue 48's follow-up): the first worker heard from ends the silence, the
    others' connections broke in the outage and they come back on fresh ones 1-2.5 s later, one only once its
    connection's user timeout ended it (5 s): none is expired (with a lease from the first alone, d was). A member
    never heard back is expired a lease and the allowance after the first."""
    ms = Membership(lease_seconds=3.0)
    a, b, c, d, e = (ms.register(n, 0.0)[0] for n in "abcde")
    assert ms.expire(5.0) == [] and SILENCE in ms.holds  # cut off from 0 s: nobody heard
    back = [(a, 10.0), (b, 11.0), (c, 12.5), (d, 15.5)]  # the network back at 10 s: a first; e never
    for t in np.arange(10.0, 20.0, 0.25):  # the returned ones' heartbeats every lease/3, the PS's ticks
        for m, at in back:
            if t >= at and (t - at) % 1.0 == 0:
                ms.touch(m.worker_id, t)
        due = [e] if t + 0.1 > 18.0 and e.active else []  # 10 + 3 + 5
        assert ms.expire(t + 0.1) == due, t
    assert [m.state for m in (a, b, c, d, e)] == ["active"] * 4 + ["expired"] and not ms.held


def test_one_worker_silent_among_live_ones_expires_on_time():
    ms = Membership(lease_seconds=10.0)
    a, b = (ms.register(n, 0.0)[0] for n in "ab")
    for t in range(1, 12):
        ms.touch(a.worker_id, float(t))
        ms.expire(float(t) + 0.5)
    assert not b.active and b.state == EXPIRED and ms.holds == {}


def test_a_hold_and_a_silence_both_end_before_leases_run_again():
    ms = Membership(lease_seconds=10.0)
    a, _ = ms.register("a", 0.0)
    ms.hold(FOLLOWER, 1.0)
    assert ms.expire(20.0) == [] and ms.holds == {FOLLOWER: 1.0, SILENCE: 0.0}
    ms.release(FOLLOWER, 20.0)  # the follower answers again, but no worker has been heard from
    assert ms.held and ms.expire(50.0) == [] and a.lease_until == 10.0
    ms.touch(a.worker_id, 50.0)
    assert not ms.held and ms.released_at == 50.0
    ms.hold(FOLLOWER, 51.0)
    ms.touch(a.worker_id, 52.0)  # heard while held: the hold still holds
    assert ms.held and ms.expire(100.0) == []


def test_silence_is_not_watched_when_the_caller_says_so():
    ms = Membership(lease_seconds=10.0)
    a, _ = ms.register("a", 0.0)
    assert ms.expire(8.0) == [] and ms.holds == {SILENCE: 0.0}
    assert ms.expire(10.1, watch_silence=False) == [a] and ms.holds == {}


names = st.sampled_from("abcdef")
calls = st.lists(st.tuples(st.sampled_from(["register", "leave", "touch", "begin_wait", "end_wait", "expire"]),
                           names, st.sampled_from([0.0, 0.3, 1.0, 2.5])), max_size=60)


@settings(max_examples=150, deadline=None)
@given(calls=calls)
def test_membership_answers_as_the_scans(calls):
    got, want, now = Membership(2.0), NaiveMembership(2.0), 0.0
    for kind, name, dt in calls:
        now += dt
        out = []
        for ms in (got, want):
            m = ms.by_name.get(name)
            wid = m.worker_id if m is not None else "unknown"
            try:
                if kind == "register":
                    r = ms.register(name, now)[0]
                    r = (r.name, r.rank, r.state)
                elif kind == "expire":
                    r = [x.name for x in ms.expire(now)]
                else:
                    r = getattr(ms, kind)(wid, now)
                    r = None if r is None else (r.name, r.rank, r.state)
            except REFUSALS as e:
                r = e.code
            out.append((r, [(x.name, x.rank, x.state, x.lease_until) for x in ms.all()],
                        [m.name for m in ms.active()], ms.active_count, ms._free_rank()))
        assert out[0] == out[1]


def test_a_member_back_in_a_stuck_round_keeps_its_rank_and_a_newcomer_takes_one_the_round_does_not_list():
    """Fixed R = 3, min_replicas 2: w0 leaves, the others die; a newcomer joins the stuck round under rank 3 (the
    round lists 0, 1, 2: w0's given back too); w0 comes back under its rank 0 and joins it too, and the round
    closes with both."""
    core = ParameterServerCore(core_config(min_workers=3, startup_grace_seconds=0.0, lease_seconds=5.0,
                                          replicas_to_aggregate=3, min_replicas=2))
    core.init_model(ModelInit({"w": np.zeros(3, np.float32)}, {"name": "sgd", "learning_rate": 1.0}), 0.0)
    ids = [core.register(f"w{i}", 0.0)[0].worker_id for i in range(3)]
    core.leave(ids[0], 4.0)  # heard from w0 at 4: the others' silence is theirs, not the PS's
    core.tick(6.0)  # w1 and w2 expire: nobody left in round 0
    new, start = core.register("new", 6.5)
    assert (new.rank, start, core.round.ranks) == (3, 0, (0, 1, 2, 3))
    g = {"new": np.array([0.5, 1.0, 3.0], np.float32), "w0": np.array([-1.5, 1.0, 0.25], np.float32)}
    core.push(PushRequest(new.worker_id, 0, {"w": g["new"].copy()}), 7.0)
    w0, start = core.register("w0", 7.5)  # stuck below min_replicas: joins at once, under its rank
    assert (w0.rank, start, core.round.eligible[ids[0]], core.round.ranks) == (0, 0, 0, (0, 1, 2, 3))
    assert core.push(PushRequest(ids[0], 0, {"w": g["w0"].copy()}), 8.0).closed
    assert core.rounds[-1].reason == "unreachable" and core.rounds[-1].aggregated == 2
    assert sorted((a.rank, a.worker_id) for a in core.rounds[-1].contributors) == [(0, ids[0]), (3, new.worker_id)]
    mean = (g["w0"] + g["new"]) / np.float32(2)
    assert core.weights["w"].tobytes() == (np.zeros(3, np.float32) - np.float32(1.0) * mean).tobytes()


def test_an_unknown_worker_leaving_changes_nothing():
    core = ParameterServerCore(core_config(min_workers=1, startup_grace_seconds=0.0))
    core.init_model(ModelInit({"w": np.zeros(1, np.float32)}, {}), 0.0)
    core.register("a", 0.0)
    with pytest.raises(REFUSALS):
        core.leave("nope", 1.0)
    assert (core.round.live, core.round.waiting, core.members.active_count) == (1, 1, 1)
    assert core.members.by_name["a"].state != LEFT
