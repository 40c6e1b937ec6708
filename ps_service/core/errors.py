"""The core's one error: a refusal with a stable code and a text for humans, and no transport in it.

Whatever the core refuses raises :class:`CoreError` before any state changes. The HTTP layer maps each code to a
status (``ps_service.http.STATUS``); a code missing there is a test failure (tests/test_core_errors.py).
"""
from __future__ import annotations


class CoreError(Exception):
    """A request the core refuses: ``code`` (stable, lower-case) and ``detail`` (for humans)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
