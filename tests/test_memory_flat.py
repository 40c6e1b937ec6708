"""The PS's memory does not grow with the worker count (ps_service/core/intake.py): a real PS reads large pushes in
rank order, leaving the others unread in the kernel (or in the worker's same-host file) until their turn; a
contributor that dies mid-body, or never pushes, holds nobody up past its lease; and the PS's peak RSS of a real job
with 6 workers stays within a model copy of the one with 2 (with backup workers, R = 4 of 6 within a copy of R = 2
of 3), over TCP and same-host files (every worker on them: :func:`assert_flat`), and a sharded follower's within a
piece copy."""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Callable

import numpy as np
import pytest

from bench.run import measure
from cluster.processes import LocalCluster, wait_for
from ps_service.core.buffers import ROUND_BYTES
from tests.live_ps import live_ps, worker_client
from tests.test_intake import held
from tests.test_metrics import samples
from tests.timing import allow
from tests.wire import FRAME, push_frame
from worker_service.loop import Heartbeat

#: float32 parameters: 1.6 MB, a push above the seam's gate (ps_service/transport: GATED_BYTES)
P = 400_000
W0 = {"w": np.zeros(P, np.float32)}


#: what a job of 6 workers holds at its peak beyond one of 3 (R = 4, R = 2) other than model-sized buffers (their
#: connections' state, allocator slack): 0.5-0.8 MiB in 3 pairs of runs at load 2.4-5.1, with margin
OTHER_MIB = 2.0


#: the transport a job's line names when every worker's tensors went as the job meant (``auto``: same-host files)
SAME_HOST = {"auto": "shm"}


def one_copy_mib(params: int) -> float:
    """One more float32 model (or piece) of ``params`` held by the PS, as the peak fields count it (MiB): a buffer of
    the pool (ps_service/core/buffers.py), its frame (the tensors and a header) rounded up to ROUND_BYTES: 10 MiB at
    2.5e6 parameters, more than the model's 9.5. Which buffers a job holds at once at its peak varies with timing
    (the pushes being read, one being refused as late, the weights' frame and one an answer still sends): a run of the
    job with fewer workers may miss the coincidence the other one meets, so each bound allows one such buffer."""
    return -(-(4 * params + (64 << 10)) // ROUND_BYTES) * ROUND_BYTES / 2**20


#: pairs of runs at most, until one whose every worker's tensors went as its job meant (:func:`assert_flat`)
SAMPLES = 3


def assert_flat(few: Callable[[], dict], many: Callable[[], dict], peak: Callable[[dict], float], bound: float,
                transport: str) -> None:
    """The peak (``peak`` of a job's line) of the job with more workers (``many()`` runs it) is within ``bound`` of the
    one with fewer, in a pair of runs whose lines both name ``transport`` (every worker's tensors went so: ``shm`` for
    a same-host job); a pair with a line that names another is run again, up to :data:`SAMPLES` pairs.

    A same-host job measures what it means only when every worker is on the same-host transport: a worker whose
    gradient file does not fit in the shared-memory directory (posix_fallocate: ENOSPC; 6 workers and the weights need
    7 files of 9.5 MiB: a small tmpfs, or one that other processes' files fill) sends its tensors in request bodies
    (worker_service/transport/attach.py), and the PS then holds its push's body being read and the weights in their
    own frame for its answers (ps_service/core/model.py): two copies more, whatever the worker count (CI: 90.7 MB at
    6 workers against 70.8 at 3; here, in a 64 MiB tmpfs: 89.6 on ``http+shm`` against 70.5)."""
    pairs = []
    for _ in range(SAMPLES):
        pairs.append((few(), many()))
        if all(line["transport"] == transport for line in pairs[-1]):
            low, high = map(peak, pairs[-1])
            assert high - low < bound, pairs[-1]
            return
    raise AssertionError(f"no pair of runs with every worker on {transport} in {SAMPLES}: {pairs}")


def test_assert_flat_runs_a_pair_off_its_transport_again_and_fails_one_over_its_bound():
    runs: dict[str, list[tuple[float, str]]] = {"few": [(70.5, "shm"), (70.6, "shm")],
                                                "many": [(89.6, "http+shm"), (70.7, "shm")]}

    def job(name: str) -> Callable[[], dict]:
        return lambda: dict(zip(("peak", "transport"), runs[name].pop(0)))
    assert_flat(job("few"), job("many"), lambda line: line["peak"], 12.0, "shm")
    assert runs == {"few": [], "many": []}  # run twice: on shm the second time
    runs.update(few=[(70.5, "shm")], many=[(89.6, "shm")])
    with pytest.raises(AssertionError, match="89.6"):
        assert_flat(job("few"), job("many"), lambda line: line["peak"], 12.0, "shm")
    runs.update(few=[(70.5, "shm")] * SAMPLES, many=[(89.6, "http+shm")] * SAMPLES)
    with pytest.raises(AssertionError, match="no pair of runs"):
        assert_flat(job("few"), job("many"), lambda line: line["peak"], 12.0, "shm")
    assert runs == {"few": [], "many": []}


def gradient(i: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(i).standard_normal(P).astype(np.float32)}


@contextmanager
def three_workers(**settings):
    """A live PS (SGD, learning rate 0.5) with workers a, b, c (ranks 0, 1, 2) registered and W0 initialised, round 0
    open: (the PS, their clients, their ids)."""
    with live_ps(min_workers=3, startup_grace_seconds=0, optimizer="sgd", learning_rate=0.5, **settings) as ps:
        clients = [ps.client() for _ in range(3)]
        try:
            ids = [c.register(name)["worker_id"] for c, name in zip(clients, "abc")]
            assert clients[0].init_model(W0, {"name": "sgd", "learning_rate": 0.5})
            wait_for(lambda: ps.rt.core.round is not None, allow(10), "round 0 to open")
            assert [ps.rt.core.members.by_id[w].rank for w in ids] == [0, 1, 2]
            yield ps, clients, ids
        finally:
            for c in clients:
                c.close()


@pytest.mark.parametrize("rank0", ["dies mid-body", "never pushes"])
def test_a_contributor_that_dies_mid_body_or_never_pushes_holds_the_others_up_only_to_its_lease(rank0):
    with three_workers(lease_seconds=1.5) as (ps, clients, ids):
        core = ps.rt.core
        dead = None
        if rank0 == "dies mid-body":  # its frame's header and a part of its body, then it is gone
            body = push_frame(ids[0], 0, gradient(0))
            dead = socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10))
            dead.sendall(f"POST /v1/gradients HTTP/1.1\r\nhost: x\r\ncontent-type: {FRAME}\r\n"
                         f"content-length: {len(body)}\r\n\r\n".encode() + body[:200_000])
            wait_for(lambda: ids[0] in core.intake.reading, allow(10), "the PS to read rank 0's push (next in order)")
        answers: list = []
        pushers = [threading.Thread(target=lambda i=i: answers.append(clients[i].push(ids[i], 0, gradient(i))))
                   for i in (2, 1)]
        # their heartbeats go on while they wait, as the stock worker's: rank 0's silence is its own
        beats = [Heartbeat.of(clients[i], ids[i], 1.5) for i in (1, 2)]
        most = [0]

        def closed() -> bool:
            most[0] = max(most[0], held(core))
            return core.global_step == 1
        try:
            for t in pushers:
                t.start()
            wait_for(lambda: closed() or core.intake.deferred > 0, allow(10), "a push to wait for its turn", 0.001)
            if dead is not None:
                dead.close()
            wait_for(closed, allow(20), "the round to close without rank 0", 0.001)
            for t in pushers:
                t.join(allow(20))
        finally:
            for hb in beats:
                hb.halt.set()
                hb.join(allow(10))
        assert sorted(a["status"] for a in answers) == ["accepted", "accepted"]
        record = core.rounds[-1]
        assert sorted(a.name for a in record.contributors) == ["b", "c"] and record.missing == ("a",)
        mean = (gradient(1)["w"] + gradient(2)["w"]) / np.float32(2)  # rank order: b, then c
        assert core.weights["w"].tobytes() == (W0["w"] - np.float32(0.5) * mean).tobytes()
        assert most[0] <= 2 and core.intake.reading == set()


def test_with_backup_workers_the_first_r_heads_are_summed_in_rank_order_and_a_later_one_is_late():
    """A real PS, R = 2 of 3, each push 1.6 MB (gated): rank 2's head comes first and waits (ranks 0 and 1 may still
    come before it); rank 0's makes R, so ranks 0 and 2 contribute, read in rank order; rank 1's, after R heads, is
    answered ``late``. The weights are the rank-order mean of ranks 0 and 2, bit for bit."""
    with three_workers(lease_seconds=5.0, replicas_to_aggregate=2) as (ps, clients, ids):
        core = ps.rt.core
        answers: dict = {}

        def push(i: int) -> None:
            answers[i] = clients[i].push(ids[i], 0, gradient(i))
        threads = {i: threading.Thread(target=push, args=(i,)) for i in range(3)}
        threads[2].start()
        wait_for(lambda: ids[2] in core.round.heads and core.intake.deferred >= 1, allow(10), "rank 2's head")
        assert core.intake.reading == set()  # unread: rank 0 or 1 may still come and sort first
        threads[0].start()
        wait_for(lambda: core.global_step == 1 or len(core.round.heads) == 2, allow(10), "R heads")
        threads[1].start()
        for t in threads.values():
            t.join(allow(30))
        assert [answers[i]["status"] for i in range(3)] == ["accepted", "late", "accepted"], answers
        record = core.rounds[0]
        assert [a.worker_id for a in record.contributors] in ([ids[0], ids[2]], [ids[2], ids[0]])
        assert [a.worker_id for a in record.late] == [ids[1]]
        mean = (gradient(0)["w"] + gradient(2)["w"]) / np.float32(2)  # rank order: a, then c
        assert core.weights["w"].tobytes() == (W0["w"] - np.float32(0.5) * mean).tobytes()
        assert core.intake.reading == core.intake.refusing == set()


@pytest.mark.parametrize("rank1", ["comes after", "came before"])
def test_with_backup_workers_a_contributor_whose_body_fails_gives_its_place_to_the_next_push_or_r_is_out_of_reach(
        rank1):
    """R = 2 of 3: ranks 2 and 0 count at their heads, rank 0 is read first and dies mid-body. Rank 1's push, coming
    after that, takes its place: the round sums ranks 1 and 2 (``full``). Came before (while rank 0's body was read:
    ``late`` at its head), nobody is left to take the place: once rank 0's lease ends (its client is gone; rank 1's
    heartbeats) the round closes with rank 2 alone (``unreachable``, min_replicas 1)."""
    with three_workers(lease_seconds=3.0, replicas_to_aggregate=2) as (ps, clients, ids):
        core, answers = ps.rt.core, {}
        threads = {i: threading.Thread(target=lambda i=i: answers.setdefault(i, clients[i].push(ids[i], 0, gradient(i))))
                   for i in (1, 2)}
        threads[2].start()
        wait_for(lambda: ids[2] in core.round.heads and core.intake.deferred >= 1, allow(10), "rank 2's head")
        body = push_frame(ids[0], 0, gradient(0))
        clients[0].heartbeat(ids[0])  # its lease runs from here
        dead = socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10))
        dead.sendall(f"POST /v1/gradients HTTP/1.1\r\nhost: x\r\ncontent-type: {FRAME}\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body[:200_000])
        wait_for(lambda: ids[0] in core.intake.reading, allow(10), "the PS to read rank 0's push (first in order)")
        if rank1 == "came before":
            threads[1].start()
            wait_for(lambda: 1 in answers, allow(10), "rank 1's answer")
        dead.close()
        wait_for(lambda: core.global_step == 1 or ids[0] not in core.round.heads, allow(10), "rank 0's place back")
        if rank1 == "comes after":
            threads[1].start()
        for t in threads.values():
            t.join(allow(20))
        # rank 1 lives on (a PS that hears from no worker holds every lease: membership.py)
        wait_for(lambda: clients[1].heartbeat(ids[1]) and core.global_step == 1, allow(20), "the round to close", 0.1)
        record, want = core.rounds[0], {"comes after": (1, 2), "came before": (2,)}[rank1]
        assert sorted(ids.index(a.worker_id) for a in record.contributors) == list(want)
        assert record.reason == ("full" if rank1 == "comes after" else "unreachable")
        assert answers[1]["status"] == ("accepted" if rank1 == "comes after" else "late")
        assert answers[2]["status"] == "accepted"
        total = gradient(want[0])["w"]
        if len(want) == 2:
            total = (total + gradient(want[1])["w"]) / np.float32(2)  # rank order: b, then c
        assert core.weights["w"].tobytes() == (W0["w"] - np.float32(0.5) * total).tobytes()
        assert core.intake.reading == core.intake.refusing == set()


def _peak_rss_mb(workers: int, params: int, transport: str, shards: int = 1, replicas: int | None = None) -> dict:
    """One ``bench.run`` job's line (``replicas``: with ``PS_REPLICAS_TO_AGGREGATE``, all N workers there at step 0),
    measured from this process: its cluster forked from this process's warm fork server (cluster/forkserver.py), not
    from the zygotes of a ``python -m bench.run`` of its own. Its window (1.5 s on a quiet machine, a few rounds) scales
    with the load: it must hold a round (none of a sharded job of 5e6 parameters closed in 1.5 s at load 10)."""
    ps_env = None if replicas is None else {"PS_REPLICAS_TO_AGGREGATE": replicas, "PS_MIN_WORKERS": workers}
    line = measure(workers, params, allow(1.5), warmup=allow(1.0), transport=transport, shards=shards, ps_env=ps_env)
    assert line["steps_per_s"] is not None and line["steps"] > 0, line
    return line


@pytest.mark.parametrize("transport", ["http", "auto"])
def test_the_ps_peak_memory_does_not_grow_with_the_workers(transport):
    """2.5e6 parameters (a 10 MB model): at 6 workers the PS's peak memory is within one model copy of its peak at 2
    (it held one more copy per worker before: 4 copies more at 6 workers). Over TCP its peak RSS (VmHWM); same-host
    its anonymous memory (``peak_anon_MB``): its RSS also counts the workers' gradient files it maps, shared pages
    of theirs."""
    params = 2_500_000
    field = "peak_rss_MB" if transport == "http" else "peak_anon_MB"
    assert_flat(*(lambda n=n: _peak_rss_mb(n, params, transport) for n in (2, 6)), lambda line: line[field],
                one_copy_mib(params) + OTHER_MIB, SAME_HOST.get(transport, transport))


def test_a_followers_peak_memory_does_not_grow_with_the_workers():
    """Two shards over TCP, 5e6 parameters (a 20 MB model, a 10 MB piece a shard): at 6 workers the follower's peak RSS
    is within a piece copy of its peak at 2 (it held every worker's piece until the round's apply before: 4 pieces more
    at 6 workers; ps_service/sharding/turns.py). The coordinator's RSS varies by more than a piece between runs of one
    N here (its encoded answers): tests/test_shard_follow.py counts what it holds instead."""
    params = 5_000_000
    two, six = (_peak_rss_mb(n, params, "http", shards=2) for n in (2, 6))
    assert six["shard_peak_rss_MB"][1] - two["shard_peak_rss_MB"][1] < one_copy_mib(params // 2) + OTHER_MIB, (two, six)


@pytest.mark.parametrize("transport", ["http", "auto"])
def test_with_backup_workers_the_ps_peak_memory_does_not_grow_with_the_workers(transport):
    """Fixed R (backup workers, ps_service/core/intake.py): a push counts at its head, the R contributors are read in
    rank order and the others are refused one at a time, so at 6 workers with R = 4 the PS's peak memory is within
    one model copy of its peak at 3 workers with R = 2 (it read every push on arrival before: R held, N - R read)."""
    params = 2_500_000
    field = "peak_rss_MB" if transport == "http" else "peak_anon_MB"
    assert_flat(*(lambda n=n, r=r: _peak_rss_mb(n, params, transport, replicas=r) for n, r in ((3, 2), (6, 4))),
                lambda line: line[field], one_copy_mib(params) + OTHER_MIB, SAME_HOST.get(transport, transport))


def test_a_push_that_waits_its_turn_longer_than_the_tcp_user_timeout_keeps_its_connection():
    """Rank 0 never pushes: rank 2's 16 MB push (more than the socket buffers hold) waits for its turn until rank 0's
    7 s lease ends, longer than the clients' 5 s TCP user timeout (shared/liveness.py), which ends a connection whose
    window stays shut that long: the PS takes a little of the body every 2 s, so the push goes through on its
    connection (the client here does not retry) and is summed in its turn, no push read out of turn.

    The PS is a process of its own, as deployed, not a thread of this one (:func:`live_ps`): the sender's kernel times
    the shut window, so a stall of this process (the pushers' threads, pytest) stopped a PS in it from reading and
    ended the push (CI, once: nothing read for about 5 s); a stall here now stops only the pushers, whose bodies wait in
    their kernel's send buffers."""
    size = 4_000_000
    env = {"PS_LEASE_SECONDS": 7.0, "PS_MIN_WORKERS": 3, "PS_OPTIMIZER": "sgd", "PS_LEARNING_RATE": 0.5}
    with LocalCluster(0, ps_env=env) as c:
        clients = [worker_client(c.url) for _ in range(3)]
        try:
            ids = [cl.register(name)["worker_id"] for cl, name in zip(clients, "abc")]
            assert clients[0].init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 0.5})
            wait_for(lambda: c.status()["round"] is not None, allow(10), "round 0 to open", 0.1)
            grads = {i: {"w": np.full(size, float(i), np.float32)} for i in (1, 2)}
            answers: list = []

            def push(i: int) -> None:
                try:
                    answers.append(clients[i].push(ids[i], 0, grads[i]))
                except Exception as exc:  # its connection ended (ETIMEDOUT: the window stayed shut)
                    answers.append({"status": repr(exc)})
            pushers = [threading.Thread(target=push, args=(i,)) for i in (1, 2)]
            for t in pushers:
                t.start()
            for t in pushers:
                t.join(allow(30))
            assert sorted(a["status"] for a in answers) == ["accepted", "accepted"], (answers, c.logs())
            wait_for(lambda: c.status()["global_step"] == 1, allow(10), "the round to close", 0.1)
            reads = samples(c.get("/metrics").text)
            assert reads[("ps_push_reads_overdue_total", ())] == 0 and reads[("ps_push_reads_deferred_total", ())] > 0
            weights = clients[0].pull(1, wait=allow(10)).tensors["w"]  # a reader's pull: b's lease may have ended
            assert np.array_equal(weights, np.full(size, -0.75, np.float32))  # 0 - 0.5 * (1 + 2) / 2
        finally:
            for cl in clients:
                cl.close()
