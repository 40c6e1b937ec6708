"""The coordinator's links to its followers (PS -> PS HTTP with the training token, every call with a timeout).

Contract:
- :meth:`Links.init_followers` sends each follower its pieces of the model (``PUT /v1/shard/model``), in
  parallel, retrying lost connections and 5xx for at most ``INIT_DEADLINE_SECONDS``; a follower's 4xx is
  raised as a 409 ``shard_init_failed`` naming it, an unreachable one as 503 ``shard_unreachable``.
- :meth:`Links.round_closed` queues "apply round s with contributors C" for every follower; one task per
  follower sends them in step order (``POST /v1/shard/apply``), retrying each (capped backoff) until the
  follower answers. A refusal (4xx: the follower restarted from another state) stops that follower's link:
  the job cannot go on consistently, and ``/v1/status`` says why (:attr:`Follower.error`).
- :meth:`Links.check_steps` (start-up after a restore) asks each follower its step and checkpoint steps: every
  shard must resume at the coordinator's step; a follower elsewhere that has a checkpoint of it is told to
  restore it (``POST /v1/shard/restore``), else :attr:`Links.blocked` says which differs (workers cannot register).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from shared.errors import ProtocolError
from shared.frame import MEDIA_TYPE as FRAME
from shared.protocol import API
from shared.tokens import bearer_header

log = logging.getLogger("ps_service")

INIT_DEADLINE_SECONDS = 30.0
REQUEST_TIMEOUT_SECONDS = 10.0
BACKOFF_MAX_SECONDS = 1.0


@dataclass
class Follower:
    index: int
    url: str
    step: int | None = None  # its global step, as it last answered
    reachable: bool | None = None  # did the last exchange get an answer
    error: str | None = None  # a refusal that stopped the link
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class Links:
    def __init__(self, urls: list[str], token) -> None:
        self.followers = [Follower(i, url) for i, url in enumerate(urls) if i > 0]
        self.headers = dict(bearer_header(token))
        self.client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS, headers=self.headers)
        self.tasks: list[asyncio.Task] = []
        self.blocked: str | None = None

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._sender(f)) for f in self.followers]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        await self.client.aclose()

    async def _exchange(self, f: Follower, method: str, path: str, deadline: float, **kw) -> httpx.Response:
        """One request, retried on lost connections, timeouts and 5xx until ``deadline`` (monotonic)."""
        delay = 0.05
        while True:
            try:
                resp = await self.client.request(method, f"{f.url}{API}{path}", **kw)
                f.reachable = True
                if resp.status_code < 500:
                    return resp
                why = f"{resp.status_code} {resp.text[:200]}"
            except httpx.HTTPError as exc:
                f.reachable, why = False, f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > deadline:
                raise TimeoutError(f"shard {f.index} at {f.url}: {why}")
            log.warning("shard %d at %s: %s %s failed (%s); retrying", f.index, f.url, method, path, why)
            await asyncio.sleep(delay)
            delay = min(BACKOFF_MAX_SECONDS, delay * 2)

    async def init_followers(self, bodies: dict[int, bytes]) -> None:
        """PUT each follower its pieces (``bodies``: index -> the frame)."""
        async def one(f: Follower) -> None:
            try:
                resp = await self._exchange(f, "PUT", "/shard/model", time.monotonic() + INIT_DEADLINE_SECONDS,
                                            content=bodies[f.index],
                                            headers={"content-type": FRAME})
            except TimeoutError as exc:
                raise ProtocolError(503, "shard_unreachable", str(exc)) from None
            if resp.status_code >= 400:
                raise ProtocolError(409, "shard_init_failed", f"shard {f.index} at {f.url} refused the model: "
                                                              f"{resp.status_code} {resp.text[:300]}")
            f.step = resp.json().get("step")

        await asyncio.gather(*(one(f) for f in self.followers))

    def round_closed(self, step: int, contributors: list[tuple[int, str]], mean_of: int) -> None:
        msg = {"step": step, "contributors": [list(c) for c in contributors], "mean_of": mean_of}
        for f in self.followers:
            f.queue.put_nowait(msg)

    async def _sender(self, f: Follower) -> None:
        while True:
            msg = await f.queue.get()
            if f.error is not None:
                continue
            resp = await self._exchange(f, "POST", "/shard/apply", float("inf"), json=msg)
            if resp.status_code >= 400:
                f.error = f"round {msg['step']}: {resp.status_code} {resp.text[:300]}"
                log.error("shard %d at %s refused to apply round %d (%s): its link is stopped; the job cannot go "
                          "on consistently (restore every shard from the same step)", f.index, f.url, msg["step"],
                          f.error)
                continue
            f.step = resp.json().get("step")

    async def check_steps(self, step: int, own: list[int]) -> None:
        """After the coordinator restored step ``step`` (``own``: the steps of its checkpoints): every follower must
        resume at that step. One that is at another step but has a checkpoint of it is told to restore it
        (``POST /v1/shard/restore``); else registration stays refused, naming the newest step every shard has."""
        bad, common = [], set(own) | {step}
        for f in self.followers:
            try:
                resp = await self._exchange(f, "GET", "/shard/state", time.monotonic() + INIT_DEADLINE_SECONDS)
                st = resp.json()
            except (TimeoutError, ValueError) as exc:
                bad.append(f"shard {f.index} did not answer ({exc})")
                continue
            f.step = st.get("step") if st.get("initialized") else None
            held = set(st.get("checkpoints") or [])
            common &= held | ({f.step} if f.step is not None else set())
            if f.step != step and step in held:
                resp = await self._exchange(f, "POST", "/shard/restore", time.monotonic() + INIT_DEADLINE_SECONDS,
                                            json={"step": step})
                if resp.status_code == 200:
                    log.warning("shard %d was at step %s: it restored step %d, the coordinator's", f.index, f.step, step)
                    f.step = step
            if f.step != step:
                bad.append(f"shard {f.index} is at step {'none (no model)' if f.step is None else f.step}")
        self.blocked = None
        if bad:
            newest = max(common, default=None)
            self.blocked = (f"the coordinator restored step {step} but {'; '.join(bad)}: restore every shard from a "
                            f"checkpoint of the same step (the newest every shard has: {newest}), or start them all "
                            "fresh")
            log.error("%s", self.blocked)
