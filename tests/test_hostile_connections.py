"""Connections that hold the PS without a request (docs/protocol.md, Connections): one that never sends a request,
or whose request head never ends (slowloris: a header line now and then), is idle and closed after
``PS_HTTP_KEEPALIVE_SECONDS``, as one idle after an answer is (uvicorn armed that timeout only after an answer: such
connections stayed open for ever). A real PS (uvicorn on loopback, the PS's own HTTP protocol) with a 0.5 s timeout,
on its main port and its probe port.
Also what a client written from the docs could not tell before they said it: an unknown method, the shard routes'
integers."""
from __future__ import annotations

import re
import socket
import time

import pytest

from cluster.processes import free_port
from ps_service.http import parse_json
from ps_service.sharding.routes import ApplyRound
from shared.errors import ProtocolError
from tests.live_ps import live_ps, read_response
from tests.timing import allow

KEEPALIVE = 0.5


@pytest.fixture(scope="module")
def ps():
    with live_ps(http_keepalive_seconds=KEEPALIVE, probe_port=free_port()) as ps:
        ps.ports = {"main port": ps.port, "probe port": ps.rt.settings.probe_port}
        yield ps


def closed_after(sock: socket.socket, trickle: bytes = b"", every: float = 0.1) -> float:
    """Seconds until the PS closes ``sock`` with no answer; ``trickle`` is sent a byte every ``every`` s meanwhile."""
    start = time.monotonic()
    sock.settimeout(every)
    for i in range(len(trickle) + int(allow(10) / every)):  # (each recv waits at most ``every``: the trickle's pace)
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
            raise AssertionError("an answer to no request")
        except socket.timeout:
            pass
        if i < len(trickle):
            try:
                sock.sendall(trickle[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
    raise AssertionError("still open after %.1f s" % (time.monotonic() - start))


@pytest.mark.parametrize("port", ["main port", "probe port"])
@pytest.mark.parametrize("sent, trickle", [(b"", b""), (b"GET /v1/status HTTP/1.1\r\n", b""),
                                           (b"GET /v1/status HTTP/1.1\r\n", b"X-Slow: " + b"a" * 60)],
                         ids=["no request", "half a head", "a head a byte every 0.1 s"])
def test_a_connection_without_a_whole_request_head_is_closed_as_idle(ps, sent, trickle, port):
    with socket.create_connection(("127.0.0.1", ps.ports[port]), timeout=allow(10)) as s:
        s.sendall(sent)
        # not scaled: a bound under the trickle's own 6 s is what shows the PS cut a trickling head
        assert KEEPALIVE * 0.8 <= closed_after(s, trickle) < KEEPALIVE + 3.0


def test_a_head_that_ends_in_time_is_answered_and_the_connection_kept(ps):
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        s.sendall(b"Host: ps\r\n\r\n")
        assert read_response(s) == (200, b'{"status":"ok"}')
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: ps\r\n\r\n")  # the same connection: kept alive
        assert read_response(s) == (200, b'{"status":"ok"}')
        assert KEEPALIVE * 0.8 <= closed_after(s) < KEEPALIVE + allow(3.0)  # then idle: closed


@pytest.mark.parametrize("method, status, code", [("BREW", 400, b'"bad_http"'), ("PROPFIND", 405, b'"method_not_allowed"'),
                                                  ("OPTIONS", 405, b'"method_not_allowed"')])
def test_a_method_the_parser_does_not_know_is_bad_http_one_it_knows_405(ps, method, status, code):
    """docs/protocol.md (Query parameters, the bad_http row): BREW is no HTTP method uvicorn's parser reads."""
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(f"{method} /v1/status HTTP/1.1\r\nHost: ps\r\n\r\n".encode())
        got, body = read_response(s)
        assert got == status and code in body


@pytest.mark.parametrize("raw, step", [(b"1", 1), (b"1.0", 1), (b"1e0", 1), (b"1.5", None), (b"true", None),
                                       (b'"1"', None), (b"9007199254740992", None), (b"-1", None)])
def test_an_integer_of_the_shard_routes_json_is_an_integral_json_number(raw, step):
    """docs/protocol-shards.md (POST /v1/shard/apply): 1.0 and 1e0 are 1, as JSON Schema's integers; anything else that
    is not an integer in range is 400 bad_request."""
    body = b'{"step": %s, "contributors": [], "mean_of": 1}' % raw
    if step is None:
        with pytest.raises(ProtocolError) as refused:
            parse_json(body, ApplyRound)
        assert (refused.value.status, refused.value.code) == (400, "bad_request")
    else:
        assert parse_json(body, ApplyRound).step == step


UPGRADE = {"websocket": "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                        "Sec-WebSocket-Version: 13\r\n",
           "h2c": "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"}


@pytest.mark.parametrize("port", ["main port", "probe port"])
@pytest.mark.parametrize("upgrade", sorted(UPGRADE))
def test_an_upgrade_request_without_a_body_is_served_as_plain_http(ps, upgrade, port):
    """docs/protocol.md (the bad_http row): the PS speaks HTTP/1.1 only and answers a request that asks for another
    protocol as one that does not. A websocket upgrade was 403 with an empty text/plain body (uvicorn's websocket
    handler, no route) and the connection closed."""
    with socket.create_connection(("127.0.0.1", ps.ports[port]), timeout=allow(10)) as s:
        for path, status, want in [("/healthz", 200, b'{"status":"ok"}'), ("/v1/nowhere", 404, b'"not_found"')]:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: ps\r\n{UPGRADE[upgrade]}\r\n".encode())
            got, body = read_response(s)
            assert got == status and want in body, (got, body)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: ps\r\n\r\n")  # the same connection, still HTTP/1.1
        assert read_response(s) == (200, b'{"status":"ok"}')


@pytest.mark.parametrize("port", ["main port", "probe port"])
@pytest.mark.parametrize("upgrade", sorted(UPGRADE))
def test_a_request_pipelined_behind_an_upgrade_request_is_answered(ps, upgrade, port):
    """The parser pauses where an Upgrade head ends: the bytes read after it, a request sent in the same packet,
    were dropped and that request never answered (the client waited out its timeout)."""
    with socket.create_connection(("127.0.0.1", ps.ports[port]), timeout=allow(10)) as s:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: ps\r\n{UPGRADE[upgrade]}\r\n"
                  "GET /v1/nowhere HTTP/1.1\r\nHost: ps\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := s.recv(65536):  # to the close the second request asked for
            got += chunk
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", got) == [b"200", b"404"], got


@pytest.mark.parametrize("upgrade", sorted(UPGRADE) + ["foo"])
@pytest.mark.parametrize("path, ctype", [("/v1/workers", "application/json"),
                                         ("/v1/gradients", "application/x-syncps-frame")])
def test_an_upgrade_request_with_a_body_is_bad_http_and_nothing_changes(ps, upgrade, path, ctype):
    """The HTTP parser switches protocols at the end of an Upgrade request's head and never reads its body: a
    registration so sent was refused 400 bad_content_length ("the body is shorter", though it was whole), its body
    then read as the connection's next request, and a websocket one never answered. Now 400 bad_http, closed."""
    before = ps.rt.core.members.by_id.copy(), ps.rt.core.global_step
    inner = b"GET /v1/nowhere-smuggled HTTP/1.1\r\nHost: ps\r\n\r\n"
    heads = UPGRADE.get(upgrade, "Connection: Upgrade\r\nUpgrade: foo\r\n")
    with socket.create_connection(("127.0.0.1", ps.port), timeout=allow(10)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: ps\r\n{heads}Content-Type: {ctype}\r\n"
                  f"Content-Length: {len(inner)}\r\n\r\n".encode() + inner)
        got, body = read_response(s)
        assert got == 400 and b'"bad_http"' in body and b"Upgrade" in body, (got, body)
        assert s.recv(1024) == b""  # closed: the smuggled request is never read
    assert (ps.rt.core.members.by_id, ps.rt.core.global_step) == before
