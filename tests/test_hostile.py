"""Hostile input against a real PS (uvicorn on loopback): every bad request gets a clear 4xx JSON error
and leaves the state byte-identical (weights, optimizer slots, step, round progress, membership, counters).

The PS under test is mid-training: model initialised (adam: slots are non-zero), step 1 closed by two
workers, round 1 half full (worker A pushed, B not yet), and a third worker that left. Each case of the
table sends one request and asserts (status, error code, unchanged state hash).
"""
from __future__ import annotations

import math
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np
import pytest

from shared.codec import MAX_ITEMS, MAX_TENSORS, encode_tensors, pack
from shared.protocol import MSGPACK
from tests.live_ps import live_ps, raw_exchange, read_response, state_hash

LIMIT = 1 << 20  # PS_MAX_BODY_BYTES of the PS under test
IDLE = 0.5  # PS_BODY_IDLE_TIMEOUT_SECONDS
W0 = {"w": np.arange(6, dtype=np.float32).reshape(3, 2) / 10, "b": np.array([0.5, -0.5], np.float32)}


def grads(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, scale) for k, v in W0.items()}


@dataclass
class Ctx:
    a: str  # active, pushed round 1
    b: str  # active, not yet pushed round 1
    gone: str  # registered, then left
    step: int  # the open round


@pytest.fixture(scope="module")
def ps():
    with live_ps(max_body_bytes=LIMIT, body_idle_timeout_seconds=IDLE, lease_seconds=600, min_workers=2,
                 startup_grace_seconds=0) as ps:
        ca, cb, cc = ps.client(), ps.client(), ps.client()
        a, b = ca.register("a")["worker_id"], cb.register("b")["worker_id"]
        assert ca.init_model(W0, {"name": "adam", "learning_rate": 0.1})
        assert ca.pull(0, a, wait=5.0).step == 0
        assert ca.push(a, 0, grads(1.0))["status"] == "accepted"
        assert cb.push(b, 0, grads(2.0))["step"] == 1
        assert ca.push(a, 1, grads(3.0))["status"] == "accepted"
        gone = cc.register("c")["worker_id"]
        cc.leave(gone)
        ps.ctx = Ctx(a, b, gone, 1)
        yield ps
        for c in (ca, cb, cc):
            c.close()


@pytest.fixture
def unchanged(ps):
    """Asserts after the test that the PS state is byte-identical to before it."""
    before = state_hash(ps.rt)
    yield
    assert state_hash(ps.rt) == before, "a refused request changed the PS state"


# ---- request builders -------------------------------------------------------------------------------------
def tensor(dtype="float32", shape=(2,), data=None) -> dict:
    if data is None:
        data = b"\0" * (math.prod(shape) * np.dtype(dtype).itemsize)
    return {"dtype": dtype, "shape": list(shape), "data": data}


def push_obj(ctx: Ctx, **over) -> dict:
    obj = {"worker_id": ctx.b, "step": ctx.step, "tensors": encode_tensors(grads(1.0)), "loss": 0.5,
           "num_examples": 4, "timings": {"fetch": 0.1, "compute": 0.1, "push": 0.1}}
    obj.update(over)
    return obj


def with_tensor(ctx: Ctx, name: str, value: Any) -> dict:
    return push_obj(ctx, tensors={**encode_tensors(grads(1.0)), name: value})


@dataclass
class Case:
    id: str
    status: int
    code: str
    method: str = "POST"
    path: str = "/v1/gradients"
    body: Callable[[Ctx], Any] | None = None  # an object to msgpack, or bytes as they are
    ctype: str | None = MSGPACK
    params: dict = field(default_factory=dict)
    detail: str | None = None  # a substring the detail must contain (e.g. the offending tensor)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def many_items(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n  # array32 of n empty maps


CASES = [
    # content type: 415
    Case("push-json-content-type", 415, "unsupported_media_type", body=lambda c: push_obj(c), ctype="application/json"),
    Case("push-no-content-type", 415, "unsupported_media_type", body=lambda c: push_obj(c), ctype=None),
    Case("init-text-plain", 415, "unsupported_media_type", "PUT", "/v1/model", body=lambda c: b"hello", ctype="text/plain"),
    Case("register-msgpack", 415, "unsupported_media_type", path="/v1/workers", body=lambda c: {"name": "x"}),
    # malformed msgpack: 400
    Case("msgpack-garbage", 400, "bad_msgpack", body=lambda c: b"\xc1\xc1\xc1"),
    Case("msgpack-empty", 400, "bad_msgpack", body=lambda c: b""),
    Case("msgpack-truncated", 400, "bad_msgpack", body=lambda c: pack(push_obj(c))[:-3]),
    Case("msgpack-trailing-bytes", 400, "bad_msgpack", body=lambda c: pack(push_obj(c)) + b"\x00"),
    Case("msgpack-ext-type", 400, "bad_msgpack", body=lambda c: msgpack.packb(msgpack.ExtType(7, b"pickle"))),
    Case("msgpack-timestamp-step", 400, "bad_field",
         body=lambda c: msgpack.packb({**push_obj(c), "step": msgpack.Timestamp(5)}, use_bin_type=True)),
    Case("msgpack-int-map-key", 400, "bad_msgpack", body=lambda c: b"\x81\x01\x02"),
    Case("msgpack-deep-nesting", 400, "bad_msgpack", body=lambda c: nested(100_000)),
    Case("msgpack-huge-item-count", 400, "bad_msgpack", body=lambda c: many_items(MAX_ITEMS + 1)),
    Case("msgpack-declared-array-longer-than-body", 400, "bad_msgpack", body=lambda c: b"\xdd\xff\xff\xff\xff" + b"\xc0" * 70000),
    # wrong form: 400
    Case("body-not-a-map", 400, "bad_body", body=lambda c: [1, 2, 3]),
    Case("missing-worker-id", 400, "missing_field", body=lambda c: {k: v for k, v in push_obj(c).items() if k != "worker_id"}),
    Case("missing-tensors", 400, "missing_field", body=lambda c: {k: v for k, v in push_obj(c).items() if k != "tensors"}),
    Case("worker-id-int", 400, "bad_field", body=lambda c: push_obj(c, worker_id=12345)),
    Case("worker-id-list", 400, "bad_field", body=lambda c: push_obj(c, worker_id=[c.b])),
    Case("step-string", 400, "bad_field", body=lambda c: push_obj(c, step="1")),
    Case("step-bool", 400, "bad_field", body=lambda c: push_obj(c, step=True)),
    Case("step-float", 400, "bad_field", body=lambda c: push_obj(c, step=1.0)),
    Case("tensors-list", 400, "bad_field", body=lambda c: push_obj(c, tensors=[1, 2])),
    Case("tensor-not-a-map", 400, "bad_tensor", body=lambda c: with_tensor(c, "b", [0, 0])),
    Case("tensor-missing-data", 400, "bad_tensor", body=lambda c: with_tensor(c, "b", {"dtype": "float32", "shape": [2]})),
    Case("tensor-data-str", 400, "bad_tensor", body=lambda c: with_tensor(c, "b", tensor(data="\0" * 8))),
    Case("tensor-extra-field", 400, "bad_tensor", body=lambda c: with_tensor(c, "b", {**tensor(), "pickle": b"x"})),
    Case("tensor-name-bytes", 400, "bad_tensor_name", body=lambda c: push_obj(c, tensors={b"w": tensor()})),
    Case("loss-string", 400, "bad_field", body=lambda c: push_obj(c, loss="low")),
    Case("num-examples-negative", 400, "bad_field", body=lambda c: push_obj(c, num_examples=-1)),
    Case("num-examples-absurd", 400, "bad_field", body=lambda c: push_obj(c, num_examples=2**64 - 1)),
    Case("timings-nan", 400, "bad_field", body=lambda c: push_obj(c, timings={"fetch": float("nan")})),
    Case("timings-inf", 400, "bad_field", body=lambda c: push_obj(c, timings={"push": float("inf")})),
    Case("timings-negative", 400, "bad_field", body=lambda c: push_obj(c, timings={"compute": -1.0})),
    Case("timings-list", 400, "bad_field", body=lambda c: push_obj(c, timings=[1, 2, 3])),
    # size: 413 (the streaming and lying cases are separate tests below)
    Case("body-over-limit", 413, "body_too_large", body=lambda c: b"\0" * (LIMIT + 1)),
    # who: 404 / 409
    Case("unknown-worker", 404, "unknown_worker", body=lambda c: push_obj(c, worker_id="0123456789abcdef")),
    Case("unknown-worker-huge-id", 404, "unknown_worker", body=lambda c: push_obj(c, worker_id="x" * 1000)),
    Case("left-worker", 409, "not_active", body=lambda c: push_obj(c, worker_id=c.gone)),
    Case("heartbeat-unknown", 404, "unknown_worker", path="/v1/workers/nope/heartbeat", ctype=None),
    Case("leave-unknown", 404, "unknown_worker", "DELETE", "/v1/workers/nope", ctype=None),
    Case("pull-as-unknown-worker", 404, "unknown_worker", "GET", "/v1/model", ctype=None,
         params={"worker_id": "nope", "timeout": 0}),
    Case("init-again", 409, "already_initialized", "PUT", "/v1/model", body=lambda c: {"tensors": encode_tensors(W0)}),
    # the model: 422 naming the offending tensor
    Case("tensor-missing", 422, "tensor_mismatch", detail="'b'",
         body=lambda c: push_obj(c, tensors=encode_tensors({"w": grads()["w"]}))),
    Case("tensor-extra", 422, "tensor_mismatch", detail="'evil'", body=lambda c: with_tensor(c, "evil", tensor())),
    Case("tensor-wrong-shape", 422, "tensor_mismatch", detail="'w'",
         body=lambda c: with_tensor(c, "w", tensor(shape=(2, 3)))),
    Case("tensor-int-dtype", 422, "tensor_mismatch", detail="'b'", body=lambda c: with_tensor(c, "b", tensor("int32"))),
    Case("tensor-object-dtype", 422, "unsupported_dtype", detail="'b'",
         body=lambda c: with_tensor(c, "b", tensor(data=b"\0" * 16) | {"dtype": "object"})),
    Case("tensor-pickle-dtype-O", 422, "unsupported_dtype", body=lambda c: with_tensor(c, "b", tensor() | {"dtype": "O"})),
    Case("tensor-big-endian", 422, "unsupported_dtype", body=lambda c: with_tensor(c, "b", tensor() | {"dtype": ">f4"})),
    Case("tensor-complex", 422, "unsupported_dtype", body=lambda c: with_tensor(c, "b", tensor() | {"dtype": "complex64"})),
    Case("tensor-length-mismatch", 422, "bad_length", detail="'b'", body=lambda c: with_tensor(c, "b", tensor(data=b"\0" * 7))),
    Case("tensor-absurd-declared-shape", 422, "bad_length",
         body=lambda c: with_tensor(c, "b", {"dtype": "float64", "shape": [2**63] * 8, "data": b"\0" * 8})),
    Case("tensor-zero-size-absurd-shape", 422, "bad_shape",
         body=lambda c: with_tensor(c, "b", {"dtype": "float32", "shape": [0, 2**63], "data": b""})),
    Case("tensor-negative-dim", 422, "bad_shape", body=lambda c: with_tensor(c, "b", {"dtype": "float32", "shape": [-2], "data": b""})),
    Case("tensor-nine-dims", 422, "bad_shape", body=lambda c: with_tensor(c, "b", tensor(shape=(1,) * 9))),
    Case("too-many-tensors", 422, "too_many_tensors",
         body=lambda c: push_obj(c, tensors={f"t{i}": tensor("float32", (0,)) for i in range(MAX_TENSORS + 1)})),
    Case("gradient-nan", 422, "nonfinite_gradient", detail="'w'",
         body=lambda c: push_obj(c, tensors=encode_tensors({**grads(), "w": np.full((3, 2), np.nan, np.float32)}))),
    Case("gradient-inf", 422, "nonfinite_gradient", detail="'b'",
         body=lambda c: push_obj(c, tensors=encode_tensors({**grads(), "b": np.array([1, -np.inf], np.float32)}))),
    Case("step-in-the-future", 422, "future_step", body=lambda c: push_obj(c, step=c.step + 1)),
    Case("step-far-future", 422, "future_step", body=lambda c: push_obj(c, step=2**64 - 1)),
    Case("step-negative", 422, "bad_step", body=lambda c: push_obj(c, step=-1)),
    # JSON registration: 400
    Case("register-malformed-json", 400, "bad_request", path="/v1/workers", ctype="application/json", body=lambda c: b'{"name": '),
    Case("register-deep-json", 400, "bad_request", path="/v1/workers", ctype="application/json", body=lambda c: b"[" * 60000),
    Case("register-name-int", 400, "bad_request", path="/v1/workers", ctype="application/json", body=lambda c: b'{"name": 5}'),
    Case("register-missing-name", 400, "bad_request", path="/v1/workers", ctype="application/json", body=lambda c: b"{}"),
    Case("register-empty-name", 400, "bad_request", path="/v1/workers", ctype="application/json", body=lambda c: b'{"name": ""}'),
    Case("register-blank-name", 400, "bad_name", path="/v1/workers", ctype="application/json", body=lambda c: b'{"name": "  "}'),
    Case("register-control-chars", 400, "bad_request", path="/v1/workers", ctype="application/json",
         body=lambda c: b'{"name": "a\\nINFO forged log line"}'),
    Case("register-long-name", 400, "bad_request", path="/v1/workers", ctype="application/json",
         body=lambda c: b'{"name": "' + b"x" * 200 + b'"}'),
    Case("register-json-over-64k", 413, "body_too_large", path="/v1/workers", ctype="application/json",
         body=lambda c: b'{"name": "' + b"x" * 70000 + b'"}'),
    # query parameters: 400
    Case("pull-timeout-negative", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"timeout": -1}),
    Case("pull-timeout-nan", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"timeout": "nan"}),
    Case("pull-timeout-inf", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"timeout": "inf"}),
    Case("pull-timeout-text", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"timeout": "soon"}),
    Case("pull-min-step-negative", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"min_step": -5}),
    Case("pull-min-step-4300-digits", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"min_step": "9" * 5000}),
    Case("pull-worker-id-too-long", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"worker_id": "x" * 65}),
    Case("rounds-limit-zero", 400, "bad_request", "GET", "/v1/rounds", ctype=None, params={"limit": 0}),
    Case("rounds-limit-huge", 400, "bad_request", "GET", "/v1/rounds", ctype=None, params={"limit": 10**9}),
    # routing
    Case("wrong-method", 405, "method_not_allowed", "PATCH", "/v1/model", ctype=None),
    Case("unknown-path", 404, "not_found", "GET", "/v1/pickle", ctype=None),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_with_a_clear_4xx_and_nothing_changes(ps, unchanged, case):
    raw = case.body(ps.ctx) if case.body else None
    content = raw if isinstance(raw, (bytes, type(None))) else pack(raw)
    headers = {"content-type": case.ctype} if case.ctype else {}
    with ps.http() as h:
        r = h.request(case.method, case.path, content=content, headers=headers, params=case.params)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert (r.status_code, body["error"]) == (case.status, case.code), body
    assert set(body) == {"error", "detail"} and body["detail"]
    if case.detail:
        assert case.detail in body["detail"]


# ---- a PS whose model is not initialised yet: the initialiser is validated too ------------------------------
INIT_CASES = [
    Case("init-int-weights", 422, "bad_dtype", "PUT", "/v1/model",
         body=lambda c: {"tensors": encode_tensors({"w": np.zeros(3, np.int64)})}),
    Case("init-empty-model", 422, "empty_model", "PUT", "/v1/model", body=lambda c: {"tensors": {}}),
    Case("init-unknown-optimizer", 422, "bad_optimizer", "PUT", "/v1/model",
         body=lambda c: {"tensors": encode_tensors(W0), "optimizer": {"name": "pickle"}}),
    Case("init-learning-rate-text", 422, "bad_optimizer", "PUT", "/v1/model",
         body=lambda c: {"tensors": encode_tensors(W0), "optimizer": {"name": "sgd", "learning_rate": "fast"}}),
    Case("init-learning-rate-nan", 422, "bad_optimizer", "PUT", "/v1/model",
         body=lambda c: {"tensors": encode_tensors(W0), "optimizer": {"name": "sgd", "learning_rate": float("nan")}}),
    Case("init-optimizer-list", 400, "bad_field", "PUT", "/v1/model", body=lambda c: {"tensors": encode_tensors(W0), "optimizer": [1]}),
    Case("init-tensors-missing", 400, "missing_field", "PUT", "/v1/model", body=lambda c: {"optimizer": {}}),
    Case("push-before-init", 409, "not_initialized", body=lambda c: push_obj(c)),
    Case("pull-before-init", 409, "not_initialized", "GET", "/v1/model", ctype=None, params={"timeout": 0}),
]


@pytest.fixture(scope="module")
def empty_ps():
    with live_ps(lease_seconds=600) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        ps.ctx = Ctx(wid, wid, wid, 0)
        yield ps
        c.close()


@pytest.mark.parametrize("case", INIT_CASES, ids=[c.id for c in INIT_CASES])
def test_refused_before_the_model_exists(empty_ps, case):
    before = state_hash(empty_ps.rt)
    test_refused_with_a_clear_4xx_and_nothing_changes(empty_ps, None, case)
    assert state_hash(empty_ps.rt) == before and not empty_ps.rt.core.initialized


# ---- what a well-behaved client cannot send: raw sockets ---------------------------------------------------
def head(path: str = "/v1/gradients", extra: str = "", ctype: str = MSGPACK) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: ps\r\nContent-Type: {ctype}\r\n{extra}\r\n".encode()


def test_declared_huge_body_is_refused_before_a_byte_of_it_is_sent(ps, unchanged):
    status, body = raw_exchange(ps.port, head(extra="Content-Length: 1073741824\r\n"))
    assert status == 413 and b"body_too_large" in body


def test_chunked_body_without_length_is_cut_off_while_streaming(ps, unchanged):
    """1 GiB offered in chunks, no Content-Length: the PS answers 413 once past the limit, long before the end."""
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"\0" * (1 << 16))
    sent, offered = 0, 1 << 30
    with socket.create_connection(("127.0.0.1", ps.port), timeout=10) as s:
        s.sendall(head(extra="Transfer-Encoding: chunked\r\n"))
        s.setblocking(False)
        deadline = time.monotonic() + 60
        while sent < offered and time.monotonic() < deadline:
            readable, writable, _ = select.select([s], [s], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sent += s.send(chunk)
                except BlockingIOError:
                    pass
        s.setblocking(True)
        status, body = read_response(s)
    assert status == 413 and b"body_too_large" in body
    print(f"[hostile] chunked body: 413 after {sent} bytes sent (limit {LIMIT})")
    assert sent < 64 * LIMIT, f"the PS read {sent} bytes before refusing"


def test_content_length_shorter_than_the_body(ps, unchanged):
    """Only the declared bytes are the body (truncated msgpack); the rest is garbage on the connection."""
    status, _ = raw_exchange(ps.port, head(extra="Content-Length: 3\r\n") + pack(push_obj(ps.ctx)))
    assert status == 400


def test_content_length_longer_than_the_body_then_the_client_leaves(ps, unchanged, caplog):
    body = pack(push_obj(ps.ctx))
    status, _ = raw_exchange(ps.port, head(extra=f"Content-Length: {len(body) + 100}\r\n") + body, shutdown=True)
    assert status in (None, 400)
    assert "internal error" not in caplog.text


def test_stalled_body_times_out_with_408(ps, unchanged):
    body = pack(push_obj(ps.ctx))
    t0 = time.monotonic()
    status, reply = raw_exchange(ps.port, head(extra=f"Content-Length: {len(body)}\r\n") + body[:10])
    assert status == 408 and b"body_timeout" in reply
    assert IDLE <= time.monotonic() - t0 < IDLE + 10


@pytest.mark.parametrize("extra", ["Content-Length: -1\r\n", "Content-Length: abc\r\n",
                                   "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n"])
def test_malformed_framing_is_refused_by_the_http_layer(ps, unchanged, extra):
    status, _ = raw_exchange(ps.port, head(extra=extra) + b"0\r\n\r\n")
    assert status == 400


def test_the_ps_still_trains_after_the_table(ps):
    """The refusals left a working PS: B's push closes round 1 with A's and B's gradients. The state
    hash sees legitimate changes, down to a lease renewal."""
    c = ps.client()
    h0 = state_hash(ps.rt)
    c.heartbeat(ps.ctx.b)
    h1 = state_hash(ps.rt)
    res = c.push(ps.ctx.b, ps.ctx.step, grads(4.0))
    assert res["status"] == "accepted" and res["step"] == ps.ctx.step + 1
    assert ps.rt.core.optimizer.iterations == 2
    assert len({h0, h1, state_hash(ps.rt)}) == 3
    c.close()


# ---- the NaN/Inf policy: skip-and-count --------------------------------------------------------------------
def test_nonfinite_skip_policy_counts_drops_and_does_not_stall_the_round():
    with live_ps(nonfinite_policy="skip", lease_seconds=600, min_workers=2, startup_grace_seconds=0,
                 optimizer="sgd", learning_rate=0.5) as ps:
        ca, cb = ps.client(), ps.client()
        a, b = ca.register("a")["worker_id"], cb.register("b")["worker_id"]
        assert ca.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        assert ca.pull(0, a, wait=5.0).step == 0
        bad = {**grads(1.0), "b": np.array([np.nan, 1], np.float32)}
        assert ca.push(a, 0, bad) == {"status": "skipped", "step": 0, "done": False}
        res = cb.push(b, 0, grads(2.0))  # the round does not wait for A again: B's gradient alone closes it
        assert res == {"status": "accepted", "step": 1, "done": False}
        for k, w in W0.items():
            np.testing.assert_array_equal(ps.rt.core.weights[k], w - np.float32(0.5) * np.float32(2.0))
        # a round where every push is skipped passes without an update
        before = {k: v.copy() for k, v in ps.rt.core.weights.items()}
        assert ca.push(a, 1, bad)["status"] == "skipped"
        assert cb.push(b, 1, {**grads(), "w": np.full((3, 2), np.inf, np.float32)}) == \
            {"status": "skipped", "step": 2, "done": False}
        assert all(np.array_equal(ps.rt.core.weights[k], before[k]) for k in W0)
        assert ps.rt.core.optimizer.iterations == 1
        st = ca.status()
        assert st["pushes"]["skipped"] == 3 and st["pushes"]["accepted"] == 1
        workers = {w["name"]: w for w in ca.http.get("/v1/workers").json()["workers"]}
        assert workers["a"]["pushes"]["skipped"] == 2 and workers["b"]["pushes"]["skipped"] == 1
        ca.close()
        cb.close()
