"""Per-second rates of monotonic counters over a sliding window. Pure, no I/O: the clock is an argument.

Contract: ``sample(now, counts)`` records the counters' values at most once every ``resolution`` seconds;
``rates(now, counts)`` answers ``(span, per-second rates)``, each ``(count_now - count_then) / (now - then)`` with
``then`` the newest sample at least ``window`` seconds old (else the oldest). Memory: at most ``window / resolution
+ 2`` samples, and a rate is never capped by how many events are kept.
"""
from __future__ import annotations

from collections import deque


class RateMeter:
    def __init__(self, window: float = 10.0, resolution: float = 0.1) -> None:
        self.window = window
        self.resolution = resolution
        self.samples: deque[tuple[float, tuple[float, ...]]] = deque()

    def sample(self, now: float, counts: tuple[float, ...]) -> None:
        if self.samples and now - self.samples[-1][0] < self.resolution:
            return
        self.samples.append((now, tuple(counts)))
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window:
            self.samples.popleft()  # the next one is old enough to start the window

    def rates(self, now: float, counts: tuple[float, ...]) -> tuple[float, tuple[float, ...]]:
        """(span in seconds, rate per second of each counter); zeros before two distinct instants."""
        then, old = self.samples[0] if self.samples else (now, counts)
        for t, c in self.samples:
            if t > now - self.window:
                break
            then, old = t, c
        span = now - then
        if span <= 0:
            return 0.0, tuple(0.0 for _ in counts)
        return span, tuple((c - o) / span for c, o in zip(counts, old))
