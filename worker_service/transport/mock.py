"""A transport that answers with a function, as httpx's ``MockTransport``: tests drive the worker's client and loop
through every layer above the socket (endpoint, retries, tensor transports, frames) without a live PS.

    def handler(request: Request) -> Answer:
        if request.path == "/v1/status":
            return Answer.of_json({"state": "running"})
        return Answer.of_json({"error": "not_found", "detail": request.path}, 404)

    client = PSClient("http://ps", connection=MockTransport(handler))

A handler may raise :class:`shared.rawhttp.ConnectionLost` (a lost exchange, retried by the endpoint).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from shared import frame


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: dict[str, str]
    headers: Mapping[str, str]
    body: bytes
    timeout: float

    def json(self) -> Any:
        return json.loads(self.body)

    def frame(self) -> frame.Frame:
        return frame.decode(self.body)


@dataclass
class Answer:
    status_code: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes = b""

    def json(self) -> Any:
        return json.loads(self.content)

    @classmethod
    def of_json(cls, obj: Any, status: int = 200) -> "Answer":
        return cls(status, {"content-type": "application/json"}, json.dumps(obj).encode())

    @classmethod
    def of_frame(cls, tensors: Mapping[str, np.ndarray], meta: dict, headers: Mapping[str, str] | None = None
                 ) -> "Answer":
        return cls(200, {"content-type": frame.MEDIA_TYPE, **(headers or {})}, frame.encode_bytes(tensors, meta))


class MockTransport:
    """The :class:`~worker_service.transport.base.Transport` interface over ``handler(Request) -> Answer``."""

    def __init__(self, handler: Callable[[Request], Answer]) -> None:
        self.handler = handler
        self.closed = False

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                timeout: float = 30.0) -> Answer:
        url = urlsplit(target)
        return self.handler(Request(method, url.path, dict(parse_qsl(url.query)), {k.lower(): v for k, v in
                                    headers.items()}, b"".join(bytes(p) for p in body), timeout))

    def close(self) -> None:
        self.closed = True
