"""The core's configuration (:class:`CoreConfig`), and the one place it is built from the PS settings.

Contract: a frozen value, its fields the PS settings of their names (the class docstring), mapped by
:meth:`CoreConfig.from_settings`; a checkpoint stores the fields and compares them on restore.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ps_service.core.rounds import CloseRule


@dataclass(frozen=True)
class CoreConfig:
    """Every field but the last two is the PS setting of its name (:class:`ps_service.settings.PSSettings`), with
    no default here: the settings class is the one source (:meth:`from_settings`; tests too, tests/configs.py)."""
    replicas_to_aggregate: int | None
    total_num_replicas: int | None
    min_workers: int
    startup_grace_seconds: float
    start_timeout_seconds: float
    max_steps: int | None
    aggregation: str
    lease_seconds: float
    round_timeout_seconds: float | None
    min_replicas: int
    #: "reject" (422) or "skip" (counted, not applied) for NaN/Inf gradients
    nonfinite_policy: str
    #: "sync" (the barrier), "async" or "ssp" (each gradient applied on arrival: ps_service/core/staleness.py)
    mode: str
    #: ssp's bound s (per-worker clocks)
    ssp_staleness: int
    #: async/ssp: gradients older than this many global steps are refused stale (None: no limit)
    max_staleness: int | None
    #: optimizer settings given to the PS; they win over what the model's initialiser brings
    optimizer_overrides: Mapping[str, Any] = field(default_factory=dict)
    #: closed rounds kept for /v1/rounds (a fixed count, not a setting)
    max_rounds_kept: int = 1000

    @classmethod
    def from_settings(cls, settings) -> "CoreConfig":
        """The core's part of :class:`ps_service.settings.PSSettings` (same field names): the one mapping."""
        given = type(settings).model_fields
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls) if f.name in given},
                   optimizer_overrides=settings.optimizer_overrides())

    @property
    def rule(self) -> CloseRule:
        return CloseRule(self.replicas_to_aggregate, self.min_replicas, self.round_timeout_seconds)
