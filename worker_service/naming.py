"""A worker's default name: its container's compose name (``syncps-worker-1``), else ``hostname:pid``.

Under Compose a worker is its container's PID 1 on a user-defined network, whose DNS (Docker's embedded
server) answers a reverse lookup of the container's address with ``<container name>.<network>``: the
name ``docker compose ps`` shows, without a Docker socket. The C resolver cannot be asked (it answers
from /etc/hosts, where Docker maps the address to the container id), so this module sends the one PTR
query itself, over UDP, with a timeout: up to :data:`DOCKER_LOOKUP_SECONDS` when the resolver is Docker's
(127.0.0.11), which can take seconds to answer on a busy machine, and whose answer is the name that gives a restarted
container its rank back; :data:`NAME_LOOKUP_SECONDS` for any other. The fallback needs no lookup and is unique per
container: the kernel's hostname (under Docker the container id) and the pid.
"""
from __future__ import annotations

import os
import socket
import struct
import time

#: how long the compose-name lookup may take before the worker falls back to hostname:pid (a resolver not Docker's)
NAME_LOOKUP_SECONDS = 3.0
#: the same for Docker's embedded resolver, which answers every container on a compose network (a slow answer)
DOCKER_LOOKUP_SECONDS = 30.0
DOCKER_DNS = "127.0.0.11"
#: each query's timeout: the first, doubled after each one unanswered (a reply later than its query's is lost)
QUERY_SECONDS, QUERY_SECONDS_MAX = 1.0, 8.0
RESOLV_CONF = "/etc/resolv.conf"


def _nameserver() -> str | None:
    """The first nameserver of /etc/resolv.conf (in a container on a compose network: Docker's, 127.0.0.11)."""
    try:
        with open(RESOLV_CONF, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    return parts[1]
    except OSError:
        pass
    return None


def _read_name(msg: bytes, pos: int, hops: int = 0) -> tuple[str, int]:
    """A (possibly compressed) domain name at ``pos`` of a DNS message; (name, position after it)."""
    labels = []
    while True:
        n = msg[pos]
        if n & 0xC0 == 0xC0:  # a pointer to a name earlier in the message
            if hops > 16:
                raise ValueError("DNS name pointer loop")
            rest, _ = _read_name(msg, ((n & 0x3F) << 8) | msg[pos + 1], hops + 1)
            return ".".join([*labels, rest] if rest else labels), pos + 2
        pos += 1
        if n == 0:
            return ".".join(labels), pos
        labels.append(msg[pos:pos + n].decode("ascii", "replace"))
        pos += n


def reverse_dns(ip: str, server: str, timeout: float, port: int = 53) -> str | None:
    """The PTR name of an IPv4 address, asked of ``server`` directly (UDP, one query, ``timeout`` seconds)."""
    qid = int.from_bytes(os.urandom(2), "big")
    qname = b"".join(bytes([len(x)]) + x.encode() for x in [*reversed(ip.split(".")), "in-addr", "arpa"]) + b"\0"
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 12, 1)  # PTR, IN
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(query, (server, port))
        msg = s.recv(4096)
    rid, flags, qd, an = struct.unpack(">HHHH", msg[:8])
    if rid != qid or flags & 0x000F or an == 0:  # not ours, an error (NXDOMAIN...), or no answer
        return None
    pos = 12
    for _ in range(qd):
        pos = _read_name(msg, pos)[1] + 4
    for _ in range(an):
        pos = _read_name(msg, pos)[1]
        rtype, _, _, rdlen = struct.unpack(">HHIH", msg[pos:pos + 10])
        pos += 10
        if rtype == 12:
            return _read_name(msg, pos)[0].rstrip(".") or None
        pos += rdlen
    return None


def compose_name(timeout: float | None = None) -> str | None:
    """The container's name on its Docker network (``syncps-worker-1``: the first label of the PTR name), or None
    (anything unexpected). Retried until ``timeout`` (None: :data:`DOCKER_LOOKUP_SECONDS` on Docker's resolver,
    else :data:`NAME_LOOKUP_SECONDS`): right after a container (re)starts, its record may lag its process, and a busy
    resolver answers late."""
    server = _nameserver()
    if server is None:
        return None
    if timeout is None:
        timeout = DOCKER_LOOKUP_SECONDS if server == DOCKER_DNS else NAME_LOOKUP_SECONDS
    end = time.monotonic() + timeout
    try:
        host = socket.gethostname()
        ip = socket.gethostbyname(host)  # /etc/hosts: the container's address on its network
    except OSError:
        return None
    wait = QUERY_SECONDS
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return None
        try:
            fqdn = reverse_dns(ip, server, min(wait, left))
        except (OSError, ValueError, IndexError, struct.error):
            fqdn = None
        if fqdn:
            label, _, network = fqdn.partition(".")
            return label if label and network and label != host else None
        wait = min(2 * wait, QUERY_SECONDS_MAX)
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def default_name() -> str:
    """The compose name when the worker is a container's main process (PID 1); else hostname:pid. Both stay the same
    across a restart of the container (it gets its rank back) and differ between processes and containers."""
    if os.getpid() == 1:
        name = compose_name()
        if name:
            return name
    return f"{socket.gethostname()}:{os.getpid()}"
