"""Retrying one request, with log lines that say which request failed and why.

:func:`call` runs ``fn`` until it returns, retrying the errors listed in ``retry_on`` with capped exponential
backoff and jitter: attempt n waits ``min(wait_max, wait_initial * 2 ** (n - 1) + uniform(0, wait_jitter))``
(stamina's schedule; stamina itself is not used: its retry hooks are process-wide and its time budget allows a wait
that ends past the deadline). It logs (logger ``worker.retry``) a WARNING before each retry
(``retrying POST /v1/gradients (step 12) in 0.21 s (attempt 2 of 10): ConnectionLost: ...``), a WARNING for an
attempt that failed after ``slow_after`` seconds or more (``... got no answer in 35.0 s (...)``), and an ERROR when
it gives up, then raises the last error (``giving up on ... after 10 attempts in 41.3 s: ...``). A single attempt
that fails (``attempts=1``, e.g. a heartbeat) is raised without the ERROR line; errors not in ``retry_on`` are raised
at once, unlogged.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger("worker.retry")


def describe(exc: BaseException) -> str:
    """``Type: message`` of an error (just ``Type`` when it has no message)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def call(fn: Callable[[], T], what: str, attempts: int, timeout: float,
         retry_on: tuple[type[BaseException], ...], *, slow_after: float = 5.0,
         wait_initial: float = 0.05, wait_max: float = 1.0, wait_jitter: float = 0.2) -> T:
    """``fn()``, retried on ``retry_on`` errors at most ``attempts`` times in all. ``what`` names the request in the
    log lines; ``timeout`` is the time budget in seconds of all attempts and waits: no retry is scheduled whose wait
    would end past it. Each attempt's own timeout is ``fn``'s business."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    start = time.monotonic()
    for attempt in range(1, attempts + 1):
        began = time.monotonic()
        try:
            return fn()
        except retry_on as exc:
            now = time.monotonic()
            if now - began >= slow_after:
                log.warning("%s got no answer in %.1f s (%s)", what, now - began, describe(exc))
            wait = min(wait_max, wait_initial * 2 ** (attempt - 1) + random.uniform(0, wait_jitter))
            if attempt == attempts or now + wait - start > timeout:
                if attempt > 1:
                    log.error("giving up on %s after %d attempts in %.1f s: %s", what, attempt, now - start,
                              describe(exc))
                raise
            log.warning("retrying %s in %.2f s (attempt %d of %d): %s", what, wait, attempt + 1, attempts,
                        describe(exc))
        time.sleep(wait)
