"""HTTP plumbing shared by the PS's routes: bounded body reading and JSON error bodies.

Every refusal leaves as ``{"error": code, "detail": text}`` with a 4xx status
(see :class:`shared.errors.ProtocolError`); FastAPI's own validation and
routing errors are mapped to the same shape (400: a malformed or mistyped
request), and an unexpected exception to a 500 of that shape (logged, never
echoing internals).

Every route that takes a body reads it with :func:`read_body` *in the endpoint*,
after the auth dependency ran: content type checked first (415), size checked
while streaming (413), a stalled body cut off (408), a client that vanished
mid-body answered 400 without a traceback. JSON bodies are then validated with
:func:`parse_json` (400). No route declares a pydantic body parameter, which
FastAPI would buffer, unbounded, before any dependency runs.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TypeVar
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ps_service.bodysink import SINK_KEY, BodySink
from ps_service.buffers import POOL
from shared.codec import ZERO_COPY_MIN_BYTES
from shared.errors import ProtocolError

log = logging.getLogger("ps_service")
M = TypeVar("M", bound=BaseModel)
#: default idle timeout of a body (the routes pass PS_BODY_IDLE_TIMEOUT_SECONDS)
BODY_IDLE_TIMEOUT = 30.0
#: limit of JSON bodies (they are small control messages)
JSON_BODY_LIMIT = 1 << 16


def error_response(status: int, code: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int, media_type: str,
                    idle_timeout: float = BODY_IDLE_TIMEOUT) -> bytes | memoryview:
    """The request body, refused with 415 for another content type, 413 past ``limit``, 408 if it stalls.

    The size check happens while streaming: a huge body is never buffered whole.
    ``idle_timeout`` bounds the wait for each chunk (a client that trickles or stops).
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != media_type:
        raise ProtocolError(415, "unsupported_media_type", f"send {media_type}, not {ctype[:64] or 'nothing'!r}")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise ProtocolError(400, "bad_content_length", "content-length must be a non-negative integer")
        if int(declared) > limit:
            raise ProtocolError(413, "body_too_large", f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    # a large body goes into one pooled buffer of our own (no join; writable: the core may aggregate in it),
    # written by the protocol itself where it can (ps_service/bodysink.py)
    big = declared is not None and int(declared) >= ZERO_COPY_MIN_BYTES
    sink = BodySink(POOL.take(int(declared))) if big else None
    if sink is not None:
        request.scope[SINK_KEY] = sink
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle_timeout) as deadline:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise ProtocolError(413, "body_too_large", f"body exceeds the limit of {limit} bytes")
                if sink is None:
                    chunks.append(chunk)
                elif chunk:
                    sink.write(chunk)
                deadline.reschedule(loop.time() + idle_timeout)  # every wake-up brings bytes (or the end)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise ProtocolError(408, "body_timeout", f"the body stalled for {idle_timeout:g} s") from None
    except ClientDisconnect:
        raise ProtocolError(400, "client_disconnected", "the client went away before the end of the body") from None
    except ValueError:
        raise ProtocolError(400, "bad_content_length", "the body is longer than its content-length") from None
    finally:
        request.scope.pop(SINK_KEY, None)
    if sink is not None:
        return sink.view[:sink.at]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_json(body: bytes, model: type[M]) -> M:
    """Validate a JSON body against ``model``; malformed JSON, missing or mistyped fields: 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise ProtocolError(400, "bad_request", _first_error(exc.errors(include_url=False, include_input=False))) from None


def _first_error(errors: list) -> str:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where or 'body'}: {first.get('msg', 'invalid request')}"[:300]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol(_: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.detail, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "bad_request", _first_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, "internal", "internal server error")
