"""The one place a worker's exchanges are retried (worker_service/transport/endpoint.py), through a mock
transport."""
from __future__ import annotations

import logging

import pytest
from pydantic import SecretStr

from shared.errors import ProtocolError
from shared.rawhttp import ConnectionLost
from worker_service.transport.endpoint import Endpoint
from worker_service.transport.mock import Answer, MockTransport, Request


def endpoint(answers: list, attempts: int = 5) -> tuple[Endpoint, list[Request]]:
    """An endpoint whose PS gives ``answers`` in turn (an exception is raised)."""
    seen = []

    def handler(r: Request) -> Answer:
        seen.append(r)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    return Endpoint("http://ps", MockTransport(handler), timeout=7.0, attempts=attempts, retry_timeout=60.0,
                    token=SecretStr("s3cret")), seen


def test_lost_exchanges_and_5xx_are_retried_and_logged(caplog):
    ep, seen = endpoint([ConnectionLost("reset"), Answer(503), Answer.of_json({"ok": 1})])
    with caplog.at_level(logging.WARNING, "worker.retry"):
        assert ep.call_json("POST", "/v1/x", {"a": 1}, params={"n": 2}, what="POST /v1/x (step 4)") == {"ok": 1}
    assert [r.params for r in seen] == [{"n": "2"}] * 3 and seen[0].json() == {"a": 1}
    assert all(r.headers["authorization"] == "Bearer s3cret" and r.timeout == 7.0 for r in seen)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("retrying POST /v1/x (step 4) in ")
    assert "(attempt 2 of 5): ConnectionLost: reset" in lines[0] and "ServerError: 503 from the PS" in lines[1]


def test_a_4xx_is_raised_with_the_ps_code_and_not_retried():
    ep, seen = endpoint([Answer.of_json({"error": "unknown_worker", "detail": "who?"}, 404)])
    with pytest.raises(ProtocolError) as err:
        ep.call("GET", "/v1/model")
    assert (err.value.status, err.value.code, err.value.detail) == (404, "unknown_worker", "who?") and len(seen) == 1
    ep, _ = endpoint([Answer(413, {}, b"too large")])
    with pytest.raises(ProtocolError) as err:
        ep.call("POST", "/v1/gradients")
    assert (err.value.status, err.value.code, err.value.detail) == (413, "http_error", "too large")


def test_attempts_are_counted_and_the_last_error_raised():
    ep, seen = endpoint([ConnectionLost("a"), ConnectionLost("b")], attempts=2)
    with pytest.raises(ConnectionLost, match="b"):
        ep.call("GET", "/v1/status")
    assert len(seen) == 2
