"""Bearer tokens as settings: from an environment variable or from a file (a Docker secret).

Both services read their token through :func:`resolve_token` from a settings validator: ``X_AUTH_TOKEN`` (the
value) or ``X_AUTH_TOKEN_FILE`` (a path, e.g. ``/run/secrets/ps_token``), never both. An empty value means "no token"
and a file's surrounding whitespace is dropped. Tokens stay :class:`pydantic.SecretStr` (a repr or a log line shows
``**********``) and are visible ASCII without spaces (they travel as ``Authorization: Bearer <token>``), else the
setting is refused. :func:`presented_token` reads the token a request presents (the PS's side of
:func:`bearer_header`).
"""
from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr


def resolve_token(value: SecretStr | None, file: Path | None, env_name: str) -> SecretStr | None:
    """The effective token; ValueError if both are set or the file cannot be read."""
    if value is not None and not value.get_secret_value():
        value = None
    if file is None:
        return _visible(value, env_name)
    if value is not None:
        raise ValueError(f"set {env_name} or {env_name}_FILE, not both")
    try:
        text = Path(file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{env_name}_FILE: cannot read {str(file)!r} ({type(exc).__name__})") from None
    if not text:
        raise ValueError(f"{env_name}_FILE: {str(file)!r} is empty")
    return _visible(SecretStr(text), env_name)


def _visible(token: SecretStr | None, env_name: str) -> SecretStr | None:
    if token is not None and not all("!" <= c <= "~" for c in token.get_secret_value()):
        raise ValueError(f"{env_name}: a token is visible ASCII, without spaces (it is sent as a bearer token)")
    return token


def presented_token(values: list[str]) -> str | None:
    """The bearer token of a request's ``Authorization`` field values (RFC 6750 section 2.1, RFC 9110 section 11):
    exactly one field whose value, without its surrounding spaces and tabs, is ``Bearer`` in any case, one or more
    spaces, then the token, which holds no space or tab. "" when the request carries no bearer token (no field,
    another scheme, ``Bearer`` alone); None when it is malformed (two fields or more, a space or tab in the token)."""
    if len(values) != 1:
        return "" if not values else None
    scheme, _, token = values[0].strip(" \t").partition(" ")
    token = token.lstrip(" ")
    if scheme.lower() != "bearer" or not token:
        return ""
    return None if " " in token or "\t" in token else token


def bearer_header(token: SecretStr | None) -> dict[str, str]:
    """The request header that presents ``token`` (none without a token)."""
    return {"Authorization": f"Bearer {token.get_secret_value()}"} if token is not None else {}
