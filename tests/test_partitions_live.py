"""Partitioned pushes through a real PS (uvicorn on loopback, tests/live_ps.py) and its TCP receiver: a push body of
a head and Q partition frames (docs/protocol-partitions.md) gives the core one call per frame, and a job of
such pushes ends with the weights, optimizer slots and iteration count of the same job pushed whole at
PS_PARTITION_BYTES=0, bit for bit (SGD and Adam; Q = 1, 2, 4; float32 and float64 tensors, one cut across
partitions). A whole push to a partitioned PS is cut by the PS (the same bits); a malformed partitioned push is
refused 4xx JSON and changes nothing; PS_PARTITION_BYTES is refused at start where it is not built. With compression
(bf16, fp16, top-k, 2-bit) stock worker clients' partitioned pushes end with the bits of the same job at P = 0."""
from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from cluster.processes import wait_for
from shared.partitions import plan
from ps_service.settings import PSSettings
from shared import frame
from shared.protocol import API
from shared.shards import spec_of
from tests.live_ps import live_ps, read_response, state_hash
from tests.timing import allow

SHAPES = {"a": ((6, 5), "float32"), "b": ((41,), "float32"), "c": ((9,), "float64"), "d": ((3,), "float32")}
OPTIMIZERS = {"sgd": {"name": "sgd", "learning_rate": 0.1}, "adam": {"name": "adam", "learning_rate": 0.05}}
WORKERS, STEPS = 2, 4


def weights0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {k: rng.standard_normal(s).astype(d) for k, (s, d) in SHAPES.items()}


def gradient(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return {k: rng.standard_normal(s).astype(d) for k, (s, d) in SHAPES.items()}


def size_for(q: int) -> int:
    """The smallest partition size whose plan of the model has ``q`` partitions."""
    spec = spec_of(weights0())
    return next(b for b in range(1, 4096) if plan(spec, b).count == q)


def partitioned_body(meta: dict, grads: dict[str, np.ndarray], partition_bytes: int) -> bytes:
    """A push body of a head and the plan's Q partition frames (docs/protocol-partitions.md)."""
    p = plan(spec_of(grads), partition_bytes)
    parts = [p.split(grads, q) for q in range(p.count)]
    frames = [(parts[0], {**meta, "partitions": p.count})] + [(t, {"partition": q}) for q, t in enumerate(parts[1:], 1)]
    return b"".join(bytes(b) for b in frame.encode_many(frames))


def post(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post(f"{API}/gradients", content=body, headers={"content-type": frame.MEDIA_TYPE})


def run_job(optimizer: str, partition_bytes: int, partitioned: bool) -> dict[str, bytes]:
    """STEPS rounds of WORKERS pushes; the PS's weights, slots and iterations at the end."""
    with live_ps(min_workers=WORKERS, startup_grace_seconds=0, partition_bytes=partition_bytes) as ps:
        clients = [ps.client() for _ in range(WORKERS)]
        regs = [c.register(f"w{i}") for i, c in enumerate(clients)]
        assert all(r["partition_bytes"] == partition_bytes for r in regs)
        assert clients[0].init_model(weights0(), OPTIMIZERS[optimizer])
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        ids = {r["rank"]: r["worker_id"] for r in regs}
        with ps.http() as http:
            for step in range(STEPS):
                for rank, wid in sorted(ids.items()):
                    meta = {"worker_id": wid, "step": step, "loss": 1.0}
                    g = gradient(step, rank)
                    body = partitioned_body(meta, g, partition_bytes) if partitioned else frame.encode_bytes(g, meta)
                    r = post(http, body)
                    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
                assert ps.rt.core.global_step == step + 1 and not ps.rt.core.deciding
        core = ps.rt.core
        out = {f"w/{k}": v.tobytes() for k, v in core.weights.items()}
        out |= {f"{s}/{k}": v.tobytes() for s, t in core.optimizer.slots.items() for k, v in t.items()}
        for c in clients:
            c.close()
        return out | {"iterations": str(core.optimizer.iterations).encode()}


@pytest.fixture(scope="module")
def today() -> dict[str, dict[str, bytes]]:
    return {name: run_job(name, 0, False) for name in OPTIMIZERS}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("q", [1, 2, 4])
def test_partitioned_pushes_end_with_todays_bits(today, optimizer, q):
    size = size_for(q)
    assert plan(spec_of(weights0()), size).count == q
    assert run_job(optimizer, size, True) == today[optimizer]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_whole_push_to_a_partitioned_ps_is_cut_by_it(today, optimizer):
    assert run_job(optimizer, size_for(4), False) == today[optimizer]


def test_q_1_is_todays_push_byte_for_byte():
    g, meta = gradient(0, 0), {"worker_id": "x", "step": 0}
    assert partitioned_body(meta, g, 0) == frame.encode_bytes(g, {**meta, "partitions": 1})
    p = plan(spec_of(g), 0)
    assert p.count == 1 and p.whole


def one_push(bodies, **settings) -> tuple[list[tuple[int, str | None]], dict[str, bytes], int]:
    """A one-worker job at Q = 4 (and ``settings``) sent ``bodies(meta, parts)`` in turn for step 0: each answer
    (status, error code), then the weights and slots, and the global step."""
    size = size_for(4)
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=size, **settings) as ps:
        c = ps.client()
        wid = c.register("w")["worker_id"]
        assert c.init_model(weights0(), OPTIMIZERS["adam"])
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        g = gradient(0, 0)
        p = plan(spec_of(g), size)
        answers = []
        with ps.http() as http:
            for body, unchanged in bodies({"worker_id": wid, "step": 0}, [p.split(g, q) for q in range(p.count)]):
                before = state_hash(ps.rt)
                r = post(http, body)
                answers.append((r.status_code, r.json().get("error") or r.json().get("status")))
                assert not unchanged or state_hash(ps.rt) == before, answers[-1]
        core = ps.rt.core
        out = {f"w/{k}": v.tobytes() for k, v in core.weights.items()}
        out |= {f"{s}/{k}": v.tobytes() for s, t in core.optimizer.slots.items() for k, v in t.items()}
        c.close()
        return answers, out, core.global_step


def joined(frames) -> bytes:
    return b"".join(bytes(b) for b in frame.encode_many(frames))


def test_pushes_refused_at_their_head_change_nothing():
    def bodies(meta, parts):
        def head(q):
            return (parts[0], {**meta, "partitions": q})
        yield joined([head(3), *[(t, {"partition": q}) for q, t in enumerate(parts[1:3], 1)]]), True  # Q is 4
        yield frame.encode_bytes(parts[0], {**meta, "partitions": 0}), True
        yield frame.encode_bytes(parts[0], meta), True  # partition 0 alone is not the model
        yield joined([(parts[0], {**meta, "partitions": 4, "shm_seq": 1}),
                      *[(t, {"partition": q}) for q, t in enumerate(parts[1:], 1)]]), True
        yield joined([head(4), *[(t, {"partition": q}) for q, t in enumerate(parts[1:], 1)]]), False
    answers, _, step = one_push(bodies)
    assert answers == [(422, "tensor_mismatch"), (400, "bad_field"), (422, "tensor_mismatch"), (400, "bad_field"),
                       (200, "accepted")]
    assert step == 1


def test_partitions_1_given_is_a_push_of_one_frame():
    """docs/protocol-partitions.md: ``"partitions": 1`` (the default, said) is a push of one frame, not a Q other than
    the job's: whole tensors are taken, partition 0 alone is not the model."""
    def bodies(meta, parts):
        yield frame.encode_bytes(parts[0], {**meta, "partitions": 1}), True
        yield frame.encode_bytes(gradient(0, 0), {**meta, "partitions": 1}), False
    answers, _, step = one_push(bodies)
    assert answers == [(422, "tensor_mismatch"), (200, "accepted")] and step == 1


def test_a_push_refused_after_its_head_is_completed_by_sending_it_again():
    """Frames before a refused one stand; the push sent again is a duplicate whose missing frames are taken: the
    weights are those of the good push alone."""
    def good(meta, parts):
        yield joined([(parts[0], {**meta, "partitions": 4}), *[(t, {"partition": q}) for q, t in
                                                                 enumerate(parts[1:], 1)]]), False
    _, alone, _ = one_push(good)

    def bodies(meta, parts):
        frames = [(parts[0], {**meta, "partitions": 4}), *[(t, {"partition": q}) for q, t in enumerate(parts[1:], 1)]]
        whole = joined(frames)
        yield whole[:-8], False  # the last frame cut short: frames 0-2 taken
        yield whole + bytes(64), False  # bytes after the last frame: it is not taken
        yield joined([*frames[:2], (parts[2], {"partition": 3}), frames[3]]), False
        yield joined([*frames[:2], ({k: v.astype(np.float64) for k, v in parts[2].items()}, {"partition": 2}),
                      frames[3]]), False
        yield whole, False
    answers, after, step = one_push(bodies)
    assert answers == [(400, "bad_frame"), (400, "bad_frame"), (400, "bad_field"), (422, "tensor_mismatch"),
                       (200, "duplicate")]
    assert step == 1 and after == alone


def test_a_compressed_partitioned_push_is_refused_for_its_encoding():
    """bf16 job: a head declaring another encoding, or whose pieces are not bf16, changes nothing; a later frame that
    is not bf16 is refused after its head and the frames before it were taken, in a chunked body (fed whole once read)
    as in one taken as it arrives, and the push sent again (chunked) completes it."""
    from shared.compression import Compressor, Spec

    def bodies(meta, parts):
        def push(heads_meta, encoded):
            return joined([(encoded[0], {**meta, **heads_meta, "partitions": 4}),
                           *[(t, {"partition": q}) for q, t in enumerate(encoded[1:], 1)]])
        bf16 = Compressor(Spec("bf16")).encode_partitions(gradient(0, 0), plan(spec_of(weights0()), size_for(4)))
        yield push({}, parts), True  # declares none
        yield push({"compression": "fp16"}, bf16), True
        yield push({"compression": "bf16"}, [parts[0], *bf16[1:]]), True  # the head's pieces are not bf16
        bad = push({"compression": "bf16"}, [*bf16[:2], parts[2], bf16[3]])  # frame 2 is not
        yield iter([bad]), False  # chunked: the head and frame 1 taken
        yield bad, False  # as it arrives: the same (both duplicate now)
        yield iter([push({"compression": "bf16"}, bf16)]), False  # chunked: frame 2 completes the round
    answers, _, step = one_push(bodies, compression="bf16", shm_dir="")
    assert answers == [(422, "compression_mismatch"), (422, "compression_mismatch"), (422, "bad_encoding"),
                       (422, "bad_encoding"), (422, "bad_encoding"), (200, "duplicate")]
    assert step == 1


@pytest.mark.parametrize("other", [{"mode": "async"}, {"mode": "ssp"},
                                   {"nonfinite_policy": "skip"}, {"role": "standby", "peer_url": "http://x:1"}])
def test_partition_bytes_is_refused_where_it_is_not_built(other):
    with pytest.raises(ValidationError, match="PS_PARTITION_BYTES"):
        PSSettings(partition_bytes=1024, **other)
    PSSettings(partition_bytes=0, **other)


@contextmanager
def one_worker_job(big: dict[str, np.ndarray], size: int):
    """A live PS with ``size``-byte partitions, its model ``big`` (SGD) and one worker registered: (the PS, its id)."""
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=size) as ps:
        c = ps.client()
        wid = c.register("w")["worker_id"]
        assert c.init_model(big, OPTIMIZERS["sgd"])
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        yield ps, wid
        c.close()


def push_head(body: bytes) -> bytes:
    """The request head of a raw ``POST /v1/gradients`` of ``body``."""
    return (f"POST {API}/gradients HTTP/1.1\r\nhost: x\r\ncontent-type: {frame.MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()


def test_a_partitioned_push_reaches_the_core_frame_by_frame_as_it_arrives():
    """The first 6 MB of a 12 MB push (1 MB partitions) are in the core, their partitions closed and applied, while
    the rest of the body has not been sent."""
    big = {"w": np.linspace(-1, 1, 3_000_000, dtype=np.float32)}
    size = 1 << 20
    with one_worker_job(big, size) as (ps, wid):
        p = plan(spec_of(big), size)
        assert p.count == 12
        g = {"w": np.full(3_000_000, 0.5, np.float32)}
        body = partitioned_body({"worker_id": wid, "step": 0}, g, size)
        with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(20)) as s:
            s.sendall(push_head(body) + body[:6 << 20])
            core = ps.rt.core
            wait_for(lambda: core.parts is not None and {1, 2} <= core.parts.closed, allow(10),
                     "partitions 1 and 2 to close before the body's end")
            assert core.global_step == 0 and core.deciding
            w = core.weights["w"]
            assert w[0] == np.float32(-1) - np.float32(0.05) and w[-1] == np.float32(1)  # 0 and 1 applied, 11 not
            s.sendall(body[6 << 20:])
            status, answer = read_response(s)
        assert status == 200 and json.loads(answer) == {"status": "accepted", "step": 1, "done": False}
        np.testing.assert_array_equal(core.weights["w"], big["w"] - np.float32(0.1) * np.float32(0.5))


def test_each_frame_is_taken_once_its_last_byte_is_in():
    """The PS is woken at each frame's end, not only every 4 MiB of body: of a 2.4 MB push in 3 frames, the first two
    sent and nothing more (1.6 MB), partition 1 closes and is applied while the last frame is not sent."""
    big = {"w": np.linspace(-1, 1, 600_000, dtype=np.float32)}
    size = 1 << 20
    with one_worker_job(big, size) as (ps, wid):
        body = partitioned_body({"worker_id": wid, "step": 0}, {"w": np.full(600_000, 0.5, np.float32)}, size)
        reader = frame.FrameReader()
        assert len(reader.feed(body, len(body), 2)) == 2  # the first two frames end at reader.end
        with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(20)) as s:
            s.sendall(push_head(body) + body[:reader.end])
            core, stepped = ps.rt.core, np.float32(big["w"][200_000] - 0.05)
            # (read from this thread while the PS's applies it: the partition is closed, then its update runs)
            wait_for(lambda: core.parts is not None and 1 in core.parts.closed
                     and core.weights["w"][200_000] == stepped, allow(10), "partition 1 to close and be applied before the body's end")
            assert core.global_step == 0
            s.sendall(body[reader.end:])
            status, answer = read_response(s)
        assert status == 200 and json.loads(answer)["step"] == 1


def test_the_workers_body_transport_sends_the_documented_frames():
    from worker_service.transport.http import BodyTransport
    size, g, meta = size_for(4), gradient(1, 0), {"worker_id": "x", "step": 1}
    body = b"".join(bytes(b) for b in BodyTransport(None, partition_bytes=size).push_body(meta, g))
    assert body == partitioned_body(meta, g, size)
    assert b"".join(bytes(b) for b in BodyTransport(None).push_body(meta, g)) == frame.encode_bytes(g, meta)


# ---- compression (docs/partitions.md, Modes, compression ...): stock workers over TCP ------------------------------
CODECS = ("bf16", "fp16", "topk", "2bit")
#: the model of the compressed jobs: w (4000 bytes) cut into 4 slices of 250 elements at COMPRESSED_BYTES, one a
#: partition; a, b (compressed) and c (float64, never compressed) whole in the head
COMPRESSED = {"a": ((6, 5), "float32"), "b": ((41,), "float32"), "c": ((9,), "float64"), "w": ((40, 25), "float32")}
COMPRESSED_BYTES = 1024


def compressed_gradient(step: int, rank: int) -> dict[str, np.ndarray]:
    """w's third slice (rows 20-29: elements 500-749) small, so top-k, chosen over the whole of w, sends none there."""
    rng = np.random.default_rng(1000 + 100 * step + rank)
    g = {k: rng.standard_normal(s).astype(d) for k, (s, d) in COMPRESSED.items()}
    g["w"][20:30] *= np.float32(1e-4)
    return g


def stock_job(codec: str, partition_bytes: int) -> tuple[dict[str, bytes], list[bytes]]:
    """WORKERS stock worker clients (PSClient, its body transport over loopback TCP, one thread each) push STEPS
    steps of :func:`compressed_gradient` under ``codec`` (rank 0 partitioned as the job says, rank 1 one frame each):
    the PS's weights and iteration count at the end, and rank 0's push bodies."""
    rng = np.random.default_rng(5)
    w0 = {k: rng.standard_normal(s).astype(d) for k, (s, d) in COMPRESSED.items()}
    with live_ps(min_workers=WORKERS, startup_grace_seconds=0, partition_bytes=partition_bytes, shm_dir="",
                 compression=codec, compression_topk_ratio=0.05, compression_2bit_threshold=0.25,
                 compression_topk_warmup_steps=2) as ps:
        clients = [ps.client() for _ in range(WORKERS)]
        regs = [c.register(f"w{i}") for i, c in enumerate(clients)]
        assert clients[0].init_model(w0, OPTIMIZERS["sgd"])
        bodies: list[bytes] = []
        for i, c in enumerate(clients):
            c.attach(regs[i]["worker_id"])
            assert c.tensors.name == f"http+{codec}"
        clients[1].tensors.current.partition_bytes = 0  # rank 1's pushes go whole: the PS decodes and cuts them
        t0 = clients[0].tensors.current
        push_body = t0.push_body
        t0.push_body = lambda meta, g: bodies.append(b"".join(map(bytes, push_body(meta, g)))) or [bodies[-1]]
        errors: list[BaseException] = []

        def work(rank: int) -> None:
            c, wid = clients[rank], regs[rank]["worker_id"]
            try:
                for step in range(STEPS):
                    assert c.pull(step, wid, allow(10)).step == step
                    assert c.push(wid, step, compressed_gradient(step, rank))["status"] == "accepted"
            except BaseException as exc:  # noqa: BLE001 (raised in the test's thread)
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(r,)) for r in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(allow(30))
        assert not errors, errors
        wait_for(lambda: ps.rt.core.global_step == STEPS and not ps.rt.core.deciding, allow(10), "the last round")
        core = ps.rt.core
        assert (1 if core.partitions is None else core.partitions.count) == (5 if partition_bytes else 1)
        assert all(not np.array_equal(core.weights[k], w0[k]) for k in w0)
        out = {k: v.tobytes() for k, v in core.weights.items()} | {"iterations": str(core.optimizer.iterations).encode()}
        for c in clients:
            c.close()
        return out, bodies


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_partitioned_pushes_end_with_the_bits_of_p_0(codec):
    """Stock workers' compressed pushes: at P = 0 one frame each; at P > 0 rank 0's a head and 4 partition frames, each
    piece encoded (top-k's entries chosen over the whole of w: none in its small third slice), decoded by the PS
    partition by partition, and rank 1's one frame, decoded and cut by the PS. The final weights are the same bits."""
    whole, flat = stock_job(codec, 0)
    cut, parts = stock_job(codec, COMPRESSED_BYTES)
    assert cut == whole
    p = plan({k: (s, d) for k, (s, d) in COMPRESSED.items()}, COMPRESSED_BYTES)
    assert p.count == 5 and len(flat) == len(parts) == STEPS
    for one, body in zip(flat, parts):
        assert frame.decode(one).meta["compression"] == codec
        frames = frame.decode_following(body, p.count)
        assert frames[0].meta["compression"] == codec and frames[0].meta["partitions"] == p.count
        assert [sorted(f.tensors) for f in frames] == [list(p.keys[q]) for q in range(p.count)]
        assert frames[0].tensors["c"].dtype == np.float64  # never compressed
        if codec == "topk":
            assert frames[3].tensors["w[500:750]"].shape == (2, 0)
