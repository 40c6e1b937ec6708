"""Pulls answered partition by partition through a real PS (uvicorn on loopback, tests/live_ps.py;
docs/protocol-partitions.md, Pull): a raw-socket client that asks ``GET /v1/model?min_step=s+1&partitioned=1`` while
round s is between partitions reads the answer's head and partition 0's weights of step s + 1 before the last
partition of step s was pushed, then each later partition as it closes; the frames put together are the PS's
weights of step s + 1 bit for bit, the last names the next round's ranks. Without ``partitioned``, or at
PS_PARTITION_BYTES=0, the pull is answered whole once the round closed, as ever. The stock worker's transport pushes
on one connection while it pulls so on a second, and gets the next weights whole, bit for bit. An answer in flight
keeps its step's bytes while a fixed-R job's next round closes under it."""
from __future__ import annotations

import json
import socket
import threading

import numpy as np

from cluster.processes import wait_for
from shared import frame
from shared.partitions import plan
from shared.protocol import API
from shared.shards import spec_of
from tests.live_ps import live_ps, read_response
from tests.timing import allow
from worker_service.client import PSClient
from worker_service.transport.http import BodyTransport

SIZE = 1 << 20  # 12 partitions of the model below
W0 = {"w": np.linspace(-1, 1, 3_000_000, dtype=np.float32)}
G = {"w": np.full(3_000_000, 0.5, np.float32)}
STEP1 = W0["w"] - np.float32(0.1) * np.float32(0.5)  # SGD, learning rate 0.1


class ChunkedFrames:
    """A raw HTTP/1.1 answer read off a socket: its status and headers, then its chunked body's frames as they
    come (:class:`shared.frame.FrameReader`)."""

    def __init__(self, s: socket.socket) -> None:
        self.s, self.raw, self.body, self.ended = s, b"", b"", False
        while b"\r\n\r\n" not in self.raw:
            self._recv()
        head, _, self.raw = self.raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        self.reader = frame.FrameReader()
        self.frames: list[frame.Frame] = []

    def _recv(self) -> None:
        chunk = self.s.recv(1 << 20)
        assert chunk, "the PS closed the connection"
        self.raw += chunk

    def _dechunk(self) -> None:
        while not self.ended:
            line, sep, rest = self.raw.partition(b"\r\n")
            if not sep:
                return
            n = int(line, 16)
            if len(rest) < n + 2:
                return
            self.body += rest[:n]
            self.raw = rest[n + 2:]
            self.ended = n == 0

    def until(self, count: int) -> list[frame.Frame]:
        """Read until ``count`` frames are in (or the body ended)."""
        while len(self.frames) < count and not self.ended:
            self._recv()
            self._dechunk()
            body = bytes(self.body)
            self.frames += self.reader.feed(body, len(body), count)
        return self.frames


def start_push(port: int, wid: str, upto: int) -> tuple[socket.socket, bytes]:
    """Send the first ``upto`` bytes of worker ``wid``'s partitioned push of step 0; (its socket, the rest)."""
    p = plan(spec_of(G), SIZE)
    parts = [p.split(G, q) for q in range(p.count)]
    frames = [(parts[0], {"worker_id": wid, "step": 0, "partitions": p.count})]
    body = b"".join(bytes(b) for b in frame.encode_many(frames + [(t, {"partition": q})
                                                                  for q, t in enumerate(parts[1:], 1)]))
    head = (f"POST {API}/gradients HTTP/1.1\r\nhost: x\r\ncontent-type: {frame.MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=allow(20))
    s.sendall(head + body[:upto])
    return s, body[upto:]


def pull(port: int, query: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=allow(20))
    s.sendall(f"GET {API}/model?{query} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    return s


def training(ps) -> tuple[PSClient, str]:
    """One worker registered with ``ps``, the model W0 in and training started: (its client, its worker id)."""
    c = ps.client()
    wid = c.register("w")["worker_id"]
    assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.1})
    wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
    return c, wid


def test_a_pull_reads_partition_0_of_the_next_step_before_the_push_ends():
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=SIZE) as ps:
        c, wid = training(ps)
        p = plan(spec_of(W0), SIZE)
        assert p.count == 12
        core = ps.rt.core
        sent_before = ps.rt.tensors.bytes_out
        pusher, rest = start_push(ps.port, wid, 6 << 20)  # partitions 0-4 whole, 5 begun
        wait_for(lambda: core.deciding and {1, 2} <= core.parts.closed, allow(10), "partitions 0-2 to close")
        with pull(ps.port, f"min_step=1&partitioned=1&worker_id={wid}&timeout={allow(10)}") as s:
            answer = ChunkedFrames(s)
            assert answer.status == 200 and answer.headers["content-type"] == frame.MEDIA_TYPE
            assert "content-length" not in answer.headers and answer.headers["x-syncps-step"] == "0"
            head = answer.until(1)[0]
            assert head.meta == {"step": 1, "partitions": 12}
            (key, w), = head.tensors.items()
            assert key == "w[0:250000]"
            np.testing.assert_array_equal(w, STEP1[:250_000])
            assert core.global_step == 0 and core.deciding and 11 not in core.parts.closed  # not pushed yet
            assert len(answer.until(3)) == 3  # partitions 1 and 2 closed: sent too
            pusher.sendall(rest)
            status, body = read_response(pusher)
            pusher.close()
            assert status == 200 and json.loads(body) == {"status": "accepted", "step": 1, "done": False}
            frames = answer.until(13)
            assert answer.ended and len(frames) == 12
            answer.reader.finish(len(answer.body), 12)  # the body ends with the last frame
        assert ps.rt.tensors.bytes_out - sent_before == len(answer.body)  # counted as every answer's bytes
        assert [f.meta for f in frames[1:-1]] == [{"partition": q} for q in range(1, 11)]
        assert frames[-1].meta == {"partition": 11, "done": False, "ranks": [0]}
        pieces = {k: v for f in frames for k, v in f.tensors.items()}
        assert list(pieces) == [piece.key for part in p.partitions for piece in part]
        np.testing.assert_array_equal(np.concatenate(list(pieces.values())), STEP1)
        np.testing.assert_array_equal(core.weights["w"], STEP1)
        c.close()


def test_a_pull_of_the_current_step_between_partitions_waits_for_the_rounds_close():
    """A pull of step 0 (a newcomer's, an export's) made while round 0 is between partitions is not answered with the
    weights as they are then (step 0's label on partitions of step 1 already applied): it waits for the close and
    gets step 1 whole, bit for bit."""
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=SIZE) as ps:
        c, wid = training(ps)
        core = ps.rt.core
        pusher, rest = start_push(ps.port, wid, 6 << 20)  # partitions 0-4 whole, 5 begun
        wait_for(lambda: core.deciding and {1, 2} <= core.parts.closed, allow(10), "partitions 0-2 to close")
        with pull(ps.port, f"min_step=0&timeout={allow(10)}") as s:
            wait_for(lambda: ps.rt._waiters, allow(10), "the pull to wait")  # not answered with mixed weights
            assert core.deciding and core.global_step == 0
            pusher.sendall(rest)
            assert read_response(pusher)[0] == 200
            pusher.close()
            status, body = read_response(s)
        assert status == 200
        answer = frame.decode(body)
        assert answer.meta["step"] == 1
        np.testing.assert_array_equal(answer.tensors["w"], STEP1)
        c.close()


def answered_whole(partition_bytes: int, query: str) -> frame.Frame:
    """The pull ``query`` made between partitions (or at 0: while the push is on the way) is answered once the round
    closed, whole (today's frame)."""
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=partition_bytes) as ps:
        c, wid = training(ps)
        core = ps.rt.core
        if partition_bytes:
            pusher, rest = start_push(ps.port, wid, 6 << 20)
            wait_for(lambda: core.deciding, allow(10), "the round's decision")
            with pull(ps.port, query) as s:
                pusher.sendall(rest)
                assert read_response(pusher)[0] == 200
                status, body = read_response(s)
            pusher.close()
        else:
            with pull(ps.port, query) as s:
                assert c.push(wid, 0, G)["status"] == "accepted"
                status, body = read_response(s)
        assert status == 200
        c.close()
        return frame.decode(body)


def test_without_partitioned_a_pull_between_partitions_is_answered_whole():
    f = answered_whole(SIZE, f"min_step=1&timeout={allow(10)}")
    assert f.meta == {"step": 1, "done": False, "ranks": [0]}
    np.testing.assert_array_equal(f.tensors["w"], STEP1)


def test_partitioned_is_ignored_where_rounds_are_not_partitioned():
    f = answered_whole(0, f"min_step=1&partitioned=1&timeout={allow(10)}")
    assert f.meta == {"step": 1, "done": False, "ranks": [0]}
    np.testing.assert_array_equal(f.tensors["w"], STEP1)


def test_the_stock_worker_pulls_the_next_weights_partition_by_partition_while_it_pushes():
    """Worker a (the stock transport, rank 0) pushes step 0 whole while its pull waits; worker b's push, half sent,
    decides the round: a's pull is answered partition by partition; once b's push ends, a's push answer carries
    step 1's weights, the PS's bit for bit."""
    with live_ps(min_workers=2, startup_grace_seconds=0, partition_bytes=SIZE) as ps:
        a = PSClient(ps.url, timeout=allow(20), attempts=1)
        b = ps.client()
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert b.init_model(W0, {"name": "sgd", "learning_rate": 0.1})
        core, parts = ps.rt.core, ps.rt.tensors.partitions
        wait_for(lambda: core.started, allow(10), "training to start")
        transport = BodyTransport(a.endpoint, partition_bytes=SIZE)
        out = {}
        pusher = threading.Thread(target=lambda: out.update(answer=transport.push({"worker_id": wa, "step": 0}, G,
                                                                                  allow(20), allow(20))))
        pusher.start()
        wait_for(lambda: core.parts is not None and wa in core.parts.came[11], allow(10), "a's push to be read")
        s, rest = start_push(ps.port, wb, 6 << 20)
        wait_for(lambda: parts.answered == 1, allow(10), "a's pull to be answered partition by partition")
        assert core.global_step == 0 and core.deciding
        s.sendall(rest)
        assert read_response(s)[0] == 200
        s.close()
        pusher.join(allow(20))
        answer = out["answer"]
        assert (answer.status, answer.step, answer.done) == ("accepted", 1, False)
        got = answer.pulled
        assert (got.step, got.done, got.ranks) == (1, False, [0, 1]) and list(got.tensors) == ["w"]
        np.testing.assert_array_equal(got.tensors["w"], core.weights["w"])
        np.testing.assert_array_equal(got.tensors["w"], W0["w"] - np.float32(0.1) * np.float32(0.5))
        transport.close()
        a.close()
        b.close()


def test_an_answer_in_flight_keeps_its_steps_bytes_while_the_next_round_closes():
    """Fixed R = 1 (backup workers): worker b's pull of step 1 is answered partition by partition while a's push of
    step 0 goes; b reads nothing more until a has pushed step 1 too and round 1 closed (the weights changed again):
    b's answer is still step 1's weights, bit for bit (each partition's bytes copied at its close)."""
    with live_ps(min_workers=2, startup_grace_seconds=0, partition_bytes=SIZE, replicas_to_aggregate=1) as ps:
        a, b = ps.client(), ps.client()
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.1})
        core = ps.rt.core
        wait_for(lambda: core.started, allow(10), "training to start")
        pusher, rest = start_push(ps.port, wa, 6 << 20)
        wait_for(lambda: core.deciding, allow(10), "round 0's decision (a's head: R = 1)")
        with pull(ps.port, f"min_step=1&partitioned=1&worker_id={wb}&timeout={allow(10)}") as s:
            answer = ChunkedFrames(s)
            assert answer.until(1)[0].meta == {"step": 1, "partitions": 12}
            pusher.sendall(rest)
            assert read_response(pusher)[0] == 200
            pusher.close()
            assert core.global_step == 1
            assert a.push(wa, 1, G)["status"] == "accepted"
            assert core.global_step == 2  # round 1 closed: every partition of the weights changed again
            frames = answer.until(13)
        assert len(frames) == 12 and frames[-1].meta == {"partition": 11, "done": False, "ranks": [0, 1]}
        np.testing.assert_array_equal(np.concatenate([v for f in frames for v in f.tensors.values()]), STEP1)
        assert not np.array_equal(core.weights["w"], STEP1)
        a.close()
        b.close()
