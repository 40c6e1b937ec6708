"""Real jobs against the libraries a user would run instead, over many steps: 4 stock workers (processes, a real PS)
train 200 steps and end with the weights of

- TensorFlow's own ``tf.compat.v1.train`` optimizer, given the same gradients step by step (each computed on
  TensorFlow's own weights, summed in rank order and divided by the count, as the PS does), bit for bit
  (docs/concepts/barrier.md, Optimizers: SGD, momentum, Nesterov and Adam, float32 and float64), over TCP and same-host
  files, on one PS and on 2 and 4 shards, with partitioned rounds whose partitions cut tensors, and at 1e5
  parameters, where every answer is large enough for the worker's reused answer buffers and the PS's pooled frames;
- ``torch.optim`` stepping one torch process (tests/reference.py's ``train_torch_reference``) on the cnn task: SGD,
  momentum and Nesterov (with weight decay) bit for bit, Adam within tests/test_torch_exactness.py's 1e-6 (the PS's
  square root is correctly rounded, torch's CPU one is not: docs/torch.md), over TCP and same-host files, with
  partitioned rounds and on 2 shards.

Off unless ``SYNCPS_OUTSIDE`` is set: every case is a whole job of 200 rounds, minutes in all, too slow for
``make test``; the TensorFlow cases also need ``SYNCPS_TF_PYTHON``, a Python that has ``tensorflow`` (tests/tf_apply.py
runs there; the project's venv has none)::

    python -m venv ~/.cache/syncps-anchors/tf && ~/.cache/syncps-anchors/tf/bin/pip install tensorflow-cpu
    SYNCPS_OUTSIDE=1 SYNCPS_TF_PYTHON=~/.cache/syncps-anchors/tf/bin/python python -m pytest tests/test_outside_exactness.py
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from ps_service.core.optimizers import normalize_spec
from tests.clusters import run_job
from tests.reference import large_batch_gradient, worker_blas_threads
from tests.tf_apply import read, write
from tests.timing import allow
from worker_service.tasks import load_task

TF_PYTHON = os.environ.get("SYNCPS_TF_PYTHON", "")
pytestmark = pytest.mark.skipif(not os.environ.get("SYNCPS_OUTSIDE"), reason="SYNCPS_OUTSIDE is not set (slow)")

STEPS, WORKERS, BATCH, SEED = 200, 4, 16, 7
OPTIMIZERS = {
    "sgd": {"PS_OPTIMIZER": "sgd", "PS_LEARNING_RATE": 0.1},
    "momentum": {"PS_OPTIMIZER": "momentum", "PS_LEARNING_RATE": 0.05, "PS_MOMENTUM": 0.9, "PS_NESTEROV": "false"},
    "nesterov": {"PS_OPTIMIZER": "momentum", "PS_LEARNING_RATE": 0.05, "PS_MOMENTUM": 0.9, "PS_NESTEROV": "true"},
    "adam": {"PS_OPTIMIZER": "adam", "PS_LEARNING_RATE": 0.01},
}
BIG = "bench.task:params_100000"
#: (task, dtype, optimizer, transport, shards, partition bytes)
CASES = [
    *[("linear", dtype, opt, "http", 1, 0) for dtype in ("float32", "float64") for opt in OPTIMIZERS],
    *[("mlp", dtype, opt, transport, 1, 0) for dtype, opt in (("float32", "adam"), ("float64", "nesterov"))
      for transport in ("http", "shm")],
    *[("mlp", dtype, opt, "http", shards, 0) for dtype, opt in (("float32", "adam"), ("float64", "nesterov"))
      for shards in (2, 4)],
    *[("mlp", dtype, opt, transport, shards, 4096) for dtype, opt in (("float32", "adam"), ("float64", "momentum"))
      for transport, shards in (("http", 1), ("shm", 1), ("http", 2), ("http", 4))],
    #: 1e5 parameters (400 KB in float32): every answer, and every shard's at S = 4, over rawhttp's 64 KiB threshold,
    #: so the worker's answer buffers and the PS's pooled frames are taken again and again
    *[(BIG, "float32", "adam", "http", shards, partition_bytes) for shards in (1, 2, 4) for partition_bytes in (0, 65536)],
    *[(BIG, "float64", "nesterov", transport, 1, partition_bytes) for transport in ("http", "shm")
      for partition_bytes in (0, 65536)],
]


def tensorflow_replay(task_name: str, dtype: str, spec: dict) -> tuple[dict[str, np.ndarray], str]:
    """TensorFlow's weights after STEPS steps of the job's large-batch training (and its version)."""
    task = load_task(task_name, SEED, dtype)
    weights = {k: np.array(v) for k, v in sorted(task.init_params().items())}
    tf = subprocess.Popen([TF_PYTHON, str(Path(__file__).with_name("tf_apply.py"))], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        write(tf.stdin, {**weights, "spec": np.array(json.dumps(spec))})
        version = str(read(tf.stdout)["tensorflow"])
        with threadpool_limits(worker_blas_threads(), "blas"):
            for step in range(STEPS):
                write(tf.stdin, large_batch_gradient(task, weights, step, WORKERS, BATCH))
                weights = read(tf.stdout)
        return weights, version
    finally:
        tf.stdin.close()
        tf.wait(allow(60))


@pytest.mark.parametrize("task,dtype,optimizer,transport,shards,partition_bytes", CASES, ids=lambda v: str(v))
def test_a_job_ends_with_tensorflows_weights(task, dtype, optimizer, transport, shards, partition_bytes):
    if not TF_PYTHON:
        pytest.skip("SYNCPS_TF_PYTHON (a Python with tensorflow) is not set")
    ps_env = {"PS_MAX_STEPS": STEPS, **OPTIMIZERS[optimizer],
              **({"PS_PARTITION_BYTES": partition_bytes} if partition_bytes else {}),
              **({"PS_SHARD_SPLIT_ELEMENTS": 64 if task != BIG else 4096} if shards > 1 else {})}
    job = run_job(WORKERS, ps_env, {"WORKER_TASK": task, "WORKER_DTYPE": dtype, "WORKER_SEED": SEED,
                                    "WORKER_BATCH_SIZE": BATCH, **({"WORKER_SHM_DIR": ""} if transport == "http" else {})},
                  deadline=600.0, shards=shards)
    assert job.exit_codes == [0] * WORKERS and job.status["global_step"] == STEPS
    assert {w["transport"] for w in job.workers} == ({transport} if shards == 1 else {job.workers[0]["transport"]})
    assert all(w["pushes"]["accepted"] == STEPS for w in job.workers)
    spec = normalize_spec(job.status["optimizer"])
    want, version = tensorflow_replay(task, dtype, spec)
    assert job.tensors.keys() == want.keys()
    differ = {k: int(np.count_nonzero(job.tensors[k] != want[k])) for k in want}
    print(json.dumps({"case": [task, dtype, optimizer, transport, shards, partition_bytes], "tensorflow": version,
                      "transports": sorted({w["transport"] for w in job.workers}), "elements_differing": differ}))
    for k in want:
        assert job.tensors[k].dtype == np.dtype(dtype)
        assert job.tensors[k].tobytes() == want[k].tobytes(), f"{k}: {differ[k]} elements differ from TensorFlow's"


TORCH = {"sgd": "tests.torch_tasks:cnn_plain_sgd", "momentum": "tests.torch_tasks:cnn_momentum",
         "nesterov": "tests.torch_tasks:cnn_sgd", "adam": "tests.torch_tasks:cnn_smooth"}
#: (optimizer, dtype, transport, shards, partition bytes)
TORCH_CASES = [
    *[("nesterov", dtype, transport, 1, 0) for dtype in ("float32", "float64") for transport in ("http", "shm")],
    ("sgd", "float32", "http", 1, 0), ("momentum", "float32", "http", 1, 0), ("adam", "float32", "http", 1, 0),
    ("nesterov", "float32", "http", 1, 4096), ("nesterov", "float32", "shm", 1, 4096),
    ("nesterov", "float32", "http", 2, 0), ("nesterov", "float32", "http", 2, 4096),
]
TORCH_BATCH = 8


@pytest.mark.parametrize("optimizer,dtype,transport,shards,partition_bytes", TORCH_CASES, ids=lambda v: str(v))
def test_a_torch_job_ends_with_torch_optims_weights(optimizer, dtype, transport, shards, partition_bytes):
    from tests.reference import train_torch_reference
    from tests.torch_util import one_thread, run_forked_job

    one_thread()
    task = TORCH[optimizer]
    worker_env = {"WORKER_TASK": task, "WORKER_DTYPE": dtype, "WORKER_SEED": SEED, "WORKER_BATCH_SIZE": TORCH_BATCH,
                  **({"WORKER_SHM_DIR": ""} if transport == "http" else {})}
    if shards == 1:
        job = run_forked_job(WORKERS, {"max_steps": STEPS, "partition_bytes": partition_bytes}, worker_env,
                             deadline=900.0)
    else:
        job = run_job(WORKERS, {"PS_MAX_STEPS": STEPS, "PS_SHARD_SPLIT_ELEMENTS": 64,
                                **({"PS_PARTITION_BYTES": partition_bytes} if partition_bytes else {})},
                      worker_env, deadline=900.0, shards=shards)
    assert job.exit_codes == [0] * WORKERS and job.status["global_step"] == STEPS
    assert job.status["optimizer"]["flavor"] == "torch"
    assert all(w["pushes"]["accepted"] == STEPS for w in job.workers)
    want = train_torch_reference(task, WORKERS, STEPS, TORCH_BATCH, SEED, dtype)
    assert job.tensors.keys() == want.keys()
    differ = {k: int(np.count_nonzero(job.tensors[k] != want[k])) for k in want}
    worst = max(float(np.linalg.norm(job.tensors[k] - want[k]) / np.linalg.norm(want[k])) for k in want)
    print(json.dumps({"case": ["torch", optimizer, dtype, transport, shards, partition_bytes],
                      "transports": sorted({w["transport"] for w in job.workers}),
                      "elements_differing": sum(differ.values()), "elements": sum(v.size for v in want.values()),
                      "max_relative_difference": worst}))
    for k in want:
        assert job.tensors[k].dtype == np.dtype(dtype)
        if optimizer == "adam":
            assert np.linalg.norm(job.tensors[k] - want[k]) <= 1e-6 * np.linalg.norm(want[k]), k
        else:
            assert job.tensors[k].tobytes() == want[k].tobytes(), f"{k}: {differ[k]} elements differ from torch's"


@pytest.mark.parametrize("compression", ["topk", "2bit"])
def test_a_compressed_job_ends_alike_with_and_without_partitions(compression):
    """docs/protocol-partitions.md: the values decoded, the residuals and the PS's weights are those of the same job at
    P = 0, bit for bit (every encoding is elementwise)."""
    ends = []
    for partition_bytes in (0, 4096):
        job = run_job(WORKERS, {"PS_MAX_STEPS": STEPS, "PS_COMPRESSION": compression, "PS_OPTIMIZER": "sgd",
                                "PS_LEARNING_RATE": 0.1,
                                **({"PS_PARTITION_BYTES": partition_bytes} if partition_bytes else {})},
                      {"WORKER_TASK": "mlp", "WORKER_DTYPE": "float32", "WORKER_SEED": SEED, "WORKER_BATCH_SIZE": BATCH,
                       "WORKER_SHM_DIR": ""}, deadline=600.0)
        assert job.exit_codes == [0] * WORKERS and job.status["global_step"] == STEPS
        assert job.status["compression"]["name"] == compression, job.status["compression"]
        assert all(w["pushes"]["accepted"] == STEPS for w in job.workers)
        ends.append(job.tensors)
    differ = {k: int(np.count_nonzero(ends[0][k] != ends[1][k])) for k in ends[0]}
    print(json.dumps({"case": ["compressed", compression, "P=0 against P=4096"], "elements_differing": differ}))
    assert all(ends[0][k].tobytes() == ends[1][k].tobytes() for k in ends[0]), differ
