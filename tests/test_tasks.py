"""worker_service/tasks: a task may bring an optimizer for the job's mode (``optimizer_for``); the built-in linear
task's defaults train in every mode (async and SSP apply each gradient on its own: the sync rate 0.5 diverged)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.clusters import run_job
from worker_service.tasks import optimizer_for
from worker_service.tasks.linear import LinearTask


def test_a_task_brings_the_spec_of_the_jobs_mode_when_it_takes_one():
    task = LinearTask(seed=0, dtype="float32")
    assert optimizer_for(task, "sync") == {"name": "sgd", "learning_rate": 0.5}
    assert optimizer_for(task, "async") == optimizer_for(task, "ssp") == {"name": "sgd", "learning_rate": 0.1}

    class Plain:  # a user's task whose optimizer() takes no mode: asked as before
        def optimizer(self):
            return {"name": "adam", "learning_rate": 0.01}

    assert optimizer_for(Plain(), "async") == {"name": "adam", "learning_rate": 0.01}


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_the_default_linear_job_converges_in_async_and_ssp(mode):
    """4 workers, default settings but the mode (as `PS_MODE=async docker compose up` runs it): every worker exits
    0 and the weights reach the task's solution (before: 3 of 4 workers stopped on 422 nonfinite_gradient)."""
    job = run_job(4, {"PS_MODE": mode, "PS_MAX_STEPS": 600, "PS_SHM_DIR": ""}, {"WORKER_TASK": "linear"})
    assert job.exit_codes == [0, 0, 0, 0] and job.status["optimizer"]["learning_rate"] == 0.1
    np.testing.assert_allclose(job.tensors["w"].reshape(-1), [0.1, 0.2, 0.3], atol=1e-4)
    np.testing.assert_allclose(job.tensors["b"].reshape(-1), [0.4], atol=1e-4)
