"""Bearer tokens as settings: from an environment variable or from a file (a Docker secret).

Both services read their token through :func:`resolve_token` from a settings
validator: ``X_AUTH_TOKEN`` (the value) or ``X_AUTH_TOKEN_FILE`` (a path, e.g.
``/run/secrets/ps_token``), never both. An empty value means "no token" (so
compose's ``${PS_AUTH_TOKEN:-}`` passes "unset" through), and a file's
surrounding whitespace (its trailing newline) is dropped. Tokens stay
:class:`pydantic.SecretStr`, so a settings repr, a log line or a JSON dump shows
``**********``; only :meth:`SecretStr.get_secret_value` reveals them.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr


def resolve_token(value: SecretStr | None, file: Path | None, env_name: str) -> SecretStr | None:
    """The effective token; ValueError if both are set or the file cannot be read."""
    if value is not None and not value.get_secret_value():
        value = None
    if file is None:
        return value
    if value is not None:
        raise ValueError(f"set {env_name} or {env_name}_FILE, not both")
    try:
        text = Path(file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{env_name}_FILE: cannot read {str(file)!r} ({type(exc).__name__})") from None
    if not text:
        raise ValueError(f"{env_name}_FILE: {str(file)!r} is empty")
    return SecretStr(text)


def bearer_header(token: SecretStr | None) -> dict[str, str]:
    """The request header that presents ``token`` (none without a token)."""
    return {"Authorization": f"Bearer {token.get_secret_value()}"} if token is not None else {}
