"""The primary's link to its standby (PS -> PS HTTP with the peer token, :func:`ps_service.auth.peer_token`; every
call with a timeout; the messages, their answers and the log's rules are docs/protocol-standby.md's).

Contract (one asyncio task, :meth:`Link.run`, while this PS leads, :attr:`Pair.leading`): without a standby fed it
sends the state (the snapshot on the event loop, encoded off it); each step message goes into the standby's log if it
advertised one this PS can map (:meth:`send`: at once on the event loop, else from the queue) or over HTTP from the
writer thread (a kept-alive connection of its own), in order, each until acknowledged; the task pings every quarter
of the failover timeout (idle, or with a log). No answer for ``PS_FAILOVER_TIMEOUT_SECONDS``: the standby is lost
(:meth:`Pair.lost_standby`); 409 ``stale_term`` (or a log closed with a newer term): deposed; another refusal: the
state again. A candidate restarted with a term kept asks its peer as often (:meth:`Pair.peer_answers`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import httpx

import ps_service.standby as standby  # its roles (read at call time: the package imports this module first)
from ps_service.auth import peer_token
from ps_service.standby import messages, ring
from shared import liveness
from shared.frame import MEDIA_TYPE as FRAME
from shared.httpxconn import HttpxConnection
from shared.protocol import API
from shared.rawhttp import ConnectionLost, RawConnection
from shared.tokens import bearer_header

log = logging.getLogger("ps_service")
#: a state transfer may take this long (megabytes over a slow link)
STATE_TIMEOUT_SECONDS = 60.0
LOGGED = "(in the log)"  # the writer thread's answer for a message committed in the standby's log


class Link:
    def __init__(self, pair) -> None:
        self.pair = pair
        f = pair.failover
        transport = httpx.AsyncHTTPTransport(socket_options=liveness.socket_options())
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(f, connect=f), transport=transport,
                                        headers=dict(bearer_header(peer_token(pair.settings))))
        self.url = f"{pair.peer}{API}/ha"
        self.last_ok = time.monotonic()
        self.failures = 0
        self.error: str | None = None  # the last failure, for /v1/status
        self._woken = asyncio.Event()
        self.task: asyncio.Task | None = None
        # the writer thread of the steps (one request at a time, on a kept-alive connection of its own)
        self.conn = RawConnection(pair.peer) if pair.peer.startswith("http://") else HttpxConnection(pair.peer)
        self._step_headers = {**bearer_header(peer_token(pair.settings)), "content-type": FRAME}
        self._ready = threading.Condition()
        self._done = (-1, 0)  # (epoch, seq): the newest step the writer got acknowledged
        self._closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.log: ring.LogWriter | None = None  # the standby's log, mapped (same host), for snapshot ``transferred``
        self.logged: deque[tuple[int, int]] = deque(maxlen=ring.SLOTS)  # (seq, bytes) of the records written last
        self.pinged = 0.0

    async def peer(self, timeout: float | None = None) -> dict | None:
        """The peer's ``GET /v1/ha`` answer, or None if it does not answer (in ``timeout`` s, else the link's)."""
        try:
            resp = await self.client.get(self.url, timeout=timeout or httpx.USE_CLIENT_DEFAULT)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.create_task(self.run())
        self.thread = threading.Thread(target=self._writer, name="standby-writer", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """Something to send: the writer thread at once (a step), the task (a transfer, a ping)."""
        self._woken.set()
        with self._ready:
            self._ready.notify()

    async def close(self) -> None:
        """Stop the task and the thread: both look at ``_closing`` (a cancellation alone can be lost: Python 3.11's
        ``asyncio.wait_for`` drops one that arrives as its future completes, CPython gh-86296)."""
        self._closing = True
        self.wake()
        if self.task is not None:
            await asyncio.wait({self.task}, timeout=self.pair.failover)
            while not self.task.done():
                self.task.cancel()
                await asyncio.wait({self.task}, timeout=0.2)
        await self.client.aclose()
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, self.pair.failover + 1)
        self.conn.close()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until woken; whether woken."""
        try:
            await asyncio.wait_for(self._woken.wait(), seconds)
            return True
        except TimeoutError:
            return False
        finally:
            self._woken.clear()

    async def run(self) -> None:
        p = self.pair
        while not self._closing:
            try:
                if p.leading:
                    await self._once()
                elif p.restarted:  # a candidate back with a kept term: does its peer answer, and with a term?
                    if (answer := await self.peer()) is not None:
                        p.peer_answers(answer)
                    await self._sleep(p.failover / 4)
                else:
                    self.last_ok = time.monotonic()
                    await self._sleep(p.failover / 4)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the link die
                log.exception("hot standby: the link to %s failed", p.peer)
                await asyncio.sleep(p.failover / 4)

    def _failed(self, why: str) -> None:
        """No answer, or a 5xx: the standby is lost once the last answer is older than the failover timeout."""
        p = self.pair
        self.failures += 1
        self.error = why
        if time.monotonic() - self.last_ok > p.failover and (p.feeding or p.role == standby.PRIMARY):
            if p.feeding:
                log.warning("hot standby: the standby at %s does not answer (%s)", p.peer, why)
            p.lost_standby(f"the standby has not answered for {time.monotonic() - self.last_ok:.1f} s ({why})")

    async def _request(self, method: str, path: str, timeout: float | None = None, **kw) -> httpx.Response | None:
        """The standby's answer below 500 (:meth:`_heard`); None: no answer or a 5xx, counted (:meth:`_failed`)."""
        p = self.pair
        try:
            resp = await self.client.request(method, f"{self.url}{path}", timeout=timeout or httpx.USE_CLIENT_DEFAULT,
                                             **kw)
        except httpx.HTTPError as exc:
            await asyncio.sleep(min(p.failover / 4, 0.02 * 2 ** min(self.failures, 6)))
            return self._failed(f"{type(exc).__name__}: {exc}")
        if resp.status_code >= 500:
            await asyncio.sleep(p.failover / 4)
            return self._failed(f"{resp.status_code} {resp.text[:200]}")
        if self._heard(resp.status_code, resp.text, f"{method} {path}"):
            await self._sleep(p.failover / 4)
        return resp

    def _heard(self, status: int, answer: str, what: str) -> bool:
        """The standby answered (below 500): 409 ``stale_term`` deposes this PS; another refusal: the state again.
        Whether it refused."""
        self.last_ok, self.failures, self.error = time.monotonic(), 0, None
        if status == 409 and '"stale_term"' in answer:
            self.pair.deposed(f"the peer says: {answer[:200]}")
        elif status >= 400:
            log.warning("hot standby: %s refused: %s %s", what, status, answer[:200])
            self.pair.feeding = self.pair.gated = False  # the state again
            return True
        return False

    async def _once(self) -> None:
        p = self.pair
        if not p.feeding or p.transferring:  # (a candidate too: a standby that answers again gets the state, then it
            await self._transfer()  # serves again)
            return
        woken = await self._sleep(p.failover / 4)
        carried = self.log is not None  # (by the log: ping anyway)
        if p.seq > p.acked:  # the writer thread sends the steps: is the standby still answering?
            if time.monotonic() - self.last_ok > p.failover:
                self._failed(f"no acknowledgement for {time.monotonic() - self.last_ok:.1f} s")
        elif (not woken or carried and time.monotonic() - self.pinged >= p.failover / 4) and p.feeding:
            self.pinged, seq = time.monotonic(), p.acked
            resp = await self._request("POST", "/ping", params={"term": p.term, "seq": seq, "gated": int(p.gated)})
            if resp is not None and resp.status_code == 200:
                p.acknowledged(seq, None)

    # ---- the step messages: into the standby's log (same host) or over HTTP ------------------------------------
    def send(self, seq: int, parts: list, members: frozenset | None) -> None:
        """Message ``seq``, on the event loop as the core queues it: into the standby's log at once if nothing is queued
        before it (acknowledged once committed), else queued for the writer thread (the log or HTTP), in order."""
        p = self.pair
        if not p.queue and self._into_log(p.epoch, seq, parts) == 200:
            self._step_answered(p.epoch, seq, self.logged[-1][1], members, 200, LOGGED)
        else:
            p.queue.append((seq, messages.copied(parts), members))
            self.wake()

    def log_behind(self) -> tuple[int | None, int]:
        """The last message the standby applied from the log (None: no log) and the bytes of the records after it."""
        w = self.log
        if w is None:
            return None, 0
        applied = w.applied
        return applied, sum(n for s, n in list(self.logged) if s > applied)

    # ---- the steps, from the writer thread ------------------------------------------------------------------
    def _next(self):
        p = self.pair
        if not p.feeding or p.transferring or self._closing:
            return None
        done = max(p.acked, self._done[1] if self._done[0] == p.epoch else 0)
        while True:
            try:
                queued = list(p.queue)
                break
            except RuntimeError:  # the event loop's thread changed it meanwhile: look again
                continue
        return next(((p.epoch, m) for m in queued if m[0] > done), None)

    def _writer(self) -> None:
        p = self.pair
        while not self._closing:
            with self._ready:
                while (job := self._next()) is None and not self._closing:
                    self._ready.wait(p.failover / 4)
            if job is None:
                return
            epoch, (seq, body, members) = job
            t, cpu = time.perf_counter(), time.thread_time()
            status, answer = self._into_log(epoch, seq, [body]), LOGGED
            if status is None:
                target = f"{API}/ha/steps?term={p.term}&seq={seq}&gated={int(p.gated)}"
                try:
                    resp = self.conn.request("POST", target, self._step_headers, (body,), p.failover)
                    status, answer = resp.status_code, resp.text
                except (ConnectionLost, httpx.HTTPError) as exc:
                    status, answer = None, f"{type(exc).__name__}: {exc}"
            elif status == 409:
                continue  # (the event loop handles the closed log)
            p.costs["send_s"] += time.perf_counter() - t  # (this thread's own keys: no other writes them)
            p.costs["writer_cpu_s"] += time.thread_time() - cpu
            if status == 200:
                self._done = (epoch, seq)
            size = len(body)
            del job, body  # its pool buffer is free once the event loop drops the acknowledged message
            self.loop.call_soon_threadsafe(self._step_answered, epoch, seq, size, members, status, answer)
            if status != 200:
                time.sleep(min(p.failover / 4, 0.02 * 2 ** min(self.failures, 6)))

    def _into_log(self, epoch: int, seq: int, parts: list) -> int | None:
        """Message ``seq`` written and committed in the log (its marker last): 200, acknowledged. None: no log, the ring
        full (the standby's reader lags: it takes the records before the message over HTTP first) or the message does
        not fit a slot: over HTTP. 409: not written (a job of an older snapshot: the log is its epoch's; or the log was
        closed: the standby's answer is handled on the event loop)."""
        p, w = self.pair, self.log
        if w is None:
            return None
        if self._closing or epoch != p.epoch or not p.feeding:
            return 409
        body = w.begin(seq) if w.room(seq) else None
        if body is None or sum(len(x) for x in parts) > len(body):
            return None
        n = len(messages.copied(parts, body))
        closed = w.commit(seq, p.term, p.gated, n)
        if closed:
            self.log = None
            code = "stale_term" if closed > p.term else "log_closed"
            self.loop.call_soon_threadsafe(self._heard, 409, f'{{"error": "{code}", "closed with term": {closed}}}',
                                           f"record {seq} of the log")
            return 409
        self.logged.append((seq, n))
        return 200

    def _step_answered(self, epoch: int, seq: int, size: int, members, status: int | None, answer: str) -> None:
        """A message's result (the writer thread's, on the event loop's thread): a record committed in the log
        (``LOGGED``) is acknowledged, not an answer heard from the standby (its pings say it is alive)."""
        p = self.pair
        if epoch != p.epoch or not p.feeding:
            return
        if status is None or status >= 500:
            self._failed(answer if status is None else f"{status} {answer[:200]}")
            return
        if answer is not LOGGED and self._heard(status, answer, f"step message {seq}"):
            self.wake()
        elif status == 200:
            p.bytes_sent += size
            p.costs["logged"] += answer is LOGGED
            while p.queue and p.queue[0][0] <= seq:
                p.queue.popleft()
            p.acknowledged(seq, members)

    async def _transfer(self) -> None:
        p = self.pair
        if not p.core.initialized:
            await self._sleep(p.failover / 4)
            return
        resp = await self._request("GET", "")
        if resp is None or resp.status_code != 200 or not p.leading:
            return
        if resp.json().get("term", 0) > p.term:
            p.deposed(f"the peer is the {resp.json().get('role')} of term {resp.json().get('term')}")
            return
        seq, state = p.snapshot()
        self.log = None  # (the standby makes a new one with the state)
        body = await asyncio.to_thread(messages.encode_state, state)
        del state
        resp = await self._request("PUT", "/state", timeout=STATE_TIMEOUT_SECONDS, content=body,
                                   params={"term": p.term, "seq": seq}, headers={"content-type": FRAME})
        if resp is not None and resp.status_code == 200 and p.feeding:
            if (advert := resp.json().get("log")) is not None and p.settings.shm_dir:
                try:
                    self.log = ring.LogWriter.open(p.settings.shm_dir, advert)
                    log.info("hot standby: the steps go into the standby's log %s (same host)", advert.get("name"))
                except (OSError, ValueError) as exc:  # another host (or not the file advertised): HTTP
                    log.info("hot standby: the standby's log is not here (%s): the steps go over HTTP", exc)
            p.transfers += 1
            p.bytes_sent += len(body)
            log.info("hot standby: sent the state of message %d (%d bytes) to %s", seq, len(body), p.peer)
            p.acknowledged(seq, p.state_roster)
