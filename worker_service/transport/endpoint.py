"""One PS process as the worker sees it: its URL, the :class:`~worker_service.transport.base.Transport` to it, the
token every request carries, and the retry policy. The one place a worker's exchanges are retried.

Contract of :meth:`Endpoint.call`: a timeout on every exchange; connection errors (``ConnectionLost``), timeouts
and 5xx (:class:`ServerError`) retried with capped exponential backoff and jitter (:mod:`worker_service.retry`,
each retry logged with the request and the error); a 4xx raised as :class:`shared.errors.ProtocolError` with the
PS's error code; any other answer returned. With a ``token``, every request carries ``Authorization: Bearer``.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence
from urllib.parse import urlencode

from pydantic import SecretStr

from shared.errors import ProtocolError
from shared.rawhttp import ConnectionLost, RawConnection
from shared.tokens import bearer_header
from worker_service import retry
from worker_service.transport.base import Response, Transport
from worker_service.transport.httpx import HttpxConnection


class ServerError(Exception):
    """A 5xx answer: the PS is restarting or overloaded; retried."""


def connect(base_url: str) -> Transport:
    """The production transport for ``base_url``."""
    return RawConnection(base_url) if base_url.startswith("http://") else HttpxConnection(base_url)


class Endpoint:
    def __init__(self, base_url: str, transport: Transport, *, timeout: float, attempts: int, retry_timeout: float,
                 token: SecretStr | None) -> None:
        self.base_url, self.transport = base_url, transport
        self.timeout, self.attempts, self.retry_timeout, self.token = timeout, attempts, retry_timeout, token
        self._headers = dict(bearer_header(token))

    def sibling(self, base_url: str) -> "Endpoint":
        """Another PS process (a shard) over its own production transport, with this one's token and policy."""
        return Endpoint(base_url, connect(base_url), timeout=self.timeout, attempts=self.attempts,
                        retry_timeout=self.retry_timeout, token=self.token)

    def call(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
             body: Sequence[bytes | memoryview] = (), headers: Mapping[str, str] | None = None,
             timeout: float | None = None, attempts: int | None = None, what: str | None = None) -> Response:
        """One exchange, retried on connection errors, timeouts and 5xx; a 4xx is raised as ProtocolError.
        ``what`` names it in the retry log lines (default ``"<method> <path>"``)."""
        target = path + (f"?{urlencode(params)}" if params else "")
        head = {**self._headers, **(headers or {})}

        def once() -> Response:
            resp = self.transport.request(method, target, head, body, timeout or self.timeout)
            if resp.status_code >= 500:
                raise ServerError(f"{resp.status_code} from the PS")
            return resp

        resp = retry.call(once, what or f"{method} {path}", attempts or self.attempts, self.retry_timeout,
                          (ConnectionLost, ServerError))
        if resp.status_code >= 400:
            try:
                obj = resp.json()
                code, detail = obj.get("error", "http_error"), obj.get("detail", "")
            except (ValueError, AttributeError):
                code, detail = "http_error", bytes(resp.content[:200]).decode("utf-8", "replace")
            raise ProtocolError(resp.status_code, code, detail)
        return resp

    def call_json(self, method: str, path: str, obj: Any = None, **kw: Any) -> Any:
        """:meth:`call` with a JSON body (when ``obj`` is not None); the answer's JSON."""
        body = [json.dumps(obj).encode()] if obj is not None else []
        headers = {"content-type": "application/json"} if obj is not None else {}
        return self.call(method, path, body=body, headers=headers, **kw).json()

    def close(self) -> None:
        self.transport.close()
