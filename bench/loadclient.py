"""The load benchmark's HTTP side (bench/load.py): a minimal HTTP/1.1 client over asyncio streams, and
latency samples.

:class:`Conn` is one keep-alive connection (``Content-Length`` bodies only, which is all the PS sends);
:func:`fresh` makes one exchange on a new connection and closes it, the way a probe, a registration or a
heartbeat after a keep-alive timeout reaches the PS. As the worker's own connection does, a :class:`Conn`
idle for half the PS's announced keep-alive opens a fresh connection instead of racing the PS's close
(shared/keepalive.py). Every exchange runs under a timeout and counts its
5xx answers in :class:`Samples`; a latency is recorded in milliseconds under a name.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from shared import keepalive

JSON = "application/json"


class Samples:
    """Latencies (ms) by name, timeouts (and lost connections) by name, and the count of 5xx answers."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}
        self.timeouts: dict[str, int] = {}
        self.errors_5xx = 0

    def add(self, name: str, seconds: float) -> None:
        self.ms.setdefault(name, []).append(seconds * 1e3)

    def timed_out(self, name: str) -> None:
        self.timeouts[name] = self.timeouts.get(name, 0) + 1

    def failed(self, name: str, exc: BaseException) -> None:
        """A timeout (counted under ``name``) or a lost connection (counted as ``name + "_lost"``)."""
        self.timed_out(name if isinstance(exc, TimeoutError) else name + "_lost")

    def quantile(self, name: str, q: float) -> float | None:
        xs = sorted(self.ms.get(name, ()))
        if not xs:
            return None
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = field(repr=False)

    def json(self):
        return json.loads(self.body)


class Conn:
    """One HTTP/1.1 connection to ``host:port``, opened on first use and again after it was lost."""

    def __init__(self, host: str, port: int, samples: Samples) -> None:
        self.host, self.port, self.samples = host, port, samples
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._idle = keepalive.IdleClock()
        self.opened = 0  # connections made so far

    def kept(self) -> bool:
        """Whether the next request goes on a kept-alive connection (one that may turn out stale)."""
        return self._streams is not None and not self._idle.expired()

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

    async def request(self, method: str, target: str, body: bytes = b"", ctype: str = JSON,
                      timeout: float = 30.0, close: bool = False) -> Answer:
        """One exchange (connecting first if needed); the connection is closed on any error."""
        try:
            async with asyncio.timeout(timeout):
                return await self._exchange(method, target, body, ctype, close)
        except BaseException:
            self.close()
            raise

    async def _exchange(self, method: str, target: str, body: bytes, ctype: str, close: bool) -> Answer:
        if self._streams is not None and self._idle.expired():
            self.close()  # the PS may be closing it (its keep-alive runs out)
        if self._streams is None:
            self.opened += 1
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        head = (f"{method} {target} HTTP/1.1\r\nhost: ps\r\ncontent-length: {len(body)}\r\n"
                + (f"content-type: {ctype}\r\n" if body else "") + ("connection: close\r\n" if close else "") + "\r\n")
        writer.write(head.encode() + body)
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if "content-length" not in headers and status not in (204, 304):
            raise ValueError(f"an answer without content-length: {lines[0]}")
        data = await reader.readexactly(int(headers.get("content-length", 0)))
        self._idle.answered(headers)
        if status >= 500:
            self.samples.errors_5xx += 1
        if close or headers.get("connection", "").lower() == "close":
            self.close()
        return Answer(status, headers, data)


async def fresh(host: str, port: int, samples: Samples, name: str, method: str, target: str,
                body: bytes = b"", timeout: float = 30.0) -> Answer | None:
    """One exchange on a new connection, its latency (connect included) recorded under ``name``;
    None (and counted) if it took longer than ``timeout`` or the connection was lost."""
    t0 = time.perf_counter()
    try:
        answer = await Conn(host, port, samples).request(method, target, body, timeout=timeout, close=True)
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
        samples.failed(name, exc)
        return None
    samples.add(name, time.perf_counter() - t0)
    return answer
