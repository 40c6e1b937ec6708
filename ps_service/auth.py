"""Access control of the PS: bearer tokens, as FastAPI dependencies routers attach.

Contract:
- :func:`require_training` guards every route that registers, leaves,
  heartbeats, initialises, pulls, pushes or controls: with ``PS_AUTH_TOKEN``
  set, the request needs ``Authorization: Bearer <that token>``. The routes between the PS processes
  (:data:`PEER_ROUTES`: a sharded PS's coordinator to a follower, a hot-standby pair's primary to
  its standby) take ``PS_PEER_TOKEN`` instead when it is set (the training token is every worker's:
  it must not make a follower apply a round nor a standby a step), and their read-only state
  (:data:`PEER_READABLE`) either (:func:`training_tokens`); a PS sends its peers :func:`peer_token`.
- :func:`require_monitor` guards the read-only monitoring routes (status,
  workers, rounds, metrics, the dashboard): with ``PS_MONITOR_TOKEN`` set, they
  need that token or the training token; unset, they are open. The monitor
  token never opens a training route.
- ``/healthz`` and ``/readyz`` take neither (orchestrators probe them).
- Tokens are compared in constant time (:func:`hmac.compare_digest` over
  SHA-256 digests, so not even the length leaks). A refusal is a 401
  ``{"error": "unauthorized", "detail": ...}`` with ``WWW-Authenticate: Bearer``,
  raised before the body is read, and counted in ``Runtime.auth_failures``.
  Neither the expected nor the presented token is ever logged or echoed.
  The header's form (RFC 6750): :func:`shared.tokens.presented_token`; a
  malformed one (two ``Authorization`` fields, a space in the token) is a 401
  with ``error="invalid_request"``.
"""
from __future__ import annotations

import hashlib
import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from ps_service.runtime import runtime
from shared.errors import ProtocolError
from shared.protocol import API
from shared.tokens import presented_token

REALM = 'Bearer realm="syncps"'

# The schemes document the security of each route in the OpenAPI schema; :func:`check` reads the header itself
# (auto_error=False: FastAPI refuses nothing).
_training_scheme = HTTPBearer(auto_error=False, scheme_name="trainingToken",
                              description="PS_AUTH_TOKEN: training and control routes.")
_monitor_scheme = HTTPBearer(auto_error=False, scheme_name="monitorToken",
                             description="PS_MONITOR_TOKEN (or PS_AUTH_TOKEN): monitoring routes.")


class Unauthorized(ProtocolError):
    """A 401 that carries the ``WWW-Authenticate`` challenge (RFC 6750)."""

    def __init__(self, detail: str, challenge: str) -> None:
        super().__init__(401, "unauthorized", detail)
        self.headers = {"WWW-Authenticate": challenge}


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def token_matches(presented: str, expected: SecretStr) -> bool:
    """Constant-time comparison (the same work whatever the inputs' contents and lengths)."""
    return hmac.compare_digest(_digest(presented), _digest(expected.get_secret_value()))


#: the routes between the PS processes: a sharded PS's coordinator to a follower, a hot-standby pair's primary to its
#: standby; with ``PS_PEER_TOKEN`` set, that token only opens them
PEER_ROUTES = frozenset({("PUT", f"{API}/shard/model"), *(("POST", f"{API}/shard/{p}")
                                                          for p in ("apply", "progress", "lost", "restore")),
                         ("PUT", f"{API}/ha/state"), ("POST", f"{API}/ha/steps"), ("POST", f"{API}/ha/ping")})
#: the peers' read-only state (the coordinator's links, the pair's probes ask it too): either token opens it
PEER_READABLE = frozenset({("GET", f"{API}/shard/state"), ("GET", f"{API}/ha")})


def training_tokens(settings, method: str, path: str) -> tuple[SecretStr, ...]:
    """The tokens that open the training route ``method path`` (none: it is open): the peer token alone on
    :data:`PEER_ROUTES` when one is set, else the training token (and the peer token on :data:`PEER_READABLE`)."""
    peer, training = settings.peer_token, settings.auth_token
    if peer is not None and (method, path) in PEER_ROUTES:
        return (peer,)
    if training is None:
        return ()
    return (training, peer) if peer is not None and (method, path) in PEER_READABLE else (training,)


def peer_token(settings) -> SecretStr | None:
    """The token a PS sends its peers (a coordinator its followers, a PS of a pair the other): PS_PEER_TOKEN, else the
    training token."""
    return settings.peer_token or settings.auth_token


def from_peer(request: Request) -> bool:
    """Whether a request that passed :func:`require_training` may see what only a peer needs (the standby's log
    advert): no peer token set, or it presented that one."""
    peer = runtime(request).settings.peer_token
    presented = presented_token(request.headers.getlist("authorization"))
    return peer is None or bool(presented) and token_matches(presented, peer)


def authorised(scope: dict) -> bool:
    """Whether an ASGI request ``scope`` may use a training route (for the middlewares that run before the routes'
    dependencies: ps_service/hotpath.py, ps_service/standby/gate.py); nothing counted or raised."""
    tokens = training_tokens(scope["app"].state.runtime.settings, scope.get("method"), scope.get("path"))
    if not tokens:
        return True
    presented = presented_token([v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"])
    return bool(presented) and any([token_matches(presented, token) for token in tokens])


def check(request: Request, *accepted: SecretStr | None) -> None:
    """Pass if no token is configured or the request's bearer token (:func:`shared.tokens.presented_token`) matches
    one of ``accepted``; else count and raise 401."""
    tokens = [t for t in accepted if t is not None]
    if not tokens:
        return
    presented = presented_token(request.headers.getlist("authorization"))
    if presented and any([token_matches(presented, token) for token in tokens]):  # a list: the same work either way
        return
    runtime(request).auth_failures += 1
    if presented == "":
        raise Unauthorized("this route needs 'Authorization: Bearer <token>'", REALM)
    if presented is None:
        raise Unauthorized("one 'Authorization: Bearer <token>' field, the token without spaces",
                           f'{REALM}, error="invalid_request"')
    raise Unauthorized("the bearer token is not valid for this route", f'{REALM}, error="invalid_token"')


async def require_training(request: Request,
                           creds: HTTPAuthorizationCredentials | None = Depends(_training_scheme)) -> None:
    """Dependency of the training and control routes (PS_AUTH_TOKEN; a sharded PS's peer routes: PS_PEER_TOKEN when
    set, :func:`training_tokens`)."""
    check(request, *training_tokens(runtime(request).settings, request.method, request.scope["path"]))


async def require_monitor(request: Request,
                          creds: HTTPAuthorizationCredentials | None = Depends(_monitor_scheme)) -> None:
    """Dependency of the read-only monitoring routes (PS_MONITOR_TOKEN, or the training token)."""
    s = runtime(request).settings
    if s.monitor_token is not None:
        check(request, s.monitor_token, s.auth_token)


#: pass as ``dependencies=`` of a router or route
TRAINING = [Depends(require_training)]
MONITORING = [Depends(require_monitor)]
