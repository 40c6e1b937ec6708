"""worker_service/prefetch.py: the next batch drawn while the round is out, handed over only for the place guessed."""
import json
import threading

import numpy as np
import pytest

from cluster.processes import LocalCluster
from tests.clusters import final_weights, wait_for
from tests.reference import train_reference
from tests.timing import allow
from worker_service.prefetch import BatchAhead
from worker_service.settings import WorkerSettings


class Recorder:
    """A task's ``batch`` that records its calls (args, thread) and how many ran at once."""

    def __init__(self, fail_at: int | None = None, hold: threading.Event | None = None) -> None:
        self.calls: list[tuple[tuple, str]] = []
        self.fail_at, self.hold = fail_at, hold
        self.running = self.most = 0
        self.lock = threading.Lock()

    def batch(self, step, position, count, batch_size):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.calls.append(((step, position, count, batch_size), threading.current_thread().name))
        try:
            if self.hold is not None and step == 1:
                self.hold.wait(0.3)  # nobody sets it: a guess still running while get() decides
            if step == self.fail_at:
                raise RuntimeError(f"no data for step {step}")
            return ("batch", step, position, count)
        finally:
            with self.lock:
                self.running -= 1


def test_a_right_guess_is_drawn_once_in_the_prefetch_thread_and_handed_over():
    task = Recorder()
    ahead = BatchAhead(task, 8)
    assert ahead.get(0, 1, 2) == ("batch", 0, 1, 2)  # nothing guessed yet: drawn here
    ahead.ahead(1, 1, 2)
    assert ahead.get(1, 1, 2) == ("batch", 1, 1, 2)
    ahead.close()
    assert [c[0] for c in task.calls] == [(0, 1, 2, 8), (1, 1, 2, 8)]
    assert task.calls[0][1] == threading.current_thread().name and task.calls[1][1].startswith("prefetch")
    assert (ahead.used, ahead.dropped) == (1, 0)


@pytest.mark.parametrize("real", [(2, 0, 2), (1, 0, 3), (1, 1, 2)], ids=["step", "count", "position"])
def test_a_wrong_guess_is_dropped_and_the_real_place_drawn(real):
    task = Recorder()
    ahead = BatchAhead(task, 4)
    ahead.ahead(1, 0, 2)
    assert ahead.get(*real) == ("batch", *real)
    ahead.close()
    assert [c[0] for c in task.calls] == [(1, 0, 2, 4), (*real, 4)]
    assert (ahead.used, ahead.dropped) == (0, 1)


def test_the_error_of_a_used_guess_is_raised_and_that_of_a_dropped_one_forgotten():
    ahead = BatchAhead(Recorder(fail_at=1), 4)
    ahead.ahead(1, 0, 1)
    with pytest.raises(RuntimeError, match="no data for step 1"):
        ahead.get(1, 0, 1)
    ahead.ahead(1, 0, 1)
    assert ahead.get(2, 0, 1) == ("batch", 2, 0, 1)
    ahead.close()


def test_a_dropped_guess_still_running_ends_before_batch_is_called_again():
    task = Recorder(hold=threading.Event())
    ahead = BatchAhead(task, 4)
    ahead.ahead(1, 0, 2)
    assert ahead.get(2, 0, 2) == ("batch", 2, 0, 2)
    ahead.close()
    assert task.most == 1, "the task's batch ran twice at once"


def test_disabled_by_the_setting_or_by_the_task():
    class OptsOut(Recorder):
        prefetch = False

    on = BatchAhead(Recorder(), 4)
    assert on._pool is not None
    on.close()
    for task, enabled in ((Recorder(), False), (OptsOut(), True)):
        ahead = BatchAhead(task, 4, enabled)
        assert ahead._pool is None
        ahead.ahead(1, 0, 1)
        assert ahead.get(1, 0, 1) == ("batch", 1, 0, 1)
        ahead.close()
        assert [c[1] for c in task.calls] == [threading.current_thread().name]
    assert WorkerSettings().prefetch is True
    assert WorkerSettings(_env_file=None, prefetch="0").prefetch is False


@pytest.mark.parametrize("prefetch", ["1", "0"])
def test_a_job_with_and_without_prefetch_ends_with_the_one_process_weights(prefetch):
    """2 workers over HTTP, mlp float64: the same bits as one process; with prefetch every step but the first of
    each worker used the batch drawn while its previous round was out."""
    steps = 12
    with LocalCluster(2, ps_env={"PS_MAX_STEPS": steps},
                      worker_env={"WORKER_TASK": "mlp", "WORKER_DTYPE": "float64", "WORKER_SEED": 7,
                                  "WORKER_BATCH_SIZE": 16, "WORKER_SHM_DIR": "", "WORKER_PREFETCH": prefetch}) as c:
        try:
            assert c.wait_workers(allow(120)) == [0, 0]
            wait_for(lambda: c.status()["state"] == "done", allow(10), "the PS to report done")
            got = final_weights(c)
            summaries = [json.loads(line.removeprefix("SUMMARY ")) for p in sorted(c.log_dir.glob("worker*.log"))
                         for line in p.read_text().splitlines() if line.startswith("SUMMARY ")]
        except BaseException:
            c.mark_failed()
            raise AssertionError(f"job failed; logs in {c.log_dir}:\n{c.logs(1500)}")
    _, ref = train_reference("mlp", 2, steps, batch_size=16, seed=7, dtype="float64")
    assert got.keys() == ref.keys() and all(got[k].tobytes() == ref[k].tobytes() for k in ref)
    assert len(summaries) == 2 and all(s["statuses"] == {"accepted": steps} for s in summaries)
    for s in summaries:
        p = s["prefetched"]
        if prefetch == "1":  # a guess per push; the last one's round ends the job (done), so it is not used
            assert p["used"] + p["dropped"] <= steps and p["used"] >= steps - 2, p
        else:
            assert p == {"used": 0, "dropped": 0}
