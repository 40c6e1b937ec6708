"""The proof that the barrier is right: N synchronous workers (real processes, real PS) end with
exactly the weights of one process doing the same large-batch training on the concatenated batches, 0 ulp in
float32 and float64: given the same per-shard gradients, which the replay computes with the workers' BLAS
threads (tests/reference.py: a product split between threads rounds otherwise, here from ~33k parameters)."""
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from tests.clusters import run_job
from tests.reference import train_reference, worker_blas_threads

CASES = [
    # task, dtype, workers, steps, transport (local workers use the same-host one unless told otherwise)
    *[("linear", "float64", n, 40, "shm") for n in (1, 2, 4)],
    *[("linear", "float32", n, 40, "shm") for n in (1, 2, 4)],
    *[("mlp", "float64", n, 25, "shm") for n in (1, 2, 4)],
    ("linear", "float64", 4, 40, "http"),
    ("linear", "float32", 4, 40, "http"),
    ("mlp", "float64", 2, 25, "http"),
    #: 1e5 parameters (16 x 315 x 316 products: OpenBLAS splits them between 2 threads, the workers run 1)
    ("bench.task:params_100000", "float32", 2, 3, "shm"),
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
        assert got.tobytes() == ref[k].tobytes(), f"{k}: not bit-identical (0 ulp)"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_replay_computes_with_the_workers_blas_threads_whatever_its_process_runs(dtype):
    """The 1e5-parameter replay called from a process whose BLAS runs 2 threads gives the bits of one run with 1
    (a stock worker's; with 2 threads there 87,187 (float32) and 76,546 (float64) of the 99,540 weights differ)."""
    assert worker_blas_threads({}) == 1 and worker_blas_threads({"OPENBLAS_NUM_THREADS": "3"}) == 3
    runs = []
    for threads in (2, 1):
        with threadpool_limits(threads, "blas"):
            runs.append(train_reference("bench.task:params_100000", 2, 3, batch_size=16, seed=7, dtype=dtype)[1])
    assert all(runs[0][k].tobytes() == runs[1][k].tobytes() for k in runs[1])
