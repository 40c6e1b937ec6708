"""One PS process as the worker sees it: its URL, the :class:`~worker_service.transport.base.Transport` to it, the
token every request carries, and the retry policy. The one place a worker's exchanges are retried.

Contract of :meth:`Endpoint.call`: a timeout on every exchange; connection errors, timeouts and 5xx retried with
capped exponential backoff and jitter (:mod:`worker_service.retry`, each retry logged); a 4xx raised as
:class:`shared.errors.ProtocolError` with the PS's error code; any other answer returned. A hot-standby pair
(``urls``, docs/protocol-standby.md): every request carries the newest term seen (``x-syncps-term``); a lost
connection, 503 ``standby`` or ``fenced`` move the attempt to the other PS at once (but not a 503 ``standby`` while
the other PS lost this worker's connection within :data:`LOST_REPORT_SECONDS`: that standby is about to ask for votes,
and the request says so, ``x-syncps-peer-lost``); 503 ``election`` gets this worker's vote (once per term; a PS it
did not vote for in that term is left for the one it did) and the same PS is asked again; then, as any 5xx, a backoff
of at most :data:`PAIR_WAIT_MAX_SECONDS`.
"""
from __future__ import annotations

import json
import time
from typing import Any, Mapping, Sequence
from urllib.parse import urlencode

from pydantic import SecretStr

from shared.errors import ProtocolError
from shared.protocol import API
from shared.rawhttp import ConnectionLost, RawConnection
from shared.tokens import bearer_header
from worker_service import retry
from worker_service.transport.base import Response, Transport
from shared.httpxconn import HttpxConnection


class ServerError(Exception):
    """A 5xx answer: the PS is restarting or overloaded; retried."""


def connect(base_url: str) -> Transport:
    """The production transport for ``base_url``."""
    return RawConnection(base_url) if base_url.startswith("http://") else HttpxConnection(base_url)


TERM = "x-syncps-term"
#: a pair's request header: the other PS lost this worker's connection within the last LOST_REPORT_SECONDS
LOST, LOST_REPORT_SECONDS = "x-syncps-peer-lost", 2.0
#: a pair's refusals that send the next attempt to the other PS
ELSEWHERE = frozenset({"standby", "fenced"})
#: a pair's backoff between attempts at most (a PS alone: retry.py's 1 s)
PAIR_WAIT_MAX_SECONDS = 0.25


def split_urls(text: str) -> list[str]:
    """The PS URLs of ``WORKER_PS_URL`` (one, or a hot-standby pair's two, comma-separated)."""
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


class Endpoint:
    def __init__(self, base_url: str, transport: Transport, *, timeout: float, attempts: int, retry_timeout: float,
                 token: SecretStr | None, urls: list[str] | None = None) -> None:
        self.base_url, self.transport = base_url, transport
        self.timeout, self.attempts, self.retry_timeout, self.token = timeout, attempts, retry_timeout, token
        self._headers = dict(bearer_header(token))
        #: a hot-standby pair: both PS processes (else just ``base_url``), each over its own transport
        self.urls = urls or [base_url]
        self._transports = {base_url: transport}
        self.term = 0  # the newest term a PS of the pair answered with
        self.voter: str | None = None  # this worker's name, once registered: it votes in a pair's elections
        self.ballot: dict[int, str] = {}  # term -> the PS voted for
        self.lost_at: dict[str, float] = {}  # URL -> when a connection to it was last lost (time.monotonic)

    def _move(self, url: str | None = None) -> None:
        """The next attempts go to ``url`` (default: the next PS of the pair)."""
        if len(self.urls) < 2:
            return
        url = url or self.urls[(self.urls.index(self.base_url) + 1) % len(self.urls)]
        if url not in self._transports:
            self._transports[url] = connect(url)
        self.base_url, self.transport = url, self._transports[url]

    def _pair_headers(self, head: Mapping[str, str]) -> Mapping[str, str]:
        """A pair's request: the newest term seen, and whether the other PS lost our connection just now (its process
        is gone, most likely: a standby then asks for votes without waiting the whole failover timeout)."""
        extra = {TERM: str(self.term)} if self.term else {}
        if self._other_lost():
            extra[LOST] = "1"
        return {**head, **extra} if extra else head

    def _other_lost(self) -> bool:
        """The other PS of the pair lost this worker's connection within :data:`LOST_REPORT_SECONDS`."""
        return any(time.monotonic() - t < LOST_REPORT_SECONDS for u, t in self.lost_at.items() if u != self.base_url)

    def _pair_answer(self, resp: Response) -> bool:
        """Read a pair's answer: its term; a refusal moves to the other PS, or votes. Whether to ask again at once."""
        term = resp.headers.get(TERM)
        if term is not None and term.isdigit():
            self.term = max(self.term, int(term))
        if resp.status_code != 503 or term is None:
            return False
        try:
            code = resp.json().get("error")
        except (ValueError, AttributeError):
            return False
        if code in ELSEWHERE:
            if code == "standby" and self._other_lost():  # its primary is gone, most likely: wait for the election
                return False
            self._move()
            return True
        if code != "election":
            return False
        ballot = int(term) + 1
        chosen = self.ballot.get(ballot)
        if chosen is not None and chosen != self.base_url:
            self._move(chosen)
            return True
        if self.voter is None:
            return False
        self.ballot[ballot] = self.base_url
        self.transport.request("POST", f"{API}/ha/vote", {**self._headers, "content-type": "application/json"},
                               [json.dumps({"term": ballot, "name": self.voter}).encode()], self.timeout)
        return True  # (this vote may have decided it)

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

        pair = len(self.urls) > 1

        def once() -> Response:
            for hop in range(2 if pair else 1):  # a pair: the other PS at once (or the same after a vote), then backoff
                try:
                    resp = self.transport.request(method, target, self._pair_headers(head) if pair else head,
                                                  body, timeout or self.timeout)
                except ConnectionLost:
                    self.lost_at[self.base_url] = time.monotonic()
                    self._move()  # a pair: the other PS next
                    if hop or not pair:
                        raise
                    continue
                if pair and self._pair_answer(resp) and not hop:
                    continue
                if resp.status_code >= 500:
                    raise ServerError(f"{resp.status_code} from the PS")
                return resp

        # a pair: short waits (the other PS, or the election, answers within the failover timeout)
        backoff = {"wait_max": PAIR_WAIT_MAX_SECONDS, "wait_jitter": PAIR_WAIT_MAX_SECONDS / 4} if pair else {}
        resp = retry.call(once, what or f"{method} {path}", attempts or self.attempts, self.retry_timeout,
                          (ConnectionLost, ServerError), **backoff)
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
        for t in self._transports.values():  # the current one among them
            t.close()
