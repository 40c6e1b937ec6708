"""Partitioned pushes through a real PS (uvicorn on loopback, tests/live_ps.py) and its TCP receiver: a push body of
a head and Q partition frames (docs/protocol-partitions.md) gives the core one call per frame, and a job of
such pushes ends with the weights, optimizer slots and iteration count of the same job pushed whole at
PS_PARTITION_BYTES=0, bit for bit (SGD and Adam; Q = 1, 2, 4; float32 and float64 tensors, one cut across
partitions). A whole push to a partitioned PS is cut by the PS (the same bits); a malformed partitioned push is
refused 4xx JSON and changes nothing; PS_PARTITION_BYTES is refused at start where it is not built."""
from __future__ import annotations

import json
import socket

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


def one_push(bodies) -> tuple[list[tuple[int, str | None]], dict[str, bytes], int]:
    """A one-worker job at Q = 4 sent ``bodies(meta, parts)`` in turn for step 0: each answer (status, error code),
    then the weights and slots, and the global step."""
    size = size_for(4)
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=size) as ps:
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


@pytest.mark.parametrize("other", [{"mode": "async"}, {"mode": "ssp"}, {"compression": "bf16"},
                                   {"nonfinite_policy": "skip"}, {"role": "standby", "peer_url": "http://x:1"}])
def test_partition_bytes_is_refused_where_it_is_not_built(other):
    with pytest.raises(ValidationError, match="PS_PARTITION_BYTES"):
        PSSettings(partition_bytes=1024, **other)
    PSSettings(partition_bytes=0, **other)


def test_a_partitioned_push_reaches_the_core_frame_by_frame_as_it_arrives():
    """The first 6 MB of a 12 MB push (1 MB partitions) are in the core, their partitions closed and applied, while
    the rest of the body has not been sent."""
    big = {"w": np.linspace(-1, 1, 3_000_000, dtype=np.float32)}
    size = 1 << 20
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=size) as ps:
        c = ps.client()
        wid = c.register("w")["worker_id"]
        assert c.init_model(big, OPTIMIZERS["sgd"])
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        p = plan(spec_of(big), size)
        assert p.count == 12
        g = {"w": np.full(3_000_000, 0.5, np.float32)}
        body = partitioned_body({"worker_id": wid, "step": 0}, g, size)
        head = (f"POST {API}/gradients HTTP/1.1\r\nhost: x\r\ncontent-type: {frame.MEDIA_TYPE}\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(20)) as s:
            s.sendall(head + body[:6 << 20])
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
        c.close()


def test_the_workers_body_transport_sends_the_documented_frames():
    from worker_service.transport.http import BodyTransport
    size, g, meta = size_for(4), gradient(1, 0), {"worker_id": "x", "step": 1}
    body = b"".join(bytes(b) for b in BodyTransport(None, partition_bytes=size).push_body(meta, g))
    assert body == partitioned_body(meta, g, size)
    assert b"".join(bytes(b) for b in BodyTransport(None).push_body(meta, g)) == frame.encode_bytes(g, meta)
