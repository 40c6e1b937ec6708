"""The hot-standby pair under ``docker compose`` for real (issue 51; docs/guides/standby.md): docker-compose.yml with
docker-compose.standby.yml on a real Docker engine, driven by the guide's commands (``compose_util.DOCUMENTED_STANDBY``,
run as written; the job's settings in the project's env file, as a user's ``.env``).

The pair (``ps`` the primary, ``ps-standby`` its standby, each published on a host port of its own) and 4 workers
train; once the standby is in sync (``pair.lag_rounds`` 0 on the primary, ``synced`` on the standby) the guide's
``kill ps`` kills the primary. Asserted: the standby takes over (a newer term, role primary) and closes rounds; no
round is redone beyond the one that was open (the step the standby took over at against the last step the primary
showed, and every worker's "this worker was at step X, resuming at Y" line); the killed PS, started again with the
guide's ``start ps``, rejoins as the standby of the newer term and catches up; the job finishes ``done`` on the new
primary with every step and the linear task solved; every worker exits 0; the guide's ``down -v`` leaves nothing.
The seconds from the kill to a round closed again are printed past the capture (``pytest -m compose``).
"""
from __future__ import annotations

import re
import time

import pytest

from bench.failover import RESUMED
from bench.swarm import PublishedPS
from cluster.processes import free_port
from tests.compose_util import DOCUMENTED_STANDBY, STANDBY_FILES
from tests.test_compose import assert_linear_solved, compose, image, logs_on_failure, report  # noqa: F401 (fixtures)
from tests.timing import allow

pytestmark = [pytest.mark.compose, pytest.mark.timeout(420)]

TOOK_OVER = re.compile(r"took over at step (\d+)")
#: the steps after the old primary rejoined only run out the clock: it gated the new primary at steps ~430 (load 20)
STEPS = 1000


def pair(s: dict) -> dict:
    return s.get("pair") or {}


def test_the_primary_killed_the_standby_finishes_the_job_and_the_old_primary_rejoins(compose, request):
    standby_port = free_port()
    # WORKER_COMPUTE_DELAY_SECONDS: at most ~40 rounds/s, so the job outlasts the kill, the takeover and the rejoin
    p = compose("standby", files=STANDBY_FILES, documented=DOCUMENTED_STANDBY, PS_MAX_STEPS=STEPS,
                WORKER_TASK="linear", WORKER_COMPUTE_DELAY_SECONDS=0.02, SYNCPS_STANDBY_PORT=standby_port)
    standby = PublishedPS()
    standby.url = f"http://127.0.0.1:{standby_port}"
    with logs_on_failure(p):
        t_up = time.monotonic()
        p.run("up", timeout=600)
        p.wait_status(lambda s: s["state"] == "training" and s["workers"]["active"] == 4 and s["global_step"] >= 100
                      and pair(s).get("role") == "primary" and pair(s).get("standby") == "in_sync"
                      and pair(s).get("lag_rounds") == 0, allow(180), "training with 4 workers and the standby in sync")
        synced = standby.wait_status(lambda s: pair(s).get("role") == "standby" and pair(s).get("synced"), allow(30),
                                     "the standby synced")
        assert synced["pair"]["term"] == 1 and synced["max_steps"] == STEPS
        t_sync = time.monotonic() - t_up

        # the primary dies: the last step it showed, then the guide's `kill ps`
        before = p.get("/v1/status")
        assert before["global_step"] < STEPS - 300, f"the job is nearly over at step {before['global_step']}"
        term = before["pair"]["term"]
        t0 = time.monotonic()
        p.run("kill_ps")
        took = standby.wait_status(lambda s: pair(s).get("role") == "primary", allow(60), "the standby to take over")
        t_takeover = time.monotonic() - t0
        m = TOOK_OVER.search(took["pair"]["last_change"] or "")
        assert m, took["pair"]
        at = int(m.group(1))
        again = standby.wait_status(lambda s: s["global_step"] > at, allow(60), "a round closed on the new primary")
        t_again = time.monotonic() - t0
        assert took["pair"]["term"] > term and took["pair"]["takeovers"] == 1
        redone = before["global_step"] - at
        assert redone <= 1, f"the standby took over at step {at}, the primary had shown {before['global_step']}"
        assert (p.try_status() is None) and not p.running("ps")

        # the killed PS started again: the standby of the newer term, in sync
        t1 = time.monotonic()
        p.run("start_ps")
        back = p.wait_status(lambda s: pair(s).get("role") == "standby" and pair(s).get("synced"), allow(90),
                             "the old primary to rejoin as the standby")
        assert back["pair"]["term"] == took["pair"]["term"]
        gated = standby.wait_status(lambda s: pair(s).get("standby") == "in_sync" and pair(s).get("lag_rounds") == 0,
                                    allow(60), "the new primary to gate on its new standby")
        t_rejoin = time.monotonic() - t1

        done = standby.wait_status(lambda s: s["state"] == "done", allow(240), "the job to finish on the new primary")
        assert done["global_step"] == STEPS and done["pair"]["role"] == "primary"
        assert_linear_solved(standby)
        workers = p.wait_workers_exited(allow(60))
        assert [c["State"]["ExitCode"] for c in workers] == [0] * 4, [c["Name"] for c in workers]
        resumed = [tuple(map(int, m)) for m in RESUMED.findall(p.compose("logs", "--no-color", "worker").stdout)]
        assert resumed and all(back_at >= was - 1 for was, back_at in resumed), resumed
        assert {w["transport"] for w in standby.workers()["workers"]} == {"shm"}
        report(request, f"[compose standby] up -> 4 workers, standby in sync: {t_sync:.1f} s; kill ps at step "
                        f"{before['global_step']} -> ps-standby primary of term {took['pair']['term']} in "
                        f"{t_takeover:.1f} s, took over at step {at} (redone beyond the open round: {max(0, redone)}), "
                        f"a round closed again {t_again:.1f} s after the kill (step {again['global_step']}); workers "
                        f"resumed {sorted(set(resumed))}; start ps -> the new primary gating on it at step "
                        f"{gated['global_step']} in {t_rejoin:.1f} s; done at {done['global_step']}")
        p.run("down", timeout=180)
        assert p.leftovers() == []
