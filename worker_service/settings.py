"""Every worker setting, one documented field each, read from ``WORKER_*`` environment variables.

The only place the worker reads its environment (pydantic-settings).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.tokens import resolve_token
from worker_service.naming import default_name


def cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list (``3``, ``0-3,6``; empty: none), ValueError if it is not one."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        if not (lo.isdigit() and (not dash or hi.isdigit())) or (dash and int(hi) < int(lo)):
            raise ValueError(f"{text!r} is not a CPU list (e.g. 3, or 0-3,6)")
        cpus.update(range(int(lo), int(hi if dash else lo) + 1))
    return frozenset(cpus)


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore")

    ps_url: str = Field("http://localhost:8000", description="Base URL of the PS; a hot-standby pair's two, "
                        "comma-separated (the worker follows the primary: docs/guides/standby.md).")
    task: str = Field("linear", description="Built-in task (linear, mlp, cnn) or 'package.module:factory' of your own.")
    batch_size: int = Field(32, ge=1, description="Examples per worker per step.")
    seed: int = Field(0, description="Seed of the task's data and initial weights (same on every worker).")
    dtype: Literal["float32", "float64"] = Field("float32", description="dtype of weights and gradients.")
    name: str = Field(
        default_factory=default_name,
        description="Name the worker registers under. Unset or empty: under Compose the container's name "
                    "(syncps-worker-1, by reverse DNS), else hostname:pid.")
    request_timeout_seconds: float = Field(30.0, gt=0, description="Timeout of each HTTP request (pulls add their wait).")
    retry_attempts: int = Field(
        100, ge=1, description="Attempts per request on connection errors, timeouts and 5xx (backoff capped at 1 s: "
                               "WORKER_RETRY_TIMEOUT_SECONDS usually ends the retrying, e.g. across a PS restart).")
    retry_timeout_seconds: float = Field(120.0, gt=0, description="Give up on a request after retrying this long.")
    log_every_seconds: float = Field(5.0, gt=0, description="Seconds between progress lines.")
    auth_token: SecretStr | None = Field(
        None, description="Bearer token sent to the PS (its PS_AUTH_TOKEN). Unset or empty: none sent.")
    auth_token_file: Path | None = Field(
        None, description="File holding the token (a Docker secret, /run/secrets/...); instead of WORKER_AUTH_TOKEN.")
    fault_drop_before: float = Field(
        0.0, ge=0, le=1, description="Fault drill (worker_service/transport/faults.py): share of requests dropped before the PS.")
    fault_drop_after: float = Field(
        0.0, ge=0, le=1, description="Fault drill: share of requests the PS processes whose answer is then lost.")
    fault_duplicate: float = Field(0.0, ge=0, le=1, description="Fault drill: share of requests the PS receives twice.")
    fault_seed: int = Field(0, description="Fault drill: seed of the fault pattern (mixed with the worker's name).")
    shm_dir: str = Field(
        "/dev/shm", description="Shared-memory directory of the same-host transport: used when the PS's weights file "
                                "is found there (same host), else tensors go over HTTP. Empty: always HTTP.")
    compute_delay_seconds: float = Field(
        0.0, ge=0, description="Extra seconds added to every compute phase: a deliberately slow worker, for straggler drills.")
    prefetch: bool = Field(
        True, description="Draw the next step's batch (the task's batch()) in a thread while a push and its round are out. "
                          "A task whose batch() is not a function of its arguments opts out with prefetch = False.")
    stopped_exit_code: int = Field(
        0, ge=0, le=255, description="Exit code when stopped (SIGTERM/SIGINT) before the job is done; a done job "
                                     "exits 0 whatever it is. deploy/k8s sets 143: a Job counts a pod that exits 0 as "
                                     "finished, so an evicted worker would not be run again.")
    cpus: str = Field(
        "", description="CPUs the worker runs on, a Linux CPU list (3, or 0-3,6). Empty: wherever the OS puts it. "
                        "python -m cluster gives each worker a CPU of its own when there are no more workers than CPUs.")

    @field_validator("cpus", mode="after")
    @classmethod
    def _cpus(cls, text: str) -> str:
        cpu_list(text)  # a ValueError names what is wrong
        return text.strip()

    @field_validator("name", mode="after")
    @classmethod
    def _name(cls, name: str) -> str:
        return name.strip() or default_name()  # WORKER_NAME= (empty, as docker-compose.yml sets it): the default

    @model_validator(mode="after")
    def _token(self) -> "WorkerSettings":
        self.auth_token = resolve_token(self.auth_token, self.auth_token_file, "WORKER_AUTH_TOKEN")
        return self


def default(field: str, given=None):
    """``given``, or when it is None the setting's default (not the environment's value): the one source of the
    defaults the worker's classes take when built without settings (``PSClient``'s timeouts and retry attempts)."""
    return WorkerSettings.model_fields[field].get_default(call_default_factory=True) if given is None else given
