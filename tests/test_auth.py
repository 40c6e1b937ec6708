"""Access control: bearer tokens on a real PS (uvicorn on loopback), and a forged push during a live
training run (real worker processes) that changes nothing."""
from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
from ps_service.app import create_app
from ps_service.settings import PSSettings
from shared import frame
from tests.live_ps import live_ps, raw_exchange, state_hash
from tests.reference import train_reference
from tests.wire import FRAME, push_frame
from worker_service.client import PSClient
from worker_service.settings import WorkerSettings

TOKEN = "train-3f9c1e7a5b2d4c6e8f0a1b3c5d7e9f11"
MONITOR = "watch-0a2b4c6d8e1f3a5b7c9d0e2f4a6b8c9d"
W0 = {"w": np.zeros((3, 1), np.float32), "b": np.zeros(1, np.float32)}
OPEN = {"/healthz", "/readyz", "/"}  # "/": the static dashboard page (no data; its script sends the token)


# ---- settings ------------------------------------------------------------------------------------------------
def test_tokens_never_show_in_repr_or_dumps():
    s = PSSettings(auth_token=TOKEN, monitor_token=MONITOR)
    for text in (repr(s), str(s), s.model_dump_json(), str(s.model_dump())):
        assert TOKEN not in text and MONITOR not in text
    assert s.auth_token.get_secret_value() == TOKEN
    w = WorkerSettings(auth_token=TOKEN)
    assert TOKEN not in repr(w) and TOKEN not in w.model_dump_json()


def test_token_from_a_docker_secret_file(tmp_path):
    secret = tmp_path / "ps_token"
    secret.write_text(TOKEN + "\n")
    assert PSSettings(auth_token_file=secret).auth_token.get_secret_value() == TOKEN
    assert WorkerSettings(auth_token_file=secret).auth_token.get_secret_value() == TOKEN
    assert PSSettings(monitor_token_file=secret).monitor_token.get_secret_value() == TOKEN
    with pytest.raises(ValueError, match="PS_MONITOR_TOKEN or PS_MONITOR_TOKEN_FILE"):
        PSSettings(monitor_token="x", monitor_token_file=secret)
    with pytest.raises(ValidationError, match="not both"):
        PSSettings(auth_token="x", auth_token_file=secret)
    with pytest.raises(ValidationError, match="cannot read"):
        PSSettings(auth_token_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValidationError, match="empty"):
        PSSettings(auth_token_file=tmp_path / "empty")


def test_empty_token_means_none(monkeypatch):
    monkeypatch.setenv("PS_AUTH_TOKEN", "")  # compose passes ${PS_AUTH_TOKEN:-} when .env has none
    assert PSSettings().auth_token is None


def test_every_route_is_guarded_or_deliberately_open():
    """Fail closed: a route someone adds later without an auth dependency fails this test. Read from the
    OpenAPI schema, where the auth dependencies declare their bearer schemes."""
    schema = create_app(PSSettings()).openapi()
    seen = set()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            schemes = {name for req in op.get("security", []) for name in req}
            seen.add(path)
            if path in OPEN:
                assert not schemes, path
            elif "training" in op["tags"]:
                assert schemes == {"trainingToken"}, f"{method} {path}: {schemes}"
            else:
                assert schemes == {"monitorToken"}, f"{method} {path} has no auth dependency"
    assert {"/v1/gradients", "/v1/model", "/v1/workers", "/v1/status", "/metrics", "/"} <= seen


def test_production_mode_has_no_docs():
    app = create_app(PSSettings(production=True))
    assert app.openapi_url is None and app.docs_url is None and app.redoc_url is None


# ---- a PS with both tokens -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ps():
    with live_ps(auth_token=TOKEN, monitor_token=MONITOR, lease_seconds=600, startup_grace_seconds=0) as ps:
        c = ps.client(TOKEN)
        wid = c.register("a")["worker_id"]
        assert c.init_model(W0, {"name": "sgd", "learning_rate": 0.1})
        assert c.pull(0, wid, wait=allow(5.0)).step == 0
        ps.wid = wid
        ps.push_body = push_frame(wid, 0, {k: v + 1e6 for k, v in W0.items()})
        yield ps
        c.close()


TRAINING = [("POST", "/v1/workers", "json"), ("POST", "/v1/workers/{wid}/heartbeat", None),
            ("DELETE", "/v1/workers/{wid}", None), ("GET", "/v1/model?timeout=0", None),
            ("PUT", "/v1/model", "init"), ("POST", "/v1/gradients", "push")]
MONITORING = [("GET", p, None) for p in ("/v1/status", "/v1/workers", "/v1/rounds", "/v1/loss", "/metrics")]
HEALTH = [("GET", "/healthz", None), ("GET", "/readyz", None), ("GET", "/", None), ("GET", "/dashboard.js", None),
          ("GET", "/docs", None), ("GET", "/redoc", None), ("GET", "/openapi.json", None)]  # no data: open
BAD = {"none": None, "wrong": f"Bearer {TOKEN[:-1]}X", "monitor": f"Bearer {MONITOR}", "empty": "Bearer",
       "basic": "Basic dXNlcjpwdw==", "prefix": f"Bearer {TOKEN[:8]}"}  # Authorization header values


def send(ps, method, path, body, authorization):
    content, headers = None, {}
    if body == "json":
        content, headers = b'{"name": "forger"}', {"content-type": "application/json"}
    elif body in ("init", "push"):
        content = ps.push_body if body == "push" else frame.encode_bytes(W0)
        headers = {"content-type": FRAME}
    if authorization is not None:
        headers["Authorization"] = authorization
    with ps.http() as h:
        return h.request(method, path.format(wid=ps.wid), content=content, headers=headers)


@pytest.mark.parametrize("who", sorted(BAD))
@pytest.mark.parametrize("method,path,body", TRAINING, ids=[f"{m} {p}" for m, p, _ in TRAINING])
def test_training_routes_refuse_anything_but_the_training_token(ps, method, path, body, who):
    before, failures = state_hash(ps.rt), ps.rt.auth_failures
    r = send(ps, method, path, body, BAD[who])
    assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
    assert r.headers["www-authenticate"].startswith('Bearer realm="syncps"')
    assert ps.rt.auth_failures == failures + 1
    assert state_hash(ps.rt) == before
    assert TOKEN not in r.text and MONITOR not in r.text


@pytest.mark.parametrize("who", ["none", "wrong", "empty", "basic"])
@pytest.mark.parametrize("method,path,body", MONITORING, ids=[p for _, p, _ in MONITORING])
def test_monitoring_routes_refuse_without_a_token(ps, method, path, body, who):
    failures = ps.rt.auth_failures
    r = send(ps, method, path, body, BAD[who])
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert ps.rt.auth_failures == failures + 1


@pytest.mark.parametrize("token", [MONITOR, TOKEN], ids=["monitor-token", "training-token"])
@pytest.mark.parametrize("method,path,body", MONITORING, ids=[p for _, p, _ in MONITORING])
def test_monitoring_routes_accept_either_token(ps, method, path, body, token):
    r = send(ps, method, path, body, f"Bearer {token}")
    assert r.status_code == 200
    assert TOKEN not in r.text and MONITOR not in r.text


@pytest.mark.parametrize("method,path,body", HEALTH, ids=[p for _, p, _ in HEALTH])
def test_health_stays_open(ps, method, path, body):
    assert send(ps, method, path, body, None).status_code == 200


def test_training_token_works_and_the_scheme_is_case_insensitive(ps):
    assert send(ps, "POST", "/v1/workers/{wid}/heartbeat", None, f"Bearer {TOKEN}").status_code == 200
    with ps.http() as h:
        assert h.post(f"/v1/workers/{ps.wid}/heartbeat", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("method,path,ctype", [("POST", "/v1/gradients", FRAME), ("PUT", "/v1/model", FRAME),
                                               ("POST", "/v1/workers", "application/json")])
def test_unauthenticated_body_is_never_read(ps, method, path, ctype):
    """401 comes before the body: a 1 GiB declared body is refused at once, not waited for."""
    status, body = raw_exchange(ps.port, f"{method} {path} HTTP/1.1\r\nHost: ps\r\nContent-Type: {ctype}\r\n"
                                         f"Content-Length: 1073741824\r\n\r\n".encode())
    assert status == 401 and b"unauthorized" in body


def test_monitoring_is_open_without_a_monitor_token():
    with live_ps(auth_token=TOKEN) as ps, ps.http() as h:
        assert h.get("/v1/status").status_code == 200
        assert h.post("/v1/workers", json={"name": "x"}).status_code == 401
        assert h.post("/v1/workers", json={"name": "x"}, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


# ---- a forged push during a live training run ----------------------------------------------------------------
def test_forged_pushes_during_live_training_change_nothing():
    """Two real workers train linear/float64 with the token; meanwhile a forger pushes huge gradients for the
    current step under the real workers' ids with no token, a wrong one, or a lowercase-mangled one. Every
    forgery is a 401, and the final weights are bit-identical to the single-process reference."""
    steps, workers = 60, 2
    env = {"WORKER_TASK": "linear", "WORKER_DTYPE": "float64", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16,
           "WORKER_COMPUTE_DELAY_SECONDS": 0.01}
    with LocalCluster(workers, ps_env={"PS_MAX_STEPS": steps}, worker_env=env, token=TOKEN) as c:
        def registered():
            ids = [w["worker_id"] for w in c.get("/v1/workers").json()["workers"]]
            return ids if len(ids) == workers else None

        ids = wait_for(registered, allow(60), "the workers to register")
        forged, mid_run, stop = {"none": 0, "wrong": 0, "mangled": 0}, [0], threading.Event()
        bad_headers = {"none": {}, "wrong": {"Authorization": f"Bearer {TOKEN[::-1]}"},
                       "mangled": {"Authorization": f"Bearer {TOKEN.upper()}"}}

        def forge():
            with httpx.Client(base_url=c.url, timeout=allow(5.0)) as h:
                while not stop.is_set():
                    step = c.status()["global_step"]
                    for kind, hdr in bad_headers.items():
                        body = push_frame(ids[forged[kind] % workers], step, {"w": np.full((3, 1), 1e6), "b": np.full(1, 1e6)})
                        r = h.post("/v1/gradients", content=body, headers={"content-type": FRAME, **hdr})
                        assert r.status_code == 401, r.text
                        forged[kind] += 1
                    if 0 < step < steps:
                        mid_run[0] += 1

        t = threading.Thread(target=forge, daemon=True)
        t.start()
        try:
            codes = c.wait_workers(allow(120))
        finally:
            stop.set()
            t.join(allow(10))
        st = c.status()
        metrics = c.get("/metrics").text
        pc = PSClient(c.url, token=TOKEN)
        final = pc.pull(0, wait=allow(5.0))
        pc.close()
        logs = c.log("ps") + "".join(c.log(f"worker-{i}") for i in range(workers))
    assert codes == [0] * workers, logs[-3000:]
    assert st["state"] == "done" and st["global_step"] == steps
    assert mid_run[0] >= 5 and all(n >= 5 for n in forged.values()), (forged, mid_run)
    total = sum(forged.values())
    assert st["pushes"]["accepted"] == steps * workers
    failures = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("ps_auth_failures_total")]
    assert failures and failures[0] >= total
    _, ref = train_reference("linear", workers, steps, batch_size=16, seed=7, dtype="float64")
    for k in ref:
        assert final.tensors[k].tobytes() == ref[k].tobytes(), f"{k}: forged pushes changed the weights"
    assert TOKEN not in logs
    print(f"[auth] {total} forged pushes ({forged}), {mid_run[0]} rounds of them mid-run: all 401, weights exact")
