"""The one error type of the wire protocol.

Anything that rejects a request raises :class:`ProtocolError`; the PS turns it
into an HTTP response ``{"error": code, "detail": text}`` with ``status``, and
the worker client raises it again from such a response. Codes are stable,
lower-case identifiers; details are for humans.
"""
from __future__ import annotations


class ProtocolError(Exception):
    """A request the PS refuses (or a payload the codec refuses)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail


def bad_request(code: str, detail: str) -> ProtocolError:
    return ProtocolError(400, code, detail)


def unprocessable(code: str, detail: str) -> ProtocolError:
    return ProtocolError(422, code, detail)
