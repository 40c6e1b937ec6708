"""Gradient compression (shared/compression.py, docs/protocol.md "Compression"): the encodings round-trip,
hostile compressed tensors are refused with 422 before anything changes, and a live PS with two workers
applies exactly the decoded gradients (checked against a numpy replay of what the workers sent)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shared import compression as C, frame, scan
from shared.codec import bfloat16
from shared.errors import ProtocolError
from tests.live_ps import live_ps, state_hash
from tests.wire import push_frame
from worker_service.transport.http import BodyTransport

ENCODINGS = ("bf16", "fp16", "topk", "2bit")
F32 = np.float32


def grads_of(rng: np.random.Generator, shapes: dict) -> dict:
    return {k: rng.standard_normal(s).astype(F32) for k, s in shapes.items()}


def refused(fn, *args, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)
    return info.value


# ---- round trips ---------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.sampled_from(ENCODINGS), st.integers(0, 300), st.integers(0, 2**32 - 1),
       st.floats(0.001, 1.0), st.floats(0.01, 3.0))
def test_round_trip_and_residual(name, n, seed, ratio, threshold):
    spec = C.Spec(name, ratio, threshold)
    rng = np.random.default_rng(seed)
    comp = C.Compressor(spec)
    model = {"w": np.zeros(n, F32), "d": np.zeros(3, np.float64)}
    total_sent, total_grad = np.zeros(n, np.float64), np.zeros(n, np.float64)
    for _ in range(3):
        g = {"w": rng.standard_normal(n).astype(F32), "d": rng.standard_normal(3)}
        before = comp.residuals.get("w", np.zeros(n, F32)).copy()
        wire = comp.encode(g)
        assert wire["d"] is g["d"]  # float64 tensors travel as they are
        dec = {k: C.dense(v) for k, v in C.decode_push(spec, name, wire, model)[0].items()}
        assert dec["w"].dtype == F32 and dec["w"].shape == (n,)
        if name in ("bf16", "fp16"):
            assert np.array_equal(dec["w"], g["w"].astype(bfloat16() if name == "bf16" else np.float16).astype(F32))
            continue
        acc = before + g["w"]
        assert np.array_equal(comp.residuals["w"], acc - dec["w"])  # the residual keeps exactly what was not sent
        if name == "topk":
            k = spec.k(n)
            sent = np.flatnonzero(dec["w"])
            assert len(sent) <= k and np.array_equal(dec["w"][sent], acc[sent])
            if k and n:
                assert np.abs(acc[sent]).min(initial=np.inf) >= np.sort(np.abs(acc))[n - k] or len(sent) < k
        else:
            t = F32(threshold)
            assert set(np.unique(dec["w"])) <= {F32(0), t, -t}
            assert np.array_equal(dec["w"] == t, acc >= t) and np.array_equal(dec["w"] == -t, acc <= -t)
        total_sent += dec["w"]
        total_grad += g["w"]
    if name in ("topk", "2bit"):  # error feedback: nothing is lost, only delayed
        assert np.allclose(total_sent + comp.residuals.get("w", 0), total_grad, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(ENCODINGS), st.integers(1, 300), st.integers(0, 2**32 - 1), st.integers(1, 700))
def test_partitions_carry_the_whole_tensors_encoding_piece_by_piece(name, n, seed, partition_bytes):
    """docs/protocol-partitions.md: each partition's pieces decoded and put back together are the whole push's decoded
    tensors, bit for bit, and the residuals are the whole push's (top-k: entries chosen over the whole tensor)."""
    from shared.partitions import plan
    from shared.shards import spec_of
    spec = C.Spec(name, 0.1, 0.5)
    rng = np.random.default_rng(seed)
    whole, cut = C.Compressor(spec), C.Compressor(spec)
    model = {"w": np.zeros(n, F32), "m": np.zeros((3, 7), F32), "d": np.zeros(5, np.float64)}
    p = plan(spec_of(model), partition_bytes)
    for step in range(3):
        g = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.items()}
        want = {k: C.dense(v) for k, v in C.decode_push(spec, name, whole.encode(g, step), model)[0].items()}
        parts = cut.encode_partitions(g, p, step)
        assert [sorted(t) for t in parts] == [list(p.keys[q]) for q in range(p.count)]
        got = {k: np.empty_like(v) for k, v in model.items()}
        for q, wire in enumerate(parts):
            for key, piece in C.decode_push(spec, name, wire, p.split(model, q))[0].items():
                np.copyto(p.split(got, q)[key], C.dense(piece))
        assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
        assert {k: v.tobytes() for k, v in cut.residuals.items()} == {k: v.tobytes() for k, v in whole.residuals.items()}


@pytest.mark.parametrize("n,k", [(2_000_000, 1), (2_000_000, 2000), (2_000_000, 20000), (1000, 10)])
def test_top_k_is_exact_on_the_pruned_path(n, k):
    x = np.random.default_rng(n + k).standard_normal(n).astype(F32)
    x[::7] = 0  # ties at zero
    want = np.sort(np.argpartition(np.abs(x), n - k)[n - k:])
    got = C.top_k(x, k)
    assert got.dtype == np.uint32 and np.array_equal(np.sort(np.abs(x[got])), np.sort(np.abs(x[want])))
    assert np.all(np.diff(got.astype(np.int64)) > 0)


def test_topk_warmup_sends_more_first_then_the_ratio():
    """PS_COMPRESSION_TOPK_WARMUP_STEPS: density falls geometrically from 25 % at step 0 to the ratio at step W, then
    stays; the push's step (its weights') picks k, so a retried push (same step) sends the same k."""
    spec = C.Spec("topk", 0.01, topk_warmup_steps=100)
    assert spec.density(0) == C.WARMUP_START and spec.density(100) == spec.density(10**9) == 0.01
    assert spec.density(-1) == 0.01  # a step the worker does not know: the ratio
    assert abs(spec.density(50) - (0.25 * 0.01) ** 0.5) < 1e-12
    ds = [spec.density(s) for s in range(101)]
    assert all(a > b for a, b in zip(ds, ds[1:]))
    assert C.Spec("topk", 0.5, topk_warmup_steps=100).density(0) == 0.5  # a ratio above the start: no warm-up
    assert C.Spec("topk", 0.01).density(0) == 0.01  # W = 0: off
    comp, g = C.Compressor(spec), {"w": np.random.default_rng(0).standard_normal(10_000).astype(F32)}
    assert [comp.encode(g, step)["w"].shape[1] for step in (0, 50, 99, 100, 5000)] == [2500, 500, 104, 100, 100]
    assert C.Spec.from_wire(spec.to_wire()) == spec and C.Spec.from_wire({"name": "topk"}).topk_warmup_steps == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            C.Spec.from_wire({"name": "topk", "topk_warmup_steps": bad})
    # the worker's transport encodes with the step of the push's weights
    t = BodyTransport(endpoint=None, spec=spec)
    sent = [frame.decode(b"".join(bytes(b) for b in t.push_body({"step": s}, g))) for s in (0, 100)]
    assert [f.tensors["w"].shape for f in sent] == [(2, 2500), (2, 100)] and sent[0].meta["step"] == 0


def test_mxnet_2bit_layout():
    """MXNet's bytes: 4 codes per byte, the first in the high bits; 0b11 = +t, 0b10 = -t; 16 per word."""
    y = np.array([0.6, -0.7, 0.1, 0.5, -0.5, 0.49, 0, 2.0, -3.0], F32)
    words = C.quantize_2bit(y.copy(), F32(0.5))
    assert words.dtype == np.uint32 and words.shape == (1,)
    assert bytes(words.view(np.uint8)) == bytes([0b11100011, 0b10000011, 0b10000000, 0])


@pytest.mark.parametrize("n", [1, 15, 16, 17, scan.CHUNK - 1, scan.CHUNK, scan.CHUNK + 1, 3 * scan.CHUNK + 7])
def test_2bit_in_chunks_is_the_whole_array_at_once(n):
    """quantize_2bit works chunk by chunk: its words and the residual are those of the whole-array formula."""
    x = np.random.default_rng(n).standard_normal(n).astype(F32)
    t = F32(0.5)
    flat = x.copy()
    pos, neg = flat >= t, flat <= -t
    codes = np.zeros(-(-n // 16) * 16, np.uint8)
    codes[:n] = pos.view(np.uint8) * np.uint8(3) + neg.view(np.uint8) * np.uint8(2)
    q = codes.reshape(-1, 4)
    want = ((q[:, 0] << 6) | (q[:, 1] << 4) | (q[:, 2] << 2) | q[:, 3]).view(np.uint32)
    flat -= (pos.view(np.int8) - neg.view(np.int8)).astype(F32) * t
    residual = x.copy()
    got = C.quantize_2bit(residual, t)
    assert got.dtype == np.uint32 and np.array_equal(got, want)
    assert np.array_equal(residual.view(np.uint32), flat.view(np.uint32))


def test_2bit_code_01_is_refused_at_every_place_of_a_word_and_no_other_code_is():
    t = F32(0.5)
    for j in range(16):  # element 4 * b + (3 - i) of the word sits in bits 8 * b + 2 * i
        for code, refused in ((0b01, True), (0b10, False), (0b11, False)):
            wire = np.array([0xFFFFFFFF, code << (2 * j)], np.uint32)  # word 0 all +t: valid beside it
            if refused:
                with pytest.raises(ProtocolError) as e:
                    C.dequantize_2bit(wire, (32,), t, "w")
                assert e.value.code == "bad_encoding"
            else:
                got = C.dequantize_2bit(wire, (32,), t, "w")
                assert (got[:16] == t).all() and np.count_nonzero(got[16:]) == 1


def test_nonfinite():
    spec = C.Spec("topk", 0.01)
    comp = C.Compressor(spec)
    g = np.ones(1000, F32)
    g[500] = np.nan
    dec = {k: C.dense(v) for k, v in C.decode_push(spec, "topk", comp.encode({"w": g}), {"w": g})[0].items()}
    assert np.isnan(dec["w"][500])  # sent, so the PS refuses (or skips) it ...
    assert not comp.residuals["w"].any()  # ... and the residual does not keep poison
    with pytest.raises(C.NonFiniteGradient):
        C.Compressor(C.Spec("2bit")).encode({"w": g})
    big = np.array([1e6, np.inf], F32)
    assert np.isinf(C.Compressor(C.Spec("fp16")).encode({"w": big})["w"]).all()  # fp16 overflows: the PS refuses it


def known_finite(spec, wire, model) -> bool:
    return C.decode_push(spec, spec.name, wire, model)[1]


def test_known_finite_only_when_every_tensor_is_top_k_with_finite_values_or_2_bit():
    """The PS skips its dense NaN/Inf check of a decoded push only when the encoding makes it finite."""
    g = {"w": np.arange(1000, dtype=F32), "b": np.ones(10, F32)}
    for name, expected in (("topk", True), ("2bit", True), ("bf16", False), ("fp16", False)):
        spec = C.Spec(name, 0.01, 0.5)
        assert known_finite(spec, C.Compressor(spec).encode(g), g) is expected, name
    topk = C.Spec("topk", 0.01)
    bad = {**g, "w": g["w"].copy()}
    bad["w"][7] = np.inf
    assert not known_finite(topk, C.Compressor(topk).encode(bad), g)
    mixed = {**g, "b": np.ones(10, np.float64)}  # a float64 tensor travels uncompressed: the core checks it
    assert not known_finite(topk, C.Compressor(topk).encode(mixed), mixed)


# ---- hostile compressed tensors -----------------------------------------------------------------------------
def test_hostile_tensors_are_422():
    model = {"w": np.zeros((4, 5), F32)}
    topk, two = C.Spec("topk", 0.1), C.Spec("2bit")
    u = lambda *rows: np.array(rows, np.uint32)  # noqa: E731
    val = lambda *v: np.array(v, F32).view(np.uint32)  # noqa: E731
    cases = [
        (topk, {"w": np.zeros((4, 5), F32)}),  # dense float32 in a topk job
        (topk, {"w": u([1, 2], [3, 4], [5, 6])}),  # three rows
        (topk, {"w": np.zeros((2, 21), np.uint32)}),  # k > n
        (topk, {"w": u([3, 20], val(1, 2))}),  # index out of range
        (topk, {"w": u([3, 3], val(1, 2))}),  # duplicate
        (topk, {"w": u([4, 3], val(1, 2))}),  # not increasing
        (topk, {"w": np.zeros((2, 2), np.int32)}),  # int32
        (two, {"w": np.zeros(1, np.uint32)}),  # 20 elements need 2 words
        (two, {"w": np.array([0x40, 0], np.uint32)}),  # code 0b01
        (two, {"w": np.array([0, 0x00C00000], np.uint32)}),  # padding: element 22 set
        (C.Spec("bf16"), {"w": np.zeros((4, 5), np.float16)}),  # fp16 in a bf16 job
        (C.Spec("fp16"), {"w": np.zeros((5, 4), np.float16)}),  # wrong shape
    ]
    for spec, tensors in cases:
        assert refused(C.decode_push, spec, spec.name, tensors, model).code == "bad_encoding", (spec, tensors)
    ok = C.decode_push(two, "2bit", {"w": np.array([0xC0, 0x000000C0], np.uint32)}, model)[0]["w"].reshape(-1)
    assert ok[0] == 0.5 and ok[16] == 0.5 and np.count_nonzero(ok) == 2
    stray = {"w": u([0], val(1)), "zz": np.zeros(2, F32)}  # a name the model lacks: left to the core
    assert C.decode_push(topk, "topk", stray, model)[0]["zz"] is stray["zz"]
    for spec, declared in [(topk, None), (topk, "2bit"), (C.Spec(), "topk")]:
        assert refused(C.decode_push, spec, declared, {}, model).code == "compression_mismatch"
    assert refused(C.check_declared, topk, "topk", via_body=False).code == "compression_mismatch"  # same-host
    C.check_declared(topk, None, via_body=False)
    with pytest.raises(ValueError):
        C.Spec("zip")


# ---- live: a real PS, two workers ---------------------------------------------------------------------------
SHAPES = {"b": (3,), "w": (40, 25)}
LR = 0.1


@pytest.mark.parametrize("name", ENCODINGS)
def test_live_ps_applies_the_decoded_gradients_exactly(name):
    rng = np.random.default_rng(7)
    init = grads_of(rng, SHAPES)
    settings_ = dict(compression=name, compression_topk_ratio=0.05, compression_2bit_threshold=0.25,
                     compression_topk_warmup_steps=2, total_num_replicas=2, startup_grace_seconds=0.0, shm_dir="", aggregation="mean")
    with live_ps(**settings_) as ps:
        workers = [ps.client() for _ in range(2)]
        regs = [c.register(f"w{i}") for i, c in enumerate(workers)]
        assert regs[0]["compression"]["name"] == name and regs[0]["compression"]["topk_ratio"] == 0.05
        assert regs[0]["compression"]["topk_warmup_steps"] == 2
        assert workers[0].init_model(init, {"name": "sgd", "learning_rate": LR})
        sent: list[list[dict]] = [[], []]
        for i, c in enumerate(workers):
            c.attach(regs[i]["worker_id"])
            encode = c.tensors.current.compressor.encode_partitions  # (one partition: the whole push)
            c.tensors.current.compressor.encode_partitions = (lambda g, plan, step, encode=encode, i=i:
                                                      sent[i].append(encode(g, plan, step)[0]) or [sent[i][-1]])
        weights = {k: v.copy() for k, v in init.items()}
        for step in range(4):
            for i, c in enumerate(workers):
                assert c.pull(step, regs[i]["worker_id"], 5.0).step == step
                assert c.push(regs[i]["worker_id"], step, grads_of(rng, SHAPES), 1.0, 8)["status"] == "accepted"
            # replay: decode what each rank sent, sum in rank order, mean, w -= g * lr (float32)
            decoded = [C.decode_push(C.Spec(name, 0.05, 0.25), name, sent[i][step], init)[0] for i in (0, 1)]
            for k in weights:
                acc = C.dense(decoded[0][k]).copy()
                acc += C.dense(decoded[1][k])
                acc /= 2
                weights[k] -= acc * F32(LR)
        final = workers[0].pull(4, regs[0]["worker_id"], 5.0)
        assert final.step == 4
        for k in weights:
            assert np.array_equal(final.tensors[k], weights[k]), k
        status = ps.http().get("/v1/status").json()
        assert status["compression"]["name"] == name and status["global_step"] == 4
        if name == "topk":  # warm-up: 25 % of w's 1,000 entries on step 0, sqrt(0.25 * 0.05) on step 1, then 5 %
            assert [sent[0][s]["w"].shape[1] for s in range(4)] == [250, 112, 50, 50]
        # a push in another encoding, or a malformed one, is 422 and changes nothing
        before = state_hash(ps.rt)
        wid = regs[0]["worker_id"]
        with ps.http() as h:
            for meta, tensors, code in [({}, init, "compression_mismatch"),
                                        ({"compression": "none"}, init, "compression_mismatch"),
                                        ({"compression": name}, {**init, "w": np.zeros((1, 1), np.uint32)},
                                         "bad_encoding")]:
                r = h.post("/v1/gradients", content=push_frame(wid, 4, tensors, **meta),
                           headers={"content-type": "application/x-syncps-frame"})
                assert (r.status_code, r.json()["error"]) == (422, code), r.text
            if name != "2bit":  # a NaN in what the push carries (2 bits cannot carry one) is found, decoded or not
                bad = grads_of(rng, SHAPES)
                next(iter(bad.values())).reshape(-1)[1] = np.nan
                wire = C.Compressor(C.Spec(name, 0.05, 0.25)).encode(bad)
                r = h.post("/v1/gradients", content=push_frame(wid, 4, wire, compression=name),
                           headers={"content-type": "application/x-syncps-frame"})
                assert (r.status_code, r.json()["error"]) == (422, "nonfinite_gradient"), r.text
        assert state_hash(ps.rt) == before
        for c in workers:
            c.close()


def test_uncompressed_job_refuses_a_compressed_push():
    with live_ps(startup_grace_seconds=0.0, shm_dir="") as ps:
        c = ps.client()
        reg = c.register("w0")
        assert reg["compression"]["name"] == "none"
        c.init_model({"w": np.zeros(4, F32)}, {"name": "sgd"})
        c.attach(reg["worker_id"])
        assert c.pull(0, reg["worker_id"], 5.0).step == 0
        with ps.http() as h:
            body = push_frame(reg["worker_id"], 0, {"w": np.zeros(4, bfloat16())}, compression="bf16")
            r = h.post("/v1/gradients", content=body, headers={"content-type": "application/x-syncps-frame"})
            assert (r.status_code, r.json()["error"]) == (422, "compression_mismatch")
            r = h.post("/v1/gradients", content=push_frame(reg["worker_id"], 0, {"w": np.zeros(4, F32)}, compression=3),
                       headers={"content-type": "application/x-syncps-frame"})
            assert (r.status_code, r.json()["error"]) == (400, "bad_field")
        c.close()


def test_same_host_worker_stays_uncompressed_in_a_compressed_job(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    w0 = {"w": np.zeros(64, F32)}
    with live_ps(compression="2bit", compression_2bit_threshold=0.25, shm_dir=str(shm_dir), min_workers=2,
                 startup_grace_seconds=0.0, lease_seconds=600) as ps:
        a, b = ps.client(shm_dir=str(shm_dir)), ps.client()  # b: request bodies, compressed
        wa, wb = a.register("a")["worker_id"], b.register("b")["worker_id"]
        assert a.init_model(w0, {"name": "sgd", "learning_rate": 1.0})
        assert a.attach(wa) == "shm" and b.attach(wb) == "http+2bit"
        assert a.pull(0, wa, 5.0).step == 0 and b.pull(0, wb, 5.0).step == 0
        ga, gb = np.full(64, 0.1, F32), np.full(64, -0.3, F32)
        assert a.push(wa, 0, {"w": ga})["status"] == "accepted"  # float32 through the file
        assert b.push(wb, 0, {"w": gb})["status"] == "accepted"  # -0.3 <= -0.25: sent as -0.25
        got = b.pull(1, wb, 5.0)
        want = w0["w"] - (ga + np.full(64, -0.25, F32)) / 2 * F32(1.0)
        assert got.step == 1 and np.array_equal(got.tensors["w"], want)
        assert np.allclose(b.tensors.current.compressor.residuals["w"], -0.05)
        a.close()
        b.close()
