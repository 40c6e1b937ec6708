"""One PS's tensor transport chosen again when the PS asks (worker_service/transport/attach.py), through a mock
transport."""
from __future__ import annotations

import numpy as np
import pytest

from shared.compression import Spec
from shared.errors import ProtocolError
from shared.protocol import API
from worker_service.transport.attach import Attached
from worker_service.transport.endpoint import Endpoint
from worker_service.transport.mock import Answer, MockTransport, Request


def attached(codes: list[str]) -> tuple[Attached, list[str]]:
    """A transport whose PS refuses the first pushes with ``codes`` (409 each), then accepts."""
    seen = []

    def handler(r: Request) -> Answer:
        seen.append(f"{r.method} {r.path}")
        if codes:
            return Answer.of_json({"error": codes.pop(0), "detail": "the PS restarted"}, 409)
        return Answer.of_json({"status": "accepted", "step": r.frame().meta["step"], "done": False})

    ep = Endpoint("http://ps", MockTransport(handler), timeout=5.0, attempts=1, retry_timeout=5.0, token=None)
    return Attached(ep, None, None, Spec()), seen


@pytest.mark.parametrize("codes", [["shm_not_attached"], ["shm_torn", "shm_not_attached"]])
def test_a_push_the_ps_asks_to_attach_again_is_sent_again_and_starts_the_next_batch_once(codes):
    t, seen = attached(list(codes))
    calls = []
    answer = t.push({"step": 3}, {"w": np.ones(2, np.float32)}, 1.0, 1.0, on_way=lambda: calls.append(1))
    assert (answer.status, answer.step) == ("accepted", 3) and calls == [1]
    assert seen == [f"POST {API}/gradients"] * (len(codes) + 1) and t.name == "http"


def test_other_refusals_are_raised_at_once():
    t, seen = attached(["stale_step"])
    with pytest.raises(ProtocolError) as err:
        t.push({"step": 3}, {"w": np.ones(2, np.float32)}, 1.0, 1.0)
    assert (err.value.status, err.value.code) == (409, "stale_step") and len(seen) == 1


@pytest.mark.parametrize("exc, level", [(OSError(28, "No space left on device"), "WARNING"),
                                        (FileNotFoundError(2, "no such file"), "INFO")])
def test_a_gradient_file_without_room_is_a_warning_another_host_is_not(exc, level, monkeypatch, caplog):
    """ENOSPC (the PS's directory too small for this worker's file: a size to fix) is a WARNING naming the
    directory; no weights file to map (the PS on another host) is the expected INFO. Both send request bodies."""
    from worker_service.transport import attach

    def handler(r: Request) -> Answer:
        return Answer.of_json({"weights_file": "w", "region_bytes": 8, "nonce": "00"})

    def refuse(*args, **kwargs):
        raise exc
    monkeypatch.setattr(attach.ShmTransport, "open", refuse)
    ep = Endpoint("http://ps", MockTransport(handler), timeout=5.0, attempts=1, retry_timeout=5.0, token=None)
    with caplog.at_level("INFO", logger="worker"):
        t = Attached(ep, "w1", "/dev/shm", Spec())
    assert t.name == "http"
    [rec] = [r for r in caplog.records if "request bodies" in r.getMessage()]
    assert rec.levelname == level and ("/dev/shm has no room" in rec.getMessage()) == (level == "WARNING")
