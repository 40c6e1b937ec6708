"""The probe listener (PS_PROBE_PORT, ps_service/probes.py): /healthz and /readyz on a port of their own,
open like on the main port, the protocol's error bodies, and a liveness that follows the main event loop. On by
default (the main port + 1: 8001 beside the default 8000, where the Kubernetes manifests point their probes), which
a PS goes on without when that port is taken; 0 turns it off."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import httpx
import numpy as np
import pytest

from cluster.processes import bindable, free_port
from ps_service import probes
from ps_service.settings import PSSettings
from tests.live_ps import live_ps, raw_exchange
from tests.timing import allow


def port_with_a_free_neighbour() -> int:
    """A free port whose next one is free too (for a PS that takes both)."""
    while True:
        port = free_port()
        if port < 65535 and bindable(port + 1):
            return port


def test_the_default_probe_port_is_the_main_port_plus_one_and_zero_is_none():
    assert PSSettings.model_fields["probe_port"].default is None
    assert PSSettings().probe_listener() == (8001, False)  # beside the default 8000: the k8s manifests' 8001
    assert PSSettings(port=9000).probe_listener() == (9001, False)
    assert PSSettings(probe_port=7000).probe_listener() == (7000, True)  # set: the PS must have it
    assert PSSettings(probe_port=0).probe_listener() == (None, True)
    assert "Unset: the main port + 1 (8001)" in PSSettings.model_fields["probe_port"].description


def test_a_ps_with_the_default_settings_answers_probes_on_the_next_port():
    port = port_with_a_free_neighbour()
    with live_ps(port=port):
        r = httpx.get(f"http://127.0.0.1:{port + 1}/healthz", timeout=allow(10))
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_a_ps_goes_on_without_a_default_probe_port_that_is_taken(caplog):
    port = port_with_a_free_neighbour()
    with socket.create_server(("127.0.0.1", port + 1)) as taken, caplog.at_level("WARNING", "ps_service.probes"):
        with live_ps(port=port) as ps:
            assert httpx.get(f"{ps.url}/healthz", timeout=allow(10)).status_code == 200
        assert taken.getsockname()[1] == port + 1
    assert any("probes answer on the main port only" in r.getMessage() for r in caplog.records)


def test_a_probe_port_that_was_set_must_be_had_and_zero_is_none():
    port = port_with_a_free_neighbour()
    with live_ps(port=port, probe_port=0):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port + 1}/healthz", timeout=allow(10))

    async def listen_on(port: int, required: bool):
        async with probes.listening(None, "127.0.0.1", port, required) as listener:
            return listener

    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(RuntimeError, match="could not take port"):
            asyncio.run(listen_on(taken.getsockname()[1], True))
        assert asyncio.run(listen_on(taken.getsockname()[1], False)) is None


def test_the_probe_server_logs_no_start_or_stop_line_of_its_own():
    """uvicorn logs "Started server process", "Shutting down" and "Finished server process" for every server it runs:
    the PS's main server says them; the probe server's thread did too (each line twice in the PS's log). Its warnings
    still show."""
    seen, uvicorn_log = [], logging.getLogger("uvicorn.error")
    handler = logging.Handler()
    handler.emit = lambda r: seen.append((r.threadName, r.getMessage()))
    level = uvicorn_log.level
    uvicorn_log.setLevel(logging.INFO)
    uvicorn_log.addHandler(handler)

    async def listen():
        async with probes.listening(None, "127.0.0.1", free_port()) as listener:
            uvicorn_log.info("Started server process [%d]", 1)  # the main server's: kept
            said = threading.Thread(target=lambda: uvicorn_log.warning("a warning"), name=listener.thread.name)
            said.start()
            said.join()
            return listener.thread.name

    try:
        probe_thread = asyncio.run(listen())
    finally:
        uvicorn_log.removeHandler(handler)
        uvicorn_log.setLevel(level)
    assert (threading.current_thread().name, "Started server process [1]") in seen
    assert [m for name, m in seen if name == probe_thread] == ["a warning"], seen


def test_the_probe_port_answers_health_and_readiness_without_a_token():
    port = free_port()
    with live_ps(probe_port=port, auth_token="s3cret", monitor_token="m0n") as ps:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=allow(10)) as probe:
            assert probe.get("/healthz").json() == {"status": "ok"}
            r = probe.get("/readyz")
            assert r.status_code == 503 and r.json()["error"] == "not_ready"
            ps.client(token="s3cret").init_model({"w": np.zeros(3, np.float32)})
            assert probe.get("/readyz").json()["status"] == "ready"
            for path in ("/v1/status", "/metrics", "/v1/workers", "/healthz/"):  # nothing else (a 307 was)
                r = probe.get(path)
                assert r.status_code == 404 and set(r.json()) == {"error", "detail"}
        for req in (b"GET /healthz HTTP/1.1\r\n\r\n", b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n"):
            status, body = raw_exchange(port, req)  # RFC 9112 3.2, as on the main port
            assert status == 400 and json.loads(body)["error"] == "bad_http", body


def test_healthz_on_the_probe_port_says_stalled_when_the_main_loop_stops_turning(monkeypatch):
    port = free_port()
    with live_ps(probe_port=port) as ps:
        url = f"http://127.0.0.1:{port}/healthz"
        assert httpx.get(url, timeout=allow(10)).status_code == 200
        monkeypatch.setattr(probes, "STALL_SECONDS", -1.0)  # any pulse is too old now
        r = httpx.get(url, timeout=allow(10))
        assert r.status_code == 503 and r.json()["error"] == "stalled"
        assert httpx.get(f"{ps.url}/healthz", timeout=allow(10)).status_code == 200  # the main port's says "answers"

