"""HTTP plumbing shared by the PS's routes: bounded body reading and JSON error bodies.

Every refusal leaves as ``{"error": code, "detail": text}`` with a 4xx status
(:class:`shared.errors.ProtocolError` carries its status; the core's
:class:`ps_service.core.errors.CoreError` carries none: :data:`STATUS` maps its code); FastAPI's own validation and
routing errors are mapped to the same shape (400: a malformed or mistyped
request), and an unexpected exception to a 500 of that shape (logged, never
echoing internals).

Every route that takes a body reads it with
:func:`ps_service.transport.body.read_body` *in the endpoint*, after the auth
dependency ran. JSON bodies are then validated with :func:`parse_json` (400; a
key that appears twice in one object is 400 ``duplicate_key``). No route declares
a pydantic body parameter, which FastAPI would buffer, unbounded, before any
dependency runs.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, NoReturn, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ps_service.core.errors import CoreError
from shared.errors import ProtocolError
from shared.protocol import JSON, MAX_INT

log = logging.getLogger("ps_service")
M = TypeVar("M", bound=BaseModel)
#: limit of JSON bodies (they are small control messages)
JSON_BODY_LIMIT = 1 << 16


#: an integer in a query string or path, as docs/protocol.md says: decimal digits, a ``-`` only before a nonzero
#: number, and a zero fraction (``5.0``); not Python's ``int()`` forms (``1_0``, ``+1``, `` 1``, ``-0``); at most
#: :data:`~shared.protocol.MAX_INT` in magnitude
_DECIMAL = re.compile(r"(?:[0-9]+|-0*[1-9][0-9]*)(?:\.0+)?")


def _decimal(value: Any) -> Any:
    if isinstance(value, str):
        if not _DECIMAL.fullmatch(value):
            raise ValueError("an integer in decimal digits")
        value = int(value.partition(".")[0])  # more than 4300 digits: ValueError, a 400 as well
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        raise ValueError(f"an integer in [-{MAX_INT}, {MAX_INT}]")
    return value


#: a route's integer parameter, query (``limit: Annotated[DecimalInt, Query(ge=1)] = 20``: as ``DecimalInt = Query(20)``
#: FastAPI would drop the validator) or path (``step: DecimalInt``)
DecimalInt = Annotated[int, BeforeValidator(_decimal)]


def _json_int(value: Any) -> Any:
    if isinstance(value, (bool, str)):  # pydantic's lax int takes ``true`` as 1 and ``"1"`` as 1
        raise ValueError("a JSON integer, not a boolean or a string")
    return value


#: an integer field of a JSON body: a JSON number (``1``, or ``1.0`` as JSON Schema's integer), never ``true`` or ``"1"``
JsonInt = Annotated[int, BeforeValidator(_json_int)]


def error_response(status: int, code: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


#: the HTTP status of each code the core refuses with (:class:`CoreError`): 400 a malformed request, 404 a worker
#: the PS does not know, 409 a request that does not fit the job's state now (register, initialise or wait
#: first), 422 a well-formed request whose content the model or the optimizer cannot take
STATUS = {
    "bad_name": 400,
    "unknown_worker": 404,
    "not_initialized": 409, "already_initialized": 409, "not_active": 409, "not_started": 409,
    "future_step": 422, "tensor_mismatch": 422, "nonfinite_gradient": 422, "bad_dtype": 422,
    "nonfinite_weights": 422, "bad_optimizer": 422, "optimizer_changed": 409,
}

#: what a route may refuse with: its own errors and the core's
REFUSALS = (ProtocolError, CoreError)


def status_of(exc: ProtocolError | CoreError) -> int:
    """A refusal's HTTP status (a core code missing from :data:`STATUS` is a bug: KeyError, a 500)."""
    return exc.status if isinstance(exc, ProtocolError) else STATUS[exc.code]


def refusal_response(exc: ProtocolError | CoreError) -> JSONResponse:
    """The JSON error answer of a refusal."""
    return error_response(status_of(exc), exc.code, exc.detail, getattr(exc, "headers", None))


def _object(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ProtocolError(400, "duplicate_key", f"the key {key[:64]!r} appears twice in one object")
    return out


def _not_json(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def json_body(model: type[BaseModel]) -> dict:
    """A route's ``openapi_extra`` for a JSON body it reads itself with :func:`parse_json`: ``model``'s schema."""
    return {"requestBody": {"required": True, "content": {JSON: {"schema": model.model_json_schema()}}}}


def parse_json(body: bytes | bytearray | memoryview, model: type[M]) -> M:
    """Validate a JSON body against ``model``; malformed JSON (``NaN``/``Infinity`` included: not JSON, RFC 8259),
    a repeated key, missing or mistyped fields: 400."""
    try:
        obj = json.loads(bytes(body), object_pairs_hook=_object, parse_constant=_not_json)
    except (ValueError, RecursionError):
        raise ProtocolError(400, "bad_request", "body: the body is not valid JSON (or nested too deeply)") from None
    try:
        return model.model_validate(obj, strict=False)
    except ValidationError as exc:
        detail = first_error(exc.errors(include_url=False, include_input=False))
        raise ProtocolError(400, "bad_request", detail) from None


def first_error(errors: list) -> str:
    """A pydantic validation's first error as ``where: what`` (a 400's detail), at most 300 characters."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where or 'body'}: {first.get('msg', 'invalid request')}"[:300]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    @app.exception_handler(CoreError)
    async def _protocol(_: Request, exc: ProtocolError | CoreError) -> JSONResponse:
        return refusal_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "bad_request", first_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, "internal", "internal server error")
