"""HTTP plumbing shared by the PS's routes: bounded body reading and JSON error bodies.

Every refusal leaves as ``{"error": code, "detail": text}`` with a 4xx status
(see :class:`shared.errors.ProtocolError`); FastAPI's own validation and
routing errors are mapped to the same shape, and an unexpected exception to a
500 of that shape (logged, never echoing internals).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.errors import ProtocolError

log = logging.getLogger("ps_service")


def error_response(status: int, code: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int, media_type: str) -> bytes:
    """The request body, refused with 415 for another content type and 413 past ``limit``.

    The size check happens while streaming: a huge body is never buffered whole.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != media_type:
        raise ProtocolError(415, "unsupported_media_type", f"send {media_type}, not {ctype or 'nothing'!r}")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ProtocolError(400, "bad_content_length", "content-length must be a non-negative integer")
        if int(declared) > limit:
            raise ProtocolError(413, "body_too_large", f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(413, "body_too_large", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol(_: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(422 if first.get("loc", ("",))[0] == "body" else 400, "bad_request",
                              f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, "internal", "internal server error")
