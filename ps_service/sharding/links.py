"""The coordinator's links to its followers (PS -> PS HTTP with the peer token, PS_PEER_TOKEN, else the training
token; every call with a timeout). One sender task per follower sends its queue in order, each message retried (capped
backoff) until answered: applies of closed rounds (partitioned rounds: decisions) and, between them, the open round's
progress (partitioned rounds: contributors lost); an idle link probes ``GET /v1/shard/state`` every ``PROBE_SECONDS``.
A follower that *restarted* (it refuses a message, 4xx, or answers with another ``boot``) stops its link
(:attr:`Follower.error`) and is reported to :attr:`Links.on_restart` (:mod:`.rollback`). Weights answers wait for
:meth:`Links.sent`, so an apply leaves before megabytes of weights on the coordinator's network interface (a FIFO
queue). :meth:`Links.silent`: the followers that do not answer now (every lease held meanwhile:
:meth:`ShardRole.hold_leases`). :meth:`Links.ask`: one request to a follower, each answer noted (its step and boot).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from ps_service.sharding.turns import Gate
from shared import keepalive, liveness, marks
from shared.errors import ProtocolError
from shared.frame import MEDIA_TYPE as FRAME
from shared.protocol import API
from shared.tokens import bearer_header

log = logging.getLogger("ps_service")

INIT_DEADLINE_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 10.0
BACKOFF_MAX_SECONDS = 1.0
#: an idle link asks its follower's state this often (a restart shows as another boot id), waiting this long for it
PROBE_SECONDS = 0.5
PROBE_TIMEOUT_SECONDS = 2.0
#: an apply unanswered this long makes its follower silent (:meth:`Links.silent`)
SILENT_SECONDS = 1.0
#: how long :meth:`Links.stop` waits for a cancelled sender before it cancels it again
CANCEL_AGAIN_SECONDS = 0.2
APPLY = "/shard/apply"


@dataclass
class Follower:
    index: int
    url: str
    step: int | None = None  # its global step, as it last answered
    reachable: bool | None = None  # did the last exchange get an answer
    error: str | None = None  # a refusal that stopped the link
    boot: str | None = None  # the follower process's boot id, as it last answered (another one: it restarted)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = -1  # the newest round whose apply was written to its connection
    unanswered_since: float | None = None  # when the oldest apply still unanswered was queued (monotonic)


class Links:
    def __init__(self, urls: list[str], token, keepalive_seconds: float = keepalive.DEFAULT_SERVER_SECONDS) -> None:
        """``keepalive_seconds``: the followers' ``PS_HTTP_KEEPALIVE_SECONDS`` (shared/keepalive.py)."""
        self.followers = [Follower(i, url) for i, url in enumerate(urls) if i > 0]
        self.headers = dict(bearer_header(token))
        limits = httpx.Limits(keepalive_expiry=keepalive.reuse_seconds(keepalive_seconds))
        transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=liveness.socket_options())  # liveness.py
        timeout = httpx.Timeout(REQUEST_TIMEOUT_SECONDS, connect=liveness.connect_timeout(REQUEST_TIMEOUT_SECONDS))
        self.client = httpx.AsyncClient(timeout=timeout, headers=self.headers, transport=transport)
        self.tasks: list[asyncio.Task] = []
        self.blocked: str | None = None
        #: called with the follower and the reason when it restarted (its link is stopped meanwhile)
        self.on_restart: Callable[[Follower, str], None] | None = None
        self._moved = Gate()  # woken when a link's ``sent`` or ``error`` changes

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._sender(f)) for f in self.followers]

    async def stop(self) -> None:
        """Stop every sender (an apply in flight is abandoned), empty the queues, clear the errors."""
        await self._cancel()
        for f in self.followers:
            f.unanswered_since = None
            f.queue, f.error, f.sent = asyncio.Queue(), None, -1
        self._moved.wake()

    async def close(self) -> None:
        await self._cancel()
        await self.client.aclose()

    async def _cancel(self) -> None:
        """Cancel every sender and wait until it ended. A sender still running after :data:`CANCEL_AGAIN_SECONDS` is
        cancelled again: Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives as the future it waits
        on completes (CPython gh-86296; a round queued as the rollback stops the links), and the sender would go on
        forever, and the rollback with it."""
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            while not t.done():
                await asyncio.wait({t}, timeout=CANCEL_AGAIN_SECONDS)
                t.cancel()
            if not t.cancelled():
                t.exception()  # retrieved: a sender that failed is not reported as never retrieved
        self.tasks = []

    async def ask(self, f: Follower, method: str, path: str, seconds: float = INIT_DEADLINE_SECONDS,
                  **kw) -> tuple[dict, bool]:
        """One request to a follower (its pieces, a state, a restore, a message), retried on lost connections,
        timeouts and 5xx for at most ``seconds`` (then TimeoutError; ValueError if refused: not 200): its answer, noted
        (:meth:`_heard`), and whether another process than before gave it."""
        delay, deadline = 0.05, time.monotonic() + seconds
        while True:
            try:
                resp = await self.client.request(method, f"{f.url}{API}{path}", **kw)
                f.reachable = True
                if resp.status_code < 500:
                    break
                why = f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                f.reachable, why = False, f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"shard {f.index} at {f.url}: {why}")
            log.warning("shard %d at %s: %s %s failed (%s); retrying", f.index, f.url, method, path, why)
            await asyncio.sleep(delay)
            delay = min(BACKOFF_MAX_SECONDS, delay * 2)
        if resp.status_code != 200:
            raise ValueError(f"{resp.status_code} {resp.text[:300]}")
        answer = resp.json()
        return answer, self._heard(f, answer)

    async def init_followers(self, bodies: dict[int, bytes]) -> None:
        """PUT each follower its pieces (``bodies``: index -> the frame), in parallel (:meth:`ask`): a follower's 4xx
        is 409 ``shard_init_failed``, one unreachable 503 ``shard_unreachable``."""
        async def one(f: Follower) -> None:
            try:
                await self.ask(f, "PUT", "/shard/model", content=bodies[f.index], headers={"content-type": FRAME})
            except TimeoutError as exc:
                raise ProtocolError(503, "shard_unreachable", str(exc)) from None
            except ValueError as exc:
                raise ProtocolError(409, "shard_init_failed",
                                    f"shard {f.index} at {f.url} refused the model: {exc}") from None

        await asyncio.gather(*(one(f) for f in self.followers))

    async def sent(self, step: int, seconds: float) -> None:
        """Return once every link without an error has written the apply of round ``step`` (or a later one) to its
        connection, or after ``seconds``, whichever comes first."""
        await self._moved.wait(lambda: all(f.error is not None or f.sent >= step for f in self.followers), seconds,
                               False)

    def _mark_sent(self, f: Follower, step: int) -> None:
        if step > f.sent:
            if marks.ON:
                marks.mark("decision.sent", step=step, shard=f.index)
            f.sent = step
            self._moved.wake()

    def queue(self, path: str, msg: dict, indices: list[int] | None = None) -> None:
        """Queue ``POST path`` with ``msg`` (an apply: :data:`APPLY`, the open round's progress, contributors lost) for
        the followers of ``indices`` (None: every one). Cannot fail (an unbounded queue)."""
        for f in self.followers:
            if indices is None or f.index in indices:
                f.queue.put_nowait((path, msg))
                if f.unanswered_since is None:
                    f.unanswered_since = time.monotonic()

    def silent(self, now: float | None = None) -> list[Follower]:
        """The followers whose link runs and whose last exchange got no answer, or whose apply has waited more than
        ``SILENT_SECONDS`` for one."""
        now = time.monotonic() if now is None else now
        return [f for f in self.followers if f.error is None and (
            f.reachable is False or (f.unanswered_since is not None and now - f.unanswered_since > SILENT_SECONDS))]

    async def _sender(self, f: Follower) -> None:
        while True:
            try:
                msg = await asyncio.wait_for(f.queue.get(), PROBE_SECONDS)
            except asyncio.TimeoutError:
                msg = None
            if f.error is not None:
                continue
            try:
                if msg is None:  # idle: is it still the process we know?
                    _, other = await self.ask(f, "GET", "/shard/state", PROBE_SECONDS, timeout=PROBE_TIMEOUT_SECONDS)
                else:
                    path, body = msg

                    async def trace(event: str, info: dict, step: int = body["step"]) -> None:
                        if event == "http11.send_request_body.complete":  # httpcore's "trace" request extension
                            self._mark_sent(f, step)
                    _, other = await self.ask(f, "POST", path, float("inf"), json=body,
                                              extensions={"trace": trace} if path == APPLY else {})
                    if path == APPLY:
                        self._mark_sent(f, body["step"])
            except TimeoutError:
                continue  # a probe that got no answer: the next one asks again
            except ValueError as exc:
                what = "its state" if msg is None else f"round {msg[1]['step']}"
                self._restarted(f, f"shard {f.index} refused {what}: {exc}")
                continue
            if msg is not None and f.queue.empty():
                f.unanswered_since = None  # every apply queued so far is answered
            if other:
                self._restarted(f, f"shard {f.index} restarted (it answers at step {f.step} as another process)")

    @staticmethod
    def _heard(f: Follower, answer: dict) -> bool:
        """Note a follower's ``step`` and ``boot`` (if the answer has one) from its answer: True if it is another
        process than before."""
        was, f.boot = f.boot, answer.get("boot", f.boot)
        f.step = answer.get("step") if answer.get("initialized", True) else None
        return was is not None and f.boot != was

    def _restarted(self, f: Follower, why: str) -> None:
        f.error = why
        self._moved.wake()
        if self.on_restart is None:
            log.error("%s: its link is stopped; the job cannot go on consistently (restore every shard from the "
                      "same step)", why)
            return
        self.on_restart(f, why)
