"""The probe listener (PS_PROBE_PORT, ps_service/probes.py): /healthz and /readyz on a port of their own,
open like on the main port, the protocol's error bodies, and a liveness that follows the main event loop."""
from __future__ import annotations

import httpx
import numpy as np

from cluster.processes import free_port
from ps_service import probes
from tests.live_ps import live_ps


def test_the_probe_port_answers_health_and_readiness_without_a_token():
    port = free_port()
    with live_ps(probe_port=port, auth_token="s3cret", monitor_token="m0n") as ps:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as probe:
            assert probe.get("/healthz").json() == {"status": "ok"}
            r = probe.get("/readyz")
            assert r.status_code == 503 and r.json()["error"] == "not_ready"
            ps.client(token="s3cret").init_model({"w": np.zeros(3, np.float32)})
            assert probe.get("/readyz").json()["status"] == "ready"
            for path in ("/v1/status", "/metrics", "/v1/workers"):  # nothing else is served there
                r = probe.get(path)
                assert r.status_code == 404 and set(r.json()) == {"error", "detail"}


def test_healthz_on_the_probe_port_says_stalled_when_the_main_loop_stops_turning(monkeypatch):
    port = free_port()
    with live_ps(probe_port=port) as ps:
        url = f"http://127.0.0.1:{port}/healthz"
        assert httpx.get(url, timeout=10).status_code == 200
        monkeypatch.setattr(probes, "STALL_SECONDS", -1.0)  # any pulse is too old now
        r = httpx.get(url, timeout=10)
        assert r.status_code == 503 and r.json()["error"] == "stalled"
        assert httpx.get(f"{ps.url}/healthz", timeout=10).status_code == 200  # the main port's says "answers"

