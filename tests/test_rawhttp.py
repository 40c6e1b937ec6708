"""The worker's raw HTTP connection against real servers on loopback, and the retry helper's log lines.

The servers are our own (a tiny Starlette app under uvicorn, and a bare socket server for what uvicorn
will not do), so these tests do not depend on the PS's routes or wire format. Every network call has a
timeout; waits are deadline polls on a socket or a flag, never sleeps.
"""
from __future__ import annotations

import hashlib
import logging
import re
import select
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.processes import free_port, wait_for
from worker_service import retry
from shared import liveness
from shared.rawhttp import ConnectionLost, RawConnection
from tests.timing import allow

BIG = 4 << 20  # a body of a few MB: far more than the socket buffers hold, so sendmsg runs several times


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    headers = {"connection": "close"} if request.query_params.get("close") else None
    return JSONResponse({"length": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                         "port": request.client.port}, headers=headers)


async def refuse(request: Request) -> JSONResponse:
    """Answers 413 without reading the body, then closes (what a PS does with a body that is too large)."""
    return JSONResponse({"error": "too_large"}, status_code=413, headers={"connection": "close"})


async def chunked(request: Request) -> StreamingResponse:
    """A chunked answer (what the PS sends for a pull answered partition by partition): 3 parts, the middle big."""
    async def parts():
        for p in (b"head", bytes(range(256)) * (BIG // 256), b"tail"):
            yield p
    return StreamingResponse(parts(), media_type="application/octet-stream")


async def big(request: Request) -> Response:
    """A large ``Content-Length`` answer (a weights answer)."""
    return Response(bytes(range(256)) * (BIG // 256), media_type="application/octet-stream")


@contextmanager
def echo_server(keepalive: float = 5.0) -> Iterator[str]:
    app = Starlette(routes=[Route("/echo", echo, methods=["GET", "POST"]), Route("/refuse", refuse, methods=["POST"]),
                               Route("/chunked", chunked), Route("/big", big)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           timeout_keep_alive=keepalive, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name=f"echo-{port}", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), allow(20), "the echo server to start")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(allow(10))


def body_parts(n: int = BIG) -> tuple[list, bytes]:
    """A body as the client sends it (a small header and tensor memory, not joined), and its bytes."""
    tensor = np.arange(n // 4, dtype=np.float32)
    parts = [b"\x82head", memoryview(tensor), b"tail"]
    return parts, b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def wait_until_closed_by_server(conn: RawConnection, deadline: float | None = None) -> None:
    """Poll the idle connection's socket until the server's FIN arrives (readable), within ``deadline`` s (default
    ``allow(10)``)."""
    deadline = allow(10.0) if deadline is None else deadline
    end = time.monotonic() + deadline
    while not select.select([conn.sock], [], [], max(0.0, end - time.monotonic()))[0]:
        if time.monotonic() > end:
            raise TimeoutError(f"the server kept the idle connection open for more than {deadline} s")


def post_echo(conn: RawConnection, parts: list, query: str = "") -> tuple[dict, float]:
    t0 = time.monotonic()
    resp = conn.request("POST", f"/echo{query}", {"content-type": "application/octet-stream"}, parts,
                        timeout=allow(10.0))
    assert resp.status_code == 200, resp.text
    return resp.json(), time.monotonic() - t0


def test_a_kept_alive_connection_is_reused():
    with echo_server() as url:
        conn = RawConnection(url)
        try:
            first, _ = post_echo(conn, [b"x"])
            second, _ = post_echo(conn, [b"yz"])
        finally:
            conn.close()
    assert first["port"] == second["port"] and (first["length"], second["length"]) == (1, 2)


def test_a_body_after_the_keepalive_expired_goes_at_once_on_a_fresh_connection():
    """The regression: the old retry re-sent an emptied body on the new connection and waited out the timeout."""
    parts, data = body_parts()
    with echo_server(keepalive=0.3) as url:
        conn = RawConnection(url)
        try:
            first, _ = post_echo(conn, [b"x"])
            wait_until_closed_by_server(conn)  # the server's keep-alive ran out: it closed the idle socket
            answer, took = post_echo(conn, parts)
        finally:
            conn.close()
    assert answer["length"] == len(data) and answer["sha256"] == hashlib.sha256(data).hexdigest()
    assert answer["port"] != first["port"]  # a new connection
    assert took < allow(0.5), f"{took:.2f} s: the request waited on a dead connection"
    assert len(parts) == 3 and parts[0] == b"\x82head"  # the caller's list is left alone


def test_a_body_after_the_server_said_connection_close_goes_at_once_on_a_fresh_connection():
    parts, data = body_parts()
    with echo_server() as url:
        conn = RawConnection(url)
        try:
            first, _ = post_echo(conn, [b"x"], "?close=1")
            assert conn.sock is None  # closed on `connection: close`
            answer, took = post_echo(conn, parts)
        finally:
            conn.close()
    assert answer["length"] == len(data) and answer["sha256"] == hashlib.sha256(data).hexdigest()
    assert answer["port"] != first["port"] and took < allow(0.5), took


def test_an_answer_sent_before_the_server_stopped_reading_is_returned():
    parts, _ = body_parts(32 << 20)  # much more than the socket buffers: the server closes while we send
    with echo_server() as url:
        conn = RawConnection(url)
        try:
            resp = conn.request("POST", "/refuse", {}, parts, timeout=allow(10.0))
            assert resp.status_code == 413 and resp.json() == {"error": "too_large"}
            assert post_echo(conn, [b"again"])[0]["length"] == 5  # and the connection after it works
        finally:
            conn.close()


@contextmanager
def socket_server(handle) -> Iterator[tuple[str, list]]:
    """A bare HTTP/1.1 server (one thread, one connection at a time) for what uvicorn never does.

    ``handle(conn, request_bytes, n)`` answers the n-th request and says whether to keep the connection;
    the requests are recorded."""
    seen: list[bytes] = []
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(allow(10.0))
    halt = threading.Event()

    def serve() -> None:
        while not halt.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(allow(10.0))
                buf = b""
                try:
                    while not halt.is_set():
                        while b"\r\n\r\n" not in buf:
                            chunk = conn.recv(65536)
                            if not chunk:
                                raise EOFError
                            buf += chunk
                        head, _, buf = buf.partition(b"\r\n\r\n")
                        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                                          if ln.lower().startswith(b"content-length")))
                        while len(buf) < length:
                            buf += conn.recv(65536)
                        seen.append(head + b"\r\n\r\n" + buf[:length])
                        buf = buf[length:]
                        if not handle(conn, seen[-1], len(seen)):
                            break
                except (EOFError, OSError):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}", seen
    finally:
        halt.set()
        socket.create_connection(lsock.getsockname(), timeout=allow(10)).close()  # wakes a waiting accept()
        thread.join(allow(10))
        lsock.close()
        assert not thread.is_alive()


def ok(conn: socket.socket, body: bytes = b"{}") -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


@pytest.mark.parametrize("after_answer", [b"", b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n"])
def test_an_idle_connection_closed_without_notice_is_replaced_before_sending(after_answer):
    """The server answers as if it kept the connection, then closes it (maybe saying something unasked first)."""
    answered = threading.Event()

    def handle(conn, request, n):
        ok(conn)
        if n == 1 and after_answer and answered.wait(allow(10)):  # once the client has read the answer
            conn.sendall(after_answer)
        return False  # close

    parts, data = body_parts()
    with socket_server(handle) as (url, seen):
        conn = RawConnection(url)
        try:
            assert conn.request("GET", "/a", {}, timeout=allow(10.0)).status_code == 200
            answered.set()
            wait_until_closed_by_server(conn)
            t0 = time.monotonic()
            assert conn.request("POST", "/b", {}, parts, timeout=allow(10.0)).status_code == 200
            took = time.monotonic() - t0
        finally:
            conn.close()
    assert len(seen) == 2 and seen[1].endswith(data) and took < allow(0.5), (len(seen), took)


def test_a_request_the_server_may_have_processed_is_not_sent_again():
    """The server read the whole request, then dropped the connection: a failure for the caller, not a re-send."""
    def handle(conn, request, n):
        if n == 1:
            ok(conn)
        return n == 1  # keep the connection after the first request; drop it, unanswered, after the second

    with socket_server(handle) as (url, seen):
        conn = RawConnection(url)
        try:
            assert conn.request("GET", "/a", {}, timeout=allow(10.0)).status_code == 200
            with pytest.raises(ConnectionLost, match="closed the connection"):
                conn.request("POST", "/b", {}, [b"payload"], timeout=allow(10.0))
            wait_for(lambda: len(seen) == 2, allow(10), "the server to record the request")
        finally:
            conn.close()
    assert [r.split(b" ")[1] for r in seen] == [b"/a", b"/b"]  # /b once


def test_a_server_that_never_answers_times_out():
    release = threading.Event()
    with socket_server(lambda conn, request, n: release.wait(allow(10))) as (url, seen):
        conn = RawConnection(url)
        try:
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost, match="timed out"):
                conn.request("GET", "/stall", {}, timeout=0.3)
            assert time.monotonic() - t0 < 5
            assert conn.sock is None
        finally:
            release.set()
            conn.close()


#: how a connect's error message gives a duration
SECONDS = r"\d+\.\d\d"


@contextmanager
def unanswered() -> Iterator[int]:
    """The port of a listener whose accept queue is full: it drops every further SYN, as a host cut off the network
    does (its address blackholed)."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        with socket.create_connection(server.getsockname(), timeout=allow(5)):  # the queue holds one
            yield server.getsockname()[1]


def resolving(monkeypatch, ports: list[int]) -> str:
    """A name that resolves to 127.0.0.1 at each of ``ports``, in order (a host with several addresses)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "ps.test":
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", p)) for p in ports]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return "ps.test"


def test_a_connect_nobody_answers_says_so_and_how_long_it_waited(monkeypatch):
    """A connect to a blackholed address gives up after the user timeout (shared/liveness.py, here 0.5 s), and the
    error says that, not the request's 30 s read timeout (which it was labelled with when the connect's own timeout
    ended it before TCP_USER_TIMEOUT did)."""
    monkeypatch.setattr(liveness, "USER_TIMEOUT_SECONDS", 0.5)
    with unanswered() as port:
        conn = RawConnection(f"http://127.0.0.1:{port}")
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost) as err:
            conn.request("GET", "/", {}, timeout=30.0)
        assert time.monotonic() - t0 < allow(5)
        assert re.fullmatch(rf"no connect to 127\.0\.0\.1:{port} in {SECONDS} s: 127\.0\.0\.1:{port} no answer in "
                            rf"{SECONDS} s \(a network outage or the host gone\)", str(err.value)), str(err.value)


def test_a_host_with_several_addresses_waits_the_connect_timeout_once_and_names_each(monkeypatch):
    """Two blackholed addresses and a refused one (nothing listens): the connect waits the caller's 1 s once, not
    once an address (2 s before), and the error names every address, what it gave and after how long (it named
    one)."""
    with unanswered() as first, unanswered() as third:
        refused = free_port()
        conn = RawConnection(f"http://{resolving(monkeypatch, [first, refused, third])}:{first}")
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost) as err:
            conn.request("GET", "/", {}, timeout=1.0)
        took = time.monotonic() - t0
    assert took < 1.0 + allow(0.5), took
    assert re.fullmatch(
        rf"no connect to ps\.test:{first} in {SECONDS} s: 127\.0\.0\.1:{first} no answer in {SECONDS} s; "
        rf"127\.0\.0\.1:{refused} connection refused after {SECONDS} s; 127\.0\.0\.1:{third} no answer in {SECONDS} s "
        r"\(a network outage or the host gone\)", str(err.value)), str(err.value)


def test_the_addresses_of_a_host_race_and_a_live_one_wins_while_a_blackholed_one_waits(monkeypatch):
    """Happy eyeballs (RFC 8305): a blackholed first address, a live second one: the second is tried 0.25 s after
    the first, and taken, well within the connect's 5 s (the whole 5 s went to the first before)."""
    with unanswered() as blackholed, socket.create_server(("127.0.0.1", 0)) as live:
        name = resolving(monkeypatch, [blackholed, live.getsockname()[1]])
        t0 = time.monotonic()
        with liveness.connect(name, blackholed, 30.0) as sock:
            took = time.monotonic() - t0
            assert sock.getpeername() == live.getsockname() and sock.gettimeout() == 30.0
    assert liveness.STAGGER_SECONDS <= took < liveness.connect_timeout(30.0) / 2, took


def test_a_close_from_another_thread_ends_a_request_in_flight_at_once():
    """A transport closed while one of its threads waits on a long poll (a worker registering again, or stopping):
    the request fails at once, not at its timeout (a close alone wakes no thread blocked in the socket: the worker
    process lingered ~35 s after its last step)."""
    release = threading.Event()
    with socket_server(lambda conn, request, n: release.wait(allow(30))) as (url, seen):
        conn = RawConnection(url)
        failed: list[BaseException] = []

        def poll():
            try:
                conn.request("GET", "/long-poll", {}, timeout=allow(30))
            except BaseException as exc:  # noqa: BLE001 (the test asserts on it)
                failed.append(exc)

        waiter = threading.Thread(target=poll, daemon=True)
        try:
            waiter.start()
            wait_for(lambda: seen, allow(10), "the request to reach the server")
            t0 = time.monotonic()
            conn.close()
            waiter.join(allow(5))
            assert not waiter.is_alive() and time.monotonic() - t0 < allow(5)
            assert len(failed) == 1 and type(failed[0]) is ConnectionLost, failed
        finally:
            release.set()
            conn.close()


# ---- the retry helper


def flaky(failures: int, exc: Exception = ConnectionLost("the server closed the connection before answering")):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise exc
        return "answer"

    return fn, calls


FAST = {"wait_initial": 0.001, "wait_max": 0.002, "wait_jitter": 0.001}


def test_each_retry_is_logged_with_the_request_and_the_error(caplog):
    fn, calls = flaky(2)
    with caplog.at_level(logging.INFO, logger="worker"):
        assert retry.call(fn, "POST /v1/gradients (step 12)", 5, 60.0, (ConnectionLost,), **FAST) == "answer"
    assert len(calls) == 3
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2, lines
    for i, line in enumerate(lines, start=2):
        assert line.startswith("retrying POST /v1/gradients (step 12) in ")
        assert f"(attempt {i} of 5): ConnectionLost: the server closed the connection before answering" in line
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_helper_gives_up_after_the_attempts_and_raises_the_error(caplog):
    fn, calls = flaky(100)
    with caplog.at_level(logging.INFO, logger="worker"), pytest.raises(ConnectionLost):
        retry.call(fn, "GET /v1/model (step 3)", 4, 60.0, (ConnectionLost,), **FAST)
    assert len(calls) == 4
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("giving up on GET /v1/model (step 3) after 4 attempts in ")
    assert errors[0].endswith(": ConnectionLost: the server closed the connection before answering")


def test_the_helper_gives_up_when_its_time_budget_is_spent():
    fn, calls = flaky(1000)
    with pytest.raises(ConnectionLost):
        retry.call(fn, "GET /x", 1000, 0.05, (ConnectionLost,), wait_initial=0.01, wait_max=0.01, wait_jitter=0)
    assert 1 < len(calls) < 10


def test_other_errors_are_raised_at_once_without_a_retry(caplog):
    fn, calls = flaky(1, ValueError("a 4xx"))
    with caplog.at_level(logging.INFO, logger="worker"), pytest.raises(ValueError):
        retry.call(fn, "GET /x", 5, 60.0, (ConnectionLost,), **FAST)
    assert len(calls) == 1 and not caplog.records


def test_a_request_that_stalled_before_failing_is_logged_with_its_duration(caplog):
    release = threading.Event()
    with socket_server(lambda conn, request, n: release.wait(allow(10))) as (url, seen):
        conn = RawConnection(url)
        try:
            with caplog.at_level(logging.INFO, logger="worker"), pytest.raises(ConnectionLost):
                retry.call(lambda: conn.request("POST", "/v1/gradients", {}, [b"g"], timeout=0.2),
                           "POST /v1/gradients (step 7)", 2, 60.0, (ConnectionLost,), slow_after=0.1, **FAST)
        finally:
            release.set()
            conn.close()
    stalls = [r.getMessage() for r in caplog.records if "got no answer" in r.getMessage()]
    assert len(stalls) == 2 and all(r.levelno == logging.WARNING for r in caplog.records if "got no answer" in r.getMessage())
    assert stalls[0].startswith("POST /v1/gradients (step 7) got no answer in 0.")
    assert stalls[0].endswith("s (ConnectionLost: timed out: no progress for 0.2 s)"), stalls[0]


BODIES = {"/big": bytes(range(256)) * (BIG // 256), "/chunked": b"head" + bytes(range(256)) * (BIG // 256) + b"tail"}


@pytest.mark.parametrize("path", ["/big", "/chunked"])
def test_large_answers_are_received_into_two_pooled_buffers_taken_in_turn_and_the_connection_kept(path):
    """A ``Content-Length`` answer, and a chunked one (a pull answered partition by partition: its chunks received
    into one buffer, not joined)."""
    with echo_server() as url:
        conn = RawConnection(url)
        try:
            held = []  # the buffer each answer was received into
            for _ in range(4):
                r = conn.request("GET", path, {}, timeout=allow(10))
                assert r.status_code == 200 and bytes(r.content) == BODIES[path]
                assert any(r.content.obj is a for a in conn._pool)
                held.append(id(r.content.obj))
            assert r.headers.get("transfer-encoding") == ("chunked" if path == "/chunked" else None)
            # the second answer is still viewed when the third comes (``r``), not the first: two buffers, in turn
            assert held[2] == held[0] and held[3] == held[1] != held[0] and len(conn._pool) == 2
            first = conn.request("GET", "/echo", {}, timeout=allow(10)).json()["port"]
            assert conn.request("GET", "/echo", {}, timeout=allow(10)).json()["port"] == first
        finally:
            conn.close()


def test_a_large_answer_is_received_whole_with_its_tail_below_the_low_water_mark():
    """A body part of LOW_WATER bytes or more is received with the socket's low-water mark set: its last bytes, fewer
    than the mark, still come (the mark is what is left), and the mark is back at 1 for the next answer."""
    from shared import rawhttp
    body = bytes(range(256)) * (3 * rawhttp.LOW_WATER // 256 + 1)

    def handle(conn, request, n):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: %d\r\n\r\n"
                     % len(body) + body[:-100])
        time.sleep(0.2)  # the tail alone, later
        conn.sendall(body[-100:])
        return True

    with socket_server(handle) as (url, _):
        conn = RawConnection(url)
        try:
            for _ in range(2):
                resp = conn.request("GET", "/x", {}, timeout=allow(10.0))
                assert resp.status_code == 200 and bytes(resp.content) == body
                assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        finally:
            conn.close()
