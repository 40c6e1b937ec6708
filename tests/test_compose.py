"""``docker compose up`` for real: the repository's Dockerfile and docker-compose.yml, a real Docker
engine, real containers, driven by the commands of docs/guides/compose.md (``compose_util.DOCUMENTED``, run as
written; the job's settings in the project's env file, as a user's ``.env``).

Each test is its own compose project (unique name, own host port, ``down -v`` afterwards even on
failure, and the test checks nothing of it is left). Skipped, loudly, when ``SYNCPS_SKIP_COMPOSE``
is set or no engine answers: the line ``COMPOSE TESTS SKIPPED: <reason>`` goes to stdout and the
suite's summary lists it under "degraded checks".
Measured times are printed past the capture (``pytest -m compose`` runs just these).
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

from cluster.processes import wait_for
from tests.compose_util import DOCUMENTED, IMAGE, ComposeProject, build_image, compose_unavailable, docker
from tests.conftest import degraded
from tests.timing import allow
from worker_service.client import PSClient

pytestmark = [pytest.mark.compose, pytest.mark.timeout(420)]

W_TRUE, B_TRUE = [0.1, 0.2, 0.3], 0.4


def report(request, line: str) -> None:
    """Print past pytest's capture (the skip line must reach the CI log; timings are worth seeing)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        print(f"\n{line}", flush=True)


@pytest.fixture(scope="module")
def image(request):
    reason = compose_unavailable()
    if reason:
        line = f"COMPOSE TESTS SKIPPED: {reason}"
        report(request, line)
        degraded("compose tests (test_compose.py)", f"skipped: {reason}")
        pytest.skip(line)
    report(request, f"[compose] image {IMAGE} built in {build_image():.1f} s")
    return IMAGE


@pytest.fixture
def compose(image, request):
    """Factory of compose projects; each one is taken down (with its volumes) when the test ends."""
    made: list[ComposeProject] = []

    def make(label: str, files: tuple[str, ...] = (), documented: dict = DOCUMENTED, **env) -> ComposeProject:
        made.append(ComposeProject(label, env, files=files, documented=documented))
        return made[-1]

    yield make
    leftovers = [x for p in made for x in p.down()]
    assert not leftovers, f"docker compose down -v left {leftovers}"


@contextmanager
def logs_on_failure(p: ComposeProject):
    try:
        yield
    except BaseException:
        print(f"--- docker compose logs ({p.name})\n{p.logs()}")
        raise


def final_weights(p: ComposeProject, token: str | None = None) -> dict[str, np.ndarray]:
    client = PSClient(p.url, timeout=allow(10.0), attempts=3, token=token)
    try:
        return client.pull(0, wait=allow(5.0)).tensors
    finally:
        client.close()


def assert_linear_solved(p: ComposeProject, token: str | None = None) -> None:
    t = final_weights(p, token)
    np.testing.assert_allclose(t["w"].reshape(-1), W_TRUE, atol=1e-3)
    np.testing.assert_allclose(t["b"].reshape(-1), [B_TRUE], atol=1e-3)


def contributors(p: ComposeProject) -> set[str]:
    return {w["name"] for w in p.workers()["workers"] if w["pushes"]["accepted"] > 0}


def states(p: ComposeProject) -> dict[str, str]:
    return {w["name"]: w["state"] for w in p.workers()["workers"]}


def test_up_builds_without_a_registry_trains_4_named_workers_and_down_cleans_up(compose, request):
    token = "compose-test-token"  # PS_AUTH_TOKEN in .env reaches the PS and every worker
    fresh = f"{IMAGE}-fresh-{os.getpid()}"  # a tag no registry has: `up` must build it, never try to pull it
    p = compose("up4", PS_MAX_STEPS=400, WORKER_TASK="linear", PS_AUTH_TOKEN=token, SYNCPS_IMAGE=fresh)
    try:
        with logs_on_failure(p):
            t0 = time.monotonic()
            out = p.run("up", timeout=600)  # `docker compose up -d`: no --scale, no --build
            text = out.stdout + out.stderr
            assert "Pulling" not in text and "pull access denied" not in text and "registry" not in text, text
            assert docker("image", "inspect", fresh, check=False).returncode == 0, text
            done = p.wait_status(lambda s: s["state"] == "done", allow(180), "the job to finish")
            report(request, f"[compose] up -d (4 workers by default) -> done (400 linear steps): "
                            f"{time.monotonic() - t0:.1f} s")
            assert done["global_step"] == 400
            assert_linear_solved(p, token)
            assert httpx.get(f"{p.url}/v1/model", timeout=allow(5.0)).status_code == 401
            assert p.get("/v1/status")["auth_failures"] == 1  # that probe; the workers were never refused
            containers = p.wait_workers_exited(allow(60))
            assert len(containers) == 4  # the compose file's default count
            assert [c["State"]["ExitCode"] for c in containers] == [0] * 4, [c["Name"] for c in containers]
            # Workers are named as `docker compose ps` names their containers (syncps-...-worker-1), all pushed.
            listed = p.ps_names("worker")
            assert listed == sorted(p.worker_name(c) for c in containers)
            assert listed == [f"{p.name}-worker-{i}" for i in range(1, 5)]
            assert contributors(p) == set(listed)
            # the shared tmpfs volume put every worker on the same-host transport (no tensor in the bodies)
            assert {w["transport"] for w in p.workers()["workers"]} == {"shm"}
            assert p.get("/v1/status")["shm_bytes_received"] > 0
            # The PS outlives the job: it keeps serving the monitoring API, and its log says so (the workers exited).
            assert p.get("/healthz")["status"] == "ok"
            ps_log = p.compose("logs", "--no-color", "ps").stdout
            assert ps_log.count("the job is done at global step 400: this PS stays up") == 1, ps_log[-3000:]
            again = p.get("/v1/status")
            assert again["state"] == "done" and again["global_step"] == 400
            assert set(states(p).values()) == {"left"}
            label = f"label=com.docker.compose.project={p.name}"
            assert docker("volume", "ls", "-q", "--filter", label).stdout.split(), "no checkpoint volume was created"
        assert p.down() == []  # containers, network and the named volume are gone
    finally:
        p.down()
        docker("rmi", fresh, check=False)


def test_documented_commands_restart_the_ps_and_rescale_without_changing_the_job(compose, request):
    """The guide's commands on a running job: `up -d` after `kill ps` keeps 4 workers (the file's count, not 1),
    `up -d --no-recreate --scale worker=6` adds 2 and restarts nothing, `kill ps` + `start ps` leaves the 6
    workers alone, `--scale worker=2` stops 4 gracefully; max_steps (from the env file) never changes.
    The job is long on purpose (it must still run at the scale-down); `docker compose stop` ends it."""
    steps = 1_000_000
    p = compose("rescale", PS_MAX_STEPS=steps, WORKER_TASK="linear", PS_CHECKPOINT_EVERY_STEPS=50)
    with logs_on_failure(p):
        p.run("up")
        p.wait_status(lambda s: s["state"] == "training" and s["global_step"] >= 50, allow(120), "training to start")
        workers = sorted(c["Id"] for c in p.running("worker"))
        assert len(workers) == 4
        (ps,) = p.inspect("ps")

        # 1. the PS killed, then the guide's `docker compose up -d`: the same PS again, still 4 workers
        t0 = time.monotonic()
        p.run("kill_ps")
        wait_for(lambda: p.inspect("ps")[0]["State"]["Status"] == "exited", allow(30), "the PS container to stop")
        p.run("up")
        assert sorted(c["Id"] for c in p.running("worker")) == workers  # none dropped, none recreated
        assert p.inspect("ps")[0]["Id"] == ps["Id"]  # started again, not recreated
        back = p.wait_status(lambda s: s["state"] == "training" and s["workers"]["active"] == 4, allow(90),
                             "training with 4 workers after `up -d`")
        assert back["max_steps"] == steps
        report(request, f"[compose] kill ps + up -d -> training with 4 workers in {time.monotonic() - t0:.1f} s")

        # 2. two more workers on the running job: nothing restarted
        started = p.get("/v1/status")["started_at"]
        p.run("scale_up")
        grown = p.wait_status(lambda s: s["workers"]["active"] == 6, allow(90), "6 active workers")
        p.wait_status(lambda s: s["global_step"] >= grown["global_step"] + 20, allow(60), "rounds with 6 workers")
        assert len(contributors(p)) == 6
        assert p.inspect("ps")[0]["Id"] == ps["Id"] and p.get("/v1/status")["started_at"] == started
        assert set(workers) <= {c["Id"] for c in p.running("worker")}

        # 3. the PS killed, then `docker compose start ps`: the 6 workers stay and carry on with it
        t0 = time.monotonic()
        p.run("kill_ps")
        p.run("start_ps")
        assert len(p.running("worker")) == 6
        again = p.wait_status(lambda s: s["state"] == "training" and s["workers"]["active"] == 6
                              and s["started_at"] != started, allow(90), "training with 6 workers after `start ps`")
        report(request, f"[compose] kill ps + start ps -> training with 6 workers in {time.monotonic() - t0:.1f} s")
        assert again["max_steps"] == steps and p.inspect("ps")[0]["Id"] == ps["Id"]

        # 4. down to 2: SIGTERM, the 4 removed workers leave gracefully; none had to expire
        t0 = time.monotonic()
        p.run("scale_down")
        shrunk = p.wait_status(lambda s: s["workers"]["active"] == 2, allow(90), "2 active workers")
        report(request, f"[compose] 6 -> 2 workers in {time.monotonic() - t0:.1f} s, at step {shrunk['global_step']}")
        remaining = sorted(p.worker_name(c) for c in p.running("worker"))
        assert remaining == [f"{p.name}-worker-1", f"{p.name}-worker-2"] == p.ps_names("worker")
        st = states(p)
        assert {n: st[n] for n in st if n not in remaining} == {f"{p.name}-worker-{i}": "left" for i in range(3, 7)}
        p.wait_status(lambda s: s["global_step"] >= shrunk["global_step"] + 20, allow(60), "rounds with 2 workers")
        assert_linear_solved(p)  # converged long ago; the job goes on
        assert not [e for e in p.workers()["events"] if e["event"] == "expired"]
        assert p.get("/v1/status")["max_steps"] == steps

        # 5. `docker compose stop`: the workers leave, exit 0; the PS writes its final checkpoint, exits 0
        p.run("stop", timeout=180)
        assert sorted(c["State"]["ExitCode"] for c in p.inspect("worker")) == [0, 0]
        assert [c["State"]["ExitCode"] for c in p.inspect("ps")] == [0]


def crash(c: dict) -> bool:
    """SIGKILL a container's main process itself (a crash), so its restart policy applies; True if it did.
    ``docker kill`` would not do: Docker counts it as an explicit stop and never restarts after it.
    Without the right to signal the process, fall back to ``docker kill`` + ``docker start``."""
    assert c["State"]["Running"] and c["State"]["Pid"] > 0, c["Name"]
    try:
        os.kill(c["State"]["Pid"], signal.SIGKILL)
        return True
    except PermissionError:
        docker("kill", c["Id"])
        docker("start", c["Id"])
        return False


def test_kill_a_worker_crash_a_worker_crash_the_ps_job_finishes(compose, request):
    steps, lease = 1000, 3.0
    # WORKER_COMPUTE_DELAY_SECONDS: ~40 rounds/s at most, so the job outlasts the kills below on any machine (at
    # ~230 rounds/s it was done before the PS crash on a loaded one). The PS crash came at steps 119-410 (quiet to
    # load 18: docker's commands slow down more than the paced rounds); 1000 steps leave the 200 the check below
    # wants after up to ~19 s of kills at 40 rounds/s. Every step after the crash only runs out the clock
    p = compose("kill", PS_MAX_STEPS=steps, WORKER_TASK="linear", PS_LEASE_SECONDS=lease,
                PS_CHECKPOINT_EVERY_STEPS=100, WORKER_COMPUTE_DELAY_SECONDS=0.025)
    with logs_on_failure(p):
        p.run("up")
        p.wait_status(lambda s: s["state"] == "training" and s["global_step"] >= 50, allow(120), "training to start")
        # 1. docker kill one worker: its lease expires, the round stops waiting for it, training goes on.
        victim = p.inspect("worker")[0]
        name = p.worker_name(victim)
        t0 = time.monotonic()
        docker("kill", victim["Id"])
        p.wait_status(lambda s: s["workers"]["active"] == 3, allow(60), "the killed worker's lease to expire")
        stall = time.monotonic() - t0
        assert states(p)[name] == "expired"
        at = p.get("/v1/status")["global_step"]
        p.wait_status(lambda s: s["global_step"] >= at + 20, allow(60), "training to go on with 3 workers")
        (victim,) = [c for c in p.inspect("worker") if c["Id"] == victim["Id"]]
        assert (victim["State"]["ExitCode"], victim["RestartCount"]) == (137, 0)
        # 2. A worker crashes: restarted (on-failure), the same container names itself the same: same rank back.
        crashed = next(c for c in p.inspect("worker") if c["State"]["Running"])
        before = {w["name"]: w for w in p.workers()["workers"]}[p.worker_name(crashed)]
        t_crash = time.monotonic()
        by_policy = crash(crashed)
        again = lambda: {w["name"]: w for w in p.workers()["workers"]}[before["name"]]  # noqa: E731
        wait_for(lambda: again()["registrations"] == 2 and again()["state"] == "active", allow(60),
                 "the crashed worker back")
        assert again()["rank"] == before["rank"]
        worker_back = time.monotonic() - t_crash
        if by_policy:
            assert [c["RestartCount"] for c in p.inspect("worker") if c["Id"] == crashed["Id"]] == [1]
        # 3. The PS crashes: the restart policy brings it back, the workers find it again.
        before = p.get("/v1/status")["global_step"]
        assert before < steps - 200, f"the job is (nearly) over at step {before}: the PS crash would test nothing"
        t1 = time.monotonic()
        by_policy = crash(p.inspect("ps")[0])
        back = p.wait_status(lambda s: s["uptime_seconds"] < time.monotonic() - t1 + 1, allow(90),
                             "the PS to come back")
        t_back = time.monotonic() - t1
        resumed = p.wait_status(lambda s: s["state"] == "training" and s["global_step"] > back["global_step"],
                                allow(90), "training to resume")
        t_resume = time.monotonic() - t1
        (ps,) = p.inspect("ps")
        if by_policy:
            assert ps["RestartCount"] >= 1
        restored = (back.get("checkpoint") or {}).get("step")  # None: no checkpoint, the job starts over
        report(request, f"[compose] worker kill -> lease expiry after {stall:.1f} s (lease {lease} s); worker crash "
                        f"-> restarted and rejoined with its rank in {worker_back:.1f} s; PS crash at "
                        f"step >= {before} -> API back in {t_back:.1f} s at step {back['global_step']} (checkpoint "
                        f"{restored}), training again in {t_resume:.1f} s (step {resumed['global_step']}); "
                        f"restarted by policy: {by_policy}")
        if restored is not None:  # checkpoints every 100 steps: about one interval lost at most
            assert before - 200 <= restored <= back["global_step"]
        done = p.wait_status(lambda s: s["state"] == "done", allow(240), "the job to finish after the PS restart")
        assert done["global_step"] == steps
        # every worker attached to the restarted PS, which swept its predecessor's weights file
        assert {w["transport"] for w in p.workers()["workers"] if w["pushes"]["accepted"]} == {"shm"}
        files = p.compose("exec", "-T", "ps", "ls", "/syncps-shm").stdout.split()
        assert len(files) == 1 and files[0].startswith("syncps-w-"), files
        assert_linear_solved(p)
        containers = p.wait_workers_exited(allow(60))
        codes = sorted(c["State"]["ExitCode"] for c in containers)
        assert codes == [0, 0, 0, 137]
