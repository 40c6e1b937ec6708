"""``python -m syncps export`` (syncps/export.py): a running PS's weights (one PS with its token, a sharded PS) and a
checkpoint's, written as safetensors and as a torch state_dict, read back by the ``safetensors`` package and by
``torch.load`` and compared bit for bit; a module trained through syncps.torch takes the torch file with
``load_state_dict(strict=True)``; what cannot be exported says why in one line and writes nothing."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, safe_open

from cluster.processes import LocalCluster
from tests.timing import allow
from ps_service import checkpoint
from syncps.__main__ import main
from syncps.export import Model, write_safetensors
from tests.clusters import final_weights
from tests.live_ps import live_ps
from tests.test_checkpoint import make_core, train, write

TOKEN, MONITOR = "train-secret", "watch-secret"
#: a model with the dtypes a PS holds, a 0-d and an empty tensor, and an averaged buffer
W0 = {"fc.weight": np.arange(6, dtype=np.float32).reshape(3, 2) / 7, "fc.bias": np.zeros(2, np.float64),
      "half": np.full((2, 2), 0.1, np.float16), "scale": np.array(1.5, np.float32),
      "none": np.zeros((0, 3), np.float32),
      "buffer:bn.running_mean": np.ones(3, np.float32)}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """The same names, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        (a[k].dtype, a[k].shape, a[k].tobytes()) == (b[k].dtype, b[k].shape, b[k].tobytes()) for k in a)


def model_named(ps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.removeprefix("buffer:"): v for k, v in ps.items()}


def export(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["export", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def trained_ps(ps, steps: int = 2) -> dict[str, np.ndarray]:
    """Initialise ``ps`` with :data:`W0`, train ``steps`` rounds of one worker; the PS's weights (copies)."""
    c = ps.client(token=TOKEN)
    c.init_model(W0, {"name": "adam", "learning_rate": 0.1})
    wid = c.register("w0")["worker_id"]
    rng = np.random.default_rng(3)
    for step in range(steps):
        grads = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in W0.items()}
        assert c.push(wid, step, grads)["status"] == "accepted"
    pulled = c.pull(steps, wait=allow(10.0))
    c.close()
    assert pulled.step == steps
    return {k: v.copy() for k, v in pulled.tensors.items()}


def test_a_live_ps_exports_with_its_training_token_and_the_file_reads_back_bit_for_bit(tmp_path, capsys):
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "monitor").write_text(MONITOR)
    with live_ps(min_workers=1, startup_grace_seconds=0, auth_token=TOKEN, monitor_token=MONITOR) as ps:
        weights = trained_ps(ps)
        out = tmp_path / "m.safetensors"
        code, said, _ = export(capsys, "--url", ps.url, "--token-file", str(tmp_path / "token"), "--out", str(out))
        assert code == 0 and said.startswith(f"wrote {out}: 6 tensors") and "global step 2" in said
        for args, why in ((["--token-file", str(tmp_path / "monitor")], "the monitor token does not open it"),
                          ([], "401 unauthorized")):
            code, said, err = export(capsys, "--url", ps.url, "--out", str(tmp_path / "refused.safetensors"), *args)
            assert (code, said) == (1, "") and why in err and len(err.splitlines()) == 1
    assert not (tmp_path / "refused.safetensors").exists()
    assert not np.array_equal(weights["fc.weight"], W0["fc.weight"])  # trained: not the initial weights
    assert same(load_file(str(out)), model_named(weights))
    with safe_open(str(out), "np") as f:
        assert f.metadata()["syncps_global_step"] == "2" and f.metadata()["syncps_source"] == ps.url


def test_a_ps_that_is_not_there_or_not_training_is_said_in_one_line(tmp_path, capsys):
    with live_ps(min_workers=2, startup_grace_seconds=0) as ps:
        ps.client().init_model(W0)  # initialised, waiting for its two workers
        code, _, err = export(capsys, "--url", ps.url, "--wait", "0.2", "--out", str(tmp_path / "m.safetensors"))
        assert code == 1 and "has not started training within 0.2 s" in err
        port = ps.port
    code, _, err = export(capsys, "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "m.safetensors"))
    assert code == 1 and "no answer from a PS" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_file_and_a_checkpoint_directory_export_their_weights(tmp_path, capsys):
    core, ids = make_core()
    train(core, ids, 3)
    older = write(core, tmp_path)["file"]
    train(core, ids, 2)
    newest = write(core, tmp_path)["file"]
    states = {name: checkpoint.decode((tmp_path / name).read_bytes()) for name in (older, newest)}
    for source, name in ((tmp_path / older, older), (tmp_path, newest)):
        out = tmp_path / f"{name}.safetensors"
        code, said, _ = export(capsys, "--checkpoint", str(source), "--out", str(out))
        assert code == 0 and f"global step {states[name]['global_step']}" in said and name in said
        assert same(load_file(str(out)), states[name]["weights"])
        with safe_open(str(out), "np") as f:
            assert json.loads(f.metadata()["syncps_optimizer"])["name"] == "adam"


def test_an_unusable_checkpoint_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys):
    core, ids = make_core()
    train(core, ids, 1)
    path = tmp_path / write(core, tmp_path)["file"]
    path.write_bytes(path.read_bytes()[:-10])
    (tmp_path / "shard").mkdir()
    (tmp_path / "shard" / "shard-map.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for source, why in ((path, "is not a usable checkpoint: bad_msgpack"),
                        (tmp_path, "no valid checkpoint (1 ckpt-*.msgpack file(s)"),
                        (tmp_path / "empty", "no ckpt-*.msgpack checkpoint"), (tmp_path / "shard", "one PS shard"),
                        (tmp_path / "nothing.msgpack", "cannot read")):
        code, said, err = export(capsys, "--checkpoint", str(source), "--out", str(tmp_path / "m.safetensors"))
        assert (code, said) == (1, "") and why in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "m.safetensors").exists()


def test_the_command_line_wants_one_source(capsys):
    for args in ([], ["--url", "http://x", "--checkpoint", "y"], ["--checkpoint", "y", "--format", "onnx"]):
        with pytest.raises(SystemExit) as exc:
            main(["export", *args])
        assert exc.value.code == 2
    capsys.readouterr()


def test_the_writer_follows_the_safetensors_layout(tmp_path):
    """The header by hand: its length, 8-byte padding, offsets back to back in name order, the data after it."""
    tensors = model_named(W0)
    path = tmp_path / "m.safetensors"
    write_safetensors(path, Model(tensors, 7, "here"))
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    head = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and head.pop("__metadata__") == {"syncps_global_step": "7", "syncps_source": "here"}
    assert list(head) == sorted(tensors) and len(raw) == 8 + n + sum(v.nbytes for v in tensors.values())
    end = 0
    for name, entry in head.items():
        assert entry["data_offsets"][0] == end and entry["shape"] == list(tensors[name].shape)
        end = entry["data_offsets"][1]
        assert raw[8 + n + entry["data_offsets"][0]:8 + n + end] == tensors[name].tobytes()


def test_a_sharded_ps_exports_the_whole_model(tmp_path, capsys):
    with LocalCluster(2, ps_env={"PS_MAX_STEPS": 5, "PS_SHARD_SPLIT_ELEMENTS": 2},
                      worker_env={"WORKER_TASK": "linear", "WORKER_DTYPE": "float64", "WORKER_SHM_DIR": ""},
                      shards=2) as c:
        try:
            assert c.wait_workers(allow(120)) == [0, 0]
            out = tmp_path / "m.safetensors"
            code, said, err = export(capsys, "--url", c.url, "--out", str(out))
            assert code == 0, err
            weights = final_weights(c)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    assert "global step 5" in said and same(load_file(str(out)), weights)


def test_a_module_trained_through_syncps_torch_loads_the_torch_file_strictly(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch
    from syncps.torch import connect
    from tests.test_torch_bridge import X, Y, in_threads, linear
    from tests.torch_tasks import batchnorm

    def worker(make, name: str, x, y):
        model, opt = make()
        with connect(model, opt, url=ps.url, name=name, retry_timeout=allow(20)) as dist:
            for idx in dist.batch_sampler(x, 32):
                dist.zero_grad()
                torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                dist.step()
        return model

    def lin():
        model = linear(0)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def bn():
        job = batchnorm()
        return job.model, job.optimizer

    data = batchnorm().dataset
    for make, (x, y) in ((lin, (X, Y)), (bn, data)):
        with live_ps(min_workers=2, max_steps=4, startup_grace_seconds=0) as ps:
            trained = in_threads(lambda: worker(make, "a", x, y), lambda: worker(make, "b", x, y))[0]
            assert export(capsys, "--url", ps.url, "--format", "torch", "--out", str(tmp_path / "m.pt"))[0] == 0
            assert export(capsys, "--url", ps.url, "--out", str(tmp_path / "m.safetensors"))[0] == 0
        fresh = make()[0]
        state = torch.load(tmp_path / "m.pt", weights_only=True)
        assert state.keys() == load_torch(str(tmp_path / "m.safetensors")).keys()
        # BatchNorm's integer buffer stays on each worker (not on the PS, not in the file): torch fills it in
        assert ("0.num_batches_tracked" in state) is False
        fresh.load_state_dict(state, strict=True)
        want = {k: v for k, v in trained.state_dict().items() if k in state}
        for name, t in load_torch(str(tmp_path / "m.safetensors")).items():
            assert torch.equal(t, state[name]) and t.dtype == state[name].dtype
        for name, t in fresh.state_dict().items():
            if name in state:
                assert t.dtype == want[name].dtype and t.numpy().tobytes() == want[name].numpy().tobytes(), name
