"""A syncps model as a file another framework loads: safetensors, or a PyTorch ``state_dict`` (``python -m syncps
export``, docs/guides/export.md).

Contract: the weights come from a running PS (:func:`from_ps`: ``GET /v1/model``, through every shard of a sharded
PS, with the training token) or a checkpoint file or the newest valid one of a ``PS_CHECKPOINT_DIR``
(:func:`from_checkpoint`, decoded by :func:`ps_service.checkpoint.decode`; a shard's checkpoint is refused). Names are
the model's (the ``buffer:`` prefix removed: :mod:`syncps.tensors`), so ``module.load_state_dict`` takes them; each
tensor keeps the PS's dtype, shape and bytes. :func:`write_safetensors` writes the safetensors format without the
``safetensors`` package; :func:`write_torch` is ``torch.save`` of ``{name: tensor}``. Both write a temp file and
rename it over ``path``: a reader never sees half a file.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from shared.compression import BUFFER_PREFIX

#: safetensors' dtype codes of the dtypes a PS model holds (docs/protocol.md: model tensors are floating point)
ST_DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "bfloat16": "BF16"}


class ExportError(Exception):
    """Nothing to export (no model, an unusable checkpoint, a refusal): the message says why and what to do."""


@dataclass
class Model:
    #: the model's tensors under the model's names (PS names without ``buffer:``)
    tensors: dict[str, np.ndarray]
    #: the global step the weights are at
    step: int
    #: where they came from (a URL or a checkpoint file)
    source: str
    metadata: dict[str, str] = field(default_factory=dict)


def renamed(ps_tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PS's tensors under the model's names; ExportError if two PS names give one model name."""
    names = {n: n.removeprefix(BUFFER_PREFIX) for n in ps_tensors}  # an averaged buffer's name: the module's
    if len(set(names.values())) != len(names):
        clash = sorted(n for n in names if n.startswith(BUFFER_PREFIX) and names[n] in ps_tensors)
        raise ExportError(f"the PS holds both {clash[0]!r} and {names[clash[0]]!r}: one name in the file for two")
    return {names[n]: ps_tensors[n] for n in sorted(ps_tensors)}


def from_ps(url: str, token: str | None = None, wait: float = 30.0, timeout: float = 30.0) -> Model:
    """The running PS's current weights: once training has started (a pull waits for it, at most ``wait`` s)."""
    from shared.errors import ProtocolError
    from shared.rawhttp import ConnectionLost
    from worker_service.client import PSClient
    from worker_service.transport.endpoint import ServerError

    client = PSClient(url, timeout=timeout, attempts=3, retry_timeout=timeout, token=token)
    try:
        client.attach_reader()  # a sharded PS: the pieces of every shard
        pulled = client.pull(0, None, wait)
    except ProtocolError as exc:
        hint = (" (the pull is a training route: give the file of the PS's PS_AUTH_TOKEN; the monitor token does not "
                "open it)" if exc.status == 401 else "")
        raise ExportError(f"the PS at {url} refused: {exc.status} {exc.code}: {exc.detail}{hint}") from None
    except (ConnectionLost, ServerError, TimeoutError, OSError) as exc:
        raise ExportError(f"no answer from a PS at {url}: {exc or type(exc).__name__}") from None
    finally:
        client.close()
    if pulled is None:
        raise ExportError(f"the PS at {url} has not started training within {wait:g} s (it waits for its workers): "
                          "export once it trains, or from a checkpoint")
    return Model(renamed(pulled.tensors), pulled.step, url, {"syncps_done": str(pulled.done).lower()})


def from_checkpoint(path: str | Path) -> Model:
    """A checkpoint file's weights, or the newest valid checkpoint's of a checkpoint directory."""
    from ps_service.checkpoint import CheckpointError, NAME_RE, decode, list_checkpoints, load_latest

    p = Path(path)
    if p.is_dir():
        if (p / "shard-map.json").exists():  # ps_service.sharding.SIDECAR: a shard's own pieces only
            raise ExportError(f"{p} holds one PS shard's checkpoints (a part of the model): export the running "
                              "sharded PS with --url instead")
        found = load_latest(p)
        if found is None:
            tried = len(list_checkpoints(p))
            raise ExportError(f"{p}: no valid checkpoint ({tried} ckpt-*.msgpack file(s), none usable: the PS "
                              "logs why it skips each)" if tried else f"{p}: no ckpt-*.msgpack checkpoint")
        state, p = found
    else:
        try:
            m = NAME_RE.match(p.name)
            state = decode(p.read_bytes(), int(m.group(1)) if m else None)
        except OSError as exc:
            raise ExportError(f"cannot read {p}: {exc.strerror}") from None
        except CheckpointError as exc:
            raise ExportError(f"{p} is not a usable checkpoint: {exc}") from None
    return Model(renamed(state["weights"]), state["global_step"], str(p),
                 {"syncps_optimizer": json.dumps(state["optimizer"]["spec"], sort_keys=True)})


def _replace(path: Path, write) -> int:
    """``write(file)`` into a temp file beside ``path``, then rename it over ``path``; the file's size."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def write_safetensors(path: str | Path, model: Model) -> int:
    """Write ``model`` as a safetensors file: the 8-byte length of a JSON header (``__metadata__``: strings only; each
    tensor's dtype, shape and offsets, in name order), padded with spaces to 8 bytes, then the tensors' bytes
    back to back in that order; its size in bytes."""
    names = sorted(model.tensors)
    head: dict[str, object] = {"__metadata__": {"syncps_global_step": str(model.step), "syncps_source": model.source,
                                                **model.metadata}}
    offset = 0
    for name in names:
        arr = model.tensors[name]
        code = ST_DTYPES.get(arr.dtype.name)
        if code is None:
            raise ExportError(f"{name!r} is {arr.dtype.name}: safetensors export takes {sorted(ST_DTYPES)}")
        head[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f) -> None:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            arr = np.ascontiguousarray(model.tensors[name])
            f.write(memoryview(arr if arr.dtype.byteorder != ">" else arr.astype(arr.dtype.newbyteorder("<"))))
    return _replace(Path(path), write)


def write_torch(path: str | Path, model: Model) -> int:
    """Write ``model`` as ``torch.save`` of ``{name: tensor}`` (a state_dict); its size in bytes."""
    try:
        import torch
    except ImportError:
        raise ExportError("--format torch needs PyTorch: pip install -e '.[torch]' (or export safetensors)") from None
    state = {name: torch.from_numpy(np.array(arr, copy=True)) for name, arr in sorted(model.tensors.items())}
    return _replace(Path(path), lambda f: torch.save(state, f))


WRITERS = {"safetensors": write_safetensors, "torch": write_torch}
