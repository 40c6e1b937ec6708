"""The bodies the primary sends its standby: one step of the model, and the whole state (docs/protocol-standby.md,
Replication, gives their fields). Pure, no I/O.

Contract: :func:`encode_step` / :func:`decode_step` (:func:`step_parts` and :func:`copied` write it into a buffer of
the caller's: the log's slot, :mod:`.ring`): one frame whose tensors are a step's input exactly as
:meth:`ps_service.core.ParameterServerCore.apply_round` takes it. Encoding copies the arrays once (the core consumes
them) into a buffer of :data:`ps_service.core.buffers.POOL` (warm memory: a fresh 4 MB costs ~2 ms of page faults).
:func:`encode_state` / :func:`decode_state`: the state transfer is a checkpoint file's bytes
(:mod:`ps_service.checkpoint`).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ps_service import checkpoint
from ps_service.core.buffers import POOL
from ps_service.core.checks import validate
from ps_service.core.errors import CoreError
from ps_service.http import first_error
from shared import frame
from shared.compression import SparseTensor
from shared.errors import ProtocolError
from shared.protocol import MAX_INT

SPARSE_INDICES, SPARSE_VALUES = "#indices", "#values"


def encode_step(step: int | None, total: Mapping[str, Any] | None, mean_of: int, contributors: int,
                extra: Mapping[str, Any]) -> memoryview:
    return copied(step_parts(step, total, mean_of, contributors, extra))


def step_parts(step: int | None, total: Mapping[str, Any] | None, mean_of: int, contributors: int,
               extra: Mapping[str, Any]) -> list:
    """The step message as :func:`shared.frame.encode`'s buffers (views of ``total``'s arrays: copy them before the
    core consumes them)."""
    tensors: dict[str, np.ndarray] = {}
    sparse: dict[str, list[int]] = {}
    for k, v in (total or {}).items():
        if isinstance(v, SparseTensor):
            sparse[k] = list(v.shape)
            tensors[k + SPARSE_INDICES], tensors[k + SPARSE_VALUES] = v.indices, v.values
        else:
            tensors[k] = v
    meta = {"step": step, "total": total is not None, "mean_of": mean_of, "contributors": contributors,
            "sparse": sparse, **extra}
    return frame.encode(tensors, meta)


def copied(parts: list, into: memoryview | None = None) -> memoryview:
    """``parts`` copied one after the other into ``into`` (a buffer of the pool if None); the bytes written."""
    n = sum(len(p) for p in parts)
    into = POOL.take(n) if into is None else into
    at = 0
    for part in parts:
        into[at:at + len(part)] = part
        at += len(part)
    return into[:n]


def _owned(a: np.ndarray) -> np.ndarray:
    return a if a.flags.writeable else a.copy()  # the optimizer consumes its input


class _StepMeta(BaseModel):
    """A step message's meta (docs/protocol-standby.md, ``POST /v1/ha/steps``): ``members`` and ``staleness`` as a
    state's (:mod:`ps_service.checkpoint`), only when they changed."""
    model_config = ConfigDict(extra="forbid", strict=True)
    step: Annotated[int, Field(ge=0, le=MAX_INT)] | None
    total: bool
    mean_of: Annotated[int, Field(ge=1, le=MAX_INT)]
    contributors: Annotated[int, Field(ge=0, le=MAX_INT)]
    sparse: dict[str, list[Annotated[int, Field(ge=0, le=MAX_INT)]]] = {}
    members: list[checkpoint.Member] = []
    staleness: checkpoint.Staleness | None = None


def decode_step(body) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(meta, total or None); 400 ``bad_field`` for a malformed one."""
    f = frame.decode(body)
    tensors = dict(f.tensors)
    try:
        meta = _StepMeta.model_validate(f.meta).model_dump(exclude_unset=True)
    except ValidationError as exc:
        detail = first_error(exc.errors(include_url=False, include_input=False))
        raise ProtocolError(400, "bad_field", f"a step message's meta: {detail}") from None
    if not meta["total"]:
        return meta, None
    total: dict[str, Any] = {}
    for k, shape in meta.get("sparse", {}).items():
        i, v = tensors.pop(k + SPARSE_INDICES, None), tensors.pop(k + SPARSE_VALUES, None)
        if i is None or v is None or i.ndim != 1 or i.dtype.kind != "i" or v.shape != i.shape or v.dtype != np.float32:
            raise ProtocolError(400, "bad_field", f"sparse tensor {k!r} needs 1-D integer indices and float32 values "
                                                  "of one length")
        total[k] = SparseTensor(tuple(shape), i, _owned(v))
    total.update({k: _owned(v) for k, v in tensors.items()})
    return meta, total


def check_fits(total: Mapping[str, Any] | None, weights: Mapping[str, np.ndarray]) -> None:
    """409 ``ha_gap`` unless ``total`` (:func:`decode_step`'s) is a step of ``weights``: what the core checks of a
    push's tensors (:func:`ps_service.core.checks.validate`: names, shapes, dtypes; the values were checked on the
    primary), and a sparse one's indices inside its weight (so that applying it cannot fail once acknowledged)."""
    if total is None:
        return
    try:
        validate(weights, total, check_finite=False)
    except CoreError as exc:
        raise ProtocolError(409, "ha_gap", f"the step's tensors are not this PS's model ({exc.detail}): send the "
                                           "state") from None
    if any(isinstance(v, SparseTensor) and len(v.indices) and not 0 <= int(v.indices.min()) <= int(v.indices.max())
           < weights[k].size for k, v in total.items()):
        raise ProtocolError(409, "ha_gap", "a sparse tensor of the step has indices outside its weight: send the state")


def encode_state(state: dict[str, Any]) -> bytes:
    return checkpoint.encode(state, time.time())[0]


def decode_state(body: bytes) -> dict[str, Any]:
    """The state of a transfer; 422 ``bad_state`` if it does not check (:func:`ps_service.checkpoint.decode`)."""
    try:
        return checkpoint.decode(bytes(body))
    except checkpoint.CheckpointError as exc:
        raise ProtocolError(422, "bad_state", f"the state transfer does not check: {exc}") from None
