"""Invalid settings, said as a user set them: one line per environment variable, never pydantic's own text.

Both services read their settings from environment variables (``PS_*``, ``WORKER_*``) through pydantic-settings;
a value it refuses should stop the process with the variable's name and what is wrong with it, not a traceback,
and never echo the input (tokens are settings too).
"""
from __future__ import annotations

from pydantic import ValidationError


def settings_errors(exc: ValidationError, prefix: str) -> list[str]:
    """One line per invalid setting, named by its variable (``prefix`` + the field's name in upper case)."""
    return [f"{''.join(f'{prefix}{str(p).upper()}: ' for p in e['loc'][:1])}{e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_input=False)]
