"""The wire contract shared by the PS and its clients (see docs/protocol.md).

Paths, media types, push statuses, and the parsers that turn a frame's ``meta`` (shared/frame.py)
into typed requests. Parsers only check form, strictly (unknown fields are refused); whether a
request fits the model (names, dtypes, shapes) is the PS core's business.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from shared.errors import bad_request, unprocessable
from shared.frame import MEDIA_TYPE as FRAME

API = "/v1"
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
#: the largest integer a request or a checkpoint may hold (steps, sequence numbers, ranks, counters): exact in
#: every place one flows (a JSON number in a browser, a Prometheus sample: float64; msgpack; numpy int64), with
#: room to count on (the global step stops there: the job is done). Larger: refused (docs/protocol.md).
MAX_INT = (1 << 53) - 1


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds a worker spent in each phase of its last step (reported with a push)."""

    fetch: float = 0.0
    compute: float = 0.0
    push: float = 0.0


#: the phases a push reports (``meta.timings`` keys): :class:`PhaseTimes`' fields, in order
PHASES = tuple(f.name for f in fields(PhaseTimes))
_PHASE_SET = frozenset(PHASES)


@dataclass(frozen=True)
class PushRequest:
    worker_id: str
    step: int
    tensors: Mapping[str, np.ndarray]
    loss: float | None = None
    num_examples: int | None = None
    timings: PhaseTimes = field(default_factory=PhaseTimes)
    #: the values were checked for NaN/Inf already, in memory nobody else writes (a same-host push copied and
    #: checked as read, a top-k push's finite values, a shard's held pieces): the core checks only their layout
    finite_checked: bool = False
    #: the partition of the push's step these tensors are (docs/partitions.md): 0, the push itself (its whole
    #: gradient, or with partitions its first partition's pieces); q >= 1 a later partition's pieces, after 0
    partition: int = 0


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


def _optional_int(obj: dict, key: str, low: int, high: int) -> int | None:
    """A push's field ``key``: absent or nil (None), or an int in [``low``, ``high``], else 400 ``bad_field``."""
    value = obj.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
        raise bad_request("bad_field", f"push: {key} must be an int in [{low}, {high}]")
    return value


def _only(obj: dict, allowed: frozenset, what: str) -> None:
    unknown = set(obj) - allowed
    if unknown:
        raise bad_request("bad_field", f"{what}: unknown fields {sorted(map(str, unknown))[:8]}")


PUSH_FIELDS = frozenset({"worker_id", "step", "loss", "num_examples", "timings", "shm_seq", "compression",
                         "partitions"})
#: most partition frames one push body holds (docs/protocol.md, Partitioned push)
MAX_PARTITIONS = 4096
MODEL_FIELDS = frozenset({"optimizer"})


def parse_push_meta(meta: dict, tensors: Mapping = MappingProxyType({})) -> tuple[PushRequest, int | None]:
    """(the push, with ``tensors``, its ``shm_seq`` or None) from a push frame's meta, every field checked in turn
    (400/422 naming the first that is wrong)."""
    what = "push"
    _only(meta, PUSH_FIELDS, what)
    worker_id = _require(meta, "worker_id", str, what)
    step = _require(meta, "step", int, what)
    if not 0 <= step <= MAX_INT:
        raise unprocessable("bad_step", f"step must be in [0, {MAX_INT}]")
    loss = _optional_number(meta, "loss", what)
    loss = float(loss) if loss is not None and math.isfinite(loss) else None  # a NaN/Inf loss is not reported
    n = _optional_int(meta, "num_examples", 0, MAX_NUM_EXAMPLES)
    raw = meta.get("timings")
    raw = {} if raw is None else raw  # nil is absent; any other value that is not a map is refused below
    if not isinstance(raw, dict):
        raise bad_request("bad_field", "push: timings must be a map of phase -> seconds")
    _only(raw, _PHASE_SET, "push timings")
    times = {k: _optional_number(raw, k, "timings") or 0.0 for k in PHASES}
    if not all(0 <= t <= MAX_PHASE_SECONDS for t in times.values()):  # NaN fails too
        raise bad_request("bad_field", f"push: timings must be seconds in [0, {MAX_PHASE_SECONDS:g}]")
    if not isinstance(meta.get("compression"), (str, type(None))):  # its value: shared/compression.py
        raise bad_request("bad_field", "push: compression must be a string")
    push = PushRequest(worker_id, step, tensors, loss, n, PhaseTimes(**times))
    return push, _optional_int(meta, "shm_seq", 0, MAX_INT)


def push_partitions(meta: dict) -> int:
    """Q, the frames of a push body (its head frame's ``partitions``; absent or nil: 1, today's push): an int in
    [1, :data:`MAX_PARTITIONS`], else 400 ``bad_field``."""
    q = _optional_int(meta, "partitions", 1, MAX_PARTITIONS)
    return 1 if q is None else q


def check_partition_meta(meta: dict, q: int) -> None:
    """A partitioned push's frame ``q`` >= 1 has the meta ``{"partition": q}`` and nothing else (400 ``bad_field``)."""
    if set(meta) != {"partition"} or type(meta["partition"]) is not int or meta["partition"] != q:
        raise bad_request("bad_field", f'push: frame {q} of a partitioned push must have the meta {{"partition": {q}}}')


def parse_model_meta(meta: dict, tensors: dict[str, np.ndarray]) -> ModelInit:
    what = "model init"
    _only(meta, MODEL_FIELDS, what)
    if not tensors:
        raise unprocessable("empty_model", "a model needs at least one tensor")
    optimizer = meta.get("optimizer")
    optimizer = {} if optimizer is None else optimizer  # nil is absent; 0, false, "" are not maps
    if not isinstance(optimizer, dict) or not all(isinstance(k, str) for k in optimizer):
        raise bad_request("bad_field", "model init: optimizer must be a map")
    return ModelInit(tensors, optimizer)


#: OpenAPI description of a request body that is one frame
FRAME_BODY = {"requestBody": {"required": True, "content": {FRAME: {"schema": {
    "type": "string", "format": "binary",
    "description": "one tensor frame (docs/protocol.md, Tensor frame); its meta holds the control fields"}}}}}
