"""A :class:`~worker_service.transport.base.Connection` over httpx, for PS URLs the raw connection does
not speak (``https://``, a PS behind a TLS proxy). Slower (it copies bodies), same contract; a connection idle for
half the PS's default keep-alive is not reused (shared/keepalive.py: httpx cannot follow each answer's header)."""
from __future__ import annotations

from typing import Mapping, Sequence

import httpx

from shared import keepalive
from worker_service.rawhttp import ConnectionLost


class HttpxConnection:
    def __init__(self, base_url: str) -> None:
        limits = httpx.Limits(max_keepalive_connections=2, keepalive_expiry=keepalive.reuse_seconds())
        self.client = httpx.Client(base_url=base_url, limits=limits)

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                timeout: float = 30.0) -> httpx.Response:
        try:
            content = b"".join(bytes(p) if isinstance(p, memoryview) else p for p in body) if body else None
            return self.client.request(method, target, headers=dict(headers), content=content, timeout=timeout)
        except httpx.TransportError as exc:
            raise ConnectionLost(f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self.client.close()
