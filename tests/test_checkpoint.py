"""Checkpoints: the format round-trips the whole state, writes are atomic and pruned, corrupt files are
skipped, the documented plain-script reader works, and a real PS restores on start and writes on SIGTERM."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from tests.live_ps import live_ps
from ps_service import checkpoint
from ps_service.core import ParameterServerCore
from tests.configs import core_config
from tests.timing import allow
from shared import frame
from shared.codec import pack, unpack
from ps_service.http import REFUSALS, status_of
from shared.protocol import MAX_INT, ModelInit, PushRequest

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoint.md"
W0 = {"w": np.zeros((3, 2), np.float32), "b": np.zeros((2,), np.float32)}


def make_core(n=2, **cfg) -> tuple[ParameterServerCore, list[str]]:
    core = ParameterServerCore(core_config(min_workers=n, startup_grace_seconds=0.0, **cfg))
    core.init_model(ModelInit({k: v.copy() for k, v in W0.items()}, {"name": "adam", "learning_rate": 0.1}), 0.0)
    return core, [core.register(f"w{i}", 0.0)[0].worker_id for i in range(n)]


def train(core: ParameterServerCore, ids: list[str], steps: int) -> None:
    for _ in range(steps):
        step = core.global_step
        for i, wid in enumerate(ids):
            rng = np.random.default_rng(100 * step + i)
            grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in W0.items()}
            core.push(PushRequest(wid, step, grads), 0.0)


def write(core: ParameterServerCore, directory: Path, keep: int = 3) -> dict:
    return checkpoint.write_checkpoint(directory, core.export_state(), keep)


def test_round_trip_restores_weights_optimizer_step_and_members(tmp_path):
    core, ids = make_core()
    train(core, ids, 5)
    write(core, tmp_path)
    state, path = checkpoint.load_latest(tmp_path)
    assert path.name == "ckpt-0000000005.msgpack"
    back = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=0.0))
    back.import_state(state, 100.0)
    assert back.global_step == 5 and back.optimizer.iterations == 5 and back.optimizer.spec == core.optimizer.spec
    for k in W0:
        np.testing.assert_array_equal(back.weights[k], core.weights[k])
        for slot in ("m", "v"):
            np.testing.assert_array_equal(back.optimizer.slots[slot][k], core.optimizer.slots[slot][k])
    assert [(m.worker_id, m.name, m.rank, m.state) for m in back.members.all()] == [
        (m.worker_id, m.name, m.rank, "expired") for m in core.members.all()]
    with pytest.raises(REFUSALS) as exc:  # restored means initialised: workers pull, not PUT
        back.init_model(ModelInit(dict(W0), {}), 100.0)
    assert status_of(exc.value) == 409
    # members come back under their names with their ids and ranks; training goes on bit for bit
    assert [back.register(f"w{i}", 100.0)[0].worker_id for i in range(2)] == ids
    assert back.started and back.round.step == 5
    train(core, ids, 3)
    train(back, ids, 3)
    for k in W0:
        np.testing.assert_array_equal(back.weights[k], core.weights[k])


def test_keeps_the_newest_k_and_indexes_them_in_the_manifest(tmp_path):
    core, ids = make_core()
    for _ in range(5):
        train(core, ids, 1)
        entry = write(core, tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000004.msgpack", "ckpt-0000000005.msgpack",
                                                          "manifest.json"]
    manifest = checkpoint.read_manifest(tmp_path)
    assert manifest["latest"] == "ckpt-0000000005.msgpack" and [e["step"] for e in manifest["checkpoints"]] == [5, 4]
    assert manifest["checkpoints"][0] == entry
    assert entry["bytes"] == (tmp_path / entry["file"]).stat().st_size


def test_a_manifest_entry_that_is_not_its_file_s_is_dropped_not_a_failed_write(tmp_path):
    """The manifest is not trusted: an entry edited by hand (a step that is not its file's, not an int, 2^64) is
    dropped at the next write instead of failing it (sorting a str step among ints raised)."""
    core, ids = make_core()
    for _ in range(2):
        train(core, ids, 1)
        write(core, tmp_path)
    manifest = checkpoint.read_manifest(tmp_path)
    manifest["checkpoints"][0]["step"] = "2"
    manifest["checkpoints"][1]["step"] = 2**64
    manifest["checkpoints"].append({"file": "../../etc/passwd", "step": 0})
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    train(core, ids, 1)
    write(core, tmp_path)
    assert [e["step"] for e in checkpoint.read_manifest(tmp_path)["checkpoints"]] == [3]


def corrupt_flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))


def corrupt_truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-40])


def corrupt_garbage(p: Path) -> None:
    p.write_bytes(b"\x00not msgpack at all")


def forge(p: Path, meta=lambda m: None, tensors=lambda t: None, version: int = checkpoint.VERSION) -> None:
    """Rewrite a checkpoint with changed content and a checksum that holds."""
    f = frame.decode(unpack(p.read_bytes())["payload"])
    m, t = dict(f.meta), {k: v.copy() for k, v in f.tensors.items()}
    meta(m)
    tensors(t)
    payload = frame.encode_bytes(t, m)
    p.write_bytes(pack({"format": checkpoint.FORMAT, "version": version, "sha256": hashlib.sha256(payload).hexdigest(),
                        "payload": payload}))


def corrupt_no_weights(p: Path) -> None:
    forge(p, tensors=lambda t: [t.pop(k) for k in list(t)])


INVALID = {  # each: a checkpoint whose checksum holds but whose content must not be used
    "negative step": lambda p: forge(p, meta=lambda m: m.update(global_step=-7)),
    "fractional step": lambda p: forge(p, meta=lambda m: m.update(global_step=15.5)),
    "boolean step": lambda p: forge(p, meta=lambda m: m.update(global_step=True)),
    "string step": lambda p: forge(p, meta=lambda m: m.update(global_step="20")),
    "nan weights": lambda p: forge(p, tensors=lambda t: t["weights/w"].fill(np.nan)),
    "inf slot": lambda p: forge(p, tensors=lambda t: t["slots/m/b"].fill(np.inf)),
    "missing slot": lambda p: forge(p, tensors=lambda t: t.pop("slots/v/w")),
    "slot of another shape": lambda p: forge(p, tensors=lambda t: t.update({"slots/v/w": np.zeros(5, np.float32)})),
    "integer weights": lambda p: forge(p, tensors=lambda t: t.update({"weights/b": np.zeros(2, np.int32)})),
    "unknown optimizer": lambda p: forge(p, meta=lambda m: m["optimizer"].update(spec={"name": "lion"})),
    "negative iterations": lambda p: forge(p, meta=lambda m: m["optimizer"].update(iterations=-1)),
    "shared rank": lambda p: forge(p, meta=lambda m: m["members"][1].update(rank=m["members"][0]["rank"])),
    "version 1": lambda p: forge(p, version=1),
    # every integer in [0, 2^53 - 1] (MAX_INT), and the step the file's name says
    "step not its name's": lambda p: forge(p, meta=lambda m: m.update(global_step=3)),
    "step 2^64-1": lambda p: forge(p, meta=lambda m: m.update(global_step=2**64 - 1)),
    "iterations 2^53": lambda p: forge(p, meta=lambda m: m["optimizer"].update(iterations=MAX_INT + 1)),
    "rank 2^64-1": lambda p: forge(p, meta=lambda m: m["members"][1].update(rank=2**64 - 1)),
    "registrations 2^63": lambda p: forge(p, meta=lambda m: m["members"][0].update(registrations=2**63)),
    "staleness floor 2^53": lambda p: forge(p, meta=lambda m: m.update(staleness={"floor": MAX_INT + 1, "clocks": {}})),
    "staleness clock 2^64-1": lambda p: forge(p, meta=lambda m: m.update(staleness={"floor": 0,
                                                                                    "clocks": {"x": 2**64 - 1}})),
}


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate, corrupt_garbage, corrupt_no_weights,
                                    *INVALID.values()], ids=["flip", "truncate", "garbage", "no weights", *INVALID])
def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, caplog):
    core, ids = make_core()
    train(core, ids, 2)
    write(core, tmp_path)
    train(core, ids, 2)
    newest = Path(checkpoint.write_checkpoint(tmp_path, core.export_state(), 3)["file"])
    damage(tmp_path / newest)
    (tmp_path / ".ckpt-0000000009.msgpack.123.tmp").write_bytes(b"half a write")  # a crash mid-write
    state, path = checkpoint.load_latest(tmp_path)
    assert path.name == "ckpt-0000000002.msgpack" and state["global_step"] == 2
    assert "skipping checkpoint ckpt-0000000004.msgpack: " in caplog.text


def forged_at(directory: Path, source: Path, step: int) -> Path:
    """A copy of the checkpoint ``source`` at ``step`` (its meta and its name), with a checksum that holds."""
    target = directory / checkpoint.checkpoint_name(step)
    target.write_bytes(source.read_bytes())
    forge(target, meta=lambda m: m.update(global_step=step))
    return target


@pytest.mark.parametrize("step", [2**64 - 1, MAX_INT + 1], ids=["2^64-1", "2^53"])
def test_a_checkpoint_of_a_step_beyond_the_bound_is_never_restored(tmp_path, step, caplog):
    """Issue 49: a checkpoint of step 2^64-1 whose checksum holds was restored, and then pulls answered 500,
    /metrics reset the connection and every write failed. Now the older valid one is restored."""
    core, ids = make_core()
    train(core, ids, 2)
    older = tmp_path / write(core, tmp_path)["file"]
    forged_at(tmp_path, older, step)
    state, path = checkpoint.load_latest(tmp_path)
    assert path == older and state["global_step"] == 2
    assert checkpoint.list_checkpoints(tmp_path) == [older]  # a name beyond the bound: no PS wrote it
    # the same content under the name of a step within it: refused for its step
    (tmp_path / checkpoint.checkpoint_name(step)).rename(tmp_path / "ckpt-0000000009.msgpack")
    assert checkpoint.load_latest(tmp_path)[1] == older
    assert "skipping checkpoint ckpt-0000000009.msgpack: global_step: Input should be less than or equal to " \
           "9007199254740991" in caplog.text


def test_a_checkpoint_at_the_bound_is_restored_done(tmp_path):
    """2^53 - 1 is the largest step a checkpoint may hold, and the global step stops there (the job is done), so
    the PS never writes a checkpoint it would refuse."""
    core, ids = make_core()
    forged_at(tmp_path, tmp_path / write(core, tmp_path)["file"], MAX_INT)
    back = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=0.0))
    ck = checkpoint.Checkpointer(tmp_path, every_steps=1, every_seconds=0, keep=3)
    assert ck.restore(back, 0.0) == MAX_INT and back.done
    assert [back.register(f"w{i}", 1.0)[0].worker_id for i in range(2)] == ids
    result = back.push(PushRequest(ids[0], MAX_INT, {k: np.ones_like(v) for k, v in W0.items()}), 1.0)
    assert (result.status.value, result.step, back.global_step) == ("stale", MAX_INT, MAX_INT)
    ck.finish(back)


def test_a_live_ps_skips_a_forged_checkpoint_of_step_2_64_and_trains_on(tmp_path):
    """The issue's run, on a real PS: the forged newest file is skipped, the older one restored; a push is accepted,
    the pull, /metrics and the next checkpoint work."""
    core, ids = make_core()
    train(core, ids, 2)
    forged_at(tmp_path, tmp_path / write(core, tmp_path)["file"], 2**64 - 1)
    with live_ps(checkpoint_dir=str(tmp_path), checkpoint_every_steps=1, checkpoint_every_seconds=0,
                 min_workers=2, startup_grace_seconds=0) as ps, ps.http() as h:
        assert ps.rt.core.global_step == 2
        c = ps.client()
        assert [c.register(f"w{i}")["worker_id"] for i in range(2)] == ids
        grads = {k: np.ones_like(v) for k, v in W0.items()}
        assert [c.push(w, 2, grads)["status"] for w in ids] == ["accepted", "accepted"]
        assert c.pull(3, ids[0], wait=allow(10.0)).step == 3
        assert h.get("/metrics").status_code == 200
        wait_for(lambda: (ps.rt.checkpoint_info or {}).get("step") == 3, allow(30), "the checkpoint of step 3")
        c.close()
    assert checkpoint.load_latest(tmp_path)[0]["global_step"] == 3


def test_temp_files_of_a_killed_ps_are_removed_at_start(tmp_path):
    for name in (".ckpt-0000000009.msgpack.123.tmp", ".manifest.json.123.tmp", ".manifest.json.456.tmp"):
        (tmp_path / name).write_bytes(b"half a write")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    checkpoint.Checkpointer(tmp_path, every_steps=1, every_seconds=0, keep=3).finish(make_core()[0])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == ["notes.tmp"]


def test_no_valid_checkpoint_means_a_fresh_start(tmp_path):
    assert checkpoint.load_latest(tmp_path) is None
    (tmp_path / "ckpt-0000000001.msgpack").write_bytes(b"")
    assert checkpoint.load_latest(tmp_path) is None
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_the_policy_checkpoints_every_n_steps_in_the_background_and_once_more_at_the_end(tmp_path):
    core, ids = make_core()
    infos = []
    ck = checkpoint.Checkpointer(tmp_path, every_steps=3, every_seconds=0, keep=10, on_info=infos.append)
    written = []
    for _ in range(7):
        fut = ck.maybe_save(core, 0.0)
        if fut is not None:
            written.append(fut.result()["step"])
        train(core, ids, 1)
    ck.finish(core)
    assert written == [0, 3, 6] and infos[-1]["step"] == 7 and infos[-1]["count"] == 4
    assert set(infos[-1]) >= {"step", "path", "time", "duration_seconds", "count"}
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)][:2] == ["ckpt-0000000007.msgpack",
                                                                          "ckpt-0000000006.msgpack"]


def test_a_kill_at_any_step_loses_at_most_two_intervals_even_on_the_slowest_disk(tmp_path, monkeypatch):
    """The slowest disk there is: a write ends only when the PS must wait for it. After every step (a kill -9 may
    come at any one) the newest checkpoint on disk is at most 2 x PS_CHECKPOINT_EVERY_STEPS behind, and the PS
    waited for a write only when the next checkpoint came due: every N steps."""
    n = 3
    core, ids = make_core()
    real, gates, fast = checkpoint.write_checkpoint, {}, []

    def held(directory, state, keep):  # a write that ends when its gate opens
        gate = gates.setdefault(state["global_step"], threading.Event())
        assert fast or gate.wait(allow(60)), "a write was never waited for"
        return real(directory, state, keep)

    monkeypatch.setattr(checkpoint, "write_checkpoint", held)
    ck = checkpoint.Checkpointer(tmp_path, every_steps=n, every_seconds=0, keep=50)
    waited, wait = [], ck.wait_for_write

    def open_then_wait():
        if ck._running is not None and not ck._running.done():
            waited.append(core.global_step)
            gates.setdefault(ck.last_step, threading.Event()).set()  # the running write: of the last snapshot
        wait()

    monkeypatch.setattr(ck, "wait_for_write", open_then_wait)

    def kill_now() -> int:
        """Steps a PS killed now would redo: what it restores (nothing: a fresh start, step 0) is behind."""
        found = checkpoint.load_latest(tmp_path)
        return core.global_step - (found[0]["global_step"] if found else 0)

    ck.maybe_save(core, 0.0)  # the model is initialised: step 0
    behind = []
    for _ in range(8 * n):
        train(core, ids, 1)
        behind.append(kill_now())  # the round closed, its observers not run yet
        ck.maybe_save(core, 0.0)  # the runtime's observer, after each change
        behind.append(kill_now())
    assert max(behind) == 2 * n and waited == list(range(n, 8 * n + 1, n)), (behind, waited)
    fast.append(True)
    ck.finish(core)


def test_the_time_policy_needs_the_step_to_move(tmp_path):
    core, ids = make_core()
    ck = checkpoint.Checkpointer(tmp_path, every_steps=0, every_seconds=10.0, keep=3)
    ck.last_step, ck.last_time = 0, 0.0
    assert not ck.due(core, 100.0)  # same step: nothing new to save
    train(core, ids, 1)
    assert not ck.due(core, 5.0) and ck.due(core, 10.0)
    ck.finish(core)


def test_the_step_that_ends_the_job_is_written_at_once(tmp_path, caplog):
    core, ids = make_core(max_steps=5)
    ck = checkpoint.Checkpointer(tmp_path, every_steps=100, every_seconds=60.0, keep=3)
    ck.last_step, ck.last_time = 0, 0.0
    train(core, ids, 4)
    assert not ck.due(core, 1.0)  # neither interval reached
    train(core, ids, 1)
    assert core.done and ck.due(core, 1.0)  # the last step's: at once
    with caplog.at_level("INFO", logger="ps_service.checkpoint"):
        assert ck.maybe_save(core, 1.0).result()["step"] == 5
        assert ck.finish(core) is None  # nothing moved since: no second file
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-0000000005.msgpack"]
    assert "checkpoint at global step 5 (the job is done): " in caplog.text
    assert f"shutdown: global step 5 is already in {tmp_path}" in caplog.text
    off = checkpoint.Checkpointer(tmp_path / "off", every_steps=0, every_seconds=0, keep=3)
    assert not off.due(core, 1.0)  # both intervals off: only the final one on SIGTERM
    off.finish(core)


def test_a_ps_killed_after_the_job_is_done_comes_back_done(tmp_path):
    ps_env = {"PS_MAX_STEPS": 30, "PS_CHECKPOINT_DIR": tmp_path, "PS_CHECKPOINT_EVERY_STEPS": 1000}
    with LocalCluster(2, ps_env=ps_env, worker_env={"WORKER_TASK": "linear"}) as c:
        assert c.wait_workers(allow(60)) == [0, 0]
        # written when the job was done, not 60 s later (PS_CHECKPOINT_EVERY_SECONDS) nor at shutdown; the PS's
        # writer thread logs the write after renaming the file into place: the file may be seen before the line
        wait_for(lambda: [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-0000000030.msgpack",
                                                                                  "ckpt-0000000000.msgpack"]
                 and "checkpoint at global step 30 (the job is done)" in c.log("ps"), allow(30),
                 "the checkpoint of the last step (and of the first), and its log line")
        c.kill()  # kill -9: no final checkpoint on the way out
        c.start_ps()
        st = c.status()
        assert (st["state"], st["global_step"], st["checkpoint"]["step"]) == ("done", 30, 30)


def test_the_documented_plain_script_reads_a_checkpoint(tmp_path):
    core, ids = make_core()
    train(core, ids, 3)
    write(core, tmp_path)
    corrupt_newer = tmp_path / "ckpt-0000000010.msgpack"
    corrupt_newer.write_bytes(b"\x81")
    script = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=allow(60))
    assert out.returncode == 0, out.stderr
    assert "global step 3" in out.stdout and "'name': 'adam'" in out.stdout
    assert f"b {core.weights['b'].tolist()}" in out.stdout


def test_a_real_ps_writes_on_sigterm_and_restores_on_start(tmp_path):
    ps_env = {"PS_MAX_STEPS": 30, "PS_CHECKPOINT_DIR": tmp_path, "PS_CHECKPOINT_EVERY_STEPS": 0,
              "PS_CHECKPOINT_EVERY_SECONDS": 0}
    c = LocalCluster(1, ps_env=ps_env, worker_env={"WORKER_TASK": "linear"})
    with c:
        assert c.wait_workers(allow(60)) == [0]
        assert checkpoint.list_checkpoints(tmp_path) == []  # periodic checkpoints are off
    state, path = checkpoint.load_latest(tmp_path)  # the final one, written on SIGTERM
    assert path.name == "ckpt-0000000030.msgpack" and state["members"][0]["name"] == "worker-0"
    again = LocalCluster(0, ps_env={**ps_env, "PS_MIN_WORKERS": 1}, port=c.port)
    with again:
        st = again.status()
        assert st["global_step"] == 30 and st["state"] == "done"
        assert st["checkpoint"]["step"] == 30 and st["checkpoint"]["path"] == str(path)
        body = frame.encode_bytes({"w": np.zeros(3, np.float32)}, {"optimizer": {}})
        r = httpx.put(f"{again.url}/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE},
                      timeout=allow(10))
        assert r.status_code == 409 and r.json()["error"] == "already_initialized"
        reg = httpx.post(f"{again.url}/v1/workers", json={"name": "worker-0"}, timeout=allow(10)).json()
        assert (reg["worker_id"], reg["rank"]) == (state["members"][0]["worker_id"], 0)


def test_the_guide_and_the_doc_state_the_same_bound_on_a_kill():
    """One bound, stated identically in both places (and held: test_faults.py kills a real PS ten times)."""
    guide = (DOC.parent / "guides" / "faults.md").read_text()
    found = [" ".join(re.search(r"\*\*A kill -9 redoes at most .*?no bound in steps\.", text, re.S).group(0).split())
             for text in (guide, DOC.read_text())]
    assert found[0] == found[1] and "2 × `PS_CHECKPOINT_EVERY_STEPS` steps" in found[0]


def test_a_resumed_job_takes_this_starts_hyper_parameters_and_refuses_another_optimizer(tmp_path):
    """What docs/guides/compose.md says applies on `up -d` applies to a resumed job too: the learning rate and the
    optimizer's hyper-parameters of this start's settings go on top of the checkpoint's spec (the slots and iterations stay).
    Another optimizer than the checkpoint's is refused (its slots do not carry over), and nothing is loaded."""
    core, ids = make_core()  # adam, learning rate 0.1
    train(core, ids, 3)
    write(core, tmp_path)
    state, _ = checkpoint.load_latest(tmp_path)
    back = ParameterServerCore(core_config(min_workers=2, learning_rate=0.02, beta1=0.5, momentum=0.9))
    back.import_state(state, 10.0)
    assert back.optimizer.spec == {**core.optimizer.spec, "learning_rate": 0.02, "beta1": 0.5}  # momentum: not adam's
    assert back.optimizer.iterations == 3 and back.global_step == 3
    for s, tensors in core.optimizer.slots.items():
        assert all(back.optimizer.slots[s][k].tobytes() == v.tobytes() for k, v in tensors.items())
    for other in ({"optimizer": "sgd"}, {"optimizer": "momentum", "momentum": 0.9}):
        fresh = ParameterServerCore(core_config(min_workers=2, **other))
        with pytest.raises(REFUSALS) as err:
            fresh.import_state(state, 10.0)
        assert err.value.code == "optimizer_changed" and "PS_OPTIMIZER" in err.value.detail
        assert not fresh.initialized and fresh.global_step == 0


def test_python_m_ps_service_refuses_to_resume_with_another_optimizer_in_one_line(tmp_path):
    """`python -m ps_service` on a checkpoint of another optimizer: exit 2 and one ERROR line that says what to do
    (no traceback); with only a new learning rate it starts, and /v1/status shows that rate."""
    core, ids = make_core()
    train(core, ids, 2)
    write(core, tmp_path)
    env = {"PS_CHECKPOINT_DIR": str(tmp_path), "PS_SHM_DIR": "", "PS_OPTIMIZER": "sgd"}
    cluster = LocalCluster(workers=1, ps_env=env, log_dir=tmp_path / "logs")  # the PS only: no worker started
    try:
        with pytest.raises(RuntimeError, match="PS exited with 2"):
            cluster.start_ps(deadline=allow(60))
        log = cluster.log("ps")
    finally:
        cluster.stop()
    errors = [line for line in log.splitlines() if " ps ERROR " in line]
    assert len(errors) == 1 and "cannot resume" in errors[0] and "the checkpoint trains adam" in errors[0]
    assert "Traceback" not in log
    env = {k: v for k, v in env.items() if k != "PS_OPTIMIZER"}
    cluster = LocalCluster(workers=1, ps_env={**env, "PS_LEARNING_RATE": "0.03"}, log_dir=tmp_path / "logs2")
    try:
        cluster.start_ps(deadline=allow(60))
        status = httpx.get(f"{cluster.url}/v1/status", timeout=allow(10)).json()
        assert status["optimizer"]["learning_rate"] == 0.03 and status["global_step"] == 2
    finally:
        cluster.stop()
