"""A worker's default name: its container's compose name (reverse DNS on the compose network), else hostname:pid.

The DNS exchange is tested against a small DNS server on loopback that answers as Docker's embedded one
does; the real thing (names equal to `docker compose ps`, kept across a container restart) is in
tests/test_compose.py.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from tests.timing import allow
from worker_service import naming as ws
from worker_service.naming import reverse_dns
from worker_service.settings import WorkerSettings


def encode_name(name: str) -> bytes:
    return b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0"


class FakeDNS(threading.Thread):
    """Answers each query once, as ``answer(query) -> bytes | None`` says (None: stay silent)."""

    def __init__(self, answer) -> None:
        super().__init__(daemon=True)
        self.answer = answer
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(allow(5.0))  # idle that long: the test is over
        self.port = self.sock.getsockname()[1]
        self.queries: list[bytes] = []

    def run(self) -> None:
        try:
            while True:
                data, addr = self.sock.recvfrom(512)
                self.queries.append(data)
                reply = self.answer(data)
                if reply is not None:
                    self.sock.sendto(reply, addr)
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()


def ptr_reply(query: bytes, target: str, rcode: int = 0, compress: bool = True) -> bytes:
    qid = query[:2]
    question = query[12:]
    header = qid + struct.pack(">HHHHH", 0x8180 | rcode, 1, 0 if rcode else 1, 0, 0)
    if rcode:
        return header + question
    # answer: name = pointer to the question (offset 12), type PTR, class IN, ttl 600, rdata = the target;
    # compressed: its first label, then a pointer to the question's "in-addr.arpa" (target must end so)
    rdata = encode_name(target)
    if compress:
        label, _, rest = target.partition(".")
        assert rest == "in-addr.arpa"
        rdata = bytes([len(label)]) + label.encode() + struct.pack(">H", 0xC000 | (12 + question.index(b"\x07in-addr")))
    answer = struct.pack(">HHHIH", 0xC00C, 12, 1, 600, len(rdata)) + rdata
    return header + question + answer


@pytest.fixture
def dns():
    servers = []

    def start(answer):
        servers.append(FakeDNS(answer))
        servers[-1].start()
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_reverse_dns_reads_the_ptr_name_docker_gives_a_container(dns):
    server = dns(lambda q: ptr_reply(q, "syncps-worker-3.syncps_default", compress=False))
    assert reverse_dns("172.18.0.5", "127.0.0.1", allow(2.0), server.port) == "syncps-worker-3.syncps_default"
    q = server.queries[0]
    assert encode_name("5.0.18.172.in-addr.arpa") in q and q[-4:] == struct.pack(">HH", 12, 1)  # PTR, IN


def test_reverse_dns_follows_compressed_names(dns):
    server = dns(lambda q: ptr_reply(q, "syncps-worker-3.in-addr.arpa", compress=True))
    assert reverse_dns("172.18.0.5", "127.0.0.1", allow(2.0), server.port) == "syncps-worker-3.in-addr.arpa"


def test_reverse_dns_nxdomain_and_silence_give_none_within_the_timeout(dns):
    nx = dns(lambda q: ptr_reply(q, "", rcode=3))
    assert reverse_dns("10.1.2.3", "127.0.0.1", allow(2.0), nx.port) is None
    mute = dns(lambda q: None)
    t0 = time.monotonic()
    with pytest.raises(socket.timeout):
        reverse_dns("10.1.2.3", "127.0.0.1", 0.3, mute.port)
    assert time.monotonic() - t0 < allow(2.0)


def test_compose_name_takes_the_first_label_and_gives_up_by_its_deadline(dns, monkeypatch, tmp_path):
    server = dns(lambda q: ptr_reply(q, "syncps-worker-2.syncps_default", compress=False))
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("# docker\nnameserver 127.0.0.1\noptions ndots:0\n")
    monkeypatch.setattr(ws, "RESOLV_CONF", str(resolv))
    monkeypatch.setattr(ws, "reverse_dns", lambda ip, srv, timeout: reverse_dns(ip, srv, timeout, server.port))
    assert ws.compose_name(allow(2.0)) == "syncps-worker-2"
    # a resolver that never answers: None (then hostname:pid) once the deadline passes
    mute = dns(lambda q: None)
    monkeypatch.setattr(ws, "reverse_dns", lambda ip, srv, timeout: reverse_dns(ip, srv, timeout, mute.port))
    t0 = time.monotonic()
    assert ws.compose_name(0.6) is None
    assert time.monotonic() - t0 < allow(2.0)
    # an answer without a network suffix (not a compose name): None
    plain = dns(lambda q: ptr_reply(q, "justahost", compress=False))
    monkeypatch.setattr(ws, "reverse_dns", lambda ip, srv, timeout: reverse_dns(ip, srv, timeout, plain.port))
    assert ws.compose_name(1.0) is None


def test_default_name_outside_a_container_is_hostname_pid(monkeypatch):
    monkeypatch.delenv("WORKER_NAME", raising=False)
    expected = f"{socket.gethostname()}:{os.getpid()}"
    assert os.getpid() != 1 and WorkerSettings().name == expected
    monkeypatch.setenv("WORKER_NAME", "")  # as docker-compose.yml sets it: the default
    assert WorkerSettings().name == expected
    monkeypatch.setenv("WORKER_NAME", "w-7")
    assert WorkerSettings().name == "w-7"


def test_pid_1_uses_the_compose_name_and_falls_back(monkeypatch):
    monkeypatch.setattr(ws.os, "getpid", lambda: 1)
    monkeypatch.setattr(ws, "compose_name", lambda: "syncps-worker-4")
    assert ws.default_name() == "syncps-worker-4"
    monkeypatch.setattr(ws, "compose_name", lambda: None)
    assert ws.default_name() == f"{socket.gethostname()}:1"


class FakeClock:
    """``time`` for :func:`ws.compose_name`: ``sleep`` and a silent resolver's timeouts pass at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("server", [ws.DOCKER_DNS, "10.0.0.2"])
def test_a_slow_docker_resolver_is_waited_for_and_each_query_waits_longer(monkeypatch, server):
    """A resolver silent for 20 s, then answering (Docker's on a busy machine): the worker waits for Docker's
    (:data:`ws.DOCKER_LOOKUP_SECONDS`), each query's timeout doubling to 8 s, and takes its container's name; any
    other resolver is given :data:`ws.NAME_LOOKUP_SECONDS`, then the worker falls back to hostname:pid."""
    clock, asked = FakeClock(), []

    def slow(ip, srv, timeout):
        asked.append(timeout)
        if clock.now < 20.0:
            clock.now += timeout
            raise socket.timeout("timed out")
        return "syncps-worker-5.syncps_default"
    monkeypatch.setattr(ws, "time", clock)
    monkeypatch.setattr(ws, "_nameserver", lambda: server)
    monkeypatch.setattr(ws.socket, "gethostbyname", lambda host: "172.18.0.9")
    monkeypatch.setattr(ws, "reverse_dns", slow)
    if server == ws.DOCKER_DNS:
        assert ws.compose_name() == "syncps-worker-5"
        assert asked[:5] == [1.0, 2.0, 4.0, 8.0, 8.0] and 20.0 <= clock.now < ws.DOCKER_LOOKUP_SECONDS
    else:
        assert ws.compose_name() is None
        assert ws.NAME_LOOKUP_SECONDS <= clock.now < ws.NAME_LOOKUP_SECONDS + 1.0


def test_the_fallback_name_needs_no_lookup_and_differs_between_containers(monkeypatch):
    """PID 1 with no compose name: the kernel's hostname (Docker's: the container id, one per container) and the pid;
    nothing resolved to make it."""
    def no_lookup(*args):
        raise AssertionError("a lookup")
    monkeypatch.setattr(ws.os, "getpid", lambda: 1)
    monkeypatch.setattr(ws, "compose_name", lambda: None)
    for name in ("gethostbyname", "gethostbyaddr", "getfqdn", "getaddrinfo"):
        monkeypatch.setattr(ws.socket, name, no_lookup)
    names = set()
    for container_id in ("ab295147d939", "3f1c0e2d7a55"):
        monkeypatch.setattr(ws.socket, "gethostname", lambda c=container_id: c)
        names.add(ws.default_name())
    assert names == {"ab295147d939:1", "3f1c0e2d7a55:1"}
