"""An HTTP connection over httpx, for PS URLs the raw connection does not speak (``https://``, a PS behind a TLS
proxy): a worker's calls, a primary's steps to its hot standby. Slower (it copies bodies), the contract of
:class:`shared.rawhttp.RawConnection`'s ``request`` (``ConnectionLost`` when it breaks; never retries). A connection
idle for half the keep-alive the answers announce is not reused (shared/keepalive.py): httpx's pool takes that as its
``keepalive_expiry``, so the client is made again, once, when an answer announces another timeout than assumed."""
from __future__ import annotations

from typing import Mapping, Sequence

import httpx

from shared import keepalive, liveness
from shared.rawhttp import ConnectionLost


class HttpxConnection:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.reuse_seconds = keepalive.reuse_seconds()
        self.client = self._client()

    def _client(self) -> httpx.Client:
        limits = httpx.Limits(max_keepalive_connections=2, keepalive_expiry=self.reuse_seconds)
        # TCP options that notice a silent PS host in seconds (shared/liveness.py)
        transport = httpx.HTTPTransport(limits=limits, socket_options=liveness.socket_options())
        return httpx.Client(base_url=self.base_url, transport=transport)

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                timeout: float = 30.0) -> httpx.Response:
        try:
            content = b"".join(body) if body else None  # (join takes memoryviews as they are: one copy)
            resp = self.client.request(method, target, headers=dict(headers), content=content,
                                       timeout=httpx.Timeout(timeout, connect=liveness.connect_timeout(timeout)))
        except httpx.TransportError as exc:
            raise ConnectionLost(f"{type(exc).__name__}: {exc}") from None
        announced = keepalive.reuse_seconds(keepalive.server_seconds(resp.headers))
        if announced != self.reuse_seconds:
            self.reuse_seconds = announced
            self.client.close()  # the answer was read in full: nothing in flight is lost
            self.client = self._client()
        return resp

    def close(self) -> None:
        self.client.close()
