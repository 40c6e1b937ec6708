"""The weights store (ps_service/core/model.py): the weights kept in their answers' frame, copied only when an answer still holds it.

The rule under test: once an answer is handed out, its bytes never change, whatever the optimizer does next; and
a synchronous job's steps copy nothing."""
from __future__ import annotations

import socket
import threading

import numpy as np

from ps_service.core.model import WeightsStore
from shared import frame
from tests.live_ps import live_ps
from tests.timing import allow


def _weights() -> dict[str, np.ndarray]:
    return {"b": np.arange(3, dtype=np.float32), "w": np.full((4, 5), 2.0, np.float32)}


def _head(step: int, ranks=(0, 1)) -> dict:
    return {"step": step, "done": False, "ranks": list(ranks)}


def test_the_weights_move_into_the_frame_once_and_answers_are_views_of_it():
    store, weights = WeightsStore(), _weights()
    body = store.answer(weights, ("k", 0), _head(0))
    got = frame.decode(body)
    assert got.meta == _head(0) and set(got.tensors) == {"b", "w"}
    np.testing.assert_array_equal(got.tensors["w"], np.full((4, 5), 2.0, np.float32))
    assert store.holds(weights) and store.moves == 1
    weights["w"] -= 1.0  # the optimizer's in-place update lands in the frame itself
    assert frame.decode(store.answer(weights, ("k", 0), _head(0))).tensors["w"][0, 0] == 1.0
    del body, got
    store.before_change()
    weights["w"] -= 1.0
    again = frame.decode(store.answer(weights, ("k", 1), _head(1)))  # a new step: the header rewritten in place
    assert again.meta["step"] == 1 and again.tensors["w"][0, 0] == 0.0 and store.moves == 1


def test_an_answer_in_flight_keeps_its_bytes_when_the_weights_change():
    store, weights = WeightsStore(), _weights()
    held = store.answer(weights, ("k", 0), _head(0))  # e.g. still in the server's write queue
    sent = bytes(held)
    assert store.in_flight()
    store.before_change()  # copy on write: the weights leave the frame the answer holds
    weights["w"] *= 3.0
    weights["b"] += 1.0
    assert bytes(held) == sent and store.moves == 2
    fresh = frame.decode(store.answer(weights, ("k", 1), _head(1)))
    np.testing.assert_array_equal(fresh.tensors["w"], np.full((4, 5), 6.0, np.float32))
    np.testing.assert_array_equal(fresh.tensors["b"], np.arange(1, 4, dtype=np.float32))
    held.release()
    assert store.in_flight()  # the newest answer's view (``fresh`` holds its tensors) is alive


def test_a_new_header_is_written_in_place_only_when_no_answer_holds_the_frame_and_it_fits():
    store, weights = WeightsStore(), _weights()
    held = store.answer(weights, ("k", 0), _head(0))
    before = bytes(held)
    body = store.answer(weights, ("k", 1), _head(1))  # a new key while ``held`` is alive: a fresh frame
    assert bytes(held) == before and store.moves == 2 and frame.decode(body).meta["step"] == 1
    del held, body
    many = tuple(range(60))  # a header past the next 64-byte boundary: the tensors would move
    body = store.answer(weights, ("k", 2), _head(2, many))
    assert frame.decode(body).meta["ranks"] == list(many) and store.moves == 3


def test_weights_that_live_elsewhere_are_left_there():
    """The same-host weights file (its arrays are views of a mapping) or a restore (a new dict)."""
    store = WeightsStore()
    backing = np.zeros(32, np.float32)
    in_a_file = {"w": backing[:16].reshape(4, 4)}
    assert store.answer(in_a_file, ("k", 0), _head(0)) is None and in_a_file["w"].base is backing
    weights = _weights()
    store.answer(weights, ("k", 0), _head(0))
    restored = _weights()  # ModelState.restore makes a new dict of fresh arrays
    assert not store.holds(restored)
    store.answer(restored, ("k", 0), _head(0))
    assert store.holds(restored) and not store.holds(weights) and store.moves == 2
    restored["w"] = restored["w"].copy()  # moved out (ShmHub.offer puts views of its file in the same dict)
    store.before_change()
    assert store.answer(in_a_file, ("k", 1), _head(1)) is None and not store.in_flight() and store._buf is None


def _send_pull(port: int, min_step: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=allow(30))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # a small window: the answer stays queued
    sock.sendall(f"GET /v1/model?min_step={min_step}&timeout=0 HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    return sock


class _Trickle(threading.Thread):
    """Reads 64 KB of the answer a second, no more: the answer stays in flight (40 MB would take minutes), and the
    PS's window never stays shut for its TCP_USER_TIMEOUT (5 s: shared/liveness.py ends a connection whose reader
    read nothing that long), however long the rounds take on a busy machine."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.done = sock, bytearray(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.data += self.sock.recv(64 << 10)

    def finish(self) -> bytearray:
        self.done.set()
        self.join(allow(10))
        return self.data


def _read_answer(sock: socket.socket, data: bytearray | None = None) -> frame.Frame:
    data = data if data is not None else bytearray()
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    body = bytearray(rest)
    while len(body) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "the PS closed the connection inside the answer"
        body += chunk
    return frame.decode(bytes(body))


def test_a_slow_reader_gets_the_exact_weights_of_its_step_while_rounds_go_on():
    """A 40 MB answer to a reader that barely reads: uvloop keeps it queued while two workers close 3 rounds;
    read at last, it is exactly its step's weights (w = -step with gradients 1 and learning rate 1), and the
    workers' own answers are exact too."""
    size = 10_000_000
    with live_ps(min_workers=2, total_num_replicas=2) as ps:
        clients = [ps.client() for _ in range(2)]
        ids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        clients[0].init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        ones = np.ones(size, np.float32)
        slow = _send_pull(ps.port, 0)
        trickle = _Trickle(slow)
        trickle.start()
        store = ps.rt.core.store
        try:
            for step in range(3):
                answers = [None, None]

                def push(i, step=step):
                    clients[i].push_wait = 30.0
                    answers[i] = clients[i].push(ids[i], step, {"w": ones})

                threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(allow(60))
                assert [a["status"] for a in answers] == ["accepted", "accepted"]
                for c in clients:
                    pulled = c.pull(step + 1, wait=0.0)
                    assert pulled.step == step + 1
                    np.testing.assert_array_equal(pulled.tensors["w"], np.full(size, -(step + 1.0), np.float32))
            assert store.moves >= 2  # the first step's change found the slow answer in flight: copy on write
            got = _read_answer(slow, trickle.finish())
            assert got.meta["step"] == 0
            np.testing.assert_array_equal(got.tensors["w"], np.zeros(size, np.float32))
        finally:
            trickle.done.set()
            slow.close()
            for c in clients:
                c.close()


def test_a_synchronous_job_over_tcp_copies_no_weights_per_step():
    """Two workers reading every answer before pushing again: after the first move, the steps change the frame
    in place (at most a move or two, should a write's completion come late)."""
    size, rounds = 1_000_000, 12
    with live_ps(min_workers=2, total_num_replicas=2) as ps:
        clients = [ps.client() for _ in range(2)]
        ids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        clients[0].init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 0.5})
        grads = [np.full(size, 1.0 + i, np.float32) for i in range(2)]

        def work(i):
            clients[i].push_wait = 30.0
            for step in range(rounds):
                assert clients[i].push(ids[i], step, {"w": grads[i]})["status"] == "accepted"
                assert clients[i].pull(step + 1, wait=allow(30.0)).step == step + 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(allow(120))
        assert ps.rt.core.global_step == rounds
        np.testing.assert_array_equal(ps.rt.core.weights["w"], np.full(size, -0.75 * rounds, np.float32))
        assert ps.rt.core.store.moves <= 1 + rounds // 4
        for c in clients:
            c.close()
