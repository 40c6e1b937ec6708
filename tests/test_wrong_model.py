"""A worker whose task's model is not the PS's (a PS restored from the checkpoint of another task: WORKER_TASK
changed in .env) stops at once with a message that says what to do, instead of a KeyError traceback in a restart
loop, or "done" with another model's weights evaluated (worker_service/loop.py, check_model)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.live_ps import live_ps
from tests.timing import allow
from worker_service.loop import WrongModel, train
from worker_service.tasks import load_task

OTHER = {"w1": np.zeros((64, 32), np.float32), "b1": np.zeros(32, np.float32)}  # not the linear task's model


@pytest.mark.parametrize("max_steps", [None, 0], ids=["training", "done"])
def test_a_worker_on_another_models_ps_stops_with_what_to_do(max_steps):
    with live_ps(lease_seconds=600, startup_grace_seconds=0, max_steps=max_steps) as ps:
        c = ps.client()
        assert c.init_model(OTHER, {"name": "sgd"})
        with pytest.raises(WrongModel) as err:
            train(ps.client(), load_task("linear"), "w", 8)
        assert "tensors missing: ['b', 'w']" in str(err.value) and "docker compose down -v" in str(err.value)
        with ps.http() as h:
            st = h.get("/v1/status").json()
        assert st["global_step"] == 0 and st["pushes"]["accepted"] == 0
        assert [m.state for m in ps.rt.core.members.by_id.values()] == ["left"]  # it left on its way out
        c.close()


def test_another_dtype_is_another_model():
    """WORKER_DTYPE changed on an old checkpoint: the same names and shapes in float64 are not a float32 task's."""
    with live_ps(lease_seconds=600, startup_grace_seconds=0) as ps:
        c = ps.client()
        assert c.init_model(load_task("linear", dtype="float64").init_params(), {"name": "sgd"})
        with pytest.raises(WrongModel) as err:
            train(ps.client(), load_task("linear", dtype="float32"), "w", 8)
        assert "float64 (the task's: " in str(err.value) and "float32)" in str(err.value), err.value
        c.close()


def test_the_worker_process_exits_3_and_says_so():
    with live_ps(lease_seconds=600, startup_grace_seconds=0) as ps:
        c = ps.client()
        assert c.init_model(OTHER, {"name": "sgd"})
        env = {**os.environ, "WORKER_PS_URL": ps.url, "WORKER_TASK": "linear", "WORKER_NAME": "w"}
        done = subprocess.run([sys.executable, "-m", "worker_service"], env=env, capture_output=True, text=True,
                              timeout=allow(120))
        c.close()
    assert done.returncode == 3, done.stderr[-2000:]
    assert "WORKER_TASK=linear: the PS's model is not this task's model" in done.stderr
    assert "Traceback" not in done.stderr
