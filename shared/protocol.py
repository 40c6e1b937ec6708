"""The wire contract shared by the PS and its clients (see docs/protocol.md).

Paths, media types, push statuses, and the parsers that turn a decoded
msgpack body into typed requests. Parsers only check form; whether a request
fits the model (names, shapes) is the PS's business.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from shared.codec import DTYPES, MAX_NDIM, decode_tensors
from shared.errors import bad_request, unprocessable

API = "/v1"
MSGPACK = "application/msgpack"
JSON = "application/json"
#: Response header carrying the PS's global step on every tensor route.
STEP_HEADER = "X-Syncps-Step"
#: Response header of a push answered with the next weights (``POST /v1/gradients?pull=1``): its status.
PUSH_STATUS_HEADER = "X-Syncps-Push-Status"


class PushStatus(str, Enum):
    ACCEPTED = "accepted"  # counted in the open round
    STALE = "stale"  # computed on weights older than the last closed round: never applied
    LATE = "late"  # for the round that just closed without it (backup loser, deadline) or a round it is not in
    DUPLICATE = "duplicate"  # (worker, step) was pushed before: not counted twice
    SKIPPED = "skipped"  # NaN/Inf gradient under PS_NONFINITE_POLICY=skip: counted, never applied


class JobState(str, Enum):
    WAITING_FOR_MODEL = "waiting_for_model"
    WAITING_FOR_WORKERS = "waiting_for_workers"
    TRAINING = "training"
    DONE = "done"


#: bounds of a push's bookkeeping fields (sums of them stay finite)
MAX_PHASE_SECONDS = 1e6
MAX_NUM_EXAMPLES = 1 << 32

#: Optimizer names the PS implements.
OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad")


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds a worker spent in each phase of its last step (reported with a push)."""

    fetch: float = 0.0
    compute: float = 0.0
    push: float = 0.0


@dataclass(frozen=True)
class PushRequest:
    worker_id: str
    step: int
    tensors: dict[str, np.ndarray]
    loss: float | None = None
    num_examples: int | None = None
    timings: PhaseTimes = field(default_factory=PhaseTimes)


@dataclass(frozen=True)
class ModelInit:
    tensors: dict[str, np.ndarray]
    optimizer: dict[str, Any]


def _require(obj: dict, key: str, kind: type | tuple, what: str) -> Any:
    if key not in obj:
        raise bad_request("missing_field", f"{what} needs field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise bad_request("bad_field", f"{what}: field {key!r} has the wrong type")
    return value


def _optional_number(obj: dict, key: str, what: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request("bad_field", f"{what}: field {key!r} must be a number")
    return value


def _as_map(obj: Any, what: str) -> dict:
    if not isinstance(obj, dict):
        raise bad_request("bad_body", f"{what} must be a msgpack map")
    return obj


#: JSON Schema of the msgpack request bodies, for the OpenAPI document (``data`` is msgpack bin)
TENSOR_SCHEMA = {
    "type": "object", "required": ["dtype", "shape", "data"], "additionalProperties": False,
    "properties": {"dtype": {"type": "string", "enum": sorted(DTYPES)},
                   "shape": {"type": "array", "maxItems": MAX_NDIM, "items": {"type": "integer", "minimum": 0}},
                   "data": {"type": "string", "format": "binary", "description": "little-endian, C order (msgpack bin)"}},
}
TENSORS_SCHEMA = {"type": "object", "additionalProperties": TENSOR_SCHEMA, "description": "tensor name -> tensor"}
PUSH_SCHEMA = {
    "type": "object", "required": ["worker_id", "step", "tensors"],
    "properties": {"worker_id": {"type": "string"}, "step": {"type": "integer", "minimum": 0},
                   "tensors": TENSORS_SCHEMA, "loss": {"type": ["number", "null"]},
                   "num_examples": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_NUM_EXAMPLES},
                   "timings": {"type": "object", "properties": {
                       k: {"type": "number", "minimum": 0, "maximum": MAX_PHASE_SECONDS} for k in ("fetch", "compute", "push")}}},
}
MODEL_INIT_SCHEMA = {
    "type": "object", "required": ["tensors"],
    "properties": {"tensors": TENSORS_SCHEMA, "optimizer": {"type": "object", "description": "name, learning_rate, ..."}},
}


def msgpack_body(schema: dict) -> dict:
    """``openapi_extra`` of a route whose body is msgpack of ``schema``."""
    return {"requestBody": {"required": True, "content": {MSGPACK: {"schema": schema}}}}


def parse_push(obj: Any, max_tensor_bytes: int | None = None) -> PushRequest:
    what = "push"
    obj = _as_map(obj, what)
    worker_id = _require(obj, "worker_id", str, what)
    step = _require(obj, "step", int, what)
    if step < 0:
        raise unprocessable("bad_step", "step must be >= 0")
    tensors = decode_tensors(_require(obj, "tensors", dict, what), max_tensor_bytes)
    loss = _optional_number(obj, "loss", what)
    if loss is not None and not math.isfinite(loss):
        loss = None
    n = obj.get("num_examples")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NUM_EXAMPLES):
        raise bad_request("bad_field", f"push: num_examples must be an int in [0, {MAX_NUM_EXAMPLES}]")
    raw = obj.get("timings") or {}
    if not isinstance(raw, dict):
        raise bad_request("bad_field", "push: timings must be a map of phase -> seconds")
    times = {k: _optional_number(raw, k, "timings") or 0.0 for k in ("fetch", "compute", "push")}
    if not all(0 <= t <= MAX_PHASE_SECONDS for t in times.values()):  # NaN fails too
        raise bad_request("bad_field", f"push: timings must be seconds in [0, {MAX_PHASE_SECONDS:g}]")
    return PushRequest(worker_id, step, tensors, None if loss is None else float(loss), n, PhaseTimes(**times))


def parse_model_init(obj: Any, max_tensor_bytes: int | None = None) -> ModelInit:
    what = "model init"
    obj = _as_map(obj, what)
    tensors = decode_tensors(_require(obj, "tensors", dict, what), max_tensor_bytes)
    if not tensors:
        raise unprocessable("empty_model", "a model needs at least one tensor")
    optimizer = obj.get("optimizer") or {}
    if not isinstance(optimizer, dict) or not all(isinstance(k, str) for k in optimizer):
        raise bad_request("bad_field", "model init: optimizer must be a map")
    return ModelInit(tensors, optimizer)
