"""The worker's progress log on a simulated clock: a first line 1 s after the first push (so every worker of a
short job shows its pace once), then one every ``every`` seconds, never a 0-rounds/s line, and the final line."""
from __future__ import annotations

import logging
import re

from worker_service.progress import ALREADY_DONE, ProgressLog

TIMES = {"fetch": 0.002, "compute": 0.001, "push": 0.003}


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def run(log: ProgressLog, clock: Clock, steps: range, dt: float) -> None:
    for step in steps:
        clock.t += dt
        log.pushed(step, 0.5, TIMES, "accepted")


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]


def test_first_line_one_second_after_the_first_push_then_every_interval(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    log = ProgressLog(logging.getLogger("t"), every=5.0, clock=clock)
    clock.t += 3.0  # registered, then waited 3 s for step 0 (start-up): not part of the first interval
    run(log, clock, range(0, 8), 0.125)  # the first push, then 7 more within 0.875 s
    assert lines(caplog) == []
    run(log, clock, range(8, 9), 0.125)  # 1 s after the first push
    (first,) = lines(caplog)
    assert re.match(r"progress: step 8 loss 0\.5 \| 8\.0 rounds/s \| own mean fetch 2\.0 ms compute 1\.0 ms "
                    r"push 3\.0 ms \| pushes 9 \(accepted 9\)", first), first
    run(log, clock, range(9, 48), 0.125)  # 4.875 s more: no line yet
    assert len(lines(caplog)) == 1
    run(log, clock, range(48, 49), 0.125)  # 5 s after the first line
    assert len(lines(caplog)) == 2 and lines(caplog)[1].startswith("progress: step 48 loss 0.5 | 8.0 rounds/s")


def test_a_job_shorter_than_a_second_logs_only_the_final_line(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    log = ProgressLog(logging.getLogger("t"), every=5.0, clock=clock)
    clock.t += 2.0  # registered, then waited 2 s for the job to start (a PS's start-up grace)
    run(log, clock, range(0, 8), 0.125)  # the first push answered at +2.125 s, the last at +3.0 s
    log.final(True, 8, 0.5, {"accuracy": 0.96})
    assert lines(caplog) == []
    final = caplog.records[-1].getMessage()
    assert final.startswith("FINISHED: training done at global step 8 after 3.0 s: 8 pushes (accepted 8), "
                            "9.1 rounds/s, ") and "evaluation accuracy=0.96" in final, final  # 8 rounds in 0.875 s


def test_a_worker_that_joined_a_finished_job_says_so_and_how_to_start_afresh(caplog):
    """A second `docker compose up` resumes the finished job: its workers push nothing, and the line says why."""
    caplog.set_level(logging.INFO)
    log = ProgressLog(logging.getLogger("t"), every=5.0, clock=Clock())
    log.final(True, 1000, None, {"loss": 0.5})
    final = caplog.records[-1].getMessage()
    assert final.startswith("FINISHED: training done at global step 1000 after 0.0 s: 0 pushes (none), ") and \
        final.endswith("evaluation loss=0.5" + ALREADY_DONE) and "docker compose down -v" in final, final
    log = ProgressLog(logging.getLogger("t"), every=5.0, clock=Clock())
    run(log, Clock(), range(0, 2), 0.125)
    log.final(True, 2, 0.5, {})
    assert ALREADY_DONE not in caplog.records[-1].getMessage()  # a worker that trained says nothing of it


def test_a_short_interval_is_the_first_line_too_and_no_line_without_a_new_step(caplog):
    caplog.set_level(logging.INFO)
    clock = Clock()
    log = ProgressLog(logging.getLogger("t"), every=0.5, clock=clock)
    run(log, clock, range(0, 5), 0.125)  # the first line 0.5 s after the first push
    assert [x.split(" loss")[0] for x in lines(caplog)] == ["progress: step 4"]
    clock.t += 2.0
    log.pushed(4, 0.5, TIMES, "duplicate")  # the same step again (a retried push): no 0.0 rounds/s line
    assert len(lines(caplog)) == 1
    log.pushed(5, 0.5, TIMES, "accepted")
    assert len(lines(caplog)) == 2 and "pushes 7 (accepted 6, duplicate 1)" in lines(caplog)[1]
