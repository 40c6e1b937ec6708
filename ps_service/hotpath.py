"""A fast lane for the two calls every worker makes every step: ``POST /v1/gradients`` and ``GET /v1/model``
(on a sharded PS: ``POST /v1/shard/gradients`` and ``POST /v1/shard/commit`` too, and the coordinator's
``POST /v1/shard/apply`` to a follower; never on an unsharded one).

With small models FastAPI's routing, dependency injection and response handling were most of the
PS's time per request (py-spy, P=4, 2 workers: the endpoint itself ~15 % of the samples, the
framework around it ~65 %). This ASGI middleware calls the very same endpoint functions
(:mod:`ps_service.api`) directly when a request is plainly well-formed: the exact path and method,
query parameters it parses exactly as the route declares them, and a valid bearer token when
``PS_AUTH_TOKEN`` is set. Anything else (an unknown or repeated parameter, a value out of range, a
missing or wrong token) goes down the ordinary FastAPI stack untouched, so errors, 401 counting and
the OpenAPI contract stay FastAPI's. A refusal the endpoint raises (:data:`ps_service.http.REFUSALS`) is
answered with the same JSON body as the app's handler (:func:`ps_service.http.refusal_response`);
anything unexpected propagates to the app's 500 handler.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable
from urllib.parse import parse_qsl

from pydantic_core import PydanticUndefined as REQUIRED  # a required parameter's default: none given, FastAPI answers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ps_service import api
from ps_service.auth import authorised
from ps_service.http import REFUSALS, refusal_response
from ps_service.sharding import routes as shard_routes
from shared.protocol import API, MAX_INT

#: a boolean parameter's parser (another value: KeyError, FastAPI judges it)
_bool = {"1": True, "true": True, "0": False, "false": False}.__getitem__
_NUMBER = frozenset("0123456789.eE+-")


def _seconds(v: str) -> float:
    if not v or not _NUMBER.issuperset(v):  # " 5", "5_0": float() forms the route takes too; rare, so FastAPI decides
        raise ValueError(v)
    x = float(v)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(v)
    return x


def _step(v: str) -> int:
    if not (v.isascii() and v.isdigit()) or int(v) > MAX_INT:  # (the route's DecimalInt answers 400)
        raise ValueError(v)
    return int(v)


def _worker_id(v: str) -> str:
    if len(v) > 64:
        raise ValueError(v)
    return v


def _route(endpoint: Callable, parsers: dict[str, Callable[[str], Any]]) -> tuple:
    """(endpoint, parsers, the endpoint's query defaults read off its signature: ``Query(default)`` or a plain default,
    :data:`REQUIRED` if none; the route is the one source of each default)."""
    params = inspect.signature(endpoint).parameters
    defaults = {name: getattr(p.default, "default", p.default) for name, p in params.items() if name != "request"}
    assert parsers.keys() == defaults.keys(), (endpoint.__name__, sorted(defaults))  # every query parameter parsed
    return endpoint, parsers, defaults


#: (method, path) -> (endpoint, {query parameter: parser}, the route's defaults, :data:`REQUIRED` if none)
ROUTES: dict[tuple[str, str], tuple[Callable, dict[str, Callable[[str], Any]], dict[str, Any]]] = {
    ("POST", f"{API}/gradients"): _route(api.push, {"pull": _bool, "timeout": _seconds, "since": _step}),
    # a sharded PS's per-step calls (served only when PS_SHARDS > 1: :data:`SHARDED`)
    ("POST", f"{API}/shard/gradients"): _route(shard_routes.hold, {"map": _worker_id}),  # <= 64 chars too
    ("POST", f"{API}/shard/commit"): _route(shard_routes.commit, {"pull": _bool, "timeout": _seconds}),
    ("POST", f"{API}/shard/apply"): _route(shard_routes.apply, {}),
    ("GET", f"{API}/model"): _route(api.pull, {"min_step": _step, "timeout": _seconds, "worker_id": _worker_id,
                                               "shm": _bool, "since": _step, "partitioned": _bool}),
}


def _pairs(query: str) -> list[tuple[str, str]]:
    """The query's fields as the route reads them; ValueError for a field with no ``=`` (FastAPI judges it)."""
    return parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))


def _query(raw: bytes, parsers: dict, defaults: dict) -> dict | None:
    """The parsed parameters, or None when FastAPI should judge them."""
    try:
        pairs = _pairs(raw.decode("ascii"))
        out = {k: parsers[k](v) for k, v in pairs}
    except (ValueError, KeyError, UnicodeDecodeError):
        return None
    params = {**defaults, **out}
    return params if len(out) == len(pairs) and REQUIRED not in params.values() else None


SHARDED = frozenset({shard_routes.hold, shard_routes.commit, shard_routes.apply})


class HotPath:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        route = ROUTES.get((scope.get("method"), scope.get("path"))) if scope["type"] == "http" else None
        params = _query(scope.get("query_string", b""), route[1], route[2]) if route else None
        rt = scope["app"].state.runtime if params is not None else None
        if params is None or not authorised(scope) or (rt.shards is None and route[0] in SHARDED):
            return await self.app(scope, receive, send)
        try:
            result = await route[0](Request(scope, receive), **params)
        except REFUSALS as exc:
            result = refusal_response(exc)
        if not isinstance(result, Response):
            result = JSONResponse(result)
        await result(scope, receive, send)
