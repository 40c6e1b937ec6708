"""End to end on loopback: a real uvicorn PS and real worker processes train the built-in tasks."""
import numpy as np
import pytest

from tests.clusters import run_job
from tests.reference import train_reference
from worker_service.tasks import load_task


@pytest.mark.parametrize("workers", [2, 4])
def test_linear_converges_to_the_true_weights(workers):
    job = run_job(workers, {"PS_MAX_STEPS": 100}, {"WORKER_TASK": "linear"})
    assert job.exit_codes == [0] * workers
    st = job.status
    assert st["state"] == "done" and st["global_step"] == 100
    assert st["optimizer"] == {"name": "sgd", "learning_rate": 0.5}
    assert st["pushes"]["accepted"] == 100 * workers and st["pushes"]["stale"] == 0
    assert sorted(w["rank"] for w in job.workers) == list(range(workers))
    np.testing.assert_allclose(job.tensors["w"].ravel(), [0.1, 0.2, 0.3], atol=1e-3)
    np.testing.assert_allclose(job.tensors["b"], [0.4], atol=1e-3)
    assert st["loss"]["last"] < 1e-6


def test_mlp_reaches_the_single_process_accuracy():
    steps, workers = 800, 4
    job = run_job(workers, {"PS_MAX_STEPS": steps}, {"WORKER_TASK": "mlp"}, deadline=180)
    assert job.exit_codes == [0] * workers
    assert job.status["optimizer"]["name"] == "adam" and job.status["optimizer"]["learning_rate"] == 0.001
    task = load_task("mlp")
    acc = task.evaluate(job.tensors)["accuracy"]
    # the same model trained in one process on the same global batches (4 x 32)
    _, ref = train_reference("mlp", workers, steps, batch_size=32, dtype="float32")
    ref_acc = task.evaluate(ref)["accuracy"]
    assert acc == pytest.approx(ref_acc, abs=1e-9)
    assert acc >= 0.95


def test_ps_optimizer_setting_wins_over_the_task():
    job = run_job(2, {"PS_MAX_STEPS": 200, "PS_OPTIMIZER": "momentum", "PS_LEARNING_RATE": 0.1}, {"WORKER_TASK": "linear"})
    assert job.status["optimizer"] == {"name": "momentum", "learning_rate": 0.1, "momentum": 0.9, "nesterov": False}
    np.testing.assert_allclose(job.tensors["w"].ravel(), [0.1, 0.2, 0.3], atol=1e-3)
