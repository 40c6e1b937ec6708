"""Every PS setting, one documented field each, read from ``PS_*`` environment variables.

This module is the only place the PS reads its environment (pydantic-settings), so the configuration
reference (docs/reference/configuration.md, rendered by `python -m docgen`) is this class.
``PS_AUTH_TOKEN_FILE`` (a Docker secret) is read here too, and ``PS_REQUIRE_AUTH`` refuses settings
without a training token.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.protocol import MAX_INT
from shared.tokens import resolve_token

#: what the PS says when PS_REQUIRE_AUTH=true finds no token: how to make one, and where it is mounted
MAKE_A_TOKEN = ("Make one as a secret and point PS_AUTH_TOKEN_FILE at it (or, with Docker Compose on one host, set "
                "PS_AUTH_TOKEN in .env: docs/guides/security.md): Docker Swarm: "
                "`openssl rand -hex 32 | docker secret create syncps_token -` (mounted at /run/secrets/syncps_token); "
                "Kubernetes: `kubectl -n syncps create secret generic syncps-token "
                "--from-literal=token=$(openssl rand -hex 32) --from-literal=monitor-token=$(openssl rand -hex 32)` "
                "(deploy/k8s mounts it at /run/secrets/syncps).")


class PSSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PS_", extra="ignore")

    host: str = Field("0.0.0.0", description="Address the PS binds to.")
    port: int = Field(8000, description="TCP port of the PS (workers, monitoring, metrics).")
    probe_port: int | None = Field(
        None, ge=0, le=65535,
        description="A second TCP port serving only /healthz and /readyz, from a thread of its own: probes answer at "
                    "once under any training load (docs/protocol.md). Unset: the main port + 1 (8001), and if that one "
                    "is taken the PS says so and goes on without it; 0: off. Both stay on the main port either way.")
    event_loop: Literal["uvloop", "asyncio"] = Field(
        "uvloop", description="The PS's event loop. uvloop: half the CPU per large body (1e7-param pushes over TCP). "
                              "asyncio: accepts every pending connection at once (uvloop one per loop turn), for "
                              "thousands of workers that open connections under load (docs/performance.md).")
    def probe_listener(self) -> tuple[int | None, bool]:
        """The port the probe listener takes (None: none) and whether the PS must have it (``PS_PROBE_PORT`` set) or
        goes on without it when it is taken (unset: the main port + 1)."""
        if self.probe_port is None:
            return (self.port + 1 if 0 < self.port < 65535 else None), False
        return self.probe_port or None, True

    optimizer: Literal["sgd", "momentum", "adam", "adagrad"] | None = Field(
        None, description="Optimizer; wins over the one the worker's task brings. Unset: the task's.")
    learning_rate: float | None = Field(None, gt=0, description="Learning rate; wins over the task's.")
    momentum: float | None = Field(None, ge=0, description="Momentum coefficient (momentum optimizer).")
    nesterov: bool | None = Field(None, description="Nesterov momentum (momentum optimizer).")
    beta1: float | None = Field(None, ge=0, lt=1, description="Adam beta1.")
    beta2: float | None = Field(None, ge=0, lt=1, description="Adam beta2.")
    epsilon: float | None = Field(None, gt=0, description="Adam epsilon (TF1 'epsilon hat').")
    initial_accumulator_value: float | None = Field(None, gt=0, description="Adagrad initial accumulator.")
    max_steps: int | None = Field(None, ge=0, le=MAX_INT, description="Global steps to train; then pulls say done. Unset: forever.")
    replicas_to_aggregate: int | None = Field(
        None, ge=1, description="R: gradients per update. Unset: elastic, R = the live workers of the round.")
    total_num_replicas: int | None = Field(
        None, ge=1, description="N: workers expected (N > R: backup workers). Start-up waits for N (or R) workers.")
    min_workers: int = Field(1, ge=1, description="Workers that must be registered before step 0.")
    startup_grace_seconds: float = Field(
        2.0, ge=0, description="After min_workers have registered, wait this long for more before step 0 (when no "
                               "worker count is expected: else PS_START_TIMEOUT_SECONDS); a count from "
                               "PS_WORKERS_DNS is taken once it has not changed for this long.")
    start_timeout_seconds: float = Field(
        120.0, ge=0, description="With an expected worker count (PS_TOTAL_NUM_REPLICAS, else "
                                 "PS_REPLICAS_TO_AGGREGATE, or the deployment's count: PS_WORKERS_DNS), step 0 waits "
                                 "for that many workers, at most this long after min_workers registered; then it "
                                 "starts with those there (the others join later rounds).")
    workers_dns: str = Field(
        "", description="A DNS name with one address per deployed worker (compose: `worker`; Swarm: "
                        "`tasks.worker`; Kubernetes: the workers' headless Service): until step 0 the PS resolves it "
                        "every second and waits for that many workers (PS_START_TIMEOUT_SECONDS), once the count has not changed "
                        "for PS_STARTUP_GRACE_SECONDS (containers add their addresses as they start). Empty: off.")
    aggregation: Literal["mean", "sum"] = Field("mean", description="Mean (TF) or sum of the round's gradients.")
    lease_seconds: float = Field(10.0, gt=0, description="A worker silent this long is expired and leaves its round.")
    round_timeout_seconds: float | None = Field(
        None, gt=0, description="A round open this long closes with what it has, if at least min_replicas pushed.")
    min_replicas: int = Field(1, ge=1, description="Quorum for closing a round at its deadline.")
    mode: Literal["sync", "async", "ssp"] = Field(
        "sync", description="Training mode: sync (the barrier: one update per round), async (each gradient applied "
                            "when it arrives, TF's default PS training) or ssp (async, and a worker's pull waits "
                            "while it is more than PS_SSP_STALENESS clocks ahead of the slowest live worker).")
    ssp_staleness: int = Field(
        3, ge=0, description="ssp: the bound s. A worker at clock c (its completed iterations) gets weights only "
                             "when every live worker is at clock >= c - s (0: lockstep).")
    max_staleness: int | None = Field(
        None, ge=0, description="async and ssp: a gradient computed on weights more than this many global steps "
                                "old is refused as stale. Unset: no limit.")
    nonfinite_policy: Literal["reject", "skip"] = Field(
        "reject", description="NaN/Inf gradient: reject with 422, or skip (count, do not apply).")
    max_body_bytes: int = Field(1 << 30, gt=0, description="Largest request body accepted (413 beyond).")
    body_idle_timeout_seconds: float = Field(
        30.0, gt=0, description="A request body that stalls this long between two chunks is refused (408).")
    http_keepalive_seconds: float = Field(
        60.0, gt=0, description="How long the PS keeps an idle HTTP connection open (uvicorn's timeout_keep_alive); "
                         "every answer says it (`keep-alive: timeout=N`) and clients reuse a connection idle for "
                         "less than half of it. Not uvicorn's 5 s: heartbeats (every lease/3) and steps of "
                         "seconds keep their connections.")
    auth_token: SecretStr | None = Field(
        None, description="Bearer token the training and control routes require (register, leave, heartbeat, "
                          "initialise, pull, push). Unset or empty: those routes are open.")
    auth_token_file: Path | None = Field(
        None, description="File holding the training token (a Docker secret, /run/secrets/...); "
                          "instead of PS_AUTH_TOKEN, not with it.")
    require_auth: bool = Field(
        False, description="Refuse to start without a training token (PS_AUTH_TOKEN or PS_AUTH_TOKEN_FILE): for a PS "
                           "on a network others share (the Swarm stack file and deploy/k8s set it).")
    monitor_token: SecretStr | None = Field(
        None, description="Read-only bearer token of the monitoring routes (/v1/status, /v1/workers, /v1/rounds, "
                          "/metrics, the dashboard); they accept the training token too. Unset: monitoring is open.")
    monitor_token_file: Path | None = Field(
        None, description="File holding the monitoring token (a Docker or Kubernetes secret); instead of "
                          "PS_MONITOR_TOKEN, not with it.")
    peer_token: SecretStr | None = Field(
        None, description="Bearer token of the routes between the PS processes (a sharded PS's coordinator to a "
                          "follower: PUT /v1/shard/model, POST /v1/shard/apply, /progress, /lost, /restore; a "
                          "hot-standby pair's primary to its standby: PUT /v1/ha/state, POST /v1/ha/steps, /ping): "
                          "set, they take it and only it (the training token, every worker's, no longer opens them), "
                          "GET /v1/shard/state and GET /v1/ha take either, and the PS sends it to its peers. The same "
                          "on every shard and on both PS of a pair. Unset: they take the training token.")
    peer_token_file: Path | None = Field(
        None, description="File holding the peer token (a Docker or Kubernetes secret); instead of PS_PEER_TOKEN, "
                          "not with it.")
    production: bool = Field(False, description="Production mode: no /docs, /redoc or /openapi.json.")
    pull_timeout_max_seconds: float = Field(60.0, gt=0, description="Upper bound of a pull's ?timeout=.")
    tick_seconds: float = Field(0.1, gt=0, description="How often leases and round deadlines are checked.")
    checkpoint_dir: str | None = Field(
        None, description="Directory of checkpoints (restored on start, written periodically and on SIGTERM), and of a "
                         "hot-standby pair's term (pair-term.json, docs/guides/standby.md). Unset: off.")
    checkpoint_every_steps: int = Field(
        100, ge=0, description="Checkpoint when the global step moved this many steps since the last one (0: off).")
    checkpoint_every_seconds: float = Field(
        60.0, ge=0, description="Checkpoint when this many seconds passed since the last one and the step moved (0: off).")
    checkpoint_keep: int = Field(3, ge=1, description="Checkpoints kept (the newest); older ones are deleted.")
    shm_dir: str = Field(
        "/dev/shm", description="Shared-memory directory of the same-host transport (workers on this host exchange "
                                "tensors through files there, not the socket). Empty or missing: off, all over HTTP.")
    compression: Literal["none", "bf16", "fp16", "topk", "2bit"] = Field(
        "none", description="Gradient compression of pushes in request bodies: none, bf16, fp16, topk (error feedback) "
                            "or 2bit (MXNet's); same-host files stay float32. Told to workers at registration.")
    compression_topk_ratio: float = Field(
        0.01, gt=0, le=1, description="topk: share of each float32 tensor's entries a push sends (at least one).")
    compression_topk_warmup_steps: int = Field(
        200, ge=0, lt=2 ** 53, description="topk: global steps of warm-up (Deep Gradient Compression's): a push "
                                           "computed on step s < W sends the share 0.25 * (ratio / 0.25) ** (s / W) "
                                           "of each tensor's entries (25 % at step 0, the ratio from step W on); 0: off.")
    compression_2bit_threshold: float = Field(
        0.5, gt=0, allow_inf_nan=False, description="2bit: MXNet's threshold (an element is sent as +-threshold or 0).")
    weight_deltas: bool = Field(
        True, description="topk/2bit jobs on one PS process: a worker that holds the previous step's weights gets the "
                          "float32 tensors that changed in few entries as those entries (exact; docs/protocol.md, "
                          "Weight deltas). false: always the dense weights.")
    partition_bytes: int = Field(
        0, ge=0, description="Partitioned rounds (docs/partitions.md): a round's tensors cut into partitions of about "
                             "this many bytes, each summed and applied once every contributor's frame of it is in; "
                             "a push body may carry them as frames (docs/protocol-partitions.md). 0: one "
                             "partition, the whole model (a round as without partitions). Only with PS_MODE=sync, "
                             "no PS_ROLE and PS_NONFINITE_POLICY=reject (the rest is not built); with any "
                             "PS_COMPRESSION on one PS (PS_SHARDS=1), none with shards.")
    log_level: str = Field("info", description="Log level of the PS.")

    # ---- sharded PS (docs/architecture.md, Shards): S processes, shard 0 coordinates ----
    shards: int = Field(1, ge=1, description="S: PS processes the model is spread over (1: one PS).")
    shard_index: int = Field(
        0, ge=0, description="This process's shard, 0..S-1. Shard 0 is the coordinator (membership, the barrier, "
                             "round records; workers' WORKER_PS_URL); the others follow it.")
    shard_urls: str = Field(
        "", description="Comma-separated base URLs of the S shards in index order, as workers and the coordinator "
                        "reach them (needed when PS_SHARDS > 1).")
    shard_split_elements: int = Field(
        1_000_000, ge=1, description="Tensors with more elements are cut into contiguous slices of at most this "
                                     "many (MXNet's MXNET_KVSTORE_BIGARRAY_BOUND); slices are spread by bytes. "
                                     "Each slice is a tensor of its own in every hold and pull: keep them large (at "
                                     "1, the mlp's ~4,800 one-element slices made a push over loopback TCP about 60 "
                                     "times slower than with whole tensors).")

    # ---- a hot standby (docs/guides/standby.md): two PS processes that hold the same bits ----
    role: Literal["primary", "standby"] | None = Field(
        None, description="This PS's role in a hot-standby pair: primary (serves the workers, sends every step to its "
                          "standby and answers only once the standby has it) or standby (applies them; takes over when "
                          "the primary stops answering and the workers vote for it). A PS set primary that finds its "
                          "peer serving a term starts as its standby. Unset: no pair.")
    peer_url: str = Field(
        "", description="Base URL of the other PS of the pair, as this one reaches it (needed with PS_ROLE).")
    failover_timeout_seconds: float = Field(
        1.0, gt=0, description="A pair's PS that hears nothing from the other for this long asks the workers to vote "
                               "(the standby to take over, the primary to go on alone).")

    @model_validator(mode="after")
    def _combinations(self) -> "PSSettings":
        """Settings that only go together: a pair's, the barrier's (sync only), the shards'."""
        if self.role is not None and not self.peer_url.strip():
            raise ValueError("PS_ROLE needs PS_PEER_URL: the other PS of the pair")
        if self.role is not None and self.shards > 1:
            raise ValueError("PS_ROLE (a hot standby) needs PS_SHARDS=1: shards have no standby yet")
        given = [n for n, on in (("PS_REPLICAS_TO_AGGREGATE", self.replicas_to_aggregate is not None),
                                 ("PS_ROUND_TIMEOUT_SECONDS", self.round_timeout_seconds is not None),
                                 ("PS_MIN_REPLICAS", self.min_replicas > 1)) if on]
        if self.mode != "sync" and given:
            raise ValueError(f"{', '.join(given)} configure the barrier: PS_MODE={self.mode} has none")
        if self.shards > 1 and self.shard_index >= self.shards:
            raise ValueError(f"PS_SHARD_INDEX {self.shard_index} is not below PS_SHARDS {self.shards}")
        if self.shards > 1 and len(self.shard_url_list) != self.shards:
            raise ValueError(f"PS_SHARD_URLS must list the {self.shards} shards' base URLs, comma-separated")
        if self.shards > 1 and (self.mode != "sync" or self.nonfinite_policy != "reject"):
            raise ValueError("PS_SHARDS > 1 needs PS_MODE=sync and PS_NONFINITE_POLICY=reject")
        unbuilt = [n for n, on in (("PS_MODE=" + self.mode, self.mode != "sync"), ("PS_ROLE", self.role is not None),
                                   ("PS_COMPRESSION=" + self.compression + " with PS_SHARDS > 1",
                                    self.compression != "none" and self.shards > 1),
                                   ("PS_NONFINITE_POLICY=skip", self.nonfinite_policy != "reject")) if on]
        if self.partition_bytes and unbuilt:
            raise ValueError(f"PS_PARTITION_BYTES (partitioned rounds) is not built with {', '.join(unbuilt)}: "
                             "set PS_PARTITION_BYTES=0 (docs/partitions.md)")
        return self

    @model_validator(mode="after")
    def _tokens(self) -> "PSSettings":
        """The tokens (or their files'); with PS_REQUIRE_AUTH, no start without a training token."""
        refusal = "PS_REQUIRE_AUTH=true: the PS does not start without a training token"
        try:
            self.auth_token = resolve_token(self.auth_token, self.auth_token_file, "PS_AUTH_TOKEN")
        except ValueError as exc:
            if not self.require_auth:
                raise
            if self.auth_token is not None and self.auth_token_file is not None:  # two tokens: not a missing one
                raise ValueError(f"PS_REQUIRE_AUTH=true: {exc}") from None
            raise ValueError(f"{refusal} ({exc}). {MAKE_A_TOKEN}") from None
        if self.require_auth and self.auth_token is None:
            raise ValueError(f"{refusal}, and neither PS_AUTH_TOKEN nor PS_AUTH_TOKEN_FILE is set. {MAKE_A_TOKEN}")
        self.monitor_token = resolve_token(self.monitor_token, self.monitor_token_file, "PS_MONITOR_TOKEN")
        self.peer_token = resolve_token(self.peer_token, self.peer_token_file, "PS_PEER_TOKEN")
        return self

    @property
    def shard_url_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.shard_urls.split(",") if u.strip()]

    def optimizer_overrides(self) -> dict:
        keys = ("learning_rate", "momentum", "nesterov", "beta1", "beta2", "epsilon", "initial_accumulator_value")
        out = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.optimizer:
            out["name"] = self.optimizer
        return out
