"""The PS's uvicorn protocol (ps_service/transport/bodysink.py) leans on uvicorn's internals: these tests
fail loudly, naming what moved, when an upgrade changes them (the behaviour tests of the body sink are in
tests/test_bench.py: bodies read straight into the sink, a body refused halfway keeps its connection framed).
It also answers malformed HTTP framing with the protocol's JSON error body, and holds no buffer per idle
connection."""
from __future__ import annotations

import inspect
import json
import socket
import threading

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from ps_service.transport import bodysink
from tests.live_ps import live_ps, raw_exchange
from tests.timing import allow

#: the uvicorn releases this protocol was tested with (pyproject.toml bounds the dependency the same way)
TESTED = ((0, 30), (0, 55))


def test_uvicorn_is_a_tested_release():
    version = tuple(int(x) for x in uvicorn.__version__.split(".")[:2])
    assert TESTED[0] <= version < TESTED[1], (
        f"uvicorn {uvicorn.__version__} is outside the tested range: re-run tests/test_bodysink.py, tests/test_bench.py "
        "and tests/test_hostile.py, then widen TESTED and the bound in pyproject.toml")


@pytest.mark.parametrize("method", ["on_headers_complete", "on_body", "on_message_complete", "data_received",
                                    "_unset_keepalive_if_required", "_should_upgrade", "send_400_response",
                                    "connection_made", "connection_lost", "eof_received", "pause_writing",
                                    "resume_writing", "_unsupported_upgrade_warning"])
def test_the_protocol_methods_the_sink_overrides_or_calls_exist(method):
    assert callable(getattr(HttpToolsProtocol, method, None)), (
        f"uvicorn's HttpToolsProtocol.{method} moved: ps_service/transport/bodysink.py relies on it")


@pytest.mark.parametrize("cls, attributes", [
    (HttpToolsProtocol, ("self.parser", "self.cycle", "self.headers", "self.server_state", "self.transport")),
    (RequestResponseCycle, ("self.body", "self.message_event", "self.response_complete", "self.scope")),
])
def test_the_attributes_the_sink_reads_are_set_by_uvicorn(cls, attributes):
    source = inspect.getsource(cls.__init__)
    for attribute in attributes:
        assert f"{attribute} =" in source or f"{attribute}:" in source, (
            f"uvicorn's {cls.__name__} no longer sets {attribute}: ps_service/transport/bodysink.py relies on it")


FRAMING = {
    "bad chunk size": b"transfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "content-length -1": b"content-length: -1\r\n\r\n",
    "content-length abc": b"content-length: abc\r\n\r\n",
    "content-length list": b"content-length: 10, 20\r\n\r\n0123456789",
    "content-length twice": b"content-length: 10\r\ncontent-length: 20\r\n\r\n0123456789",
    "content-length and chunked": b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("tail", FRAMING.values(), ids=FRAMING.keys())
def test_malformed_http_framing_gets_the_json_error_body(tail):
    with live_ps() as ps:
        head = b"POST /v1/gradients HTTP/1.1\r\nhost: ps\r\ncontent-type: application/x-syncps-frame\r\n"
        status, body = raw_exchange(ps.port, head + tail)
        assert status == 400
        answer = json.loads(body)
        assert answer["error"] == "bad_http" and answer["detail"] and set(answer) == {"error", "detail"}
        assert ps.rt.core.version == 0  # nothing reached the PS's state


def test_every_connection_of_a_thread_reads_through_one_buffer():
    mine = bodysink.scratch()
    assert bodysink.scratch() is mine and len(mine) == bodysink.READ_CHUNK
    other: list = []
    thread = threading.Thread(target=lambda: other.append(bodysink.scratch()))
    thread.start()
    thread.join(allow(10))
    assert other and other[0] is not mine  # each event loop's thread has its own


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_an_idle_connection_costs_the_ps_at_most_64_kib():
    """The issue's target: 300 keep-alive connections, each idle after one request (264 KiB each before)."""
    n = 300
    with live_ps(http_keepalive_seconds=120) as ps:
        raw_exchange(ps.port, b"GET /healthz HTTP/1.1\r\nhost: ps\r\n\r\n")  # warm up
        before = _rss_kib()
        conns = []
        try:
            for _ in range(n):
                s = socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10))
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: ps\r\n\r\n")
                conns.append(s)
            for s in conns:
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            grown = _rss_kib() - before
        finally:
            for s in conns:
                s.close()
    assert grown / n <= 64, f"{grown / n:.0f} KiB per idle connection"
