"""Hostile input against a real PS (uvicorn on loopback): every bad request gets a clear 4xx JSON error
and leaves the state byte-identical (weights, optimizer slots, step, round progress, membership, counters).

The PS under test is mid-training: model initialised (adam: slots are non-zero), step 1 closed by two
workers, round 1 half full (worker A pushed, B not yet), and a third worker that left. Each case of the
table sends one request and asserts (status, error code, unchanged state hash).
"""
from __future__ import annotations

import json
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest

from cluster.processes import wait_for
from shared import frame
from shared.protocol import MAX_INT, JobState
from tests.live_ps import live_ps, raw_exchange, read_response, state_hash
from tests.wire import FRAME, Packed, hand_frame, msgpack_map, pack, parts, push_frame, raw_frame, repeated, tampered
from tests.timing import allow

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
        assert ca.pull(0, a, wait=allow(5.0)).step == 0
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
def meta(ctx: Ctx, **over) -> dict:
    """The meta of B's push for the open round, with ``over`` changed (a None value drops the field)."""
    m = {"worker_id": ctx.b, "step": ctx.step, "loss": 0.5, "num_examples": 4,
         "timings": {"fetch": 0.1, "compute": 0.1, "push": 0.1}}
    m.update(over)
    return {k: v for k, v in m.items() if v is not None}


def push(ctx: Ctx, arrays: dict | None = None, **over) -> bytes:
    """B's push frame (honest gradients unless ``arrays``), meta changed by ``over``."""
    return frame.encode_bytes(grads() if arrays is None else arrays, meta(ctx, **over))


def edited(ctx: Ctx, edit: Callable[[dict], Any] | None = None, **kw) -> bytes:
    """B's honest push frame with its header changed in place by ``edit`` (kw: :func:`tests.wire.tampered`'s)."""
    return tampered(grads(), meta(ctx), edit, **kw)


def with_b(ctx: Ctx, dtype: Any = "float32", shape: Any = (2,), data: bytes | None = None) -> bytes:
    """B's push whose tensor ``b`` is declared by hand (any dtype and shape; zeros of the declared size by default)."""
    if data is None:
        data = bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return hand_frame(meta(ctx), ("w", "float32", [3, 2], grads()["w"].tobytes()), ("b", dtype, list(shape), data))


def with_meta(ctx: Ctx, packed_meta: Packed, dup_data_bytes: bool = False) -> bytes:
    """B's honest gradients under a meta written by hand (a key twice, an int key...)."""
    head, data = parts(grads())
    pairs = [("meta", packed_meta), ("tensors", head["tensors"]), ("data_bytes", head["data_bytes"])]
    return raw_frame(msgpack_map(*pairs, *pairs[2:] * dup_data_bytes), data)


def old_msgpack_push(ctx: Ctx) -> bytes:
    """The push body of the previous wire format: a msgpack map with tensors as {"dtype", "shape", "data"} maps."""
    return pack({**meta(ctx), "tensors": {k: {"dtype": "float32", "shape": list(v.shape), "data": v.tobytes()}
                                          for k, v in grads().items()}})


@dataclass
class Case:
    id: str
    status: int
    code: str | tuple[str, ...]  # a tuple: any of these
    method: str = "POST"
    path: str = "/v1/gradients"
    body: Callable[[Ctx], bytes] | None = None
    ctype: str | None = FRAME
    params: dict = field(default_factory=dict)
    detail: str | None = None  # a substring the detail must contain (e.g. the offending tensor)


def nested(depth: int) -> Packed:
    return Packed(b"\x91" * depth + b"\xc0")


HEADER_MSGPACK = "bad_msgpack"  # malformed msgpack in the header
JSON = "application/json"

CASES = [
    # content type: 415
    Case("push-json-content-type", 415, "unsupported_media_type", body=push, ctype=JSON),
    Case("push-no-content-type", 415, "unsupported_media_type", body=push, ctype=None),
    Case("push-old-msgpack-format", 415, "unsupported_media_type", body=old_msgpack_push, ctype="application/msgpack"),
    Case("init-text-plain", 415, "unsupported_media_type", "PUT", "/v1/model", body=lambda c: b"hello", ctype="text/plain"),
    Case("register-frame", 415, "unsupported_media_type", path="/v1/workers",
         body=lambda c: frame.encode_bytes({}, {"name": "x"})),
    # not a frame: 400 bad_frame
    Case("frame-garbage", 400, "bad_frame", body=lambda c: b"\xc1\xc1\xc1"),
    Case("frame-empty", 400, "bad_frame", body=lambda c: b""),
    Case("frame-old-msgpack-body", 400, "bad_frame", body=old_msgpack_push),
    Case("frame-bad-magic", 400, "bad_frame", body=lambda c: edited(c, magic=b"SYNCPSF0")),
    Case("frame-reserved-not-zero", 400, "bad_frame", body=lambda c: edited(c, reserved=1)),
    Case("frame-header-length-past-the-body", 400, "bad_frame", body=lambda c: edited(c, hlen=len(push(c)))),
    Case("frame-header-length-over-the-limit", 400, "bad_frame", body=lambda c: edited(c, hlen=frame.MAX_HEADER_BYTES + 1)),
    Case("frame-truncated", 400, "bad_frame", body=lambda c: push(c)[:-3]),
    Case("frame-trailing-bytes", 400, "bad_frame", body=lambda c: push(c) + b"\x00"),
    Case("frame-data-bytes-wrong", 400, "bad_frame",
         body=lambda c: edited(c, lambda h: h.update(data_bytes=h["data_bytes"] + 4))),
    Case("frame-data-bytes-and-body-both-longer", 400, "bad_frame",
         body=lambda c: edited(c, lambda h: h.update(data_bytes=h["data_bytes"] + 8), tail=bytes(8))),
    Case("frame-offset-not-canonical", 400, "bad_frame", body=lambda c: edited(c, lambda h: h["tensors"][1].__setitem__(3, 24))),
    Case("frame-offset-gap", 400, "bad_frame",
         body=lambda c: edited(c, lambda h: (h["tensors"][1].__setitem__(3, 128), h.update(data_bytes=136)), tail=bytes(64))),
    Case("frame-duplicate-tensor-name", 400, "bad_frame", detail="'b'",
         body=lambda c: hand_frame(meta(c), ("b", "float32", [2], bytes(8)), ("b", "float32", [2], bytes(8)))),
    # the header's msgpack
    Case("header-not-msgpack", 400, HEADER_MSGPACK, body=lambda c: raw_frame(b"\xc1\xc1")),
    Case("header-truncated", 400, HEADER_MSGPACK, body=lambda c: raw_frame(pack({"meta": meta(c)})[:-2])),
    Case("header-trailing-bytes", 400, HEADER_MSGPACK, body=lambda c: raw_frame(pack({"meta": {}}) + b"\xc0")),
    Case("header-deep-nesting", 400, HEADER_MSGPACK,
         body=lambda c: with_meta(c, msgpack_map(("worker_id", c.b), ("step", c.step), ("loss", nested(100_000))))),
    Case("header-declared-array-longer-than-the-header", 400, HEADER_MSGPACK,
         body=lambda c: raw_frame(b"\xdd\xff\xff\xff\xff" + b"\xc0" * 70000)),
    Case("header-many-items", 400, "bad_frame", body=lambda c: raw_frame(repeated(b"\x80", 1 << 16))),
    Case("meta-step-twice", 400, "duplicate_key",
         body=lambda c: with_meta(c, msgpack_map(("worker_id", c.b), ("step", c.step), ("step", c.step - 1)))),
    Case("header-key-twice", 400, "duplicate_key",
         body=lambda c: with_meta(c, Packed(pack(meta(c))), dup_data_bytes=True)),
    Case("meta-ext-type", 400, "bad_msgpack",
         body=lambda c: push(c, loss=msgpack.ExtType(7, b"pickle"))),
    Case("meta-int-key", 400, "bad_msgpack",
         body=lambda c: with_meta(c, msgpack_map(("worker_id", c.b), ("step", c.step), (1, 2)))),
    Case("meta-timestamp-step", 400, ("bad_field", "bad_msgpack"), body=lambda c: push(c, step=msgpack.Timestamp(5))),
    # the header's form: 400
    Case("header-not-a-map", 400, "bad_frame", body=lambda c: raw_frame([1, 2, 3])),
    Case("header-without-tensors", 400, "bad_frame", body=lambda c: edited(c, lambda h: h.pop("tensors"))),
    Case("header-extra-key", 400, "bad_frame", body=lambda c: edited(c, lambda h: h.update(pickle=b"x"))),
    Case("meta-not-a-map", 400, "bad_frame", body=lambda c: edited(c, lambda h: h.update(meta=[c.b, c.step]))),
    Case("tensors-a-map", 400, "bad_frame", body=lambda c: edited(c, lambda h: h.update(tensors={"w": 0}))),
    Case("tensor-entry-not-a-list", 400, "bad_frame", body=lambda c: edited(c, lambda h: h["tensors"].__setitem__(1, "b"))),
    Case("tensor-entry-extra-field", 400, "bad_frame", body=lambda c: edited(c, lambda h: h["tensors"][1].append(b"pickle"))),
    Case("tensor-name-bytes", 400, "bad_frame", body=lambda c: edited(c, lambda h: h["tensors"][1].__setitem__(0, b"b"))),
    Case("tensor-name-too-long", 400, "bad_frame", body=lambda c: edited(c, lambda h: h["tensors"][1].__setitem__(0, "b" * 257))),
    # the meta's fields: 400
    Case("missing-worker-id", 400, "missing_field", body=lambda c: push(c, worker_id=None)),
    Case("missing-step", 400, "missing_field", body=lambda c: push(c, step=None)),
    Case("meta-unknown-field", 400, "bad_field", detail="pickle", body=lambda c: push(c, pickle=b"x")),
    Case("meta-tensors-field", 400, "bad_field", body=lambda c: push(c, tensors={})),
    Case("meta-bytes-key", 400, "bad_msgpack", body=lambda c: with_meta(c, Packed(pack({**meta(c), b"step": 0})))),
    Case("worker-id-int", 400, "bad_field", body=lambda c: push(c, worker_id=12345)),
    Case("worker-id-list", 400, "bad_field", body=lambda c: push(c, worker_id=[c.b])),
    Case("step-string", 400, "bad_field", body=lambda c: push(c, step="1")),
    Case("step-bool", 400, "bad_field", body=lambda c: push(c, step=True)),
    Case("step-float", 400, "bad_field", body=lambda c: push(c, step=1.0)),
    Case("loss-string", 400, "bad_field", body=lambda c: push(c, loss="low")),
    Case("num-examples-negative", 400, "bad_field", body=lambda c: push(c, num_examples=-1)),
    Case("num-examples-absurd", 400, "bad_field", body=lambda c: push(c, num_examples=2**64 - 1)),
    Case("timings-nan", 400, "bad_field", body=lambda c: push(c, timings={"fetch": float("nan")})),
    Case("timings-inf", 400, "bad_field", body=lambda c: push(c, timings={"push": float("inf")})),
    Case("timings-negative", 400, "bad_field", body=lambda c: push(c, timings={"compute": -1.0})),
    Case("timings-unknown-phase", 400, "bad_field", body=lambda c: push(c, timings={"sleep": 1.0})),
    Case("timings-list", 400, "bad_field", body=lambda c: push(c, timings=[1, 2, 3])),
    Case("timings-empty-list", 400, "bad_field", body=lambda c: push(c, timings=[])),
    Case("timings-zero", 400, "bad_field", body=lambda c: push(c, timings=0)),
    Case("timings-false", 400, "bad_field", body=lambda c: push(c, timings=False)),
    Case("compression-empty-name", 422, "compression_mismatch", body=lambda c: push(c, compression="")),
    Case("shm-seq-with-tensors", 400, "bad_field", body=lambda c: push(c, shm_seq=5)),
    Case("shm-seq-negative", 400, "bad_field", body=lambda c: push(c, {}, shm_seq=-1)),
    # size: 413 (the streaming and lying cases are separate tests below)
    Case("body-over-limit", 413, "body_too_large", body=lambda c: b"\0" * (LIMIT + 1)),
    # who: 404 / 409
    Case("unknown-worker", 404, "unknown_worker", body=lambda c: push(c, worker_id="0123456789abcdef")),
    Case("unknown-worker-huge-id", 404, "unknown_worker", body=lambda c: push(c, worker_id="x" * 1000)),
    Case("left-worker", 409, "not_active", body=lambda c: push(c, worker_id=c.gone)),
    Case("shm-seq-not-attached", 409, "shm_not_attached", body=lambda c: push(c, {}, shm_seq=5)),
    Case("heartbeat-unknown", 404, "unknown_worker", path="/v1/workers/nope/heartbeat", ctype=None),
    Case("leave-unknown", 404, "unknown_worker", "DELETE", "/v1/workers/nope", ctype=None),
    Case("pull-as-unknown-worker", 404, "unknown_worker", "GET", "/v1/model", ctype=None,
         params={"worker_id": "nope", "timeout": 0}),
    Case("init-again", 409, "already_initialized", "PUT", "/v1/model", body=lambda c: frame.encode_bytes(W0)),
    # the model: 422 naming the offending tensor
    Case("tensor-missing", 422, "tensor_mismatch", detail="'b'", body=lambda c: push(c, {"w": grads()["w"]})),
    Case("tensor-extra", 422, "tensor_mismatch", detail="'evil'",
         body=lambda c: push(c, {**grads(), "evil": np.zeros(2, np.float32)})),
    Case("tensor-wrong-shape", 422, "tensor_mismatch", detail="'w'",
         body=lambda c: push(c, {**grads(), "w": np.zeros((2, 3), np.float32)})),
    Case("tensor-int-dtype", 422, "tensor_mismatch", detail="'b'", body=lambda c: with_b(c, "int32")),
    Case("tensor-float64-dtype", 422, "tensor_mismatch", detail="'b'", body=lambda c: with_b(c, "float64")),
    Case("tensor-float16-dtype", 422, "tensor_mismatch", detail="'b'", body=lambda c: with_b(c, "float16")),
    Case("tensor-object-dtype", 422, "unsupported_dtype", detail="'b'", body=lambda c: with_b(c, "object", data=bytes(16))),
    Case("tensor-pickle-dtype-O", 422, "unsupported_dtype", body=lambda c: with_b(c, "O", data=bytes(16))),
    Case("tensor-big-endian", 422, "unsupported_dtype", body=lambda c: with_b(c, ">f4")),
    Case("tensor-complex", 422, "unsupported_dtype", body=lambda c: with_b(c, "complex64")),
    Case("tensor-uint8", 422, "unsupported_dtype", body=lambda c: with_b(c, "uint8", data=bytes(4))),
    Case("tensor-absurd-declared-shape", 422, "bad_shape", body=lambda c: with_b(c, "float64", [2**39] * 8, bytes(8))),
    Case("tensor-dimension-too-large", 422, "bad_shape", body=lambda c: with_b(c, "float32", [0, 2**63], b"")),
    Case("tensor-zero-size-overflowing-shape", 422, "bad_shape",
         body=lambda c: with_b(c, "float32", [0] + [2**39] * 3, b"")),
    Case("tensor-zero-size-large-shape", 422, "tensor_mismatch", detail="'b'",
         body=lambda c: with_b(c, "float32", [0, 2**39], b"")),
    Case("tensor-negative-dim", 422, "bad_shape", body=lambda c: with_b(c, "float32", [-2], b"")),
    Case("tensor-nine-dims", 422, "bad_shape", body=lambda c: with_b(c, "float32", [1] * 9)),
    Case("too-many-tensors", 422, "too_many_tensors",
         body=lambda c: hand_frame(meta(c), *[(f"t{i}", "float32", [0], b"") for i in range(frame.MAX_TENSORS + 1)])),
    Case("gradient-nan", 422, "nonfinite_gradient", detail="'w'",
         body=lambda c: push(c, {**grads(), "w": np.full((3, 2), np.nan, np.float32)})),
    Case("gradient-inf", 422, "nonfinite_gradient", detail="'b'",
         body=lambda c: push(c, {**grads(), "b": np.array([1, -np.inf], np.float32)})),
    Case("step-in-the-future", 422, "future_step", body=lambda c: push(c, step=c.step + 1)),
    Case("step-far-future", 422, "future_step", body=lambda c: push(c, step=MAX_INT)),
    Case("step-negative", 422, "bad_step", body=lambda c: push(c, step=-1)),
    # a step that is not an int is mistyped (400 bad_field), not out of range (protocol.md, the push's bounds)
    Case("step-true", 400, "bad_field", body=lambda c: push(c, step=True)),
    Case("step-float", 400, "bad_field", body=lambda c: push(c, step=1.0)),
    # integers beyond 2^53 - 1 (docs/protocol.md, "Integers"): refused, never carried on into the state
    Case("step-2-53", 422, "bad_step", body=lambda c: push(c, step=MAX_INT + 1)),
    Case("step-2-64-minus-1", 422, "bad_step", body=lambda c: push(c, step=2**64 - 1)),
    Case("shm-seq-2-53", 400, "bad_field", body=lambda c: push(c, {}, shm_seq=MAX_INT + 1)),
    Case("shm-seq-2-64-minus-1", 400, "bad_field", body=lambda c: push(c, {}, shm_seq=2**64 - 1)),
    Case("pull-min-step-2-53", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"min_step": MAX_INT + 1}),
    Case("pull-since-2-64", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"since": 2**64}),
    Case("push-pull-since-2-53", 400, "bad_request", body=push, params={"pull": 1, "since": MAX_INT + 1}),
    Case("round-step-2-53", 400, "bad_request", "GET", f"/v1/rounds/{MAX_INT + 1}", ctype=None),
    Case("round-step-minus-2-53", 400, "bad_request", "GET", f"/v1/rounds/-{MAX_INT + 1}", ctype=None),
    Case("loss-since-2-63", 400, "bad_request", "GET", "/v1/loss", ctype=None, params={"since": 2**63}),
    # JSON registration: 400
    Case("register-malformed-json", 400, "bad_request", path="/v1/workers", ctype=JSON, body=lambda c: b'{"name": '),
    Case("register-nan-json", 400, "bad_request", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "a", "x": NaN}'),
    Case("register-infinity-json", 400, "bad_request", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "a", "x": -Infinity}'),
    Case("register-deep-json", 400, "bad_request", path="/v1/workers", ctype=JSON, body=lambda c: b"[" * 60000),
    Case("register-name-twice", 400, "duplicate_key", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "a", "name": "b"}'),
    Case("register-name-int", 400, "bad_request", path="/v1/workers", ctype=JSON, body=lambda c: b'{"name": 5}'),
    Case("register-missing-name", 400, "bad_request", path="/v1/workers", ctype=JSON, body=lambda c: b"{}"),
    Case("register-empty-name", 400, "bad_request", path="/v1/workers", ctype=JSON, body=lambda c: b'{"name": ""}'),
    Case("register-blank-name", 400, "bad_name", path="/v1/workers", ctype=JSON, body=lambda c: b'{"name": "  "}'),
    # only whitespace, whatever else is wrong: a control character (tab, newline, NEL), the length
    Case("register-blank-control-name", 400, "bad_name", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": " \\t\\n\\u0085 "}'),
    Case("register-long-blank-name", 400, "bad_name", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "' + b" " * 200 + b'"}'),
    Case("register-control-chars", 400, "bad_request", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "a\\nINFO forged log line"}'),
    Case("register-c1-control-char", 400, "bad_request", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "a\\u0085b"}'),
    Case("register-long-name", 400, "bad_request", path="/v1/workers", ctype=JSON,
         body=lambda c: b'{"name": "' + b"x" * 200 + b'"}'),
    Case("register-json-over-64k", 413, "body_too_large", path="/v1/workers", ctype=JSON,
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
    # an integer is decimal digits (protocol.md, "Query parameters"), not what Python's int() takes
    *[Case(f"rounds-limit-{name}", 400, "bad_request", "GET", "/v1/rounds", ctype=None, params={"limit": value})
      for name, value in [("underscore", "1_0"), ("plus", "+5"), ("space", " 5"), ("tab", "5\t"), ("dot", "5."),
                          ("exponent", "1e3")]],
    Case("pull-min-step-minus-zero", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"min_step": "-0"}),
    Case("pull-since-plus", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"since": "+1"}),
    Case("round-step-underscore", 400, "bad_request", "GET", "/v1/rounds/1_000", ctype=None),
    Case("pull-yes-no-two", 400, "bad_request", "GET", "/v1/model", ctype=None, params={"shm": "2"}),
    # routing
    Case("wrong-method", 405, "method_not_allowed", "PATCH", "/v1/model", ctype=None),
    Case("unknown-path", 404, "not_found", "GET", "/v1/pickle", ctype=None),
    # a trailing slash is another path: 404, not a 307 to the route without it (which skipped the token check)
    Case("push-trailing-slash", 404, "not_found", body=push, path="/v1/gradients/"),
    Case("status-trailing-slash", 404, "not_found", "GET", "/v1/status/", ctype=None),
]


def cases(table: list[Case]) -> list:
    return [pytest.param(c, id=c.id)
            for c in table]


def assert_refused(r, status: int, code: str | tuple[str, ...], detail: str | None = None) -> None:
    """A 4xx answer with the JSON error body ``{"error": code, "detail": text}``."""
    assert r.headers["content-type"] == "application/json", (r.status_code, r.content[:200])
    body = r.json()
    codes = code if isinstance(code, tuple) else (code,)
    assert r.status_code == status and body["error"] in codes, (r.status_code, body)
    assert set(body) == {"error", "detail"} and body["detail"]
    if detail:
        assert detail in body["detail"], body


@pytest.mark.parametrize("case", cases(CASES))
def test_refused_with_a_clear_4xx_and_nothing_changes(ps, unchanged, case):
    headers = {"content-type": case.ctype} if case.ctype else {}
    with ps.http() as h:
        r = h.request(case.method, case.path, content=case.body(ps.ctx) if case.body else None, headers=headers,
                      params=case.params)
        if r.status_code >= 500:  # uvicorn logs the traceback after the answer: one more exchange waits for that, so
            h.get("/healthz")     # it does not race pytest's report of ours (ast's state is per process in CPython 3.11)
    assert_refused(r, case.status, case.code, case.detail)


# ---- the exact dtype: no casting --------------------------------------------------------------------------
@pytest.mark.parametrize("model,grad", [(np.float32, np.array([1e300, 0, 0], np.float64)),
                                        (np.float64, np.array([1e30, 0, 0], np.float32))],
                         ids=["float64-gradient-for-float32-weights", "float32-gradient-for-float64-weights"])
def test_a_gradient_of_another_dtype_is_refused_and_the_weights_stay(model, grad):
    """Once cast, 1e300 became inf in float32 and the weights -inf; now a gradient of another dtype than its
    weight is 422 tensor_mismatch, even when it alone would close the round, and the PS state is untouched."""
    w0 = {"w": np.array([0.5, -0.25, 1.0], model)}
    with live_ps(total_num_replicas=1, lease_seconds=600, startup_grace_seconds=0) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        assert c.init_model(w0, {"name": "sgd", "learning_rate": 1.0})
        assert c.pull(0, wid, wait=allow(5.0)).step == 0
        before = state_hash(ps.rt)
        with ps.http() as h:
            r = h.post("/v1/gradients", content=push_frame(wid, 0, {"w": grad}), headers={"content-type": FRAME})
        assert_refused(r, 422, "tensor_mismatch", "'w'")
        assert state_hash(ps.rt) == before
        pulled = c.pull(0, wid, wait=allow(5.0))
        assert pulled.step == 0 and pulled.tensors["w"].dtype == model
        assert pulled.tensors["w"].tobytes() == w0["w"].tobytes()
        # the same values in the weights' dtype are taken, and close the round
        assert c.push(wid, 0, {"w": np.array([1, 0, 0], model)}) == {"status": "accepted", "step": 1, "done": False}
        np.testing.assert_array_equal(c.pull(1, wid, wait=allow(5.0)).tensors["w"], np.array([-0.5, -0.25, 1.0], model))
        c.close()


# ---- a PS whose model is not initialised yet: the initialiser is validated too ------------------------------
def init(tensors: dict | None = None, **meta) -> Callable[[Ctx], bytes]:
    return lambda c: frame.encode_bytes(W0 if tensors is None else tensors, meta)


INIT_CASES = [
    Case("init-int-weights", 422, "bad_dtype", "PUT", "/v1/model", body=init({"w": np.zeros(3, np.int64)})),
    Case("init-empty-model", 422, "empty_model", "PUT", "/v1/model", body=init({})),
    Case("init-nan-weight", 422, "nonfinite_weights", "PUT", "/v1/model",
         body=init({**W0, "b": np.array([0.5, np.nan], np.float32)}), detail="'b'"),
    Case("init-inf-weight", 422, "nonfinite_weights", "PUT", "/v1/model",
         body=init({"w": np.array([-np.inf], np.float64)})),
    Case("init-unknown-optimizer", 422, "bad_optimizer", "PUT", "/v1/model", body=init(optimizer={"name": "pickle"})),
    Case("init-learning-rate-text", 422, "bad_optimizer", "PUT", "/v1/model",
         body=init(optimizer={"name": "sgd", "learning_rate": "fast"})),
    Case("init-learning-rate-nan", 422, "bad_optimizer", "PUT", "/v1/model",
         body=init(optimizer={"name": "sgd", "learning_rate": float("nan")})),
    Case("init-optimizer-list", 400, "bad_field", "PUT", "/v1/model", body=init(optimizer=[1])),
    Case("init-optimizer-zero", 400, "bad_field", "PUT", "/v1/model", body=init(optimizer=0)),
    Case("init-optimizer-false", 400, "bad_field", "PUT", "/v1/model", body=init(optimizer=False)),
    Case("init-unknown-meta-field", 400, "bad_field", "PUT", "/v1/model", body=init(step=0)),
    Case("init-header-without-tensors", 400, "bad_frame", "PUT", "/v1/model",
         body=lambda c: tampered(W0, edit=lambda h: h.pop("tensors"))),
    Case("init-duplicate-tensor-name", 400, "bad_frame", "PUT", "/v1/model",
         body=lambda c: hand_frame({}, ("w", "float32", [1], bytes(4)), ("w", "float32", [1], bytes(4)))),
    Case("init-msgpack-content-type", 415, "unsupported_media_type", "PUT", "/v1/model", body=init(), ctype="application/msgpack"),
    Case("push-before-init", 409, "not_initialized", body=push),
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


@pytest.mark.parametrize("case", cases(INIT_CASES))
def test_refused_before_the_model_exists(empty_ps, case):
    before = state_hash(empty_ps.rt)
    test_refused_with_a_clear_4xx_and_nothing_changes(empty_ps, None, case)
    assert state_hash(empty_ps.rt) == before and not empty_ps.rt.core.initialized


# ---- what a well-behaved client cannot send: raw sockets ---------------------------------------------------
def head(path: str = "/v1/gradients", extra: str = "", ctype: str = FRAME) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: ps\r\nContent-Type: {ctype}\r\n{extra}\r\n".encode()


def test_declared_huge_body_is_refused_before_a_byte_of_it_is_sent(ps, unchanged):
    status, body = raw_exchange(ps.port, head(extra="Content-Length: 1073741824\r\n"))
    assert status == 413 and b"body_too_large" in body


def test_chunked_body_without_length_is_cut_off_while_streaming(ps, unchanged):
    """1 GiB offered in chunks, no Content-Length: the PS answers 413 once past the limit, long before the end."""
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"\0" * (1 << 16))
    sent, offered = 0, 1 << 30
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(head(extra="Transfer-Encoding: chunked\r\n"))
        s.setblocking(False)
        deadline = time.monotonic() + allow(60)
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
    """Only the declared bytes are the body (a truncated frame); the rest is garbage on the connection."""
    status, _ = raw_exchange(ps.port, head(extra="Content-Length: 3\r\n") + push(ps.ctx))
    assert status == 400


def test_content_length_longer_than_the_body_then_the_client_leaves(ps, unchanged, caplog):
    """protocol.md, Errors (`client_disconnected`): a client that closes its sending side mid-body (a half-close: it
    could still read) gets no answer; the PS closes the connection and changes nothing."""
    body = push(ps.ctx)
    status, reply = raw_exchange(ps.port, head(extra=f"Content-Length: {len(body) + 100}\r\n") + body, shutdown=True)
    assert (status, reply) == (None, b"")
    assert "internal error" not in caplog.text


def test_stalled_body_times_out_with_408(ps, unchanged):
    body = push(ps.ctx)
    t0 = time.monotonic()
    status, reply = raw_exchange(ps.port, head(extra=f"Content-Length: {len(body)}\r\n") + body[:10])
    assert status == 408 and b"body_timeout" in reply
    assert IDLE <= time.monotonic() - t0 < IDLE + allow(10)


def _answer_then_eof(s: socket.socket) -> tuple[int | None, str, bytes]:
    """One response (status, head, body), then what follows on the connection until it closes (allow(10) s at most)."""
    buf, s_deadline = b"", time.monotonic() + allow(10)
    s.settimeout(allow(10))
    while time.monotonic() < s_deadline:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    else:
        raise AssertionError(f"the PS kept the connection open after {buf[:200]!r}")
    head, _, rest = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin-1").lower(), rest


@pytest.mark.parametrize("req,status,code", [
    (lambda c: head(extra="Content-Length: 100\r\n") + push(c)[:10], 408, "body_timeout"),
    (lambda c: head(extra="Content-Length: 1073741824\r\n"), 413, "body_too_large"),
    (lambda c: head(extra="Content-Length: 100\r\n", ctype="text/plain"), 415, "unsupported_media_type"),
    (lambda c: head("/v1/workers", "Content-Length: 100\r\n", "application/json") + b'{"na', 408, "body_timeout"),
    (lambda c: b"GET /v1/status HTTP/1.1\r\nHost: ps\r\nContent-Length: 5\r\n\r\nhello", 200, "global_step"),
    (lambda c: head("/v1/nowhere", "Content-Length: 5\r\n") + b"hello", 404, "not_found"),
], ids=["408-stalled", "413-declared", "415-before-the-body", "408-json", "200-status-with-a-body", "404-with-a-body"])
def test_a_refusal_before_the_whole_body_closes_the_connection(ps, unchanged, req, status, code):
    """protocol.md, Errors: an answer sent before the request's body was read whole (a refusal, or a route that takes
    no body) says ``connection: close`` and the PS closes the connection: the rest of the body may still come."""
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(req(ps.ctx))
        got, head_text, rest = _answer_then_eof(s)
    assert got == status and code.encode() in rest and "\r\nconnection: close" in head_text, head_text


def test_a_client_that_sends_its_whole_body_before_reading_gets_the_413(ps, unchanged):
    """A client that writes a too-large body to the end before it reads (a blocking one) still reads the 413: the
    PS half-closes and drops the rest, rather than closing at once, whose reset would fail the client's send."""
    body = b"\0" * (4 * LIMIT)
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(head(extra=f"Content-Length: {len(body)}\r\n") + body)
        got, head_text, rest = _answer_then_eof(s)
    assert got == 413 and b"body_too_large" in rest and "\r\nconnection: close" in head_text


@pytest.mark.parametrize("pad", ["", " ", "\t"], ids=["plain", "trailing-space", "trailing-tab"])
def test_a_refusal_after_the_whole_body_keeps_the_connection(ps, unchanged, pad):
    """A refused push whose body was read whole leaves the connection reusable: the next request is answered.
    Whitespace after the Content-Length's digits is allowed (RFC 9110 5.5); it was 400 bad_content_length."""
    body = push(ps.ctx, step=10 ** 6)
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(head(extra=f"Content-Length: {len(body)}{pad}\r\n") + body)
        status, reply = read_response(s)
        assert status == 422 and b"future_step" in reply
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: ps\r\n\r\n")
        assert read_response(s)[0] == 200


@pytest.mark.parametrize("extra", ["Content-Length: -1\r\n", "Content-Length: abc\r\n", f"Content-Length: {2**64}\r\n",
                                   "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n"])
def test_malformed_framing_is_refused_by_the_http_layer(ps, unchanged, extra):
    status, _ = raw_exchange(ps.port, head(extra=extra) + b"0\r\n\r\n")
    assert status == 400


def _hosts(req: bytes, hosts: str) -> bytes:
    """``req`` with its Host header replaced by ``hosts`` (header lines)."""
    return req.replace(b"Host: ps\r\n", hosts.encode(), 1)


def _valid_push(c: Ctx) -> bytes:
    """B's push for the open round, which the PS would accept: the fast lane (ps_service/hotpath.py) serves it."""
    body = push(c)
    return head(extra=f"Content-Length: {len(body)}\r\n") + body


@pytest.mark.parametrize("req", [
    lambda c: _hosts(_valid_push(c), ""),
    lambda c: _hosts(_valid_push(c), "Host: ps\r\nHost: ps\r\n"),
    lambda c: b"GET /v1/model?min_step=0&timeout=0 HTTP/1.1\r\n\r\n",
    lambda c: b"GET /v1/status HTTP/1.1\r\n\r\n",
    lambda c: b"GET /v1/status HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n",
    lambda c: b"GET /v1/status HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
], ids=["push-no-host", "push-two-hosts", "pull-no-host", "route-no-host", "route-two-hosts", "http10-two-hosts"])
def test_a_request_without_one_host_header_is_refused_as_bad_http(ps, unchanged, req):
    """RFC 9112 3.2 (docs/protocol.md, Errors): HTTP/1.1 without a Host header, or any request with two, is 400
    ``bad_http`` and the connection closes, on the fast lane (a push the PS would take otherwise) as on the routes."""
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(req(ps.ctx))
        got, head_text, rest = _answer_then_eof(s)
    assert got == 400 and json.loads(rest)["error"] == "bad_http" and "\r\nconnection: close" in head_text, rest
    assert b"Host" in rest


def test_http10_without_a_host_header_is_answered(ps, unchanged):
    status, body = raw_exchange(ps.port, b"GET /v1/status HTTP/1.0\r\n\r\n")
    assert status == 200 and json.loads(body)["global_step"] == ps.ctx.step


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
        assert ca.pull(0, a, wait=allow(5.0)).step == 0
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
        with ps.http() as h:
            workers = {w["name"]: w for w in h.get("/v1/workers").json()["workers"]}
        assert workers["a"]["pushes"]["skipped"] == 2 and workers["b"]["pushes"]["skipped"] == 1
        ca.close()
        cb.close()


def test_two_finite_pushes_whose_sum_overflows_change_no_weight_over_http():
    """Two workers push float32 3e38 (finite, each one valid) in the body: their sum is inf. The round closes and
    applies nothing; the weights stay finite and unchanged (issue 11: finiteness is checked on what is applied)."""
    import threading

    from worker_service.client import PSClient

    with live_ps(total_num_replicas=2, min_workers=2) as ps:
        url = f"http://127.0.0.1:{ps.port}"
        clients = [PSClient(url) for _ in range(2)]
        try:
            ids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
            clients[0].init_model({"w": np.zeros(3, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
            answers: list = []
            threads = [threading.Thread(target=lambda i=i: answers.append(
                clients[i].push(ids[i], 0, {"w": np.full(3, 3e38, np.float32)}))) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(allow(30))
            assert sorted(a["status"] for a in answers) == ["accepted", "accepted"]
            assert ps.rt.core.global_step == 1 and ps.rt.core.weights["w"].tolist() == [0.0, 0.0, 0.0]
            rounds = clients[0].conn.request("GET", "/v1/rounds", {}, (), 10.0).json()["rounds"]
            assert rounds[0]["aggregated"] == 0
        finally:
            for c in clients:
                c.close()


# ---- what protocol.md says of the edges a client writer asks about -----------------------------------------
def test_a_sync_push_once_done_is_stale_with_done_and_a_pull_push_gets_the_final_weights():
    """protocol.md, push, "Once the job is done": the final step's push is ``stale`` with ``done: true`` (it was 409
    ``not_started``, which a client would wait on), its retry ``duplicate``; ``?pull=1`` answers the final
    weights at once; the weights never change."""
    with live_ps(total_num_replicas=1, max_steps=1, lease_seconds=600, startup_grace_seconds=0) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.1})
        assert c.push(wid, 0, grads(1.0))["step"] == 1
        final = state_hash(ps.rt)
        with ps.http() as h:
            post = lambda **params: h.post("/v1/gradients", content=push_frame(wid, 1, grads(2.0)),  # noqa: E731
                                            headers={"content-type": FRAME}, params=params)
            r = post()
            assert (r.status_code, r.json()) == (200, {"status": "stale", "step": 1, "done": True})
            assert post().json()["status"] == "duplicate"
            t0 = time.monotonic()
            r = post(pull=1, timeout=allow(20))
            assert r.status_code == 200 and r.headers["x-syncps-push-status"] == "duplicate"
            assert time.monotonic() - t0 < allow(5)
            got = frame.decode(r.content)
            assert got.meta["done"] is True and got.meta["step"] == 1
            np.testing.assert_array_equal(got.tensors["b"], W0["b"] - np.float32(0.1))
        assert ps.rt.core.push_counts["stale"] == 1
        assert ps.rt.core.weights["b"].tobytes() == got.tensors["b"].tobytes()
        c.close()


def test_leave_twice_query_rules_and_the_loss_floor(ps):
    """protocol.md: a repeated leave gets the same answer; an undeclared query parameter is ignored and a repeated
    one counts with its last value; ``GET /v1/loss`` takes ``since`` >= -1 (-1: every point); HEAD is 405."""
    with ps.http() as h:
        for _ in range(2):
            r = h.delete(f"/v1/workers/{ps.ctx.gone}")
            assert (r.status_code, r.json()) == (200, {"worker_id": ps.ctx.gone, "state": "left"})
        assert h.delete("/v1/workers/nobody").json()["error"] == "unknown_worker"
        assert h.get("/v1/rounds", params=[("limit", "5000"), ("limit", "1")]).status_code == 200
        assert_refused(h.get("/v1/rounds", params=[("limit", "1"), ("limit", "5000")]), 400, "bad_request")
        assert len(h.get("/v1/rounds", params={"limit": 1, "bogus": "x"}).json()["rounds"]) == 1
        assert len(h.get("/v1/rounds", params={"limit": "01.00"}).json()["rounds"]) == 1  # digits, a zero fraction
        assert h.get("/v1/loss", params={"since": "-01"}).json() == h.get("/v1/loss").json()
        assert h.get("/v1/loss", params={"since": -1}).json() == h.get("/v1/loss").json()
        assert_refused(h.get("/v1/loss", params={"since": -2}), 400, "bad_request")
        r = h.head("/v1/status")
        assert r.status_code == 405 and r.content == b""
        # protocol.md, Weight deltas: only a topk or 2bit job names a lineage; this one (none) sends none
        assert set(frame.decode(h.get("/v1/model", params={"timeout": 0}).content).meta) == {"step", "done", "ranks"}


def test_the_registration_answer_says_the_ps_state_and_a_rejoin(ps):
    """protocol.md, register: `state` is the PS's (shared.protocol.JobState), `rejoined` a name registered before."""
    with ps.http() as h:
        r = h.post("/v1/workers", json={"name": "a"}).json()
    assert (r["worker_id"], r["rejoined"], r["state"], r["model_initialized"]) == (ps.ctx.a, True, "training", True)
    page = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    register = page.split("### `POST /v1/workers` — register")[1].split("### ")[0]
    assert all(f"`{s.value}`" in register for s in JobState), "a JobState the register section does not name"


def test_a_worker_that_leaves_while_its_counted_push_waits_gets_its_status_at_once():
    """A ?pull=1 push counted, then its worker left: the answer was a 409 not_active at the wait's timeout while
    the round used the gradient (found by a black-box check); now the plain JSON of the push, at once. A pull
    naming a worker that leaves mid-wait ends at once too, with 409."""
    with live_ps(lease_seconds=600, min_workers=2, startup_grace_seconds=0) as ps:
        c = ps.client()
        a, b = (c.register(n)["worker_id"] for n in ("a", "b"))
        assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        answers: dict[str, Any] = {}

        def waiting_push() -> None:
            with ps.http() as h:
                t0 = time.monotonic()
                r = h.post("/v1/gradients", params={"pull": 1, "timeout": allow(30)},
                           content=push_frame(a, 0, grads(2.0)), headers={"content-type": FRAME})
                answers["push"] = (r, time.monotonic() - t0)

        t = threading.Thread(target=waiting_push)
        t.start()
        wait_for(lambda: ps.rt.core.push_counts["accepted"] == 1, allow(10), "a's push in the round (its answer waits)")
        with ps.http() as h:
            assert h.delete(f"/v1/workers/{a}").json()["state"] == "left"
        t.join(allow(10))
        r, took = answers["push"]
        assert (r.status_code, r.json()) == (200, {"status": "accepted", "step": 0, "done": False}) and took < allow(5)
        with ps.http() as h:  # the round uses a's gradient: b's closes it with the mean of both
            assert h.post("/v1/gradients", content=push_frame(b, 0, grads(4.0)),
                          headers={"content-type": FRAME}).json()["status"] == "accepted"
        np.testing.assert_array_equal(ps.rt.core.weights["b"], W0["b"] - np.float32(0.5) * np.float32(3.0))
        assert [x.name for x in ps.rt.core.rounds[-1].contributors] == ["a", "b"]

        # a pull naming b, waiting for step 5: b leaves: 409 at once, not at the timeout
        def waiting_pull() -> None:
            with ps.http() as h:
                t0 = time.monotonic()
                r = h.get("/v1/model", params={"min_step": 5, "timeout": allow(30), "worker_id": b})
                answers["pull"] = (r, time.monotonic() - t0)

        t = threading.Thread(target=waiting_pull)
        t.start()
        wait_for(lambda: ps.rt._waiters, allow(10), "the pull to wait")
        with ps.http() as h:
            assert h.delete(f"/v1/workers/{b}").json()["state"] == "left"
        t.join(allow(10))
        r, took = answers["pull"]
        assert (r.status_code, r.json()["error"]) == (409, "not_active") and took < allow(5)
        c.close()
