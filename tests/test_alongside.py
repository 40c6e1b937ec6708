"""The pull a worker sends alongside its push (partitioned rounds: worker_service/transport/http.py's
``BodyTransport.push``, worker_service/transport/partitioned.py's ``Alongside``) has its connection to itself: one that
is still reading when the push gives up waiting for it (a slow answer, still arriving) keeps that connection until it
ends, and the next step's pull goes on a new one, never on the same socket and answer buffers at once."""
from __future__ import annotations

import threading

import numpy as np

from tests.timing import allow
from worker_service.transport.http import BodyTransport
from worker_service.transport.partitioned import Alongside


class Answer:
    status_code, headers = 200, {"content-type": "application/json"}

    @staticmethod
    def json() -> dict:
        return {"status": "accepted", "step": 1, "done": False}


class Endpoint:
    """The push's connection (answers at once) and the pullers it makes: each counts the pulls in it at once."""
    base_url = "http://127.0.0.1:9"

    def __init__(self, release: threading.Event) -> None:
        self.release, self.pullers = release, []
        self.inside = self.most = 0
        self.lock = threading.Lock()

    def sibling(self, url: str) -> "Endpoint":
        self.pullers.append(Endpoint(self.release))
        return self.pullers[-1]

    def call(self, method: str, path: str, **kw):
        if method == "POST":
            return Answer()
        with self.lock:  # a pull: its answer still arriving until released
            self.inside += 1
            self.most = max(self.most, self.inside)
        self.release.wait(allow(10))
        with self.lock:
            self.inside -= 1
        raise ConnectionError("the pull ended")

    def close(self) -> None:
        pass


def test_a_pull_still_reading_when_its_push_returns_keeps_its_connection(monkeypatch):
    # the push stops waiting for its pull at once (instead of after the pull's timeout plus 5 s)
    monkeypatch.setattr(Alongside, "result", lambda self: None if self.thread.join(0.01) or self.running else self._got)
    release = threading.Event()
    push = Endpoint(release)
    transport = BodyTransport(push, partition_bytes=4096)
    grads = {"w": np.zeros(4096, np.float32)}  # 4 partitions
    try:
        for step in range(3):
            answer = transport.push({"worker_id": "w", "step": step}, grads, 0.0, 1.0)
            assert (answer.status, answer.pulled) == ("accepted", None)  # no weights: the client pulls
        assert [p.most for p in push.pullers] == [1, 1, 1]  # (before: one puller, its 3 pulls at once)
    finally:
        release.set()
