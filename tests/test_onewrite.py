"""ps_service/transport/onewrite.py: a fast-lane answer's head and body leave in one write.

The unit tests drive :func:`one_write_send` as uvicorn's cycle does (the head written while the start message
is sent, the body with the body message); the live test fails loudly, naming what moved, if a uvicorn upgrade
writes answers another way (then nothing is held: the head goes out alone, as before this module)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from ps_service.transport import onewrite
from tests.live_ps import live_ps, read_response


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def write(self, data) -> None:
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, parts) -> None:
        self.calls.append(("writelines", [bytes(p) for p in parts]))

    def close(self) -> None:
        self.calls.append(("close", []))


def _drive(messages, writes_during_start=True, fail_on=None):
    inner = Recorder()
    transport = onewrite.OneWriteTransport(inner)

    async def server_send(message):  # what uvicorn's RequestResponseCycle.send does with its transport
        if message["type"] == fail_on:
            raise RuntimeError("the client went away")
        if message["type"] == "http.response.start" and writes_during_start:
            transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        elif message["type"] == "http.response.body":
            transport.write((b"" if writes_during_start else b"HTTP/1.1 200 OK\r\n\r\n") + message["body"])

    send = onewrite.one_write_send({onewrite.KEY: transport}, server_send)

    async def run():
        for m in messages:
            await send(m)
    try:
        asyncio.run(run())
    except RuntimeError:
        pass
    return inner.calls, transport


START, BODY = {"type": "http.response.start", "status": 200}, {"type": "http.response.body", "body": b"abc"}


def test_the_head_waits_for_the_body_and_both_leave_in_one_call():
    calls, _ = _drive([START, BODY])
    assert calls == [("writelines", [b"HTTP/1.1 200 OK\r\n\r\n", b"abc"])]


def test_a_server_that_writes_nothing_at_start_is_passed_straight_through():
    calls, _ = _drive([START, BODY], writes_during_start=False)
    assert calls == [("write", [b"HTTP/1.1 200 OK\r\n\r\nabc"])]


def test_nothing_stays_held_when_the_body_fails_and_closing_flushes():
    calls, transport = _drive([START, BODY], fail_on="http.response.body")
    assert calls == [("writelines", [b"HTTP/1.1 200 OK\r\n\r\n"])] and not transport.hold  # flushed after it
    transport.hold = True
    transport.write(b"x")
    transport.close()  # what is held goes out before the connection closes
    assert calls[1:] == [("writelines", [b"x"]), ("close", [])]


def test_without_the_ps_protocol_send_is_unchanged():
    async def send(message):
        pass
    assert onewrite.one_write_send({}, send) is send


def test_a_live_fast_lane_answer_is_written_once(monkeypatch):
    recorded: list[Recorder] = []
    real_init = onewrite.OneWriteTransport.__init__

    class Tee(Recorder):  # records, then writes for real; anything else is the real transport's
        def __init__(self, inner):
            super().__init__()
            self.real = inner

        def write(self, data):
            super().write(data)
            self.real.write(data)

        def writelines(self, parts):
            super().writelines(parts)
            self.real.writelines(parts)

        def close(self):
            self.real.close()

        def __getattr__(self, name):
            return getattr(self.real, name)

    def recording_init(self, inner):
        real_init(self, Tee(inner))
        recorded.append(self.inner)
    monkeypatch.setattr(onewrite.OneWriteTransport, "__init__", recording_init)
    with live_ps() as ps:
        with socket.create_connection(("127.0.0.1", ps.port), timeout=10) as s:
            s.sendall(b"GET /v1/model?timeout=0 HTTP/1.1\r\nhost: ps\r\n\r\n")  # the fast lane: 409 not_initialized
            status, body = read_response(s)
    assert status == 409 and b"not_initialized" in body
    assert recorded, "the PS's protocol no longer wraps its transport (ps_service/transport/bodysink.py)"
    answers = [c for rec in recorded for c in rec.calls if c[1] and c[1][0].startswith(b"HTTP/1.1 409")]
    assert len(answers) == 1 and answers[0][0] == "writelines" and len(answers[0][1]) == 2, (
        f"uvicorn no longer writes an answer's head while the start message is sent: {answers}")
