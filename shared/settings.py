"""The settings every syncps process reads, whatever its service (PS, worker, bench): one documented field each, read
from ``SYNCPS_*`` environment variables by pydantic-settings, as ``PS_*`` (ps_service/settings.py) and ``WORKER_*``
(worker_service/settings.py) are; the only place they are read. docs/reference/configuration.md lists them
(``python -m docgen``).
"""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ProcessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SYNCPS_", extra="ignore")

    marks_dir: str | None = Field(None, description=(
        "Timeline marks (shared/marks.py): a directory where each process appends the events of a partitioned step, "
        "one JSON line each, to PID.jsonl (python -m bench.timeline reads them). Unset or empty: off (no call, no "
        "file). Read once, when the process starts."))
