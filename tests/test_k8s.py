"""The Kubernetes manifests (deploy/k8s) and PS_REQUIRE_AUTH, the PS's refusal to start without a token.

No cluster runs here (no kubectl either): every manifest is validated against the API schemas of a
current Kubernetes (``kubernetes-validate``, strict: an unknown field fails), and the wiring between the
objects that Kubernetes would only check at run time is checked here: the kustomization lists exactly
the folder's files, no token value is written anywhere, every env name is a real setting whose value
parses, probes, volumes, the token files, the headless Service and the workers' URL point at each other.
``PS_REQUIRE_AUTH`` is tested on the real ``python -m ps_service`` process.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from cluster.processes import LocalCluster, free_port
from ps_service.settings import PSSettings
from worker_service.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
#: the newest Kubernetes release the pinned kubernetes-validate has schemas for
K8S_VERSION = "1.37.0"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())
SECRET, SECRET_KEY = "syncps-token", "token"
TOKEN = "k8s-test-4e1f9a0c7b3d5e2f8a6c1b0d9e7f3a5c"
MONITOR = "k8s-watch-7c2e5a9f1b3d0e8c6a4f2b1d9e7c5a3f"


def objects() -> dict[str, dict]:
    """kind -> the object (one of each kind here)."""
    docs = [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind: the checks below name them by kind"
    return by_kind


OBJ = objects()
PS, SERVICE, WORKERS = OBJ["StatefulSet"], OBJ["Service"], OBJ["Deployment"]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_values(workload: dict) -> dict[str, str | None]:
    """name -> value (None: taken from a Secret or the pod's fields)."""
    return {e["name"]: e.get("value") for e in container(workload)["env"]}


def env_names(cls, prefix: str) -> set[str]:
    return {prefix + name.upper() for name in cls.model_fields}


# ---- schemas ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all(path.read_text()):
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == "1.37"


def test_strict_validation_refuses_an_unknown_field():
    """Not vacuous: a misspelt field (what a schema-less YAML check would let through) fails."""
    bad = copy.deepcopy(PS)
    container(bad)["livenesProbe"] = container(bad).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_exactly_the_files_of_the_folder():
    resources = KUSTOMIZATION["resources"]
    assert KUSTOMIZATION["kind"] == "Kustomization" and len(resources) == len(set(resources))
    assert sorted(resources) == [p.name for p in MANIFESTS]
    assert not (set(KUSTOMIZATION) & {"secretGenerator", "configMapGenerator"})


def test_no_token_value_anywhere():
    """The token lives in the cluster only: no Secret object, no token-named env var with a value, no
    string that looks like a token."""
    assert "Secret" not in OBJ
    for workload in (PS, WORKERS):
        for e in container(workload)["env"]:
            if "TOKEN" in e["name"] and not e["name"].endswith("_FILE"):
                assert "value" not in e and set(e["valueFrom"]) == {"secretKeyRef"}, e
    for path in [*MANIFESTS, K8S / "kustomization.yaml"]:
        assert not re.findall(r"[A-Za-z0-9+/_-]{32,}", path.read_text()), path


# ---- settings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("workload, cls, prefix", [(PS, PSSettings, "PS_"), (WORKERS, WorkerSettings, "WORKER_")],
                         ids=["ps", "worker"])
def test_env_names_are_settings_and_their_values_parse(workload, cls, prefix, tmp_path, monkeypatch):
    env = env_values(workload)
    unknown = sorted(set(env) - env_names(cls, prefix))
    assert not unknown, f"{workload['metadata']['name']} sets {unknown}: not fields of {cls.__name__}"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    for name in [n for n in os.environ if n.startswith(prefix)]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.endswith("_AUTH_TOKEN_FILE"):
            value = str(token_file)  # where the Secret is mounted in the pod
        if value is not None:
            monkeypatch.setenv(name, value)
    settings = cls()
    assert settings.auth_token.get_secret_value() == TOKEN
    assert settings.shm_dir == ""  # pods share no /dev/shm: every tensor goes over TCP


# ---- wiring -------------------------------------------------------------------------------------------
def named_port(workload: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container(workload)["ports"] if p["name"] == port)


def mount_of(workload: dict, volume: str) -> str:
    return next(m["mountPath"] for m in container(workload)["volumeMounts"] if m["name"] == volume)


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
    notes = PS["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": env["PS_PORT"],
                     "prometheus.io/path": "/metrics"}
    assert named_port(PS, "http") == int(env["PS_PORT"])
    monitor = next(e for e in c["env"] if e["name"] == "PS_MONITOR_TOKEN")["valueFrom"]["secretKeyRef"]
    assert monitor["name"] == SECRET  # the scraper's bearer token comes from the same Secret


@pytest.mark.parametrize("workload, var", [(PS, "PS_AUTH_TOKEN_FILE"), (WORKERS, "WORKER_AUTH_TOKEN_FILE")],
                         ids=["ps", "worker"])
def test_token_file_is_the_secret_mounted(workload, var):
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    (name,) = [n for n, v in volumes.items() if v.get("secret", {}).get("secretName") == SECRET]
    (item,) = volumes[name]["secret"]["items"]
    assert item["key"] == SECRET_KEY
    assert env_values(workload)[var] == f"{mount_of(workload, name)}/{item['path']}"


def test_workers_reach_the_ps_through_its_headless_service():
    spec = SERVICE["spec"]
    assert spec["clusterIP"] == "None" and PS["spec"]["serviceName"] == SERVICE["metadata"]["name"]
    # the PS is ready only once a worker has initialised the model: workers must find it before that
    assert spec["publishNotReadyAddresses"] is True
    assert spec["selector"].items() <= PS["spec"]["template"]["metadata"]["labels"].items()
    (port,) = spec["ports"]
    url = urlsplit(env_values(WORKERS)["WORKER_PS_URL"])
    assert (url.scheme, url.hostname, url.port) == ("http", SERVICE["metadata"]["name"], port["port"])
    assert named_port(PS, port["targetPort"]) == int(env_values(PS)["PS_PORT"])


def test_workers_are_a_deployment_of_four_scaled_by_name():
    assert WORKERS["metadata"]["name"] == "syncps-worker"  # kubectl scale deployment/syncps-worker
    assert WORKERS["spec"]["replicas"] == 4
    assert WORKERS["spec"]["selector"]["matchLabels"].items() <= WORKERS["spec"]["template"]["metadata"]["labels"].items()
    # each worker registers under its pod's name
    name = next(e for e in container(WORKERS)["env"] if e["name"] == "WORKER_NAME")
    assert name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize("obj", list(OBJ.values()), ids=list(OBJ))
def test_labels_image_and_resources(obj):
    assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "syncps"
    if obj["kind"] == "Service":
        return
    c = container(obj)
    assert c["image"] == "syncps:latest"
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(c["resources"]["limits"])


# ---- PS_REQUIRE_AUTH ------------------------------------------------------------------------------------
def run_ps(env: dict[str, str], deadline: float = 30.0) -> subprocess.CompletedProcess:
    """``python -m ps_service`` with only ``env`` among the PS_* variables, expected to exit by itself."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    return subprocess.run([sys.executable, "-m", "ps_service"], env={**clean, "PS_HOST": "127.0.0.1",
                          "PS_PORT": str(free_port()), **env}, capture_output=True, text=True, timeout=deadline)


MAKE_IT = ("docker secret create syncps_token -",
           "kubectl create secret generic syncps-token --from-literal=token=$(openssl rand -hex 32)")


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


def test_ps_with_a_token_file_starts_and_guards_its_routes(tmp_path):
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")  # as `kubectl create secret ... --from-file` may leave it
    ps = LocalCluster(workers=1, ps_env={"PS_REQUIRE_AUTH": "true", "PS_AUTH_TOKEN_FILE": secret,
                                         "PS_MONITOR_TOKEN": MONITOR})
    try:
        ps.start_ps()  # polls /healthz, open to probes
        with httpx.Client(base_url=ps.url, timeout=10.0) as http:
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
