"""The order pushes' tensors are read in (ps_service/core/intake.py), driven by simulation as the runtime drives it:
a push's head comes in, it is read if the core's claim says so, else it waits until ``readers()`` names it. Whatever
order heads arrive and reads end in, and with a member leaving mid-round (before, while or after its head came), the
PS holds at most two gradients of a round at any time (the running sum and the one being read, whatever N), no push
waits for good, and the weights are bit for bit those of the same contributors' pushes taken with no gate."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.core import ParameterServerCore
from shared.protocol import PushRequest, PushStatus
from tests.test_core import grad, make


def held(core: ParameterServerCore) -> int:
    """Gradients of the open round the PS holds: the running sum, those waiting to be summed, those being read."""
    acc = core.round.acc if core.round is not None else None
    return (0 if acc is None else (acc.acc is not None) + len(acc.waiting)) + len(core.intake.reading)


def gradient(step: int, i: int) -> dict[str, np.ndarray]:
    return grad(1000 * step + i)


def wake(core: ParameterServerCore, waiting: list[int], reading: list[int], ids: list[str], step: int) -> None:
    """The runtime's wake-ups: the waiting pushes ``readers()`` names (None: the longest-waiting) claim again."""
    while True:
        names = core.readers()
        turn = waiting[:1] if names is None else [i for i in waiting if ids[i] in names]
        moved = [i for i in turn if core.claim(ids[i], step)]
        if not moved:
            return
        for i in moved:
            waiting.remove(i)
            reading.append(i)


def gated_round(core, ids, step, order, leaver, leave_at, draw) -> set[int]:
    """One round: heads in ``order``; ``leaver`` (or None) leaves after ``leave_at`` events unless its push is in.
    The members whose push was taken."""
    heads, waiting, reading, taken, gone, events = list(order), [], [], set(), False, 0
    while core.global_step == step:
        options = (["head"] if heads else []) + (["read"] if reading else [])
        if leaver is not None and not gone and leaver not in taken and events >= leave_at:
            options.append("leave")
        assert options, f"no push can move: waiting {waiting}, reading {reading}"
        op = draw(st.sampled_from(options))
        events += 1
        if op == "head":
            i = heads.pop(0)
            (reading if core.claim(ids[i], step) else waiting).append(i)
        elif op == "read":
            i = draw(st.sampled_from(reading))
            reading.remove(i)
            try:
                assert core.push(PushRequest(ids[i], step, gradient(step, i)), 0.0).status is PushStatus.ACCEPTED
            finally:
                core.release(ids[i])
            taken.add(i)
        else:
            core.leave(ids[leaver], 0.0)
            gone = True
            for where in (heads, waiting, reading):
                if leaver in where:
                    where.remove(leaver)
                    core.release(ids[leaver])  # its read ends: refused, or the client went away
        assert held(core) <= 2, (held(core), step)
        wake(core, waiting, reading, ids, step)
        assert held(core) <= 2, (held(core), step)
    return taken


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), steps=st.integers(1, 3), data=st.data())
def test_at_most_two_gradients_held_no_push_waits_for_good_and_the_sum_is_the_rank_order_one(n, steps, data):
    core, ids = make(n)
    reference, ref_ids = make(n)
    alive = list(range(n))
    for step in range(steps):
        order = data.draw(st.permutations(alive))
        leaver = data.draw(st.sampled_from([None, *alive])) if len(alive) > 1 else None
        leave_at = data.draw(st.integers(0, 2 * n))
        taken = gated_round(core, ids, step, order, leaver, leave_at, data.draw)
        # the same contributors with no gate: who left without a push leaves first; the rest push in any order
        if leaver is not None and leaver not in taken:
            reference.leave(ref_ids[leaver], 0.0)
        for i in data.draw(st.permutations(sorted(taken))):
            reference.push(PushRequest(ref_ids[i], step, gradient(step, i)), 0.0)
        if leaver is not None and leaver in taken:
            reference.leave(ref_ids[leaver], 0.0)
            core.leave(ids[leaver], 0.0)
        if leaver is not None:
            alive.remove(leaver)
        assert core.global_step == reference.global_step == step + 1
        assert [a.worker_id for a in core.rounds[-1].contributors] != [] and \
            sorted(ids.index(a.worker_id) for a in core.rounds[-1].contributors) == sorted(taken)
    for k in core.weights:
        assert core.weights[k].tobytes() == reference.weights[k].tobytes()


def test_the_next_in_rank_order_reads_the_others_wait_and_are_woken_in_turn():
    core, ids = make(4)
    assert core.readers() == (ids[0], ids[1])  # nothing held yet: the first two
    assert not core.claim(ids[3], 0) and not core.claim(ids[2], 0)
    assert core.claim(ids[1], 0) and core.claim(ids[0], 0)
    assert not core.claim(ids[0], 0)  # its one body at a time
    core.push(PushRequest(ids[0], 0, gradient(0, 0)), 0.0)
    core.release(ids[0])
    assert core.readers() == (ids[1],) and not core.claim(ids[2], 0)
    core.push(PushRequest(ids[1], 0, gradient(0, 1)), 0.0)
    core.release(ids[1])
    assert core.readers() == (ids[2],) and core.claim(ids[2], 0) and not core.claim(ids[3], 0)
    core.release(ids[2])  # its read failed: still its turn
    assert core.readers() == (ids[2],)
    core.leave(ids[2], 0.0)  # gone: the next one's turn
    assert core.readers() == (ids[3],) and core.claim(ids[3], 0)
    core.push(PushRequest(ids[3], 0, gradient(0, 3)), 0.0)
    assert core.global_step == 1 and core.intake.deferred == 5


def test_an_expired_member_passes_its_turn_and_a_push_that_would_not_count_is_read_at_once():
    core, ids = make(3, lease_seconds=5.0)
    core.members.touch(ids[1], 4.0)
    core.members.touch(ids[2], 4.0)
    assert core.claim(ids[2], 0) is False
    core.tick(6.0)  # ids[0] expired
    assert core.readers() == (ids[1], ids[2]) and core.claim(ids[2], 0)
    assert core.claim(ids[1], 1) and core.claim(ids[0], 0)  # a future step, a member no longer active: refused once read
    assert core.intake.reading == {ids[2]}


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_read_one_push_at_a_time(mode):
    core, ids = make(3, mode=mode, learning_rate=0.01)
    assert core.readers() is None  # anyone
    assert core.claim(ids[1], 0) and not core.claim(ids[0], 0) and core.readers() == ()
    core.push(PushRequest(ids[1], 0, gradient(0, 1)), 0.0)
    core.release(ids[1])
    assert core.readers() is None and core.claim(ids[0], 0)


def fixed_round(core, ids, step, order, fails, draw, most: int = 2) -> dict[int, PushStatus]:
    """One fixed-R round and its late pushes, driven to the end: heads in ``order``; a push in ``fails`` has its first
    read fail (the client went away, or the core refused it) and comes again after the others. Each push's answer."""
    heads, waiting, reading, answers, failed = list(order), [], [], {}, set()
    while heads or waiting or reading:
        options = (["head"] if heads else []) + (["read"] if reading else [])
        assert options, f"no push can move: waiting {waiting}, step {core.global_step}"
        if draw(st.sampled_from(options)) == "head":
            i = heads.pop(0)
            (reading if core.claim(ids[i], step) else waiting).append(i)
        else:
            i = draw(st.sampled_from(reading))
            reading.remove(i)
            if i in fails and i not in failed:
                failed.add(i)
                heads.append(i)
            else:
                answers[i] = core.push(PushRequest(ids[i], step, gradient(step, i)), 0.0).status
            core.release(ids[i])
        for _ in range(2):
            assert held(core) <= most and len(core.intake.refusing) <= 1, (held(core), core.intake.refusing)
            wake(core, waiting, reading, ids, step)
    return answers


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_fixed_r_counts_a_push_at_its_head_holds_two_gradients_and_one_refused_push_and_sums_in_rank_order(n, data):
    """Backup workers (R < N): whatever order heads come and reads end in, with heads whose read fails and comes again,
    the first R heads contribute (a failed one's place goes to the next head that may take it), every other push is
    ``late``, the PS holds at most the running sum and two reads of the round (``min_replicas`` q above 2: q gradients,
    unsummed until q are in: a stuck round may still take a worker of any rank) and one late push being read, and the
    weights are bit for bit those of the same contributors' pushes taken with no gate."""
    r = data.draw(st.integers(1, n))
    q = data.draw(st.integers(1, r))
    core, ids = make(n, replicas_to_aggregate=r, min_replicas=q)
    reference, ref_ids = make(n, replicas_to_aggregate=r, min_replicas=q)
    for step in range(2):
        order = data.draw(st.permutations(range(n)))
        fails = set(data.draw(st.lists(st.sampled_from(range(n)), max_size=2)))
        answers = fixed_round(core, ids, step, order, fails, data.draw, max(2, q))
        taken = sorted(i for i, status in answers.items() if status is PushStatus.ACCEPTED)
        assert len(answers) == n and len(taken) == r and all(
            status in (PushStatus.ACCEPTED, PushStatus.LATE) for status in answers.values()), answers
        record = core.rounds[-1]
        assert record.reason == "full" and sorted(ids.index(a.worker_id) for a in record.contributors) == taken
        for i in data.draw(st.permutations(taken)):
            reference.push(PushRequest(ref_ids[i], step, gradient(step, i)), 0.0)
        assert core.global_step == reference.global_step == step + 1
        assert core.intake.reading == core.intake.refusing == set()
    for k in core.weights:
        assert core.weights[k].tobytes() == reference.weights[k].tobytes()


def test_backup_workers_the_first_r_heads_are_read_in_rank_order_the_others_are_late_at_their_head():
    core, ids = make(4, replicas_to_aggregate=2)
    assert core.readers() == (ids[0], ids[1])  # nobody came: the lowest ranks may still
    assert not core.claim(ids[3], 0)  # rank 0, 1 or 2 may still come first
    assert core.claim(ids[2], 0)  # R heads came: ranks 2 and 3 contribute, in that order (nothing summed: both read)
    assert core.round.heads.keys() == {ids[3], ids[2]} and core.readers() == (ids[2], ids[3])
    assert core.claim(ids[3], 0)
    assert core.claim(ids[0], 0)  # its head came after R others': late, read at once (no other late one is read)
    assert not core.claim(ids[1], 0) and core.readers() == (ids[2], ids[3])  # late too: one is read at a time
    late = core.push(PushRequest(ids[0], 0, gradient(0, 0)), 0.0)
    core.release(ids[0])
    assert (late.status, late.step) == (PushStatus.LATE, 0) and core.readers() == (ids[2], ids[3], ids[1])
    core.release(ids[2])  # rank 2's read failed: its place goes back; rank 1 (not late yet) or 2 again may take it
    assert list(core.round.heads) == [ids[3]] and core.readers() == (ids[1], ids[2], ids[1])  # (and the late lane's)
    assert core.claim(ids[1], 0)  # rank 1 takes it: the lowest of the two now
    assert core.push(PushRequest(ids[3], 0, gradient(0, 3)), 0.0).status is PushStatus.ACCEPTED
    core.release(ids[3])
    assert core.push(PushRequest(ids[1], 0, gradient(0, 1)), 0.0).closed
    core.release(ids[1])
    assert core.claim(ids[2], 0)  # its push again: the round closed, late
    assert core.push(PushRequest(ids[2], 0, gradient(0, 2)), 0.0).status is PushStatus.LATE
    core.release(ids[2])
    record = core.rounds[-1]
    assert [a.worker_id for a in record.contributors] == [ids[3], ids[1]]
    assert [a.worker_id for a in record.late] == [ids[0], ids[2]]
    assert core.intake.reading == core.intake.refusing == set() and core.intake.queued == {}


def test_backup_workers_a_head_whose_request_went_away_while_it_waited_gives_its_place_back():
    core, ids = make(4, replicas_to_aggregate=2)
    assert not core.claim(ids[3], 0)  # counted; waits: ranks 0-2 may still come first
    assert core.claim(ids[2], 0)  # R heads: rank 2 is read first
    core.withdraw(ids[3])  # its client went away while it waited: its place goes back
    core.withdraw(ids[2])  # being read: nothing to give back
    assert list(core.round.heads) == [ids[2]] and core.intake.reading == {ids[2]}
    assert core.claim(ids[0], 0) and list(core.round.heads) == [ids[2], ids[0]]  # takes it, and is read (nothing summed)
    assert core.claim(ids[1], 0) and core.intake.refusing == {ids[1]}  # late at its head


def test_backup_workers_a_push_late_at_its_head_stays_late_when_a_place_comes_free_while_it_is_read():
    """Hypothesis's counterexample (N=6, R=3): rank 3's head came after R others', so its push is read as late; rank
    1's read fails meanwhile. Taken then, rank 3's gradient would wait for rank 2's, read next: three held."""
    core, ids = make(6, replicas_to_aggregate=3)
    assert core.claim(ids[0], 0) and core.claim(ids[1], 0) and not core.claim(ids[2], 0)  # R heads
    assert core.claim(ids[3], 0) and core.intake.refusing == {ids[3]}  # late at its head: read on the late lane
    assert core.push(PushRequest(ids[0], 0, gradient(0, 0)), 0.0).status is PushStatus.ACCEPTED
    core.release(ids[0])
    core.release(ids[1])  # rank 1's read failed: its place goes back
    assert core.push(PushRequest(ids[3], 0, gradient(0, 3)), 0.0).status is PushStatus.LATE
    core.release(ids[3])
    assert list(core.round.heads) == [ids[0], ids[2]] and core.readers() == (ids[1],)
    assert core.claim(ids[1], 0) and held(core) == 2  # its push again: back in turn, before rank 2
