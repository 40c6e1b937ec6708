"""torch models on syncps against one torch process: N synchronous workers (processes running the stock worker
with a torch task, a real uvicorn PS) end with the weights of one process doing the same large-batch
training with the same ``torch.optim`` optimizer stepping the model (``tests/reference.py``,
``train_torch_reference``). 100 steps, batch 8 per worker, the PS running torch's formulas.

- SGD (Nesterov momentum, weight decay) on the ``cnn`` task's CNN: bit-identical in float64 and float32.
- Adam in float32, within 1e-6 relative, on the CNN with tanh and average pooling (``cnn_smooth``). The PS's
  sqrt is correctly rounded and torch's CPU sqrt is not (tests/test_torch_optim.py: with torch's sqrt the
  formulas are bit-identical), so the runs start 1 ulp apart; a model whose gradient jumps (ReLU, max-pool)
  can turn such a difference into a different decision at one unit and the runs part for good (seen at
  step 59 of ``cnn`` with N = 2: 5e-4), exactly as two torch runs that sum the batch in two orders part
  (``cnn``, N = 4, batch 32: 6e-5). docs/torch.md has the measurements.
- Adam on the ``cnn`` task itself in float64: within 1e-12 relative.
"""
import numpy as np
import pytest

from tests.reference import train_torch_reference
from tests.torch_util import one_thread, run_forked_job

STEPS, BATCH, SEED = 100, 8, 3
SGD, SMOOTH = "tests.torch_tasks:cnn_sgd", "tests.torch_tasks:cnn_smooth"  # factories returning a TorchJob
CASES = [*[(SGD, "float64", n) for n in (1, 2, 4)], *[(SGD, "float32", n) for n in (1, 2, 4)],
         *[(SMOOTH, "float32", n) for n in (1, 2, 4)], ("cnn", "float64", 4)]
TOLERANCE = {SMOOTH: 1e-6, "cnn": 1e-12}


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("task,dtype,workers", CASES, ids=lambda v: str(v).rsplit(":", 1)[-1])
def test_torch_workers_equal_one_torch_process(task, dtype, workers):
    one_thread()
    job = run_forked_job(workers, {"max_steps": STEPS},
                         {"WORKER_TASK": task, "WORKER_DTYPE": dtype, "WORKER_SEED": SEED, "WORKER_BATCH_SIZE": BATCH})
    assert job.exit_codes == [0] * workers
    assert all(w["pushes"]["accepted"] == STEPS for w in job.workers)
    assert job.status["optimizer"]["flavor"] == "torch"
    ref = train_torch_reference(task, workers, STEPS, BATCH, SEED, dtype)
    assert job.tensors.keys() == ref.keys()
    for name, want in ref.items():
        got = job.tensors[name]
        assert got.dtype == np.dtype(dtype)
        if task == SGD:
            assert got.tobytes() == want.tobytes(), f"{name}: not bit-identical"
        else:
            assert relative(got, want) <= TOLERANCE[task], name
            assert np.abs(got - want).max() <= TOLERANCE[task] * np.abs(want).max(), name
    if (task, dtype, workers) == (SGD, "float64", 4):  # one backward pass over the concatenated batch instead
        concatenated = train_torch_reference(task, workers, STEPS, BATCH, SEED, dtype, concatenated=True)
        assert all(relative(job.tensors[k], v) <= 1e-12 for k, v in concatenated.items())
