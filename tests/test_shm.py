"""The same-host transport (shared/shm.py, ps_service/transport/shm.py, worker_service/transport/shm.py).

- Region: the file format of docs/protocol.md, byte by byte; a peer's file is checked before use.
- Live PS: a worker on the same host attaches, its pushes and pulls carry no tensor bytes, the weights
  it maps are the PS's; every hostile attach or push is refused with a clear 409/400 and changes nothing
  (a hard link of the weights file is no gradient file); the PS reads a push once, checking what it reads
  (NaN/Inf or an overflowing sum: 422 or skipped), and what it applies is what it read, whatever the worker
  writes into its file afterwards, in rank order or not; a PS that lost the worker's file is re-attached;
  a PS with the transport off, or on "another host" (another directory), is used over HTTP.
- Files: the PS removes its weights file on shutdown and sweeps the ones a killed PS left; workers'
  files vanish once attached.
- Real processes: shm workers, HTTP workers and a mix of both end bit-identical to one process.
"""
from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
import struct

from shared import frame, shm
from tests.clusters import final_weights
from tests.live_ps import live_ps, state_hash
from tests.reference import train_reference
from ps_service.transport.shm import ShmHub
from worker_service.transport.shm import ShmTransport

W0 = {"w": np.arange(6, dtype=np.float32).reshape(3, 2) / 10, "b": np.array([0.5, -0.5], np.float32)}


def grads(scale: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, scale) for k, v in W0.items()}


def test_region_format_byte_by_byte(tmp_path):
    layout = frame.Layout.of({"b": np.zeros(3, np.float64), "w": np.zeros((1000, 3), np.float32)})
    assert [t.offset for t in layout.tensors] == [0, 64]  # b: 24 bytes, padded to a cache line
    nonce = bytes(range(16))
    fd, region = shm.create_region(str(tmp_path), "syncps-g-" + "a" * 32, shm.KIND_GRADIENTS, layout, nonce, 41)
    os.close(fd)
    raw = bytes(region.mapping)
    assert len(raw) == shm.region_bytes(layout) and len(raw) % 4096 == 0
    assert raw[:8] == b"SYNCPSM1" and raw[8:9] == b"G" and raw[9:16] == bytes(7)
    assert raw[16:32] == nonce and struct.unpack_from("<q", raw, 32)[0] == 41 and raw[40:64] == bytes(24)
    f = frame.decode(raw[64:], exact=False)
    assert f.layout == layout and f.meta == {}
    region.views()["w"][:] = 2.5
    data = 64 + f.data_start  # w sits at offset 64 of the data
    assert bytes(region.mapping)[data + 64:data + 68] == struct.pack("<f", 2.5)
    region.marker = shm.WRITING
    assert struct.unpack_from("<q", region.mapping, 32)[0] == -1
    # a peer checks kind, nonce and layout before it uses a file
    for kind, want_nonce, want_layout in ((shm.KIND_WEIGHTS, nonce, layout), (shm.KIND_GRADIENTS, bytes(16), layout),
                                          (shm.KIND_GRADIENTS, nonce, frame.Layout.of({"b": np.zeros(4)}))):
        with pytest.raises(ValueError):
            shm.map_existing(str(tmp_path), "syncps-g-" + "a" * 32, kind, want_nonce, writable=False,
                             layout=want_layout, size=len(raw))
    got, _ = shm.map_existing(str(tmp_path), "syncps-g-" + "a" * 32, shm.KIND_GRADIENTS, nonce, writable=False,
                              size=len(raw))
    assert got.layout == layout and got.marker == -1


@pytest.fixture
def shm_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def test_gradients_computed_into_the_file_are_pushed_without_a_copy(tmp_path):
    """A task that takes ``out`` computes into the worker's gradient file (``gradient_buffers``): the marker says
    "writing" meanwhile, the push finds its arrays there and copies nothing; other arrays are copied in."""
    layout = frame.Layout.of(W0)
    fd, weights = shm.create_region(str(tmp_path), "syncps-w-" + "b" * 32, shm.KIND_WEIGHTS, layout, bytes(16), 0)
    os.close(fd)
    ch = ShmTransport(None, str(tmp_path), weights)
    out = ch.gradient_buffers()
    assert ch._region.marker == shm.WRITING and set(out) == set(W0)
    for name, g in grads(1.5).items():
        np.copyto(out[name], g)
    assert all(np.shares_memory(out[n], v) for n, v in ch._region.views().items())  # the file itself
    seq = ch.write(out)  # the file's own arrays: nothing to copy
    assert ch._region.marker == seq and all((v == 1.5).all() for v in ch._region.views().values())
    seq2 = ch.write(grads(-2.0))  # anything else is copied in, under a fresh sequence number
    assert seq2 == seq + 1 and all((v == -2.0).all() for v in ch._region.views().values())
    ch.close()


def test_a_task_that_takes_out_writes_its_gradients_there_with_the_same_bits():
    from bench.task import BenchLinearTask
    from worker_service.tasks import writes_into
    from worker_service.tasks.linear import LinearTask
    from worker_service.tasks.mlp import MLPTask

    assert writes_into(LinearTask()) and writes_into(BenchLinearTask(1000)) and not writes_into(MLPTask())
    for task in (LinearTask(dtype="float64"), LinearTask(), BenchLinearTask(1000)):
        params = {k: np.full_like(v, 0.25) for k, v in task.init_params().items()}
        batch = task.batch(3, 1, 2, 32)
        loss, g, n = task.loss_and_grads(params, batch)
        g = {k: v.copy() for k, v in g.items()}  # the bench task reuses its own buffers
        out = {k: np.empty_like(v) for k, v in params.items()}
        loss2, g2, n2 = task.loss_and_grads(params, batch, out=out)
        assert (loss2, n2) == (loss, n) and all(g2[k] is out[k] and g2[k].tobytes() == g[k].tobytes() for k in g)


def test_same_host_worker_moves_no_tensor_bytes(shm_dir):
    with live_ps(shm_dir=shm_dir, min_workers=2, startup_grace_seconds=0, lease_seconds=600) as ps:
        a, b = ps.client(shm_dir=shm_dir), ps.client()  # b: tensors over HTTP
        with ps.http() as h:
            assert h.get("/v1/shm").json()["error"] == "not_initialized"
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        assert a.attach(wa) == "shm" and a.transport == "shm"
        channel = a.tensors.current
        assert os.listdir(shm_dir) == [ps.rt.tensors.shm.weights_name]  # the worker's file is unlinked once attached
        pulled = a.pull(0, wa, wait=allow(5.0))
        assert pulled.tensors is channel.live
        np.testing.assert_array_equal(pulled.tensors["w"], W0["w"])
        before = ps.rt.tensors.bytes_in, ps.rt.tensors.bytes_out
        assert a.push(wa, 0, grads(1.0))["status"] == "accepted"
        assert ps.rt.tensors.bytes_in == before[0]  # the HTTP body carried no tensor
        assert b.push(wb, 0, grads(3.0))["step"] == 1
        assert a.pull(1, wa, wait=allow(5.0)).step == 1
        expect = W0["w"] - np.float32(0.5) * np.float32(2.0)
        np.testing.assert_array_equal(channel.live["w"], expect)  # the PS's live weights, mapped
        np.testing.assert_array_equal(b.pull(1, wb, wait=allow(5.0)).tensors["w"], expect)
        status = ps.http().get("/v1/status").json()
        assert status["shm_bytes_received"] == channel.layout.data_bytes
        transports = {w["name"]: w["transport"] for w in ps.http().get("/v1/workers").json()["workers"]}
        assert transports == {"a": "shm", "b": "http"}
        assert "\nps_shm_workers 1.0" in ps.http().get("/metrics").text
        a.close(), b.close()
    assert os.listdir(shm_dir) == []  # the weights file goes with the PS


def test_with_body_answers_the_weights_live_in_their_frame_and_the_file_gets_a_copy_per_step(shm_dir):
    """A sync job that answers a same-host worker and one over HTTP (a co-located shard's case): the body answers
    copy no weights (they live in their frame), the file gets one copy per step and holds exactly that step's
    weights for the same-host worker; once two steps pass with no body answer the file holds them again (no copy
    at all), and a body answer takes them back out."""
    with live_ps(shm_dir=shm_dir, min_workers=2, startup_grace_seconds=0, lease_seconds=600) as ps:
        a, b = ps.client(shm_dir=shm_dir), ps.client()
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.5}) and a.attach(wa) == "shm"
        core, hub, store, channel = ps.rt.core, ps.rt.tensors.shm, ps.rt.core.store, a.tensors.current
        region = hub._weights  # the file's mapping (its marker: the step of the weights it holds)

        def round_(step: int, body_pull: bool) -> None:
            order = [(a, wa, 1.0), (b, wb, 3.0)]
            for c, w, g in order if body_pull else order[::-1]:  # the push that closes a round is answered the
                assert c.push(w, step, grads(g))["status"] == "accepted"  # new weights at once: b's not, here
            want = W0["w"] - np.float32(step + 1)  # the mean gradient 2 at learning rate 0.5, each step
            if body_pull:  # the body answer first, as a co-located shard wakes them
                np.testing.assert_array_equal(b.pull(step + 1, wb, wait=allow(5.0)).tensors["w"], want)
            assert a.pull(step + 1, wa, wait=allow(5.0)).step == step + 1
            np.testing.assert_array_equal(channel.live["w"], want)
            assert region.marker == step + 1

        for step in range(6):
            round_(step, body_pull=True)
            assert store.holds(core.weights) and not hub.holds(core.weights)
        # one copy a step into the file (not step 1's: the optimizer made it there, the body answer then moved
        # the weights out); the body answers copy none
        assert hub.mirrored == 5 and store.moves <= 3
        for step in range(6, 10):
            round_(step, body_pull=False)
        # steps 7 (a body answer at 6) and 8 copied; then the file holds the weights again: no copy
        assert hub.holds(core.weights) and hub.mirrored == 7
        round_(10, body_pull=True)
        assert store.holds(core.weights) and not hub.holds(core.weights) and hub.mirrored == 7
        assert "\nps_shm_weights_copies_total 7.0" in ps.http().get("/metrics").text
        a.close(), b.close()


def test_an_async_job_answers_from_the_frame_and_leaves_the_file_alone(shm_dir):
    """async/ssp answer every pull in a body (the weights change at every push: api.answer_via): the weights move
    into the frame of those answers at the first one, as with no file, and the file never gets a copy."""
    with live_ps(shm_dir=shm_dir, mode="async", min_workers=1, startup_grace_seconds=0, lease_seconds=600) as ps:
        a = ps.client(shm_dir=shm_dir)
        wa = a.register("a")["worker_id"]
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.5}) and a.attach(wa) == "shm"
        for step in range(3):
            assert a.push(wa, step, grads(1.0))["status"] == "accepted"
            pulled = a.pull(step + 1, wa, wait=allow(5.0))
            np.testing.assert_array_equal(pulled.tensors["w"], W0["w"] - np.float32(0.5 * (step + 1)))
            assert pulled.tensors is not a.tensors.current.live  # a body answer
            assert ps.rt.core.store.holds(ps.rt.core.weights) and ps.rt.tensors.shm.mirrored == 0
        a.close()


def shm_push(h, worker_id: str, step: int, seq):
    """A push whose tensors are said to be in the worker's gradient file."""
    body = frame.encode_bytes({}, {"worker_id": worker_id, "step": step, "shm_seq": seq})
    return h.post("/v1/gradients", content=body, headers={"content-type": frame.MEDIA_TYPE})


def test_hostile_attach_and_push_change_nothing(shm_dir):
    with live_ps(shm_dir=shm_dir, min_workers=1, startup_grace_seconds=0, lease_seconds=600) as ps:
        c = ps.client(shm_dir=shm_dir)
        wid = c.register("a")["worker_id"]
        assert c.init_model(W0, {"name": "adam", "learning_rate": 0.1})
        h = ps.http()
        offer = h.get("/v1/shm").json()
        real = ShmTransport.open(None, shm_dir, offer)  # a well-formed file of the right size, not yet attached

        def attach(file, nonce=real.nonce.hex(), worker=wid):
            return h.post(f"/v1/workers/{worker}/shm", json={"file": file, "nonce": nonce})

        small = "syncps-g-" + "1" * 32
        with open(os.path.join(shm_dir, small), "wb") as f:
            f.write(real.nonce + b"\0" * 100)
        link = "syncps-g-" + "2" * 32
        os.symlink(os.path.join(shm_dir, real.gradient_file), os.path.join(shm_dir, link))
        hard = "syncps-g-" + "3" * 32  # a hard link of the PS's own weights file (kind W, two links)
        os.link(os.path.join(shm_dir, offer["weights_file"]), os.path.join(shm_dir, hard))
        weights_nonce = offer["nonce"]
        fifo = "syncps-g-" + "4" * 32  # its open waited for a writer: the PS's event loop hung there
        os.mkfifo(os.path.join(shm_dir, fifo), 0o600)
        cases = [
            (lambda: attach("../../etc/passwd"), 400, "bad_field"),
            (lambda: attach("syncps-g-" + "0" * 32), 409, "shm_unavailable"),  # no such file: another host
            (lambda: attach(real.gradient_file, "00" * 16), 409, "shm_unavailable"),  # wrong nonce
            (lambda: attach(real.gradient_file, "zz" * 16), 400, "bad_field"),
            (lambda: attach(small), 409, "shm_unavailable"),  # wrong size
            (lambda: attach(link), 409, "shm_unavailable"),  # a symlink is never followed
            (lambda: attach(hard, weights_nonce), 409, "shm_unavailable"),  # the weights are no gradient
            (lambda: attach(fifo), 409, "shm_unavailable"),  # not a regular file
            (lambda: shm_push(h, wid, 0, 1), 409, "shm_not_attached"),
            (lambda: attach(real.gradient_file, worker="nobody"), 404, "unknown_worker"),
            # protocol.md, Errors: the body's form before the PS's state (the worker's was judged first)
            (lambda: attach("../../etc/passwd", worker="nobody"), 400, "bad_field"),
            (lambda: attach(real.gradient_file, "zz" * 16, worker="nobody"), 400, "bad_field"),
            (lambda: shm_push(h, wid, 0, 1), 409, "shm_not_attached"),
            (lambda: shm_push(h, "nobody", 0, 1), 404, "unknown_worker"),
        ]
        before = state_hash(ps.rt)
        for send, status, code in cases:
            resp = send()
            assert (resp.status_code, resp.json()["error"]) == (status, code), resp.text
        assert not ps.rt.tensors.shm.attached
        ok = attach(real.gradient_file)  # protocol.md, Same-host transport item 3: the answer
        assert (ok.status_code, ok.json()) == (200, {"worker_id": wid, "transport": "shm"})
        real.unlink()
        seq = real.write(grads(1.0))
        for bad_seq, status, code in ((seq + 1, 409, "shm_torn"), (-1, 400, "bad_field"), ("1", 400, "bad_field")):
            resp = shm_push(h, wid, 0, bad_seq)
            assert (resp.status_code, resp.json()["error"]) == (status, code), resp.text
        assert state_hash(ps.rt) == before and ps.rt.core.push_counts.get("accepted", 0) == 0
        assert shm_push(h, wid, 0, seq).json()["status"] == "accepted"
        assert ps.rt.core.global_step == 1
        os.unlink(os.path.join(shm_dir, hard))
        c.close(), h.close(), real.close()


def test_a_push_rewritten_after_it_was_accepted_changes_nothing(shm_dir):
    """A worker that rewrites its file after its push was accepted (keeping the marker) changes nothing: the PS
    copied the push out of the file when it took it (checked as copied), so the round applies what was accepted,
    the mean of both pushes, and its record lists both."""
    with live_ps(shm_dir=shm_dir, min_workers=2, startup_grace_seconds=0, lease_seconds=600) as ps:
        a, b = ps.client(shm_dir=shm_dir), ps.client(shm_dir=shm_dir)
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        assert a.attach(wa) == b.attach(wb) == "shm"
        assert a.push(wa, 0, grads(1.0))["status"] == "accepted"
        for view in a.tensors.current._grads.values():  # the file, marker untouched: NaN where the push was
            view[...] = np.nan
        assert b.push(wb, 0, grads(3.0))["step"] == 1  # closes the round
        mean = (grads(1.0)["w"] + grads(3.0)["w"]) / np.float32(2)
        np.testing.assert_array_equal(ps.rt.core.weights["w"], W0["w"] - np.float32(0.5) * mean)
        rec = ps.rt.core.rounds[-1]
        assert rec.aggregated == 2 and rec.missing == ()
        a.close(), b.close()


def test_a_push_rewritten_while_it_waits_for_a_lower_rank_changes_nothing(shm_dir):
    """Rank 1 pushes first: its gradient cannot be summed yet. NaN written into its file in between (a worker
    breaking the protocol) never reaches the weights: the PS summed the copy it took, checked, at the push."""
    with live_ps(shm_dir=shm_dir, min_workers=2, startup_grace_seconds=0, lease_seconds=600) as ps:
        a, b = ps.client(shm_dir=shm_dir), ps.client(shm_dir=shm_dir)
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert ps.rt.core.members.by_id[wa].rank == 0 and ps.rt.core.members.by_id[wb].rank == 1
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        assert a.attach(wa) == b.attach(wb) == "shm"
        assert b.push(wb, 0, grads(3.0))["status"] == "accepted"
        for view in b.tensors.current._grads.values():
            view[...] = np.nan
        assert a.push(wa, 0, grads(1.0))["step"] == 1
        w1 = W0["w"] - np.float32(0.5) * np.float32(2.0)
        np.testing.assert_array_equal(ps.rt.core.weights["w"], w1)
        rec = ps.rt.core.rounds[-1]
        assert rec.aggregated == 2 and rec.missing == ()
        assert a.push(wa, 1, grads(1.0))["status"] == "accepted" and b.push(wb, 1, grads(3.0))["step"] == 2
        np.testing.assert_array_equal(ps.rt.core.weights["w"], w1 - np.float32(0.5) * np.float32(2.0))
        a.close(), b.close()


@pytest.mark.parametrize("policy", ["reject", "skip"])
def test_nan_in_the_file_is_found_as_it_is_read(policy, shm_dir):
    """NaN/Inf in a same-host push is found when the PS takes it: 422 nonfinite_gradient and nothing changes
    (reject), or 'skipped' (skip). A sum that overflows is found as it is made: the round applies nothing."""
    with live_ps(shm_dir=shm_dir, min_workers=2, startup_grace_seconds=0, lease_seconds=600,
                 nonfinite_policy=policy) as ps:
        a, b = ps.client(shm_dir=shm_dir), ps.client(shm_dir=shm_dir)
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert a.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        assert a.attach(wa) == b.attach(wb) == "shm"
        assert a.push(wa, 0, grads(3e38))["status"] == "accepted"
        with ps.http() as h:
            before = state_hash(ps.rt)
            for bad in (np.nan, np.inf):
                g = grads(1.0)
                g["w"][1, 1] = bad
                resp = shm_push(h, wb, 0, b.tensors.current.write(g))
                if policy == "reject":
                    assert (resp.status_code, resp.json()["error"]) == (422, "nonfinite_gradient"), resp.text
                    assert "'w'" in resp.json()["detail"] and state_hash(ps.rt) == before
                else:
                    assert resp.json()["status"] == "skipped", resp.text
                    break
            if policy == "reject":
                assert shm_push(h, wb, 0, b.tensors.current.write(grads(1.0))).json()["status"] == "accepted"
        assert ps.rt.core.global_step == 1
        mean = (np.float32(3e38) + np.float32(1.0)) / 2 if policy == "reject" else np.float32(3e38)
        np.testing.assert_array_equal(ps.rt.core.weights["b"], W0["b"] - np.float32(0.5) * np.float32(mean))
        after = {k: v.copy() for k, v in ps.rt.core.weights.items()}
        assert a.push(wa, 1, grads(3e38))["status"] == "accepted"  # 3e38 + 3e38 overflows float32
        assert b.push(wb, 1, grads(3e38))["status"] == "accepted" and ps.rt.core.global_step == 2
        assert all(np.array_equal(ps.rt.core.weights[k], after[k]) for k in W0)  # no update, never an Inf
        assert ps.rt.core.rounds[-1].aggregated == 0
        a.close(), b.close()


def test_a_ps_that_lost_the_file_gets_it_again(shm_dir):
    """409 shm_not_attached (a restarted PS, a pruned file) makes the client attach again and push: the
    push is applied once, through the file; a worker that is not active is told to register (409 not_active),
    never shm_not_attached."""
    with live_ps(shm_dir=shm_dir, min_workers=1, startup_grace_seconds=0, lease_seconds=600) as ps:
        c = ps.client(shm_dir=shm_dir)
        wid = c.register("a")["worker_id"]
        assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.5}) and c.attach(wid) == "shm"
        ps.rt.tensors.shm.detach(wid)
        assert c.push(wid, 0, grads(1.0))["status"] == "accepted" and c.transport == "shm"
        assert ps.rt.core.global_step == 1 and wid in ps.rt.tensors.shm.attached
        with ps.http() as h:
            h.delete(f"/v1/workers/{wid}")
            seq = c.tensors.current.write(grads(1.0))
            for resp in (shm_push(h, wid, 1, seq),
                         h.post(f"/v1/workers/{wid}/shm", json={"file": "syncps-g-" + "0" * 32, "nonce": "00" * 16})):
                assert (resp.status_code, resp.json()["error"]) == (409, "not_active"), resp.text
        c.close()


def test_off_or_elsewhere_falls_back_to_http(shm_dir, tmp_path):
    elsewhere = tmp_path / "other-host"
    elsewhere.mkdir()
    for ps_dir, worker_dir in (("", shm_dir), (shm_dir, str(elsewhere))):
        with live_ps(shm_dir=ps_dir, min_workers=1, startup_grace_seconds=0) as ps:
            c = ps.client(shm_dir=worker_dir)
            wid = c.register("a")["worker_id"]
            assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.5})
            assert c.attach(wid) == "http" and c.transport == "http"
            assert c.push(wid, 0, grads(1.0))["status"] == "accepted"
            assert os.listdir(worker_dir) == []  # nothing left behind by the failed attempt
            c.close()


def test_weights_file_of_a_killed_ps_is_swept(shm_dir):
    """A file without a live PS's flock goes; a locked one (a PS still running, maybe in another
    container sharing the directory) stays."""
    stale = os.path.join(shm_dir, f"syncps-w-1-{'ab' * 8}")
    alive = os.path.join(shm_dir, f"syncps-w-1-{'cd' * 8}")
    for path in (stale, alive):
        open(path, "wb").close()
    holder = os.open(alive, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with live_ps(shm_dir=shm_dir) as ps:
            assert not os.path.exists(stale) and os.path.exists(alive)
            c = ps.client(shm_dir=shm_dir)
            wid = c.register("a")["worker_id"]
            assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.5}) and c.attach(wid) == "shm"
            ShmHub(shm_dir)  # a second PS starting on the directory (it sweeps) keeps the live one's file
            assert os.path.exists(os.path.join(shm_dir, ps.rt.tensors.shm.weights_name))
            c.close()
    finally:
        os.close(holder)


def _job(worker_dirs: list[str], steps: int = 30) -> tuple[dict, dict, list[dict]]:
    n = len(worker_dirs)
    c = LocalCluster(n, ps_env={"PS_MAX_STEPS": steps, "PS_SHM_DIR": next((d for d in worker_dirs if d), "")},
                     worker_env={"WORKER_TASK": "linear", "WORKER_DTYPE": "float64", "WORKER_SEED": 7,
                                 "WORKER_BATCH_SIZE": 16})
    try:
        c.start_ps()
        for i, d in enumerate(worker_dirs):
            c.start_worker(i, {"WORKER_SHM_DIR": d})
        try:
            assert c.wait_workers(allow(120)) == [0] * n
            wait_for(lambda: c.status()["state"] == "done", allow(10), "the PS to report done")
            return final_weights(c), c.status(), c.get("/v1/workers").json()["workers"]
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    finally:
        c.stop()


@pytest.mark.parametrize("kind", ["shm", "http", "mixed"])
def test_transports_train_bit_identical(kind, shm_dir):
    dirs = {"shm": [shm_dir] * 2, "http": [""] * 2, "mixed": [shm_dir, "", shm_dir, ""]}[kind]
    tensors, status, workers = _job(dirs)
    _, ref = train_reference("linear", len(dirs), 30, batch_size=16, seed=7, dtype="float64")
    for k in ref:
        assert tensors[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical"
    used = {w["name"]: w["transport"] for w in workers}
    assert used == {f"worker-{i}": "shm" if d else "http" for i, d in enumerate(dirs)}
    assert (status["shm_bytes_received"] > 0) == (kind != "http")
    if any(dirs):
        assert os.listdir(shm_dir) == []  # every file gone with its process
