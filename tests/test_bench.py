"""The speed work: the benchmark runner and task, the zero-copy codec paths, push-and-wait, and the
in-place, arrival-order-independent aggregation of large bodies (bit-identical to the reference)."""
from __future__ import annotations

import json
import random
import subprocess
import socket
import sys
import threading

import msgpack
import numpy as np
import pytest

from bench.task import BenchLinearTask, actual_params, model_dims
from shared.codec import decode_tensors, encode_tensors, pack, pack_parts, unpack, unpack_view
from shared.errors import ProtocolError
from shared.protocol import MSGPACK, PUSH_STATUS_HEADER
from tests.clusters import run_job
from tests.live_ps import live_ps, raw_exchange, read_response, state_hash


def test_bench_run_prints_the_anchor_fields():
    out = subprocess.run([sys.executable, "-m", "bench.run", "--workers", "2", "--params", "4", "--seconds", "1",
                          "--warmup", "0.3"], capture_output=True, text=True, timeout=120)
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, line
    assert line["system"] == "syncps" and line["workers"] == 2 and line["params"] == 4
    assert line["steps_per_s"] > 0 and line["steps"] > 0 and line["peak_rss_MB"] > 0
    assert line["grad_MB_per_s"] == pytest.approx(2 * 4 * 4 / 1e6 * line["steps_per_s"], abs=1e-3)


@pytest.mark.parametrize("p,dims", [(4, (3, 1)), (999, (998, 1)), (1_000_000, (999, 1000)),
                                    (10_000_000, (3161, 3162))])
def test_model_split_is_the_anchors(p, dims):
    assert model_dims(p) == dims and actual_params(p) == (dims[0] + 1) * dims[1]


def test_bench_gradient_is_the_loss_derivative():
    task = BenchLinearTask(40, seed=3, dtype="float64")
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((39, 1)), "b": rng.standard_normal(1)}
    x = task.batch(0, 0, 1, 32)

    def loss(p):
        err = x @ p["w"] + p["b"] - (x @ task.w_true + 0.4)
        return float(np.mean(err * err))
    _, grads, n = task.loss_and_grads(params, x)
    assert n == 32
    for name, i in (("w", (5, 0)), ("b", (0,))):
        bumped = {k: v.copy() for k, v in params.items()}
        bumped[name][i] += 1e-6
        assert grads[name][i] == pytest.approx((loss(bumped) - loss(params)) / 1e-6, rel=1e-4)


def _random_msgpack(rnd: random.Random, depth: int = 0):
    kind = rnd.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rnd.choice([None, True, False, 0, 127, 128, -32, -33, 65536, -2**40, 2**64 - 1, 1.5])
    if kind in (1, 2):
        return rnd.randrange(-2**63, 2**63)
    if kind == 3:
        return "".join(rnd.choice("ab€") for _ in range(rnd.choice([0, 31, 32, 300])))
    if kind in (4, 5):
        return rnd.randbytes(rnd.choice([0, 255, 256, 70_000]))
    if kind == 6:
        return [_random_msgpack(rnd, depth + 1) for _ in range(rnd.choice([0, 15, 16]))]
    return {f"k{i}": _random_msgpack(rnd, depth + 1) for i in range(rnd.choice([0, 15, 16]))}


def _plain(x):
    if isinstance(x, memoryview):
        return bytes(x)
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def test_zero_copy_unpack_agrees_with_msgpack_and_refuses_what_it_refuses():
    rnd = random.Random(7)
    for _ in range(60):
        body = msgpack.packb(_random_msgpack(rnd), use_bin_type=True)
        assert _plain(unpack_view(body)) == msgpack.unpackb(body, raw=False)
        for bad in (body[:len(body) // 2] if len(body) > 1 else b"", body + b"\x00"):
            with pytest.raises(ProtocolError) as err:
                unpack_view(bad)
            assert err.value.code == "bad_msgpack"
    for bad in (b"\xc1", msgpack.packb(msgpack.ExtType(5, b"x")), b"\x81\x01\x02", b"\xdd\xff\xff\xff\xff",
                b"\x91" * 40 + b"\x01"):
        with pytest.raises(ProtocolError):
            unpack_view(bad)


def test_pack_parts_is_msgpack_with_aligned_large_payloads():
    rnd = random.Random(3)
    for _ in range(40):
        arrays = {"t" * rnd.randint(1, 9) + str(i): np.arange(rnd.choice([3, 20_000, 70_000]),
                                                              dtype=rnd.choice(["<f4", "<f8"]))
                  for i in range(rnd.randint(1, 3))}
        obj = {"worker_id": "w" * rnd.randint(0, 40), "step": rnd.randint(0, 10**6), "tensors": encode_tensors(arrays)}
        body = b"".join(pack_parts(obj))
        assert msgpack.unpackb(body) == msgpack.unpackb(pack(obj))
        landed = np.empty(len(body), np.uint8)
        memoryview(landed)[:] = body
        out = decode_tensors(unpack(memoryview(landed))["tensors"])
        for name, arr in out.items():
            np.testing.assert_array_equal(arr, arrays[name])
            assert arr.nbytes < 65536 or (arr.flags.aligned and np.shares_memory(arr, landed))


def test_push_and_wait_answers_the_next_weights_in_one_round_trip():
    size = 20_000  # 80 KB per push: the body is received into the PS's own buffer and summed in place
    with live_ps(min_workers=2, total_num_replicas=2) as ps:
        clients = [ps.client() for _ in range(2)]
        ids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        clients[0].init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        grads = [np.full(size, 1.0 + i, np.float32) for i in range(2)]
        answers = [None, None]

        def push(i):
            clients[i].push_wait = 10.0
            answers[i] = clients[i].push(ids[i], 0, {"w": grads[i]})

        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [a["status"] for a in answers] == ["accepted", "accepted"] and all(a["step"] == 1 for a in answers)
        for c in clients:
            pulled = c.pull(1, wait=0.0)  # the weights came with the push: no request
            assert pulled.step == 1 and pulled.tensors["w"].flags.aligned
            np.testing.assert_array_equal(pulled.tensors["w"], np.full(size, -1.5, np.float32))
        with ps.http() as http:  # the plain push answer is unchanged without ?pull=1
            body = pack({"worker_id": ids[0], "step": 0, "tensors": encode_tensors({"w": grads[0]})})
            r = http.post("/v1/gradients", content=body, headers={"content-type": MSGPACK})
            assert r.json() == {"status": "duplicate", "step": 1, "done": False}
            r = http.post("/v1/gradients", params={"pull": 1, "timeout": 1}, content=body,
                          headers={"content-type": MSGPACK})
            assert r.headers["content-type"] == MSGPACK and r.headers[PUSH_STATUS_HEADER] == "duplicate"
            assert unpack(r.content)["step"] == 1
        for c in clients:
            c.close()


def test_large_gradients_arriving_in_any_order_give_the_reference_weights():
    """3 workers, float64, 2,000 x 10 weights (160 KB bodies): in-place, rank-order folding is bit-identical."""
    workers, steps, params = 3, 12, 20_010
    job = run_job(workers, {"PS_MAX_STEPS": steps},
                  {"WORKER_TASK": f"bench.task:params_{params}", "WORKER_DTYPE": "float64", "WORKER_SEED": 5})
    assert job.exit_codes == [0] * workers and job.status["global_step"] == steps
    task = BenchLinearTask(params, seed=5, dtype="float64")
    weights = task.init_params()
    for _ in range(steps):
        total = None
        for rank in range(workers):
            _, g, _ = task.loss_and_grads(weights, task.batch(0, rank, workers, 32))
            total = {k: v.copy() for k, v in g.items()} if total is None else {k: total[k] + g[k] for k in g}
        for k in weights:
            weights[k] = weights[k] - np.float64(0.5) * (total[k] / workers)
    for k in weights:
        assert job.tensors[k].tobytes() == weights[k].tobytes(), f"{k}: not bit-identical"


def _big_push_head(port: int, length: int) -> bytes:
    return (f"POST /v1/gradients HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {MSGPACK}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_large_bodies_through_the_sink_are_refused_cleanly():
    """Bodies the protocol writes into the route's buffer: a stalled one gets 408, an abandoned one
    400 or a closed connection, and neither touches the state; the PS trains on afterwards."""
    size = 50_000  # 200 KB pushes
    with live_ps(total_num_replicas=1, body_idle_timeout_seconds=1.0, lease_seconds=600) as ps:
        client = ps.client()
        wid = client.register("w")["worker_id"]
        client.init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        before = state_hash(ps.rt)
        body = pack({"worker_id": wid, "step": 0, "tensors": encode_tensors({"w": np.ones(size, np.float32)})})
        status, reply = raw_exchange(ps.port, _big_push_head(ps.port, len(body)) + body[:150_000])
        assert status == 408 and b"body_timeout" in reply
        status, _ = raw_exchange(ps.port, _big_push_head(ps.port, len(body) + 10) + body, shutdown=True)
        assert status in (None, 400)
        assert state_hash(ps.rt) == before
        assert client.push(wid, 0, {"w": np.ones(size, np.float32)})["status"] == "accepted"
        np.testing.assert_array_equal(client.pull(1, wait=5.0).tensors["w"], np.full(size, -1.0, np.float32))
        client.close()


def test_large_bodies_are_read_from_the_socket_straight_into_the_sink(monkeypatch):
    """Once the route's sink exists, the socket is read into it and the parser sees none of those bytes;
    the keep-alive connection then carries the next requests through a fresh parser."""
    from ps_service import bodysink
    parsed = []
    original = bodysink.SinkHttpToolsProtocol.on_body
    monkeypatch.setattr(bodysink.SinkHttpToolsProtocol, "on_body", lambda self, b: (parsed.append(len(b)), original(self, b)))
    size, steps = 2_000_000, 4  # 8 MB pushes
    with live_ps(total_num_replicas=1, lease_seconds=600) as ps:
        client = ps.client()  # one keep-alive connection for every tensor call
        wid = client.register("w")["worker_id"]
        client.init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        parsed.clear()
        for step in range(steps):
            assert client.push(wid, step, {"w": np.full(size, step, np.float32)})["status"] == "accepted"
            assert client.pull(step + 1, wid, wait=5.0).step == step + 1
        np.testing.assert_array_equal(client.pull(steps, wait=5.0).tensors["w"], np.full(size, -6.0, np.float32))
        assert sum(parsed) < steps * size * 4 / 2, f"{sum(parsed)} of {steps * size * 4} body bytes went through the parser"
        client.close()


def test_a_body_refused_halfway_keeps_its_connection_framed():
    """The parser missed the part of a body read straight into the sink: when the route gives up on that
    body (408 here), the rest is still read past the parser, so the next request on the connection parses."""
    size = 50_000  # a 200 KB push
    with live_ps(total_num_replicas=1, body_idle_timeout_seconds=0.5, lease_seconds=600) as ps:
        client = ps.client()
        wid = client.register("w")["worker_id"]
        client.init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        body = pack({"worker_id": wid, "step": 0, "tensors": encode_tensors({"w": np.ones(size, np.float32)})})
        with socket.create_connection(("127.0.0.1", ps.port), timeout=10) as s:
            s.sendall(_big_push_head(ps.port, len(body)) + body[:150_000])
            status, reply = read_response(s)
            assert status == 408 and b"body_timeout" in reply
            s.sendall(body[150_000:] + f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{ps.port}\r\n\r\n".encode())
            assert read_response(s) == (200, b'{"status":"ok"}')
        assert client.push(wid, 0, {"w": np.ones(size, np.float32)})["status"] == "accepted"
        client.close()


def test_a_parsed_body_is_freed_without_the_cyclic_gc():
    """Views into a body keep it alive only while they live (a parser cycle once held 40 MB bodies)."""
    import gc
    import weakref
    body = np.zeros(200_000, np.uint8)
    packed = pack({"tensors": encode_tensors({"w": np.ones(20_000, np.float32)})})
    body[:len(packed)] = np.frombuffer(packed, np.uint8)
    alive = weakref.ref(body)
    gc.disable()
    try:
        tensors = decode_tensors(unpack(memoryview(body)[:len(packed)])["tensors"])
        assert tensors["w"].sum() == 20_000
        del body, tensors
        assert alive() is None
    finally:
        gc.enable()


def test_the_raw_client_reads_a_refusal_sent_before_the_body_ended():
    """A 20 MB body over the PS's limit: the PS answers 413 at the headers and stops reading; the client
    reports that answer instead of a broken connection."""
    with live_ps(total_num_replicas=1, max_body_bytes=1 << 20) as ps:
        client = ps.client()
        with pytest.raises(ProtocolError) as err:
            client.init_model({"w": np.zeros(5_000_000, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        assert (err.value.status, err.value.code) == (413, "body_too_large")
        client.close()
