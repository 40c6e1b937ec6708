"""How long a client may reuse an idle kept-alive connection to a PS (docs/protocol.md, "Connections").

The PS closes a connection idle for ``PS_HTTP_KEEPALIVE_SECONDS`` (uvicorn's ``timeout_keep_alive``; default 60 s, so
heartbeats and steps of a few seconds keep their connections) and says so on every answer: ``keep-alive:
timeout=<seconds>``. A request sent as that close is on its way is lost unread, and a client cannot tell from the
socket that the close is imminent; so a client reuses a connection only while it has been idle for less than
:func:`reuse_seconds` of the PS's timeout (half of it) and opens a fresh one after that.
"""
from __future__ import annotations

import time
from typing import Mapping

#: the response header that carries the PS's timeout, and uvicorn's default, assumed when an answer does not say
HEADER = "keep-alive"
DEFAULT_SERVER_SECONDS = 5.0


def header_value(server_seconds: float) -> str:
    """The ``keep-alive`` value a PS with this timeout sends (e.g. ``timeout=5``)."""
    return f"timeout={server_seconds:g}"


def server_seconds(headers: Mapping[str, str], default: float = DEFAULT_SERVER_SECONDS) -> float:
    """The timeout an answer's headers (lower-case names) announce, or ``default`` if none is readable."""
    for part in headers.get(HEADER, "").split(","):
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "timeout":
            try:
                seconds = float(value)
            except ValueError:
                return default
            return seconds if seconds > 0 else default
    return default


def reuse_seconds(server_seconds: float = DEFAULT_SERVER_SECONDS) -> float:
    """For how long after its last answer a client may still send on a connection the PS keeps ``server_seconds``."""
    return server_seconds / 2


class IdleClock:
    """One connection's clock: when its last answer ended, and whether it has been idle too long to be reused."""

    def __init__(self) -> None:
        self.since, self.seconds = 0.0, reuse_seconds()

    def expired(self) -> bool:
        return time.monotonic() - self.since >= self.seconds

    def answered(self, headers: Mapping[str, str]) -> None:
        """An answer with these headers (lower-case names) was read in full just now."""
        self.since, self.seconds = time.monotonic(), reuse_seconds(server_seconds(headers))
