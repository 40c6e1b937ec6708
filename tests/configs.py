"""The core's config as a PS with given settings builds it: the tests that drive the core by simulation take their
defaults from ``ps_service.settings.PSSettings``, the one source (``CoreConfig`` has none of its own)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ps_service.core.config import CoreConfig
from ps_service.settings import PSSettings


def core_config(optimizer_overrides: Mapping[str, Any] | None = None, **settings: Any) -> CoreConfig:
    """``CoreConfig.from_settings(PSSettings(**settings))``; ``optimizer_overrides``: in place of the settings'."""
    config = CoreConfig.from_settings(PSSettings(**settings))
    return config if optimizer_overrides is None else replace(config, optimizer_overrides=dict(optimizer_overrides))
