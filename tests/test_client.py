"""The worker's client and training loop driven through a mock transport (no live PS: what is tested is the
worker's side of the protocol, every layer above the socket: endpoint, retries, tensor transport, frames)."""
from __future__ import annotations

import numpy as np

from shared.protocol import API, PUSH_STATUS_HEADER
from shared.rawhttp import ConnectionLost
from worker_service.client import PSClient
from worker_service.loop import train
from worker_service.tasks.linear import LinearTask
from worker_service.transport.mock import Answer, MockTransport, Request

LR, STEPS = 0.5, 6


class OneWorkerPS:
    """The PS of a one-worker SGD job, as a mock transport's handler; the first attempt of each push is lost
    before it arrives (the endpoint retries it)."""

    def __init__(self) -> None:
        self.weights: dict[str, np.ndarray] | None = None
        self.step, self.seen, self.lost = 0, [], set()

    def answer(self, status: str | None = None) -> Answer:
        meta = {"step": self.step, "done": self.step >= STEPS, "ranks": [0]}
        return Answer.of_frame(self.weights, meta, {PUSH_STATUS_HEADER.lower(): status} if status else None)

    def __call__(self, r: Request) -> Answer:
        self.seen.append(f"{r.method} {r.path}")
        if (r.method, r.path) == ("POST", f"{API}/workers"):
            return Answer.of_json({"worker_id": "w0", "rank": 0, "start_step": 0, "lease_seconds": 30,
                                   "model_initialized": self.weights is not None})
        if (r.method, r.path) == ("PUT", f"{API}/model"):
            self.weights = {k: v.copy() for k, v in r.frame().tensors.items()}
            return Answer.of_json({"ok": True}, 201)
        if (r.method, r.path) == ("GET", f"{API}/model"):
            assert int(r.params["min_step"]) <= self.step and r.params["worker_id"] == "w0"
            return self.answer()
        if (r.method, r.path) == ("POST", f"{API}/gradients"):
            f = r.frame()
            if f.meta["step"] not in self.lost:
                self.lost.add(f.meta["step"])
                raise ConnectionLost("lost on the way")
            assert f.meta["step"] == self.step and r.params["pull"] == "1"
            for k, g in f.tensors.items():
                self.weights[k] = self.weights[k] - np.asarray(LR, g.dtype) * g
            self.step += 1
            return self.answer("accepted")
        if (r.method, r.path) == ("DELETE", f"{API}/workers/w0"):
            return Answer.of_json({"left": True})
        return Answer.of_json({"error": "not_found", "detail": r.path}, 404)


def test_the_loop_trains_through_a_mock_transport_bit_identical_to_one_process():
    ps = OneWorkerPS()
    client = PSClient("http://ps", connection=MockTransport(ps), shm_dir=None)
    summary = train(client, LinearTask(dtype="float64"), "w", 8, prefetch=False)
    client.close()
    assert summary.done and summary.steps == STEPS and summary.statuses == {"accepted": STEPS}
    task, w = LinearTask(dtype="float64"), LinearTask(dtype="float64").init_params()
    for step in range(STEPS):
        _, g, _ = task.loss_and_grads(w, task.batch(step, 0, 1, 8))
        w = {k: w[k] - LR * g[k] for k in w}
    assert all(ps.weights[k].tobytes() == w[k].tobytes() for k in w)
    # one pull (the push answers carry the next weights), each push twice (the first lost), one leave
    assert ps.seen.count(f"GET {API}/model") == 1 and ps.seen.count(f"POST {API}/gradients") == 2 * STEPS
    assert ps.seen[-1] == f"DELETE {API}/workers/w0" and client.conn.closed


def test_a_push_refused_not_held_is_redone_after_registering_again():
    """A sharded PS's 409 ``not_held`` (a follower answered the hold late: docs/protocol-shards.md): the stock loop
    registers again, pulls and pushes that step again; the job ends as without it."""
    ps = OneWorkerPS()
    ps.lost = set(range(STEPS))  # no push lost on the way here
    refuse = {2}

    def handler(r: Request) -> Answer:
        if (r.method, r.path) == ("POST", f"{API}/gradients") and r.frame().meta["step"] in refuse:
            refuse.clear()
            ps.seen.append(f"{r.method} {r.path}")
            return Answer.of_json({"error": "not_held", "detail": "shard(s) [1] gave no receipt"}, 409)
        if (r.method, r.path) == ("POST", f"{API}/workers") and ps.weights is not None:  # again: at the PS's step
            ps.seen.append(f"{r.method} {r.path}")
            return Answer.of_json({"worker_id": "w0", "rank": 0, "start_step": ps.step, "global_step": ps.step,
                                   "lease_seconds": 30, "model_initialized": True})
        return ps(r)

    client = PSClient("http://ps", connection=MockTransport(handler), shm_dir=None)
    summary = train(client, LinearTask(dtype="float64"), "w", 8, prefetch=False)
    client.close()
    assert summary.done and summary.statuses == {"accepted": STEPS}
    assert ps.seen.count(f"POST {API}/workers") == 2 and ps.seen.count(f"POST {API}/gradients") == STEPS + 1
    task, w = LinearTask(dtype="float64"), LinearTask(dtype="float64").init_params()
    for step in range(STEPS):
        _, g, _ = task.loss_and_grads(w, task.batch(step, 0, 1, 8))
        w = {k: w[k] - LR * g[k] for k in w}
    assert all(ps.weights[k].tobytes() == w[k].tobytes() for k in w)


def test_defaults_are_the_settings():
    from worker_service.settings import WorkerSettings

    client = PSClient("http://ps", connection=MockTransport(OneWorkerPS()))
    fields = WorkerSettings.model_fields
    assert (client.endpoint.attempts, client.timeout, client.endpoint.retry_timeout) == (
        fields["retry_attempts"].default, fields["request_timeout_seconds"].default,
        fields["retry_timeout_seconds"].default)
