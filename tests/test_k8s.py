"""The Kubernetes manifests (deploy/k8s, deploy/k8s-shards, deploy/k8s-standby) and PS_REQUIRE_AUTH, the PS's
refusal to start without a token.

No cluster runs here. Both kustomizations are rendered (tests/kustomize.py, and compared with ``kubectl
kustomize`` where kubectl is installed); every rendered object is validated against the API schemas of a
current Kubernetes (``kubernetes-validate``, strict: an unknown field fails) and scanned by ``checkov``
(pinned, installed once into a venv of its own under the user's cache folder): a finding fails unless
the object carries a ``checkov.io/skip<n>: CKV_...=reason`` annotation, and every such skip must still be
needed. What Kubernetes would only check at run time is checked here: every env name is a real setting
whose value parses (with the pod's fields and ``$(VAR)`` references resolved as the kubelet does), the
start rule, the worker's name from its Job index, the shards' URLs and indexes, probes, volumes, the
token files, the Services, the disruption budgets, the network policies, the security settings, the
image tag and the sizing rule. Real processes: a PS and 4 workers with the pods' environment (the start
rule, the workers' names), deploy/k8s-standby's pair with its tokens taking over from a killed primary,
``PS_REQUIRE_AUTH`` and ``WORKER_STOPPED_EXIT_CODE``.
"""
from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from cluster.processes import LocalCluster, free_port, wait_for
from ps_service.settings import PSSettings
from tests.conftest import degraded
from tests.kustomize import Unsupported, build, kubectl_build
from tests.timing import allow
from worker_service.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
BASE, SHARDED = ROOT / "deploy" / "k8s", ROOT / "deploy" / "k8s-shards"
STANDBY = ROOT / "deploy" / "k8s-standby"
#: the newest Kubernetes release the pinned kubernetes-validate has schemas for
K8S_VERSION = "1.37.0"
CHECKOV = "checkov==3.3.30"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SECRET = "syncps-token"
TOKEN = "k8s-test-4e1f9a0c7b3d5e2f8a6c1b0d9e7f3a5c"
MONITOR = "k8s-watch-7c2e5a9f1b3d0e8c6a4f2b1d9e7c5a3f"
PEER = "k8s-peer-3b8d1f6a0c4e2d9b7a5f3c1e0d8b6a4f"
#: 32+ characters with letters and digits: a token's look (a field name has no digit, a path has slashes)
TOKEN_LIKE = re.compile(r"(?=[\w+-]*\d)(?=[\w+-]*[A-Za-z])[\w+-]{32,}")
#: variables a worker container may set that are not WORKER_* settings
WORKER_EXTRA_ENV = {"JOB_COMPLETION_INDEX", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"}
#: the worker's exit code when the PS holds another model (worker_service/__main__.py)
WRONG_MODEL_EXIT = 3


def render(folder: Path) -> dict[tuple[str, str], dict]:
    """(kind, name) -> the object, as ``kubectl kustomize folder`` renders it."""
    return {(o["kind"], o["metadata"]["name"]): o for o in build(folder)}


RENDERED = {"base": render(BASE), "shards": render(SHARDED), "standby": render(STANDBY)}
OBJ = RENDERED["base"]
PS, SERVICE, WORKERS = OBJ["StatefulSet", "syncps-ps"], OBJ["Service", "syncps-ps"], OBJ["Job", "syncps-worker"]
SHARD_PS = RENDERED["shards"]["StatefulSet", "syncps-ps"]
WORKLOADS = {"ps": PS, "worker": WORKERS, "shard": SHARD_PS}


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    (c,) = pod(workload)["containers"]
    return c


def env_values(workload: dict) -> dict[str, str | None]:
    """name -> value (None: taken from the pod's fields)."""
    return {e["name"]: e.get("value") for e in container(workload)["env"]}


def pod_env(workload: dict, fields: dict[str, str], files: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: ``fields`` answers each fieldRef by its path,
    ``$(NAME)`` takes an earlier variable's value; values under ``files`` name the test's files instead of
    the pod's mounts (mount path -> local path)."""
    out: dict[str, str] = {}
    for e in container(workload)["env"]:
        assert set(e) in ({"name", "value"}, {"name", "valueFrom"}), e
        if "valueFrom" in e:
            assert set(e["valueFrom"]) == {"fieldRef"}, f"{e['name']}: no token or other Secret as a variable"
            value = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), e["value"])
        out[e["name"]] = files.get(value, value)
    return out


def env_names(cls, prefix: str) -> set[str]:
    return {prefix + name.upper() for name in cls.model_fields}


def mount_of(workload: dict, volume: str) -> str:
    return next(m["mountPath"] for m in container(workload)["volumeMounts"] if m["name"] == volume)


def named_port(workload: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container(workload)["ports"] if p["name"] == port)


JOB_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


# ---- rendering and schemas ----------------------------------------------------------------------------
@pytest.mark.parametrize("folder", [BASE, SHARDED, STANDBY], ids=["base", "shards", "standby"])
def test_rendering_is_kubectl_kustomize(folder):
    """tests/kustomize.py renders what kubectl does (where kubectl is installed: else it is the one renderer)."""
    real = kubectl_build(folder)
    if real is None:
        degraded("kustomize rendering (test_k8s.py)", "no kubectl: rendered by tests/kustomize.py alone")
        pytest.skip("kubectl is not installed")
    assert {(o["kind"], o["metadata"]["name"]): o for o in real} == render(folder)


@pytest.mark.parametrize("image, expected", [
    ({"newName": "registry.example/team/syncps", "newTag": "2.0"}, "registry.example/team/syncps:2.0"),
    ({"digest": "sha256:" + "ab" * 32}, "syncps@sha256:" + "ab" * 32)], ids=["name-and-tag", "digest"])
def test_an_overlay_of_your_own_names_the_image_and_the_namespace(image, expected, tmp_path):
    """What docs/guides/kubernetes.md says a user does: an overlay with `namespace:` and `images:` over deploy/k8s."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "training",
        "resources": [os.path.relpath(BASE, tmp_path)], "images": [{"name": "syncps", **image}]}))
    objs = render(tmp_path)
    assert {o["metadata"]["namespace"] for o in objs.values()} == {"training"}
    assert {container(objs[k])["image"] for k in (("StatefulSet", "syncps-ps"), ("Job", "syncps-worker"))} == {expected}
    real = kubectl_build(tmp_path)
    if real is not None:
        assert {(o["kind"], o["metadata"]["name"]): o for o in real} == objs


def test_the_renderer_refuses_what_it_does_not_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(Unsupported, match="commonLabels"):
        build(tmp_path)


@pytest.mark.parametrize("key", [(s, *k) for s, objs in RENDERED.items() for k in objs], ids=lambda k: "/".join(k))
def test_rendered_object_is_valid_kubernetes(key):
    assert kubernetes_validate.validate(RENDERED[key[0]][key[1:]], K8S_VERSION, strict=True) == "1.37"


def test_strict_validation_refuses_an_unknown_field():
    """Not vacuous: a misspelt field (what a schema-less YAML check would let through) fails."""
    bad = copy.deepcopy(PS)
    container(bad)["livenesProbe"] = container(bad).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_exactly_the_files_of_the_folder():
    k = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(k["resources"]) == files and len(k["resources"]) == len(set(k["resources"]))
    assert not (set(k) & {"secretGenerator", "configMapGenerator"})
    assert [p.name for p in SHARDED.iterdir()] == ["kustomization.yaml"]  # the shards: a patch of the base
    assert [p.name for p in STANDBY.iterdir()] == ["kustomization.yaml"]  # the pair too


def test_no_token_value_anywhere():
    """The tokens live in the cluster only: no Secret object, no variable from a Secret, no string that
    looks like a token."""
    for objs in RENDERED.values():
        assert not [k for k in objs if k[0] == "Secret"]
        for w in (objs["StatefulSet", "syncps-ps"], objs["Job", "syncps-worker"]):
            pod_env(w, {JOB_INDEX: "0", POD_INDEX: "0"}, {})  # asserts: only values and pod fields
    for path in [*BASE.glob("*.yaml"), *SHARDED.glob("*.yaml")]:
        assert not TOKEN_LIKE.findall(path.read_text()), path
    assert TOKEN_LIKE.findall(f"token: {TOKEN}")  # not vacuous


# ---- settings -----------------------------------------------------------------------------------------
@pytest.fixture
def token_files(tmp_path, monkeypatch) -> dict[str, str]:
    """The Secret's keys as the pods see them (mount path -> a local file), and no PS_*/WORKER_* from here."""
    for name in [n for n in os.environ if n.startswith(("PS_", "WORKER_"))]:
        monkeypatch.delenv(name)
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "monitor-token").write_text(MONITOR + "\n")
    (tmp_path / "peer-token").write_text(PEER + "\n")
    files = {}
    for w in (PS, WORKERS):
        (volume,) = [v for v in pod(w)["volumes"] if v.get("secret", {}).get("secretName") == SECRET]
        for item in volume["secret"]["items"]:
            files[f"{mount_of(w, volume['name'])}/{item['path']}"] = str(tmp_path / item["key"])
    return files


def settings_of(workload: dict, fields: dict[str, str], files: dict[str, str], monkeypatch):
    """The container's settings object, read from its environment as the service reads it."""
    cls, prefix = (PSSettings, "PS_") if workload["kind"] == "StatefulSet" else (WorkerSettings, "WORKER_")
    env = pod_env(workload, fields, files)
    extra = WORKER_EXTRA_ENV if cls is WorkerSettings else set()
    unknown = sorted(set(env) - env_names(cls, prefix) - extra)
    assert not unknown, f"{workload['metadata']['name']} sets {unknown}: not fields of {cls.__name__}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return cls(), env


@pytest.mark.parametrize("index", [0, 3])
def test_a_worker_is_named_after_its_job_index(index, token_files, monkeypatch):
    """Pod i of the Job registers as syncps-worker-i whatever the pod's own name: a pod run again for the
    index keeps the name, so the PS gives it its worker id and rank back."""
    s, env = settings_of(WORKERS, {JOB_INDEX: str(index)}, token_files, monkeypatch)
    assert s.name == f"syncps-worker-{index}"
    assert s.auth_token.get_secret_value() == TOKEN and s.shm_dir == ""  # pods share no /dev/shm: TCP
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == "1"
    assert s.stopped_exit_code not in (0, WRONG_MODEL_EXIT)  # an evicted worker's index is run again
    # the Job's own variable is this one: it adds JOB_COMPLETION_INDEX only to a container that lacks it
    (defined,) = [e for e in container(WORKERS)["env"] if e["name"] == "JOB_COMPLETION_INDEX"]
    assert defined["valueFrom"]["fieldRef"]["fieldPath"] == JOB_INDEX


def test_ps_settings_parse_with_both_tokens(token_files, monkeypatch):
    s, _ = settings_of(PS, {}, token_files, monkeypatch)
    assert s.require_auth and s.auth_token.get_secret_value() == TOKEN
    assert s.monitor_token.get_secret_value() == MONITOR  # monitoring is closed too
    assert s.shm_dir == "" and s.shards == 1


@pytest.mark.parametrize("ordinal", [0, 1])
def test_shards_take_their_index_from_the_pod_ordinal(ordinal, token_files, monkeypatch):
    s, _ = settings_of(SHARD_PS, {POD_INDEX: str(ordinal)}, token_files, monkeypatch)
    assert s.shard_index == ordinal and s.shards == SHARD_PS["spec"]["replicas"] == 2
    name, svc = SHARD_PS["metadata"]["name"], SHARD_PS["spec"]["serviceName"]
    port = int(env_values(SHARD_PS)["PS_PORT"])
    assert s.shard_url_list == [f"http://{name}-{i}.{svc}:{port}" for i in range(s.shards)]
    assert s.shard_url_list[0] == env_values(WORKERS)["WORKER_PS_URL"]  # workers dial shard 0, the coordinator
    assert SHARD_PS["spec"]["podManagementPolicy"] == "Parallel"  # every shard up at once
    assert s.peer_token.get_secret_value() == PEER  # the coordinator's routes to a follower: not the workers' token
    # the rest of the PS is the base's
    rest = {k: v for k, v in env_values(SHARD_PS).items() if not k.startswith(("PS_SHARD", "PS_PEER_TOKEN"))}
    assert rest == env_values(PS)


@pytest.mark.parametrize("ordinal, role", [(0, "primary"), (1, "standby")])
def test_a_hot_standby_pair_takes_its_roles_from_the_pod_ordinal_on_two_nodes(ordinal, role):
    """deploy/k8s-standby: pod 0 the primary, pod 1 the standby, each the other's peer, on different nodes; the
    workers know both."""
    ps = RENDERED["standby"]["StatefulSet", "syncps-ps"]
    name, svc = ps["metadata"]["name"], ps["spec"]["serviceName"]
    script = container(ps)["command"][2].replace("exec python -m ps_service", 'echo "$PS_ROLE $PS_PEER_URL"')
    done = subprocess.run(["sh", "-c", script], env={"HOSTNAME": f"{name}-{ordinal}"}, capture_output=True,
                          text=True, timeout=allow(10))
    assert done.stdout.split() == [role, f"http://{name}-{1 - ordinal}.{svc}:8000"]
    assert ps["spec"]["replicas"] == 2
    (rule,) = pod(ps)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert rule["labelSelector"]["matchLabels"].items() <= ps["spec"]["template"]["metadata"]["labels"].items()
    urls = env_values(RENDERED["standby"]["Job", "syncps-worker"])["WORKER_PS_URL"].split(",")
    assert urls == [f"http://{name}-{i}.{svc}:8000" for i in (0, 1)]


def test_the_standby_pairs_environment_takes_over_with_the_tokens(token_files, tmp_path):
    """Live, with deploy/k8s-standby's environment (tokens required, production mode; only addresses, ports and the
    checkpoint folder are local): a pair of PS processes and the Job's 4 workers. The primary is kill -9'd once its
    standby is in sync: the standby takes over (the link between the two carries the Secret's peer token, the workers'
    votes the training token, /v1/status needs the monitoring one) and the job ends there, every worker exiting 0."""
    ps = RENDERED["standby"]["StatefulSet", "syncps-ps"]
    jobs = RENDERED["standby"]["Job", "syncps-worker"]
    ps_env = {k: v for k, v in pod_env(ps, {}, token_files).items() if k not in ("PS_HOST", "PS_PORT", "PS_PROBE_PORT")}
    assert Path(ps_env["PS_PEER_TOKEN_FILE"]).read_text().strip() == PEER  # the pair's routes: not the workers' token
    steps = 300
    c = LocalCluster(4, ps_env={**ps_env, "PS_MAX_STEPS": steps, "PS_CHECKPOINT_DIR": tmp_path / "ckpt"}, standby=True)
    monitor = {"Authorization": f"Bearer {MONITOR}"}

    def status(url: str) -> dict:
        try:
            return httpx.get(f"{url}/v1/status", headers=monitor, timeout=allow(5.0)).json()
        except (httpx.HTTPError, ValueError):
            return {}

    try:
        c.start_ps()
        for i in range(4):
            env = pod_env(jobs, {JOB_INDEX: str(i)}, token_files)
            del env["WORKER_PS_URL"]  # the local pair's two URLs
            c.start_worker(i, env={**env, "WORKER_COMPUTE_DELAY_SECONDS": "0.02"})
        wait_for(lambda: (status(c.url).get("pair") or {}).get("standby") == "in_sync"
                 and status(c.url)["global_step"] >= 20, allow(120), "training with the standby in sync")
        c.kill(c.ps)
        took = wait_for(lambda: (lambda s: s if (s.get("pair") or {}).get("role") == "primary" else None)(
            status(c.peer_url)), allow(60), "the standby to take over")
        assert took["pair"]["term"] == 2 and took["global_step"] < steps
        assert c.wait_workers(allow(120)) == [0, 0, 0, 0], c.logs()
        done = status(c.peer_url)
        assert (done["state"], done["global_step"]) == ("done", steps)
        assert httpx.get(f"{c.peer_url}/v1/status", timeout=allow(5.0)).status_code == 401  # no token, no status
    except BaseException:
        c.mark_failed()
        raise
    finally:
        c.stop()


# ---- the start rule, the Job ----------------------------------------------------------------------------
def test_workers_are_an_indexed_job_and_the_ps_waits_for_all_of_them():
    spec = WORKERS["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    n = spec["parallelism"]
    for ps in (PS, SHARD_PS):  # step 0 waits for every deployed worker, up to the start timeout (no hard floor)
        assert env_values(ps)["PS_TOTAL_NUM_REPLICAS"] == str(n) and "PS_MIN_WORKERS" not in env_values(ps)
    assert pod(WORKERS)["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] >= 1
    assert spec["podReplacementPolicy"] == "Failed"  # never two pods under one worker name
    rules = {r["action"]: r for r in spec["podFailurePolicy"]["rules"]}
    assert rules["FailJob"]["onExitCodes"] == {"containerName": container(WORKERS)["name"], "operator": "In",
                                               "values": [WRONG_MODEL_EXIT]}
    assert rules["Ignore"]["onPodConditions"] == [{"type": "DisruptionTarget"}]


def test_the_manifests_environment_starts_with_every_worker(token_files, tmp_path):
    """Live, with the PS's and the workers' environment as the pods get it (only addresses, ports and the
    checkpoint folder are local): 3 of the Job's 4 workers hold step 0 and /v1/status says why; with the
    4th every round has all 4, named after their Job index, and each worker exits 0 at the end."""
    ps_env = {k: v for k, v in pod_env(PS, {}, token_files).items() if k not in ("PS_HOST", "PS_PORT", "PS_PROBE_PORT")}
    c = LocalCluster(4, ps_env={**ps_env, "PS_MAX_STEPS": 3, "PS_CHECKPOINT_DIR": tmp_path / "ckpt"})
    monitor = {"Authorization": f"Bearer {MONITOR}"}

    def worker(i: int) -> None:
        env = pod_env(WORKERS, {JOB_INDEX: str(i)}, token_files)
        del env["WORKER_PS_URL"]  # the local PS's
        c.start_worker(i, env=env)

    try:
        c.start_ps()
        for i in range(3):
            worker(i)

        def three_and_the_model() -> dict | None:
            """A worker registers, then the first one initialises the PS: 3 may be registered before the model is."""
            if len(c.get("/v1/workers", headers=monitor).json()["workers"]) != 3:
                return None
            st = c.get("/v1/status", headers=monitor).json()
            return st if st["state"] != "waiting_for_model" else None

        status = wait_for(three_and_the_model, allow(60), "3 workers and the first one's model")
        assert status["state"] == "waiting_for_workers", status
        assert "waiting for workers: 3 of min_workers 4 registered" in status["wait_reason"], status
        worker(3)
        assert c.wait_workers(allow(120)) == [0, 0, 0, 0], c.logs()
        rounds = c.get("/v1/rounds", headers=monitor).json()["rounds"]
        assert [r["step"] for r in rounds] == [2, 1, 0]
        names = {f"syncps-worker-{i}" for i in range(4)}
        assert all({w["name"] for w in r["contributors"]} == names for r in rounds), rounds
    except BaseException:
        c.mark_failed()
        raise
    finally:
        c.stop()


def test_a_stopped_worker_exits_with_its_code_and_a_done_one_with_0():
    """WORKER_STOPPED_EXIT_CODE, live: worker 1, stopped by SIGTERM in the middle of step 0 (an eviction),
    leaves and exits 143; worker 0 trains the job to its end without it and exits 0."""
    c = LocalCluster(2, ps_env={"PS_MAX_STEPS": 5, "PS_LEASE_SECONDS": 600},
                     worker_env={"WORKER_TASK": "linear", "WORKER_STOPPED_EXIT_CODE": 143})
    try:
        c.start_ps()
        c.start_worker(0)
        c.start_worker(1, env={"WORKER_COMPUTE_DELAY_SECONDS": 600})
        wait_for(lambda: c.status()["global_step"] == 0 and len([
            w for w in c.get("/v1/workers").json()["workers"] if w["state"] == "active"]) == 2, allow(60),
            "step 0 with both")
        c.workers[1].send_signal(signal.SIGTERM)
        assert c.wait_workers(allow(120)) == [0, 143], c.logs()
        status = c.status()
        assert (status["global_step"], status["state"]) == (5, "done"), status
    except BaseException:
        c.mark_failed()
        raise
    finally:
        c.stop()


# ---- wiring -------------------------------------------------------------------------------------------
def test_ps_probes_checkpoints_and_scrape_annotations():
    env, c = env_values(PS), container(PS)
    assert PS["spec"]["replicas"] == 1
    assert env["PS_REQUIRE_AUTH"] == "true"
    probe_port = int(env["PS_PROBE_PORT"])
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert c[probe]["httpGet"]["path"] == path
        assert named_port(PS, c[probe]["httpGet"]["port"]) == probe_port
    (claim,) = PS["spec"]["volumeClaimTemplates"]
    assert mount_of(PS, claim["metadata"]["name"]) == env["PS_CHECKPOINT_DIR"]
    assert PS["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    notes = PS["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": env["PS_PORT"],
                     "prometheus.io/path": "/metrics"}
    assert named_port(PS, "http") == int(env["PS_PORT"])


def test_workers_reach_the_ps_through_its_headless_service():
    spec = SERVICE["spec"]
    assert spec["clusterIP"] == "None" and PS["spec"]["serviceName"] == SERVICE["metadata"]["name"]
    # the PS is ready only once a worker has initialised the model: workers must find it before that
    assert spec["publishNotReadyAddresses"] is True
    assert spec["selector"].items() <= PS["spec"]["template"]["metadata"]["labels"].items()
    (port,) = spec["ports"]
    url = urlsplit(env_values(WORKERS)["WORKER_PS_URL"])
    # pod 0 of the StatefulSet by its stable name (the PS, or shard 0)
    assert (url.scheme, url.hostname, url.port) == ("http", f"{PS['metadata']['name']}-0.{SERVICE['metadata']['name']}",
                                                    port["port"])
    assert named_port(PS, port["targetPort"]) == int(env_values(PS)["PS_PORT"])


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_pods_are_locked_down(name):
    """No API token, a read-only root filesystem with the writable mounts the service needs, no privilege."""
    w = WORKLOADS[name]
    (account,) = [o for (kind, _), o in OBJ.items() if kind == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False
    assert pod(w)["serviceAccountName"] == account["metadata"]["name"]
    assert pod(w)["automountServiceAccountToken"] is False
    c = container(w)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod(w)["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod(w)["volumes"]}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
    assert writable == {"/tmp", *(mount_of(w, n) for n in claims)}
    assert "emptyDir" in volumes[next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp")]
    env = env_values(w)
    assert env.get("PS_SHM_DIR", env.get("WORKER_SHM_DIR")) == ""  # nothing written to /dev/shm either


@pytest.mark.parametrize("name", ["ps", "worker"])
def test_token_files_are_the_secret_mounted(name):
    w = WORKLOADS[name]
    (volume,) = [v for v in pod(w)["volumes"] if v.get("secret", {}).get("secretName") == SECRET]
    paths = {f"{mount_of(w, volume['name'])}/{i['path']}": i["key"] for i in volume["secret"]["items"]}
    files = {v: paths[v] for k, v in env_values(w).items() if k.endswith("TOKEN_FILE")}
    assert sorted(files.values()) == (["monitor-token", "token"] if name == "ps" else ["token"])


def test_disruption_budgets_cover_each_workload_one_pod_at_a_time():
    budgets = [o for (kind, _), o in OBJ.items() if kind == "PodDisruptionBudget"]
    for w in (PS, WORKERS):
        labels = w["spec"]["template"]["metadata"]["labels"]
        (b,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert b["spec"]["maxUnavailable"] == 1 and b["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_network_policies_let_only_workers_shards_and_the_scraper_in():
    policies = {o["metadata"]["name"]: o["spec"] for (kind, _), o in OBJ.items() if kind == "NetworkPolicy"}
    ps_labels, worker_labels = (w["spec"]["template"]["metadata"]["labels"] for w in (PS, WORKERS))
    port = [{"port": int(env_values(PS)["PS_PORT"]), "protocol": "TCP"}]
    ps, worker = policies["syncps-ps"], policies["syncps-worker"]
    for p, labels in ((ps, ps_labels), (worker, worker_labels)):
        assert p["podSelector"]["matchLabels"].items() <= labels.items() and p["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = ps["ingress"]
    assert rule["ports"] == port
    peers = [(f.get("namespaceSelector"), f["podSelector"]["matchLabels"]) for f in rule["from"]]
    assert [p for p in peers if p[0] is None and p[1].items() <= worker_labels.items()]
    assert [p for p in peers if p[0] is None and p[1].items() <= ps_labels.items()]
    assert (({}, {"syncps-scraper": "true"}) in peers) and len(peers) == 3  # the scraper, from any namespace
    assert "ingress" not in worker  # workers accept nothing
    for p in (ps, worker):  # egress: the PS's port on PS pods, and DNS
        to_ps, dns = p["egress"]
        assert to_ps["ports"] == port and to_ps["to"][0]["podSelector"]["matchLabels"].items() <= ps_labels.items()
        assert "to" not in dns and {q["port"] for q in dns["ports"]} == {53}


def test_image_is_pinned_to_the_package_version():
    for objs in RENDERED.values():
        for w in (objs["StatefulSet", "syncps-ps"], objs["Job", "syncps-worker"]):
            assert container(w)["image"] == f"syncps:{VERSION}"
            assert container(w)["imagePullPolicy"] == "IfNotPresent"  # justified for checkov in the annotations
            assert w["metadata"]["namespace"] == "syncps"


def test_sizing_follows_the_cost_model():
    """deploy/k8s/ps-statefulset.yaml's rule at its stated point: M = 100 MB, adam (k = 2), N = the Job's."""
    m, k, n = 100e6, 2, WORKERS["spec"]["parallelism"]
    keep = PSSettings.model_fields["checkpoint_keep"].default
    assert "PS_CHECKPOINT_KEEP" not in env_values(PS)

    def size(q: str) -> float:
        units = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30}
        return float(q[:-2]) * units[q[-2:]] if q[-2:] in units else float(q)

    ps_mem = container(PS)["resources"]
    assert ps_mem["requests"]["memory"] == ps_mem["limits"]["memory"]  # memory is not overcommitted
    assert size(ps_mem["limits"]["memory"]) >= 90e6 + (n + 1 + k) * m + 4 * (1 + k) * m
    (claim,) = PS["spec"]["volumeClaimTemplates"]
    assert size(claim["spec"]["resources"]["requests"]["storage"]) >= (keep + 1) * (1 + k) * m
    w = container(WORKERS)["resources"]
    assert w["requests"] == w["limits"] and size(w["limits"]["memory"]) >= 150e6 + 4 * m
    assert w["limits"]["cpu"] == env_values(WORKERS)["OPENBLAS_NUM_THREADS"]  # one BLAS thread, one CPU


# ---- checkov --------------------------------------------------------------------------------------------
def checkov_bin() -> Path:
    """checkov from a venv of its own, made once under the user's cache folder (it pins other versions of
    packages the suite uses, e.g. networkx and packaging); concurrent sessions wait for one install."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "syncps"
    home = cache / CHECKOV.replace("==", "-")
    exe, done = home / "bin" / "checkov", home / ".installed"
    if done.exists():
        return exe
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return exe
        venv.EnvBuilder(with_pip=False, clear=True).create(home)  # clear: what an interrupted install left
        r = subprocess.run([sys.executable, "-m", "pip", "--python", str(home / "bin" / "python"), "install", "-q",
                            "--disable-pip-version-check", CHECKOV], capture_output=True, text=True, timeout=allow(600))
        if r.returncode != 0 and ("Could not find a version" in r.stderr or "No matching distribution" in r.stderr):
            reason = f"cannot install {CHECKOV} here: {r.stderr.strip().splitlines()[-1]}"
            degraded("checkov (test_k8s.py)", f"skipped: {reason}")
            pytest.skip(reason)
        assert r.returncode == 0, r.stderr[-3000:]
        done.touch()
    return exe


def scan(renders: dict[str, list[dict]], folder: Path) -> dict:
    """checkov's results (failed, skipped) for each render written to a file of its own in ``folder``."""
    folder.mkdir()
    for name, objects in renders.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    r = subprocess.run([str(checkov_bin()), "-d", str(folder), "--framework", "kubernetes", "--skip-download",
                        "-o", "json"], capture_output=True, text=True, timeout=allow(240))
    out = json.loads(r.stdout) if r.stdout.strip() else {}
    assert "results" in out, r.stdout[-2000:] + r.stderr[-3000:]
    return out["results"]


def where(finding: dict) -> tuple[str, str, str]:
    return finding["check_id"], finding["file_path"], finding["resource"]


def without_skips(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    notes = obj["metadata"].get("annotations", {})
    for key in [k for k in notes if k.startswith("checkov.io/skip")]:
        del notes[key]
    return obj


@pytest.mark.timeout(900)  # the first run installs checkov (~70 s on the 2-core VM); later ones take ~10 s
def test_checkov_finds_nothing_unjustified(tmp_path):
    renders = {name: list(objs.values()) for name, objs in RENDERED.items()}
    results = scan(renders, tmp_path / "as-shipped")
    failed = [(*where(f), f["check_name"]) for f in results["failed_checks"]]
    assert not failed, "checkov findings: fix them, or justify each with a checkov.io/skip<n> annotation:\n" + \
        "\n".join(map(str, failed))
    skipped = results["skipped_checks"]
    assert skipped, "the image pull policy and digest are justified, not fixed"
    for s in skipped:
        why = s["check_result"]["suppress_comment"]
        assert len(why.split()) >= 8, f"{where(s)}: say why ({why!r})"
    # every justification is still needed: without the annotations exactly those checks fail
    bare = scan({name: [without_skips(o) for o in objs] for name, objs in renders.items()}, tmp_path / "bare")
    assert sorted(map(where, bare["failed_checks"])) == sorted(map(where, skipped))


# ---- PS_REQUIRE_AUTH ------------------------------------------------------------------------------------
def run_ps(env: dict[str, str], deadline: float = 30.0) -> subprocess.CompletedProcess:
    """``python -m ps_service`` with only ``env`` among the PS_* variables, expected to exit by itself."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    return subprocess.run([sys.executable, "-m", "ps_service"], env={**clean, "PS_HOST": "127.0.0.1",
                          "PS_PORT": str(free_port()), **env}, capture_output=True, text=True, timeout=deadline)


MAKE_IT = ("docker secret create syncps_token -",
           "kubectl -n syncps create secret generic syncps-token --from-literal=token=$(openssl rand -hex 32) "
           "--from-literal=monitor-token=$(openssl rand -hex 32)")


def test_the_guide_and_the_ps_make_the_secret_the_same_way():
    guide = (ROOT / "docs" / "guides" / "kubernetes.md").read_text()
    assert MAKE_IT[1] in guide and f"kubectl -n {OBJ['Job', 'syncps-worker']['metadata']['namespace']} " in MAKE_IT[1]


@pytest.mark.parametrize("token_env", [{}, {"PS_AUTH_TOKEN_FILE": "/run/secrets/syncps/absent"},
                                       {"PS_AUTH_TOKEN": ""}], ids=["no token", "no file", "empty token"])
def test_ps_refuses_to_start_without_a_token(token_env):
    proc = run_ps({"PS_REQUIRE_AUTH": "true", **token_env})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr  # one message, no traceback
    assert lines[0].startswith("python -m ps_service: PS_REQUIRE_AUTH=true: the PS does not start without a "
                               "training token")
    assert all(cmd in lines[0] for cmd in MAKE_IT)
    if token_env.get("PS_AUTH_TOKEN_FILE"):
        assert "'/run/secrets/syncps/absent'" in lines[0]  # which file


def test_require_auth_names_an_empty_token_file(tmp_path):
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValidationError, match=f"PS_REQUIRE_AUTH=true.*'{re.escape(str(empty))}' is empty"):
        PSSettings(require_auth=True, auth_token_file=empty)
    assert PSSettings(require_auth=True, auth_token=TOKEN).auth_token.get_secret_value() == TOKEN
    with pytest.raises(ValidationError,
                       match="PS_REQUIRE_AUTH=true: set PS_AUTH_TOKEN or PS_AUTH_TOKEN_FILE, not both"):
        PSSettings(require_auth=True, auth_token=TOKEN, auth_token_file=empty)  # two tokens: not "without a token"
    assert PSSettings().require_auth is False  # off by default: a local PS stays open


def test_setting_errors_never_echo_a_token(tmp_path):
    secret = tmp_path / "token"
    secret.write_text(TOKEN)
    proc = run_ps({"PS_AUTH_TOKEN": TOKEN, "PS_AUTH_TOKEN_FILE": str(secret), "PS_MONITOR_TOKEN": MONITOR})
    assert proc.returncode != 0 and "not both" in proc.stderr
    assert TOKEN[:8] not in proc.stderr + proc.stdout and MONITOR[:8] not in proc.stderr + proc.stdout


def test_ps_without_the_monitor_key_says_which_file(tmp_path):
    """The Secret made without its monitor-token key: the PS (as deploy/k8s runs it) exits with one line."""
    secret = tmp_path / "token"
    secret.write_text(TOKEN)
    proc = run_ps({"PS_REQUIRE_AUTH": "true", "PS_AUTH_TOKEN_FILE": str(secret),
                   "PS_MONITOR_TOKEN_FILE": str(tmp_path / "monitor-token")})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "PS_MONITOR_TOKEN_FILE" in lines[0] and f"'{tmp_path / 'monitor-token'}'" in lines[0]


def test_ps_with_token_files_starts_and_guards_its_routes(tmp_path):
    secret, monitor = tmp_path / "token", tmp_path / "monitor-token"
    secret.write_text(TOKEN + "\n")  # as `kubectl create secret ... --from-file` may leave it
    monitor.write_text(MONITOR + "\n")
    ps = LocalCluster(workers=1, ps_env={"PS_REQUIRE_AUTH": "true", "PS_AUTH_TOKEN_FILE": secret,
                                         "PS_MONITOR_TOKEN_FILE": monitor})
    try:
        ps.start_ps()  # polls /healthz, open to probes
        with httpx.Client(base_url=ps.url, timeout=allow(10.0)) as http:
            assert http.get("/healthz").status_code == 200
            refused = http.post("/v1/workers", json={"name": "intruder"})
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
            ok = http.post("/v1/workers", json={"name": "w"}, headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200, ok.text
            assert http.get("/metrics").status_code == 401
            scraped = http.get("/metrics", headers={"Authorization": f"Bearer {MONITOR}"})
            assert scraped.status_code == 200 and "ps_auth_failures_total 2.0" in scraped.text
    finally:
        ps.stop()
