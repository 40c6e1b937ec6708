"""``docker stack deploy`` for real: the repository's docker-stack.yml and deploy/swarm/deploy.sh on a swarm
the module makes, on one node and on two (``../shared/docker/swarm-2node.sh``: a second Docker engine joined
as a worker node, reached over the overlay network as another host), and on two nodes the hot-standby pair of
deploy/swarm/standby.yml, its primary's node cut off (issue 51's drill).

The tests share one swarm, made for the module's first and left at its end, also after a failure: node 2 and its
image store removed, ``docker swarm leave --force``; each test's teardown leaves the swarm as the test found it (its
stacks removed with their volumes and their containers on both nodes, the secrets removed), and the teardowns check
nothing is left. Node 2's engine, with the image copied into it, is started by a thread while the one-node tests
run (not joined: they run first), the first two-node test joins it and the next finds it joined; the test that kills
node 2's engine runs last. Skipped (and listed under "degraded checks") like the compose tests when no Docker engine
answers or ``SYNCPS_SKIP_COMPOSE`` is set, and when this engine is already in a swarm (never touched).
Measured times are printed past the capture (``pytest -m compose`` runs these with the compose tests).
"""
from __future__ import annotations

import re
import shlex
import time
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import yaml

from ps_service.settings import PSSettings
from tests.clusters import settled
from tests.compose_util import IMAGE, build_image, docker
from cluster.processes import free_port, wait_for
from tests.conftest import degraded
from tests.reference import train_reference
from tests.timing import allow
from shared import shards
from tests.swarm_util import (COLOCATED_FILE, DOCUMENTED, HOSTNET_FILE, MONITOR_TOKEN, NODE2, PEER_TOKEN,
                              PUBLISHED_FILE, ROOT, STACK_FILE, STANDBY_FILE, TOKEN,
                              Stack, Swarm, docker0_address, for_node2, remove_node2, run, stack_config, start_node2,
                              still_there, swarm_unavailable, two_nodes_unavailable)
from bench.swarm import node2_docker
from worker_service.client import PSClient
from tests.test_compose import assert_linear_solved, final_weights, report
from worker_service.settings import WorkerSettings

pytestmark = [pytest.mark.compose, pytest.mark.timeout(420)]
#: seconds node 2 is cut off in the two-node test: longer than job 2's lease, shorter than Swarm's node-down time
#: (2 to 3 dispatcher heartbeats: 40-60 s with the guide's DOCUMENTED["heartbeat"])
CUT = 10.0
GUIDE = (ROOT / "docs" / "guides" / "swarm.md").read_text()  # the swarm commands, as the tests run them
STACK = yaml.safe_load(STACK_FILE.read_text())


def skip(request, check: str, reason: str) -> None:
    line = f"SWARM TESTS SKIPPED: {reason}"
    report(request, line)
    degraded(check, f"skipped: {reason}")
    pytest.skip(line)


@pytest.fixture(scope="module")
def image(request):
    reason = swarm_unavailable()
    if reason:
        skip(request, "swarm tests (test_swarm.py)", reason)
    report(request, f"[swarm] image {IMAGE} ready in {build_image():.1f} s")
    return IMAGE


@pytest.fixture(scope="module")
def shared(image, request):
    """The module's swarm (this engine as its one manager), made once, with what its tests share: node 2's engine,
    started with the image copied into it (30-50 s) by a thread while the one-node tests run (``started``; when a
    two-node test is selected), joined by the first two-node test and kept joined for the next (``joined``). At the
    end, also after a failure: node 2 and its image store removed (``removing``: already going once a test killed
    it), ``swarm-2node.sh down``, the swarm left; the teardown checks nothing is left, networks that a test's
    teardown found still there included."""
    wanted = any(item.module is request.module and "two_nodes" in item.name for item in request.session.items)
    sh = SimpleNamespace(swarm=Swarm(), started=None, joined=False, removing=None, networks=[])
    with ThreadPoolExecutor(2) as pool:
        sh.pool = pool
        try:
            sh.swarm.init()
            if wanted and not two_nodes_unavailable():
                sh.started = pool.submit(start_node2, IMAGE)
            yield sh
        finally:
            for pending in (sh.started, sh.removing):
                if pending is not None:
                    pending.exception()  # waits for it, whatever became of the tests
            left = sh.swarm.leave()
            if sh.started is not None and not sh.swarm.node2_up:
                left += remove_node2()  # started, never joined
    left += [x for x in sh.networks if still_there(x)]
    assert not left, f"the swarm tests left {left}"


@pytest.fixture
def swarm(shared, request):
    """The module's swarm for one test, left as the test found it, also after a failure: the test's stacks removed
    (their containers gone on both nodes, their volumes), the stack secrets removed. A one-node test needs node 2
    not joined: those tests come first in the module."""
    s = shared.swarm
    assert "two_nodes" in request.node.name or not shared.joined, "one-node tests run before node 2 joins"
    try:
        yield s
    finally:
        left = _test_stacks_removed(shared)
    assert not left, f"{request.node.name} left {left}"


def _test_stacks_removed(shared) -> list[str]:
    """The stacks a test made removed together (:meth:`Stack.start_rm`, then :meth:`Stack.finish_rm`: on this
    engine), their containers on node 2 gone too, the stack secrets removed; what is left (networks aside: the
    swarm removes them on its own schedule, and leaving it takes them; the module's teardown checks them). Node 2
    killed by the test: its image store starts going now (``shared.removing``)."""
    s = shared.swarm
    stacks, s.stacks = list(s.stacks), []
    node2_alive = shared.joined and bool(docker("ps", "-q", "--filter", f"name=^{NODE2}$").stdout.split())
    if shared.joined and not node2_alive and shared.removing is None:
        shared.removing = shared.pool.submit(remove_node2)
    for st in stacks:
        st.start_rm()
    left = [x for st in stacks for x in st.finish_rm()]
    if node2_alive:
        on_node2 = lambda: [x for st in stacks for x in node2_docker(  # noqa: E731
            "ps", "-aq", "--filter", f"label=com.docker.stack.namespace={st.name}", check=False).stdout.split()]
        try:
            wait_for(lambda: not on_node2(), allow(30), "the stacks' containers on node 2 to go", interval=0.5)
        except TimeoutError:
            left += [f"node 2 container {x}" for x in on_node2()]
    docker("secret", "rm", *s.tokens, check=False)
    left += [f"secret {x}" for x in docker("secret", "ls", "-q").stdout.split()]
    shared.networks += [x for x in left if x.startswith("network ")]
    return [x for x in left if not x.startswith("network ")]


@contextmanager
def logs_on_failure(*stacks: Stack):
    try:
        yield
    except BaseException:
        for st in stacks:
            for service in st.services() or ("ps", "ps-1", "worker"):
                print(f"--- docker service ps {st.name}_{service}\n{st.history(service)}")
                print(f"--- docker service logs {st.name}_{service}\n{st.logs(service)}")
        raise


def by_name(st: Stack) -> dict[str, dict]:
    return {w["name"]: w for w in st.workers()["workers"]}


# -- the files and the guide, without Docker ---------------------------------------------------------
def test_stack_file_passes_real_settings_and_the_guide_shows_the_commands():
    real = {f"PS_{n.upper()}" for n in PSSettings.model_fields} | {f"WORKER_{n.upper()}" for n in WorkerSettings.model_fields}
    named = {str(e).partition("=")[0] for svc in STACK["services"].values() for e in svc["environment"]}
    assert named <= real, sorted(named - real)
    ps, worker = STACK["services"]["ps"], STACK["services"]["worker"]
    assert ps["deploy"]["endpoint_mode"] == "dnsrr" and ps["ports"][0]["mode"] == "host"
    assert worker["deploy"]["replicas"] == 4 and "volumes" not in worker  # no shared memory: TCP
    assert {"PS_REQUIRE_AUTH=true", f"PS_AUTH_TOKEN_FILE=/run/secrets/{TOKEN}"} <= set(ps["environment"])
    assert f"WORKER_AUTH_TOKEN_FILE=/run/secrets/{TOKEN}" in worker["environment"]
    assert all(STACK["secrets"][s] == {"external": True} for s in (TOKEN, MONITOR_TOKEN))
    spans = set(re.findall(r"`([^`\n]+)`", GUIDE)) | {line.strip() for line in GUIDE.splitlines()}
    missing = [cmd for cmd in DOCUMENTED.values() if cmd not in spans]
    assert not missing, f"docs/guides/swarm.md does not show {missing}"


def test_the_standby_stack_puts_a_pair_with_the_same_settings_on_two_nodes(request):
    """deploy/swarm/standby.yml over docker-stack.yml, merged by ``docker stack config`` as deploy.sh -c merges them:
    ps-standby is the stack's ps (same settings, image, secrets, volume, healthcheck, restart policy) but for its role,
    its peer, its node and its published port; the workers know both; docs/guides/standby.md shows the command."""
    config = stack_config(STACK_FILE, STANDBY_FILE)
    if config is None:
        skip(request, "swarm stack files (test_swarm.py)", "no docker CLI on PATH")
    ps, standby, worker = (config["services"][s] for s in ("ps", "ps-standby", "worker"))
    pair = {"PS_ROLE", "PS_PEER_URL"}
    settings = lambda svc: {k: v for k, v in svc["environment"].items() if k not in pair}  # noqa: E731
    assert settings(standby) == settings(ps)
    assert [ps["environment"][k] for k in ("PS_ROLE", "PS_PEER_URL")] == ["primary", "http://ps-standby:8000"]
    assert [standby["environment"][k] for k in ("PS_ROLE", "PS_PEER_URL")] == ["standby", "http://ps:8000"]
    assert worker["environment"]["WORKER_PS_URL"] == "http://ps:8000,http://ps-standby:8000"
    own = ("environment", "ports", "deploy", "secrets")
    assert {k: v for k, v in standby.items() if k not in own} == {k: v for k, v in ps.items() if k not in own}
    assert sorted(standby["secrets"], key=str) == sorted(ps["secrets"], key=str)
    # the two PS talk with a token the workers do not hold (PS_PEER_TOKEN: docs/protocol-standby.md)
    assert ps["environment"]["PS_PEER_TOKEN_FILE"] == f"/run/secrets/{PEER_TOKEN}"
    assert config["secrets"][PEER_TOKEN]["external"] and PEER_TOKEN in {s["source"] for s in ps["secrets"]}
    assert PEER_TOKEN not in str(worker.get("secrets")) and "PS_PEER_TOKEN_FILE" not in worker["environment"]
    rest = lambda svc: {k: v for k, v in svc["deploy"].items() if k != "placement"}  # noqa: E731
    assert rest(standby) == rest(ps)
    assert ps["deploy"]["placement"]["constraints"] == ["node.role == manager", "node.labels.syncps.host == 0"]
    assert standby["deploy"]["placement"]["constraints"] == ["node.labels.syncps.host == 1"]
    assert standby["ports"] == [{**ps["ports"][0], "published": 8001}]
    guide = (ROOT / "docs" / "guides" / "standby.md").read_text()
    assert f"`{DOCUMENTED['deploy']} -c deploy/swarm/standby.yml`" in guide


def test_the_published_stack_needs_the_ps_address_and_sends_every_worker_there(request):
    """deploy/swarm/published.yml over docker-stack.yml: without SYNCPS_PS_HOST the CLI refuses it and says what to set
    (a worker URL with no host would only fail to connect, task after task); with it, the workers' PS URL is that
    address at the published port, and nothing else changes."""
    if stack_config(STACK_FILE) is None:
        skip(request, "swarm stack files (test_swarm.py)", "no docker CLI on PATH")
    with pytest.raises(RuntimeError, match="SYNCPS_PS_HOST"):
        stack_config(STACK_FILE, PUBLISHED_FILE)
    plain, published = stack_config(STACK_FILE), stack_config(STACK_FILE, PUBLISHED_FILE, SYNCPS_PS_HOST="10.0.0.5")
    port = plain["services"]["ps"]["ports"][0]["published"]
    env = published["services"]["worker"]["environment"]
    assert env.pop("WORKER_PS_URL") == f"http://10.0.0.5:{port}" and env.pop("SYNCPS_PS_HOST") == "10.0.0.5"
    plain["services"]["worker"]["environment"].pop("WORKER_PS_URL")
    assert published == plain


def test_the_hostnet_stack_puts_the_ps_and_the_workers_on_each_nodes_own_network(request):
    """deploy/swarm/hostnet.yml over docker-stack.yml, merged by ``docker stack config`` as deploy.sh -c merges them:
    without SYNCPS_PS_HOST the CLI refuses it and says what to set; with it, the PS and the workers are on Swarm's
    predefined ``host`` network only (no overlay), the PS listens on the published port itself (its healthcheck asks
    that port), the workers' PS URL is the given address at that port, and nothing else changes; docs/guides/swarm.md
    shows the command."""
    if stack_config(STACK_FILE) is None:
        skip(request, "swarm stack files (test_swarm.py)", "no docker CLI on PATH")
    with pytest.raises(RuntimeError, match="SYNCPS_PS_HOST"):
        stack_config(STACK_FILE, HOSTNET_FILE)
    plain = stack_config(STACK_FILE, SYNCPS_PORT="8123")
    hostnet = stack_config(STACK_FILE, HOSTNET_FILE, SYNCPS_PS_HOST="10.0.0.5", SYNCPS_PORT="8123")
    assert hostnet.pop("networks") == {"host": {"name": "host", "external": True}} and "networks" not in plain
    ps, worker = hostnet["services"]["ps"], hostnet["services"]["worker"]
    assert ps.pop("networks") == worker.pop("networks") == {"host": None}
    assert ps["ports"] == [{"mode": "host", "target": 8000, "published": 8123, "protocol": "tcp"}]
    assert ps["environment"].pop("PS_PORT") == "8123" and plain["services"]["ps"]["environment"].pop("PS_PORT") == "8000"
    assert "os.environ.get('PS_PORT', '8000')" in " ".join(ps["healthcheck"]["test"])  # the port it listens on
    env = worker["environment"]
    assert env.pop("WORKER_PS_URL") == "http://10.0.0.5:8123" and env.pop("SYNCPS_PS_HOST") == "10.0.0.5"
    plain["services"]["worker"]["environment"].pop("WORKER_PS_URL")
    for config in (plain, hostnet):  # a merge may reorder the list
        config["services"]["ps"]["secrets"].sort(key=str)
    assert hostnet == plain
    assert f"`SYNCPS_PS_HOST=<the PS node's address> {DOCUMENTED['deploy']} -c deploy/swarm/hostnet.yml`" in GUIDE


# -- one node -----------------------------------------------------------------------------------------
def test_deploy_without_the_secrets_fails_and_says_how_to_make_them(swarm):
    st = swarm.stack("nosecret")
    plain = run(["docker", "stack", "deploy", "--resolve-image", "never", "-c", str(STACK_FILE), st.name],
                env=st.env, check=False)
    assert plain.returncode != 0 and "secret not found" in plain.stderr, plain.stderr
    r = st.deploy(check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    howto = [line.strip() for line in r.stderr.splitlines() if "docker secret create" in line]
    assert [h.rsplit(" ", 2)[-2] for h in howto] == [TOKEN, MONITOR_TOKEN], r.stderr
    assert all(h in GUIDE for h in howto), howto  # the guide gives the same commands
    assert "secret not found" in r.stderr and not docker("service", "ls", "-q", "--filter",
                                                         f"label=com.docker.stack.namespace={st.name}").stdout.split()


def test_ps_refuses_to_start_without_a_token_when_auth_is_required(image):
    """The stack's PS_REQUIRE_AUTH=true, in the image: no token, no PS, and the message says how to make one."""
    r = run(["docker", "run", "--rm", "-e", "PS_REQUIRE_AUTH=true", IMAGE, "python", "-m", "ps_service"],
            timeout=60, check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"docker secret create {TOKEN} -" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_one_node_stack_trains_to_done_over_tcp_then_scales_to_6(swarm, request):
    """4 workers, R = 4 fixed: every round applies exactly 4 gradients. `docker service scale ..._worker=6`
    mid-job: 6 workers, 2 of them backups each round; all push over TCP (no shared-memory volume)."""
    steps, r = 540, 4  # node 2 is being started alongside (shared): room for a slower scale-up
    swarm.create_secrets()
    st = swarm.stack("one", ps={"PS_MAX_STEPS": steps, "PS_REPLICAS_TO_AGGREGATE": r, "PS_MIN_WORKERS": 4,
                                "PS_STARTUP_GRACE_SECONDS": 0},
                     worker={"WORKER_COMPUTE_DELAY_SECONDS": 0.02})  # ~35 rounds/s: the job outlasts the scale-up
    with logs_on_failure(st):
        t0 = time.monotonic()
        st.deploy()
        st.wait_status(lambda s: s["state"] == "training" and s["workers"]["active"] == 4 and s["global_step"] >= 20,
                       allow(120), "training with 4 workers")
        t_train = time.monotonic() - t0
        assert list(st.running_on("ps").values()) == [docker("info", "-f", "{{.Name}}").stdout.strip()]  # the manager
        t1 = time.monotonic()
        st.run("scale")  # waits until the 6 tasks run
        grown = st.wait_status(lambda s: s["workers"]["active"] == 6, allow(60), "6 active workers")
        t_scale = time.monotonic() - t1
        done = st.wait_status(lambda s: s["state"] == "done", allow(180), "the job to finish")
        report(request, f"[swarm] 1 node: deploy.sh -> training with 4 workers in {t_train:.1f} s; service scale "
                        f"-> 6 active in {t_scale:.1f} s (at step {grown['global_step']}); done ({steps} steps) "
                        f"{time.monotonic() - t0:.1f} s after the deploy")
        assert done["global_step"] == steps and grown["global_step"] < steps
        assert done["pushes"]["accepted"] == done["gradients_applied"] == steps * r
        workers = by_name(st)
        assert sorted(workers) == [f"{st.name}_worker-{i}" for i in range(1, 7)]
        assert all(w["pushes"]["accepted"] > 0 for w in workers.values()), workers
        assert sum(w["pushes"]["accepted"] for w in workers.values()) == steps * r
        # no shared-memory volume: every worker found no PS weights file and pushed in request bodies
        assert {w["transport"] for w in workers.values()} == {"http"}
        assert done["shm_bytes_received"] == 0
        assert "same-host transport unavailable" in st.logs("worker", tail=200)
        assert_linear_solved(st, swarm.tokens[TOKEN])
        # secure by default: the published PS wants a token on the monitoring routes too
        assert httpx.get(f"{st.url}/v1/status", timeout=allow(5.0)).status_code == 401
        assert httpx.get(f"{st.url}/healthz", timeout=allow(5.0)).status_code == 200
        t2 = time.monotonic()
        assert st.rm() == []
        report(request, f"[swarm] docker stack rm + its volume gone in {time.monotonic() - t2:.1f} s")


# -- two nodes, a hot-standby pair ---------------------------------------------------------------------
@pytest.mark.slow
def test_two_nodes_standby_pair_goes_on_on_node_2_when_the_primarys_node_is_cut_off(swarm, shared, request,
                                                                                   tmp_path):
    """deploy/swarm/standby.yml as its comment says (nodes labelled syncps.host=0/1): the primary ``ps`` on the
    manager, ``ps-standby`` on node 2, and the 4 workers on node 2 (the primary's host is a PS host of its own). Node
    2 is cut off from the manager mid-training (every packet of its link dropped: the primary's node is cut off from
    the standby and every worker): the standby takes over (term 2) holding every step a worker saw, the old primary
    closes at most the round that was open (no worker saw it: the only step redone) and takes no round after, and
    the job finishes on node 2 with final weights bit-identical to one process training on the 4 shards (float64).
    Once the network is back, the old primary is the standby of term 2. The standby is watched at its host-mode
    published port on node 2's address, which the cut leaves open (forwarded, not node 2's own traffic)."""
    t0 = time.monotonic()
    how = _join_node2(shared, request, "two-node swarm standby drill (test_swarm.py)")
    t_node = time.monotonic() - t0
    swarm.create_secrets()
    manager = docker("info", "-f", "{{.Name}}").stdout.strip()
    for host, node in enumerate((manager, NODE2)):  # as standby.yml says
        docker("node", "update", "--label-add", f"syncps.host={host}", node)
    steps = 250  # cut at step 71-78 in every run (once the standby is in sync): room for a later sync
    job = {"PS_MAX_STEPS": steps, "PS_MIN_WORKERS": 4, "PS_STARTUP_GRACE_SECONDS": 0}
    standby_port = free_port()
    extra = tmp_path / "standby-settings.yml"  # ps-standby's settings as ps's, and its port published on node 2
    extra.write_text(yaml.safe_dump({"version": "3.8", "services": {"ps-standby": {
        "environment": [f"{k}={v}" for k, v in job.items()],
        "ports": [{"target": 8000, "published": standby_port, "protocol": "tcp", "mode": "host"}]}}}))
    st = swarm.stack("standby", ps=job, worker={"WORKER_DTYPE": "float64", "WORKER_COMPUTE_DELAY_SECONDS": 0.02},
                     worker_deploy={"placement": {"constraints": ["node.role == worker"]}},
                     files=(for_node2(STANDBY_FILE, tmp_path, "ps-standby"), extra))
    auth = {"Authorization": f"Bearer {swarm.tokens[TOKEN]}"}
    node2_ip = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", NODE2).stdout.strip()
    primary, standby = st.url, f"http://{node2_ip}:{standby_port}"

    ha = lambda url: _get(url, "/v1/ha", auth)  # noqa: E731
    status = lambda url: _get(url, "/v1/status", auth)  # noqa: E731

    with logs_on_failure(st):
        t1 = time.monotonic()
        st.deploy()
        wait_for(lambda: (s := status(primary)) and s["global_step"] >= 60 and s["workers"]["active"] == 4
                 and (ha(standby) or {}).get("synced"), allow(150), "4 workers training, the standby in sync",
                 interval=0.2)
        t_train = time.monotonic() - t1
        assert st.placed("ps") == {manager} and st.placed("ps-standby") == {NODE2}
        assert sorted(st.running_on("worker").values()) == [NODE2] * 4
        with swarm.cut_node2() as cut:
            at_cut = ha(primary)["step"]
            took = wait_for(lambda: _when(ha(standby), role="primary", term=2), allow(30), "the standby to take over",
                            interval=0.1)
            t_takeover = time.monotonic() - cut[0]
            seen = [ha(primary)]
            done = wait_for(lambda: _when(status(standby), state="done"), allow(120), "the job to finish on node 2",
                            interval=0.2)
            t_done = time.monotonic() - cut[0]
            seen.append(ha(primary))
            got = final_weights(SimpleNamespace(url=standby), swarm.tokens[TOKEN])
        healed = wait_for(lambda: _when(ha(primary), role="standby", term=2), allow(30),
                          "the old primary to be the standby of term 2", interval=0.2)
        t_back = time.monotonic() - cut[1]
        report(request, f"[swarm] standby drill: node 2 {how} in {t_node:.1f} s; training with a synced standby "
                        f"{t_train:.1f} s after deploy; node 2 cut off at step {at_cut}: the standby took over at "
                        f"step {took['step']} (term 2) {t_takeover:.1f} s into the cut, the job done ({steps} steps) "
                        f"{t_done:.1f} s into it; the old primary stood at step {seen[-1]['step']} and was the "
                        f"standby of term 2 {t_back:.1f} s after the network came back")
    # every step a worker saw is on the standby: the old primary closed at most the round open at the cut, after it
    # took no round (term 1, not serving), and the job's bits are one process's
    assert all(h is not None and h["term"] == 1 and h["role"] != "primary" for h in seen), seen
    assert took["step"] >= at_cut - 1 and all(h["step"] <= took["step"] + 1 for h in seen), (at_cut, took, seen)
    assert done["global_step"] == steps
    _, ref = train_reference("linear", 4, steps, seed=0, dtype="float64")
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == np.float64 and got[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical"
    assert healed["role"] == "standby" and healed["term"] == 2


def _get(url: str, path: str, headers: dict) -> dict | None:
    """``GET url+path``'s JSON, None when it does not answer 200 (a PS cut off, or not up yet)."""
    try:
        r = httpx.get(f"{url}{path}", headers=headers, timeout=2.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _when(answer: dict | None, **fields) -> dict | None:
    """``answer`` if it has every one of ``fields``' values, else None (a :func:`wait_for` predicate)."""
    return answer if answer is not None and all(answer.get(k) == v for k, v in fields.items()) else None


# -- two nodes, node 2 lost (last: it kills node 2's engine) -----------------------------------------
@pytest.mark.slow
def test_two_nodes_train_exactly_then_lose_node_2_and_finish(swarm, shared, request, tmp_path):
    """PS on the manager, 2 workers on each node (max_replicas_per_node: 2). Job 1 ends bit-identical to one
    process training on the 4 shards, and so does job 4, deployed with deploy/swarm/hostnet.yml (the PS and the
    workers on each node's ``host`` network, the workers at the manager's address: no overlay). Job 3, deployed with deploy/swarm/colocated.yml: shard 0 on the manager,
    shard 1 on node 2, 2 workers beside each, each reaching its own shard by files (the node's tmpfs volume) and
    the other over the overlay; its pieces end bit-identical too. Job 2: node 2 is cut off the network for
    :data:`CUT` s mid-training (the swarm's dispatcher heartbeat set as docs/guides/swarm.md says): its workers
    expire (lease 2 s), the manager's 2 go on, and once the network is back node 2's workers rejoin from the same
    tasks (Swarm replaced none); then node 2's engine is killed, its workers' leases expire and the manager's 2
    workers finish the job. The three stacks are deployed together (their container start-up overlaps); job 2 is
    paced (~25 rounds/s measured here), so it is still early in its 1000 steps when jobs 1 and 3 (60 unpaced steps)
    are done and node 2 may go."""
    t0 = time.monotonic()
    how = _join_node2(shared, request, "two-node swarm test (test_swarm.py)")
    t_node = time.monotonic() - t0
    swarm.create_secrets()
    spread = {"placement": {"max_replicas_per_node": 2}}
    start = {"PS_MIN_WORKERS": 4, "PS_STARTUP_GRACE_SECONDS": 0}
    steps, lease, fault_steps = 60, 2.0, 1000
    exact = swarm.stack("exact", ps={"PS_MAX_STEPS": steps, **start}, worker={"WORKER_DTYPE": "float64"},
                        worker_deploy=spread)
    fault = swarm.stack("fault", ps={"PS_MAX_STEPS": fault_steps, "PS_LEASE_SECONDS": lease, **start},
                        worker={"WORKER_COMPUTE_DELAY_SECONDS": 0.02}, worker_deploy=spread)
    colo = swarm.stack("colo", ps={"PS_MAX_STEPS": steps, **start}, worker={"WORKER_DTYPE": "float64"},
                       files=(for_node2(COLOCATED_FILE, tmp_path, "ps-1"),))
    hostnet = swarm.stack("hostnet", ps={"PS_MAX_STEPS": steps, **start}, worker={"WORKER_DTYPE": "float64"},
                          worker_deploy=spread, files=(HOSTNET_FILE,), env={"SYNCPS_PS_HOST": docker0_address()})
    manager = docker("info", "-f", "{{.Name}}").stdout.strip()
    for host, node in enumerate((manager, NODE2)):  # as colocated.yml says
        docker("node", "update", "--label-add", f"syncps.host={host}", node)
    with logs_on_failure(exact, fault, colo, hostnet):
        # job 1: exact across two hosts (and job 4 on the hosts' own networks)
        t1 = time.monotonic()
        exact.deploy()
        colo.deploy()
        hostnet.deploy()
        fault.deploy()
        _, ref = train_reference("linear", 4, steps, seed=0, dtype="float64")
        _spread_job_checked(exact, swarm, manager, steps, ref)
        t_exact = time.monotonic() - t1
        t_colo = _colocated_job_checked(colo, swarm, manager, steps, ref, t1)
        _spread_job_checked(hostnet, swarm, manager, steps, ref)
        t_hostnet = time.monotonic() - t1

        # job 2: node 2 cut off the network for CUT s, then killed, mid-training
        fault.wait_status(lambda s: s["state"] == "training" and s["workers"]["active"] == 4 and s["global_step"] >= 30,
                          allow(120), "job 2 training with 4 workers")
        placed = fault.running_on("worker")
        remote = sorted(n for n, node in placed.items() if node != manager)
        local = sorted(n for n, node in placed.items() if node == manager)
        assert len(remote) == len(local) == 2, placed
        t_cut_expired, t_back, cut_at = _cut_node_2_and_back(fault, swarm, remote, lease)
        t_kill = time.monotonic()
        swarm.kill_node2()
        shrunk = fault.wait_status(lambda s: s["workers"]["active"] == 2, allow(30), "node 2's workers to expire")
        t_expired = time.monotonic() - t_kill
        at = shrunk["global_step"]
        done = fault.wait_status(lambda s: s["state"] == "done", allow(120), "job 2 to finish on the manager's workers")
        report(request, f"[swarm] 2 nodes: node 2 with {IMAGE} copied {how} in {t_node:.1f} s; exact job "
                        f"({steps} steps) "
                        f"done {t_exact:.1f} s after deploy, the co-located one {t_colo:.1f} s, the hostnet one "
                        f"{t_hostnet:.1f} s; job 2: node 2 cut off "
                        f"for {CUT} s at step {cut_at}: its workers expired {t_cut_expired:.1f} s into the cut and were "
                        f"back {t_back:.1f} s after it, in their tasks; then killed, its workers expired "
                        f"{t_expired:.1f} s later (lease {lease} s) at step {at}, done ({fault_steps} steps) "
                        f"{time.monotonic() - t1:.1f} s after deploy")
        assert at < fault_steps and done["global_step"] == fault_steps
        workers = by_name(fault)
        assert {n: workers[n]["state"] for n in remote} == {n: "expired" for n in remote}
        assert all(workers[n]["pushes"]["accepted"] == fault_steps for n in local)  # every round, before and after
        assert all(0 < workers[n]["pushes"]["accepted"] <= at + 1 for n in remote)
        events = fault.workers()["events"]
        assert sorted(e["name"] for e in events if e["event"] == "expired") == sorted(remote * 2)  # the cut, the kill
        assert_linear_solved(fault, swarm.tokens[TOKEN])
        assert swarm.nodes().get(manager) == "Ready"


def _join_node2(shared, request, check: str) -> str:
    """Node 2 joined to the module's swarm with the image in it, once: started ahead by :func:`shared`'s thread (else
    the usual way, ``swarm-2node.sh up`` copying the image), then the dispatcher heartbeat as the guide sets it (a node
    cut off for less than 40 s keeps its tasks); a later two-node test finds it joined. How, for the report. Skips
    (loudly) without the two-node script."""
    reason = two_nodes_unavailable()
    if reason:
        skip(request, check, reason)
    if shared.joined:
        assert shared.removing is None, "node 2 was killed by an earlier test: the test that kills it runs last"
        return "joined by an earlier test"
    try:
        ahead = shared.started.result(timeout=allow(600)) if shared.started is not None else None
    except Exception as exc:  # started the usual way below (swarm-2node.sh up copies the image)
        print(f"node 2 could not be started ahead: {exc}")
        ahead = None
    if ahead is not None and not docker("ps", "-q", "--filter", f"name=^{NODE2}$").stdout.split():
        ahead = None
    shared.swarm.join_node2(IMAGE, started=ahead is not None)
    shared.joined = True
    run(shlex.split(DOCUMENTED["heartbeat"]))
    return f"started ahead in {ahead:.1f} s, joined" if ahead is not None else "up"


def _cut_node_2_and_back(fault: Stack, swarm: Swarm, remote: list[str], lease: float) -> tuple[float, float, int]:
    """Node 2 cut off for :data:`CUT` s (longer than job 2's lease, shorter than Swarm's node-down time): its
    workers are expired during the cut, the manager's go on, and once the network is back node 2's workers
    register again from the same tasks: Swarm shut none down and started none (docker-stack.yml: Partitions).
    (Seconds from the cut to their expiry, from the network's return to all 4 active, the step at the cut.)"""
    tasks = {t["ID"] for t in fault.tasks("worker")}
    wall = time.time()
    with swarm.cut_node2() as cut:
        at = fault.get("/v1/status")["global_step"]
        fault.wait_status(lambda s: s["workers"]["active"] == 2, allow(lease + 5), "node 2's workers to expire")
        expired = time.monotonic() - cut[0]
        going_on = fault.get("/v1/status")["global_step"]
        wait_for(lambda: time.monotonic() - cut[0] >= CUT, CUT + 1, "the cut's end", interval=0.2)
        assert fault.get("/v1/status")["global_step"] > going_on + 10  # the manager's 2 go on meanwhile
    fault.wait_status(lambda s: s["workers"]["active"] == 4, allow(15), "node 2's workers back after the cut")
    back = time.monotonic() - cut[1]
    assert swarm.nodes().get(NODE2) == "Ready"
    now = fault.tasks("worker")
    assert {t["ID"] for t in now} == tasks and all(t["DesiredState"] == "Running" for t in now), now  # none replaced
    rejoined = [e["name"] for e in fault.workers()["events"] if e["event"] == "rejoined" and e["time"] >= wall]
    assert sorted(rejoined) == remote, rejoined  # each once, under its name
    return expired, back, at


def _spread_job_checked(st: Stack, swarm: Swarm, manager: str, steps: int, ref: dict) -> None:
    """A job of ``steps`` float64 steps, 2 workers on each node, done: every worker pushed every round over TCP, and
    the final weights are bit-identical to one process training on the 4 shards (``ref``)."""
    done = st.wait_status(lambda s: s["state"] == "done", allow(180), f"{st.name} to finish")
    assert done["global_step"] == steps and done["pushes"]["accepted"] == 4 * steps
    placed = sorted(t["Node"] for t in st.tasks("worker"))  # finished tasks: 2 on each node
    assert placed == sorted([manager] * 2 + [NODE2] * 2), placed
    workers = by_name(st)
    assert len(workers) == 4 and {w["transport"] for w in workers.values()} == {"http"}
    assert all(w["pushes"]["accepted"] == steps for w in workers.values())
    got = final_weights(st, swarm.tokens[TOKEN])
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == np.float64 and got[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical"


def _colocated_job_checked(colo: Stack, swarm: Swarm, manager: str, steps: int, ref: dict, deployed: float) -> float:
    """Job 3 (deploy/swarm/colocated.yml) done: shard 0 on the manager, shard 1 on node 2, both at the last step;
    2 workers beside each, the manager's reaching shard 0 by files and node 2's over the overlay (as shard 0 sees
    them); shard 0's pieces bit-identical to one process (shard 1 is reached only inside the overlay). Seconds
    from ``deployed`` (monotonic) to done."""
    done = colo.wait_status(settled, allow(180), "the co-located job to finish on both shards")
    assert done["global_step"] == steps and done["pushes"]["accepted"] == 4 * steps
    assert colo.placed("ps") == {manager} and colo.placed("ps-1") == {NODE2}
    placed = {f"{colo.name}_worker-{t['Name'].rsplit('.', 1)[1]}": t["Node"] for t in colo.tasks("worker")}
    assert sorted(placed.values()) == sorted([manager] * 2 + [NODE2] * 2), placed
    seen = {w["name"]: w["transport"] for w in colo.workers()["workers"]}
    assert seen == {n: "shm" if node == manager else "http" for n, node in placed.items()}, (seen, placed)
    client = PSClient(colo.url, timeout=allow(10.0), attempts=3, token=swarm.tokens[TOKEN])
    try:
        m = shards.from_wire(client.endpoint.call_json("GET", "/v1/shards")["map"])
        own = client.pull(0, wait=allow(5.0)).tensors  # the coordinator's pieces
    finally:
        client.close()
    want = shards.split(ref, m.pieces[0])
    assert own.keys() == want.keys() and own
    for k in want:
        assert own[k].tobytes() == np.ascontiguousarray(want[k]).tobytes(), f"{k}: not bit-identical"
    return time.monotonic() - deployed
