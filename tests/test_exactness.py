"""The proof that the barrier is right: N synchronous workers (real processes, real PS) end with
exactly the weights of one process doing the same large-batch training on the concatenated batches."""
import numpy as np
import pytest

from tests.clusters import run_job
from tests.reference import train_reference

CASES = [
    # task, dtype, workers, steps, transport (local workers use the same-host one unless told otherwise)
    *[("linear", "float64", n, 40, "shm") for n in (1, 2, 4)],
    *[("linear", "float32", n, 40, "shm") for n in (1, 2, 4)],
    *[("mlp", "float64", n, 25, "shm") for n in (1, 2, 4)],
    ("linear", "float64", 4, 40, "http"),
    ("linear", "float32", 4, 40, "http"),
    ("mlp", "float64", 2, 25, "http"),
]
#: partitioned rounds (docs/partitions.md): the stock worker's whole pushes, cut by the PS into ~10 partitions of the
#: mlp (w1 in 8 slices), summed and applied one by one
PARTITIONED = [("mlp", "float64", 4, 25, "http"), ("mlp", "float64", 4, 25, "shm")]


@pytest.mark.parametrize("task,dtype,workers,steps,transport,partition_bytes",
                         [(*c, 0) for c in CASES] + [(*c, 4096) for c in PARTITIONED], ids=lambda v: str(v))
def test_sync_workers_equal_single_process(task, dtype, workers, steps, transport, partition_bytes):
    job = run_job(workers, {"PS_MAX_STEPS": steps, **({"PS_PARTITION_BYTES": partition_bytes} if partition_bytes else {})},
                  {"WORKER_TASK": task, "WORKER_DTYPE": dtype, "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16,
                   **({"WORKER_SHM_DIR": ""} if transport == "http" else {})})
    assert {w["transport"] for w in job.workers} == {transport}
    assert job.exit_codes == [0] * workers
    assert job.status["global_step"] == steps
    assert all(w["pushes"]["accepted"] == steps for w in job.workers)
    _, ref = train_reference(task, workers, steps, batch_size=16, seed=7, dtype=dtype)
    assert job.tensors.keys() == ref.keys()
    for k in ref:
        got = job.tensors[k]
        assert got.dtype == np.dtype(dtype)
        if dtype == "float64":
            assert got.tobytes() == ref[k].tobytes(), f"{k}: not bit-identical (0 ulp)"
        else:
            np.testing.assert_allclose(got, ref[k], rtol=1e-6, atol=0)
