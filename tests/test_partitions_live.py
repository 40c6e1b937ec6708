"""Partitioned pushes through a real PS (uvicorn on loopback, tests/live_ps.py) and its TCP receiver: a push body of
a head and Q partition frames (docs/protocol-partitions.md) gives the core one call per frame, and a job of
such pushes ends with the weights, optimizer slots and iteration count of the same job pushed whole at
PS_PARTITION_BYTES=0, bit for bit (SGD and Adam; Q = 1, 2, 4; float32 and float64 tensors, one cut across
partitions). A whole push to a partitioned PS is cut by the PS (the same bits); a malformed partitioned push is
refused 4xx JSON and changes nothing; PS_PARTITION_BYTES is refused at start where it is not built."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from cluster.processes import wait_for
from ps_service.core.partitions import plan
from ps_service.settings import PSSettings
from shared import frame
from shared.protocol import API
from shared.shards import spec_of
from tests.live_ps import live_ps, state_hash
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


def test_malformed_partitioned_pushes_are_refused_and_change_nothing():
    size = size_for(4)
    with live_ps(min_workers=1, startup_grace_seconds=0, partition_bytes=size) as ps:
        c = ps.client()
        wid = c.register("w")["worker_id"]
        assert c.init_model(weights0(), OPTIMIZERS["adam"])
        wait_for(lambda: ps.rt.core.started, allow(10), "training to start")
        meta, g = {"worker_id": wid, "step": 0}, gradient(0, 0)
        good = partitioned_body(meta, g, size)
        p = plan(spec_of(g), size)
        parts = [p.split(g, q) for q in range(p.count)]
        wrong_index = frame.encode_many([(parts[0], {**meta, "partitions": 4}), (parts[1], {"partition": 2}),
                                         (parts[2], {"partition": 2}), (parts[3], {"partition": 3})])
        too_few = frame.encode_many([(parts[0], {**meta, "partitions": 3}), (parts[1], {"partition": 1}),
                                     (parts[2], {"partition": 2})])
        cases = [
            (good[:-8], 400, "bad_frame"),  # the last frame cut short
            (good + bytes(64), 400, "bad_frame"),  # bytes after the last frame
            (b"".join(bytes(b) for b in wrong_index), 400, "bad_field"),
            (b"".join(bytes(b) for b in too_few), 422, "tensor_mismatch"),
            (frame.encode_bytes(parts[0], {**meta, "partitions": 0}), 400, "bad_field"),
            (frame.encode_bytes(parts[0], meta), 422, "tensor_mismatch"),  # partition 0 alone, not the model
        ]
        with ps.http() as http:
            before = state_hash(ps.rt)
            for body, status, code in cases:
                r = post(http, body)
                assert (r.status_code, r.json().get("error")) == (status, code), (code, r.text)
                assert state_hash(ps.rt) == before
            r = post(http, good)
            assert r.status_code == 200 and r.json() == {"status": "accepted", "step": 1, "done": False}
            assert post(http, good).json()["status"] == "duplicate"
        c.close()


@pytest.mark.parametrize("other", [{"mode": "async"}, {"mode": "ssp"}, {"compression": "bf16"},
                                   {"nonfinite_policy": "skip"}, {"role": "standby", "peer_url": "http://x:1"}])
def test_partition_bytes_is_refused_where_it_is_not_built(other):
    with pytest.raises(ValidationError, match="PS_PARTITION_BYTES"):
        PSSettings(partition_bytes=1024, **other)
    PSSettings(partition_bytes=0, **other)
