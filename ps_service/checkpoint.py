"""Crash-consistent PS checkpoints: the file format, atomic writes, pruning, restore, and the periodic policy.

The format (one ``ckpt-<step>.msgpack`` a checkpoint: a checksummed envelope around one tensor frame of
:meth:`ps_service.core.ParameterServerCore.export_state`; no pickle), the manifest, the atomic write and what restore
checks are docs/checkpoint.md's contract (with a plain-script reader). :class:`Checkpointer` decides when (every N
steps and/or T seconds once the step moved; at once when the job is done), snapshots on the event loop and writes on
its own thread, one write at a time, so the newest file is never more than ``2 * every_steps`` steps behind.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ps_service.core.membership import ACTIVE, EXPIRED, LEFT
from ps_service.core.model import check_weights
from ps_service.core.optimizers import SLOT_NAMES, normalize_spec
from shared import frame
from shared.codec import pack, unpack
from ps_service.core.errors import CoreError
from shared.errors import ProtocolError
from shared.protocol import MAX_INT

log = logging.getLogger("ps_service.checkpoint")

FORMAT, VERSION = "syncps-checkpoint", 2
MANIFEST = "manifest.json"
NAME_RE = re.compile(r"^ckpt-(\d{10,})\.msgpack$")


class CheckpointError(Exception):
    """A checkpoint file that cannot be used (corrupt, truncated, wrong format)."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:010d}.msgpack"


def step_of(path: Path) -> int:
    """The global step in a checkpoint file's name."""
    return int(NAME_RE.match(path.name).group(1))


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, newest step first (no temp files, no step beyond ``MAX_INT``)."""
    d = Path(directory)
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := NAME_RE.match(p.name))] if d.is_dir() else []
    return [p for step, p in sorted(found, reverse=True) if step <= MAX_INT]


def encode(state: dict[str, Any], written_at: float) -> tuple[bytes, str]:
    """(file bytes, sha256 hex of the payload) of an exported core state."""
    opt = state["optimizer"]
    tensors = {f"weights/{k}": v for k, v in state["weights"].items()}
    for slot, per in opt["slots"].items():
        tensors.update({f"slots/{slot}/{k}": v for k, v in per.items()})
    meta = {"global_step": state["global_step"], "written_at": written_at,
            "optimizer": {"spec": opt["spec"], "iterations": opt["iterations"]},
            "members": state["members"], "config": state["config"]}
    if state.get("staleness") is not None:
        meta["staleness"] = state["staleness"]
    payload = frame.encode_bytes(tensors, meta)
    digest = hashlib.sha256(payload).hexdigest()
    return pack({"format": FORMAT, "version": VERSION, "sha256": digest, "payload": payload}), digest


#: an integer a checkpoint holds: [0, MAX_INT]
Int = Annotated[int, Field(ge=0, le=MAX_INT)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Member(_Strict):
    model_config = ConfigDict(extra="allow", strict=True)
    worker_id: str
    name: str
    rank: Int
    state: Literal[ACTIVE, EXPIRED, LEFT]
    registrations: Annotated[int, Field(ge=1, le=MAX_INT)] = 1


class _Optimizer(_Strict):
    spec: dict
    iterations: Int


class _Staleness(_Strict):  # async/ssp clocks (ps_service/core/staleness.py)
    floor: Int
    clocks: dict[str, Int]


class _Meta(_Strict):
    global_step: Int
    written_at: float = Field(allow_inf_nan=False)
    optimizer: _Optimizer
    members: list[_Member]
    config: dict
    staleness: _Staleness | None = None


#: a member's and the clocks' form, as a state's (a hot standby's step message carries them:
#: ps_service/standby/messages.py)
Member, Staleness = _Member, _Staleness


def decode(data: bytes, step: int | None = None) -> dict[str, Any]:
    """The state in a checkpoint file's bytes, every field checked (its step ``step``, when given); else
    CheckpointError."""
    try:
        outer = unpack(data)
        if not isinstance(outer, dict) or outer.get("format") != FORMAT:
            raise CheckpointError("not a syncps checkpoint")
        if outer.get("version") != VERSION:
            raise CheckpointError(f"unsupported version {outer.get('version')!r}")
        payload = outer.get("payload")
        if not isinstance(payload, (bytes, memoryview)) or hashlib.sha256(payload).hexdigest() != outer.get("sha256"):
            raise CheckpointError("checksum mismatch")
        f = frame.decode(payload)
        state = _validated(f.meta, f.tensors)
        if step is not None and state["global_step"] != step:
            raise CheckpointError(f"global_step {state['global_step']} is not the step {step} of the file's name")
        return state
    except (ProtocolError, CoreError) as exc:
        raise CheckpointError(f"{exc.code}: {exc.detail}") from None
    except CheckpointError:
        raise
    except Exception as exc:  # anything else unexpected in a hostile file: unusable, never a crash
        raise CheckpointError(f"{type(exc).__name__}: {exc}") from None


def _validated(meta: dict, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        m = _Meta.model_validate(meta)
    except ValidationError as exc:
        raise CheckpointError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:4])) \
            from None
    try:
        spec = normalize_spec(m.optimizer.spec)
    except CoreError as exc:
        raise CheckpointError(f"optimizer spec: {exc.detail}") from None
    if spec != m.optimizer.spec:
        raise CheckpointError("optimizer spec is not complete")
    weights = {k[len("weights/"):]: v for k, v in tensors.items() if k.startswith("weights/")}
    if not weights:
        raise CheckpointError("no weights")
    slots: dict[str, dict[str, np.ndarray]] = {s: {} for s in SLOT_NAMES[spec["name"]]}
    for key, arr in tensors.items():
        if key.startswith("weights/"):
            continue
        kind, slot, name = (key.split("/", 2) + ["", ""])[:3]
        if kind != "slots" or slot not in slots or name not in weights:
            raise CheckpointError(f"unexpected tensor {key!r} for optimizer {spec['name']}")
        if arr.dtype != weights[name].dtype or arr.shape != weights[name].shape:
            raise CheckpointError(f"slot {key!r} does not match its weight's dtype and shape")
        slots[slot][name] = arr
    for slot, per in slots.items():
        if per.keys() != weights.keys():
            raise CheckpointError(f"slot {slot!r} misses tensors {sorted(weights.keys() - per.keys())[:4]}")
    check_weights(tensors)  # floating point and finite (CoreError: decode says why)
    ids, ranks = {x.worker_id for x in m.members}, [x.rank for x in m.members if x.state != LEFT]
    if len(ids) < len(m.members) or len(set(ranks)) < len(ranks):
        raise CheckpointError("two members share an id or a rank")
    return {"global_step": m.global_step, "written_at": m.written_at, "weights": weights,
            "optimizer": {"spec": spec, "iterations": m.optimizer.iterations, "slots": slots},
            "members": [x.model_dump() for x in m.members], "config": m.config,
            "staleness": None if m.staleness is None else m.staleness.model_dump()}


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one: temp, fsync, rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: str | Path) -> dict:
    try:
        obj = json.loads((Path(directory) / MANIFEST).read_text())
        return obj if isinstance(obj, dict) and isinstance(obj.get("checkpoints"), list) else {}
    except (OSError, ValueError):
        return {}


def write_checkpoint(directory: str | Path, state: dict[str, Any], keep: int) -> dict[str, Any]:
    """Write one checkpoint, keep the newest ``keep``, rewrite the manifest; the new manifest entry."""
    d = Path(directory)
    now = time.time()
    data, digest = encode(state, now)
    path = d / checkpoint_name(state["global_step"])
    atomic_write(path, data)
    entry = {"file": path.name, "step": state["global_step"], "sha256": digest, "bytes": len(data), "written_at": now}
    files = list_checkpoints(d)
    for old in files[keep:]:
        old.unlink(missing_ok=True)
    kept = {p.name for p in files[:keep]}
    # the old manifest's well-formed entries of kept files (the files are the truth)
    known = {e["file"]: e for e in read_manifest(d).get("checkpoints", []) if isinstance(e, dict)
             and isinstance(e.get("file"), str) and e["file"] in kept and type(e.get("step")) is int
             and e["step"] == step_of(Path(e["file"]))}
    known[path.name] = entry
    entries = sorted((e for name, e in known.items() if name in kept), key=lambda e: e["step"], reverse=True)
    atomic_write(d / MANIFEST, json.dumps({"format": f"{FORMAT}-manifest", "version": VERSION,
                                           "latest": entries[0]["file"], "checkpoints": entries}, indent=1).encode())
    return entry


def load_latest(directory: str | Path) -> tuple[dict[str, Any], Path] | None:
    """The newest valid checkpoint's state and path; corrupt ones are logged and skipped. None if none."""
    for path in list_checkpoints(directory):
        try:
            return decode(path.read_bytes(), step_of(path)), path
        except (OSError, CheckpointError) as exc:
            log.warning("skipping checkpoint %s: %s", path.name, exc)
    return None


class StartRefused(Exception):
    """The PS cannot resume from its checkpoint with these settings (the message says what to do)."""


class Checkpointer:
    """When to checkpoint, and the background writer. ``on_info`` gets
    ``{"step", "path", "time", "duration_seconds", "count"}`` after each write or restore."""

    def __init__(self, directory: str | Path, every_steps: int | None, every_seconds: float | None, keep: int,
                 on_info: Callable[[dict], None] = lambda info: None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.dir.glob(".ckpt-*.tmp"), *self.dir.glob(f".{MANIFEST}.*.tmp")]:  # cut short by a crash
            stale.unlink(missing_ok=True)
        self.every_steps, self.every_seconds, self.keep = every_steps, every_seconds, keep
        self.on_info = on_info
        self.count = 0
        self.last_step: int | None = None  # step of the last snapshot taken (or restored)
        self.written_step: int | None = None  # step of the last checkpoint on disk
        self.last_time = time.monotonic()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._running: Future | None = None  # the last write submitted (maybe done)

    def restore(self, core, now: float) -> int | None:
        """Load the newest valid checkpoint into ``core``; its step, or None if there is none."""
        t0 = time.monotonic()
        found = load_latest(self.dir)
        if found is None:
            log.info("no checkpoint in %s: starting fresh", self.dir)
            return None
        state, path = found
        differ = sorted(k for k, v in state["config"].items() if getattr(core.config, k, v) != v)
        try:
            core.import_state(state, now)
        except CoreError as exc:  # another optimizer than the checkpoint's: refused at start, with what to do
            raise StartRefused(f"{path}: {exc.detail}") from None
        if differ:
            log.warning("settings differ from the checkpoint's (the current ones apply): %s", ", ".join(differ))
        self.last_step = self.written_step = core.global_step
        self.last_time = time.monotonic()
        duration = time.monotonic() - t0
        log.info("restored %s: global step %d, %d members, in %.3f s", path.name, core.global_step,
                 len(state["members"]), duration)
        self.on_info({"step": core.global_step, "path": str(path), "time": time.time(),
                      "duration_seconds": duration, "count": 0, "restored": True})
        return core.global_step

    def due(self, core, now: float) -> bool:
        if not core.initialized or core.global_step == self.last_step or core.deciding:
            return False  # (deciding: some of the round's partitions applied, not all: weights of two steps)
        if core.done and (self.every_steps or self.every_seconds):
            return True  # the job's last step, at once: its workers have exited, a crashed PS must not redo rounds
        if self.every_steps and (self.last_step is None or core.global_step - self.last_step >= self.every_steps):
            return True
        return bool(self.every_seconds) and now - self.last_time >= self.every_seconds

    def maybe_save(self, core, now: float) -> Future | None:
        """If due: wait for the previous write (a slow disk holds the PS back rather than fall behind), snapshot
        now and write in the background; the write's future."""
        if not self.due(core, now):
            return None
        self.wait_for_write()
        snapshot = core.export_state()
        self.last_step, self.last_time = core.global_step, now
        self._running = self._pool.submit(self._write, snapshot, "the job is done" if core.done else None)
        return self._running

    def wait_for_write(self) -> None:
        """Block until the write in progress, if any, ended; a wait of a second or more is logged."""
        if self._running is not None and not self._running.done():
            t0 = time.monotonic()
            self._running.result()
            waited = time.monotonic() - t0
            (log.warning if waited >= 1.0 else log.debug)(
                "waited %.3f s for the checkpoint write of step %s in progress", waited, self.last_step)

    def _write(self, snapshot: dict[str, Any], why: str | None = None) -> dict | None:
        """Write one snapshot; ``why`` (the job done, shutdown) makes it a log line."""
        t0 = time.monotonic()
        try:
            entry = write_checkpoint(self.dir, snapshot, self.keep)
        except Exception:
            log.exception("checkpoint of step %d failed", snapshot["global_step"])
            return None
        self.count += 1
        self.written_step = entry["step"]
        info = {"step": entry["step"], "path": str(self.dir / entry["file"]), "time": entry["written_at"],
                "duration_seconds": time.monotonic() - t0, "count": self.count}
        self.on_info(info)
        if why:
            log.info("checkpoint at global step %d (%s): %s, %.3f s", info["step"], why, info["path"],
                     info["duration_seconds"])
        return info

    def rewound(self, step: int) -> list[Future]:
        """The core went back live to ``step``: the next checkpoint counts from there. The writes still running (wait
        for them before deleting the files after ``step``)."""
        self.last_step = self.written_step = step
        return [f for f in [self._running] if f is not None and not f.done()]

    def finish(self, core) -> None:
        """Shutdown (blocking): wait for a running write, write a final checkpoint if the step moved."""
        self.wait_for_write()
        if core.initialized and core.deciding:  # some of the round's partitions applied: no step's weights
            log.warning("shutdown between the partitions of step %d: no final checkpoint", core.global_step)
        elif core.initialized and core.global_step != self.written_step:
            self.last_step = core.global_step
            self._write(core.export_state(), "shutdown")
        elif core.initialized:
            log.info("shutdown: global step %d is already in %s", core.global_step, self.dir)
        self._pool.shutdown(wait=True)


def attach(rt) -> Checkpointer | None:
    """Wire checkpoints into a PS runtime (``PS_CHECKPOINT_*``): restore the newest valid one now, then check after
    every change of the core whether one is due. None when PS_CHECKPOINT_DIR is unset."""
    s = rt.settings
    if not s.checkpoint_dir:
        return None
    ck = Checkpointer(s.checkpoint_dir, s.checkpoint_every_steps, s.checkpoint_every_seconds, s.checkpoint_keep,
                      on_info=lambda info: setattr(rt, "checkpoint_info", info))
    ck.restore(rt.core, rt.now())
    rt.observers.append(lambda: ck.maybe_save(rt.core, rt.now()))
    return ck
