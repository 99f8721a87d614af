"""Platform settings: environment variables with the ``TOLLGATE_`` prefix, plus an optional
``tollgate.toml`` (models, pools and replicas, tiers and their SLOs) found through
``TOLLGATE_CONFIG_FILE`` or in the working directory.

Secrets come only from the environment. Outside ``development``/``test`` the default secrets are
refused, so a production deployment cannot run with a key-hashing secret everyone knows, and the
internal token that engines demand of their callers (``internal_token``) must be set: there is no default.

Time constants (rate-limit windows, lease and visibility timeouts, flush and poll intervals) are
settings, so tests shorten them instead of waiting out real minutes.
"""

from __future__ import annotations

import os
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_SECRET = "tollgate-development-secret"
# The engines refuse shorter tokens too (``engine.gate.MIN_TOKEN_CHARS``).
MIN_INTERNAL_TOKEN_CHARS = 16


class TierConfig(BaseModel):
    """A service tier (named like OpenAI's ``service_tier`` values)."""

    engine_priority: int
    ttft_slo_ms: int
    tpot_slo_ms: int
    rank: int  # higher rank = better tier; a request may ask for a tier of lower or equal rank


def default_tiers() -> dict[str, TierConfig]:
    return {
        "priority": TierConfig(engine_priority=0, ttft_slo_ms=500, tpot_slo_ms=30, rank=3),
        "default": TierConfig(engine_priority=1, ttft_slo_ms=700, tpot_slo_ms=40, rank=2),
        "flex": TierConfig(engine_priority=2, ttft_slo_ms=5000, tpot_slo_ms=200, rank=1),
    }


class PoolConfig(BaseModel):
    """Engine replicas of one pool (``interactive`` or ``batch``): base URLs, and/or ``dns``, a
    ``name:port`` whose addresses are the replicas (a Kubernetes headless Service, a compose service with
    several replicas), re-resolved every ``replica_discovery_interval_s`` (``gateway.replicas``)."""

    replicas: list[str] = Field(default_factory=list)
    dns: str | None = None

    @field_validator("dns")
    @classmethod
    def _check_dns(cls, value: str | None) -> str | None:
        if value is not None:
            dns_target(value)
        return value

    @property
    def dns_target(self) -> tuple[str, int] | None:
        return None if self.dns is None else dns_target(self.dns)


def dns_target(spec: str) -> tuple[str, int]:
    """``(host, port)`` of a pool's ``dns = "name:port"``; ``ValueError`` saying what is wrong."""
    host, sep, port = spec.strip().rpartition(":")
    if not sep or not host or "/" in spec or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dns must be `name:port` (e.g. engine-interactive-headless.tollgate.svc.cluster."
                         f"local:8100), not {spec!r}")
    return host.strip("[]"), int(port)


class ModelConfig(BaseModel):
    """A model served under ``name``; ``path`` is the checkpoint directory the engines load."""

    name: str
    path: str | None = None
    pools: list[str] = Field(default_factory=lambda: ["interactive"])


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLGATE_", extra="ignore", env_nested_delimiter="__")

    environment: Literal["development", "test", "production"] = "development"
    config_file: Path | None = None
    data_dir: Path = Path(".tollgate")

    database_url: str | None = None
    redis_url: str | None = None

    # HMAC-SHA256 secret for API key hashes; refuse the default outside development.
    key_hash_secret: SecretStr = SecretStr(DEV_SECRET)
    session_secret: SecretStr = SecretStr(DEV_SECRET)

    host: str = "127.0.0.1"
    port: int = 8000
    gateway_workers: int = 1
    engine_port: int = 8100
    # ``tollgate up``: how many engine replicas of the model to run (ports engine_port, engine_port + 1, ...).
    engine_replicas: int = Field(default=1, ge=1, le=16)
    # ``tollgate up``: prefill replicas beside them (disaggregated serving; 0: none, the replicas do both).
    engine_prefill_replicas: int = Field(default=0, ge=0, le=16)
    # ``tollgate up``: ranks each replica splits the model over (``tollgate engine --tensor-parallel-size``).
    engine_tensor_parallel_size: int = Field(default=1, ge=1, le=64)

    models: list[ModelConfig] = Field(default_factory=list)
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    tiers: dict[str, TierConfig] = Field(default_factory=default_tiers)

    # Admission defaults.
    default_max_tokens_reservation: int = 1024
    rate_limit_window_s: float = 60.0
    stream_lease_ttl_s: float = 30.0
    key_cache_ttl_s: float = 5.0

    # Operations.
    max_request_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    health_poll_interval_s: float = 1.0
    # tollgate up's supervisor: how often it probes its children once every one is healthy (it probes
    # every health_poll_interval_s otherwise; exits are noticed at once).
    supervisor_idle_poll_interval_s: float = Field(default=5.0, gt=0)
    # How often a pool's ``dns`` name is resolved again (replicas appear and vanish between two).
    replica_discovery_interval_s: float = Field(default=5.0, gt=0)
    # Sent by gateways and workers to every engine (``Authorization: Bearer``); engines started with it
    # refuse callers without it (``engine.gate``). Required outside development and test.
    internal_token: SecretStr | None = None
    # How requests are spread over a pool's replicas (``gateway.routing``): "index" (by the blocks each
    # replica's prefix cache really holds, followed from its /kv/events by a long poll, retried every
    # kv_index_poll_interval_s while a replica is unreachable),
    # "affinity" (a per-process guess from where this process sent each prefix before), "round_robin".
    routing_policy: Literal["index", "affinity", "round_robin"] = "index"
    # Disaggregated serving (a model with a ``prefill`` pool beside its interactive pool of ``--role decode``
    # replicas; ``gateway.generation.disaggregation``): a prompt is prefilled on a prefill replica when at
    # least this many of its tokens are not already cached on the decode replica chosen for it; shorter
    # ones, and those mostly cached there, run on the decode replica alone. ``disagg_on_failure``: what a
    # decode replica does when its pull fails (``recompute``, ``fail``; None: the replica's own setting).
    disagg_min_prompt_tokens: int = Field(default=1024, ge=1)
    disagg_on_failure: Literal["recompute", "fail"] | None = None
    kv_index_poll_interval_s: float = 0.1
    # The prefix cache's lower tiers of the engine ``tollgate up`` starts (``tollgate engine --host-kv-gb``,
    # ``--disk-kv-gb``; the block files under ``data_dir/kv``): what cache lifetimes are held in.
    engine_host_kv_gb: float = Field(default=0.25, ge=0)
    engine_disk_kv_gb: float = Field(default=1.0, ge=0)
    # Tenants' LoRA adapters on the engines ``tollgate up`` starts: device slots (``--max-loras``; 0 serves
    # none) and the highest rank they take; they read the adapter store (``adapter_dir``).
    engine_max_loras: int = Field(default=4, ge=0)
    engine_max_lora_rank: int = Field(default=64, ge=1)
    # Bearer token a Prometheus scrape presents at the gateway's ``GET /metrics`` (the scrape config's
    # ``authorization: {credentials: ...}``); an admin API token is accepted too. None: admin tokens only.
    metrics_token: SecretStr | None = None

    # Local process supervision (`tollgate up`): binaries of the private Postgres/Redis (None: search
    # /usr/lib/postgresql/*/bin, then PATH), health waits, restart backoff, stop grace.
    postgres_bin_dir: Path | None = None
    redis_server_bin: Path | None = None
    health_check_timeout_s: float = 2.0
    startup_timeout_s: float = 300.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    stop_timeout_s: float = 15.0
    database_pool_size: int = 10

    # Celery (worker + beat): heartbeats written to Redis prove each process is alive and looping.
    worker_concurrency: int = 2
    heartbeat_interval_s: float = 5.0
    beat_max_loop_interval_s: float = 5.0
    celery_visibility_timeout_s: float = 3600.0

    # Usage outbox → ledger.
    usage_flush_interval_s: float = 1.0
    # Where a gateway or worker keeps usage records Redis refused (an outage), until it takes them again
    # (``billing.usage_spool``); default ``data_dir/spool``. Local to the host: give pods a volume.
    usage_spool_dir: Path | None = None
    usage_spool_retry_s: float = 1.0
    usage_flush_batch: int = 500

    # Stored responses (``/v1/responses`` with ``store``, OpenAI's default): kept this long, then gone to
    # every query and deleted by beat (``responses.retention``, every ``responses_retention_sweep_s``).
    responses_retention_s: float = 30 * 24 * 3600.0
    responses_retention_sweep_s: float = 3600.0
    # A worker running a background response polls for its cancellation this often.
    responses_cancel_poll_s: float = 0.5
    # A running background response's lease (gateway.responses.background): a worker that dies leaves
    # it to expire, and beat's requeue sweep (every batch_sweep_interval_s) runs the response again.
    background_lease_ttl_s: float = 30.0

    # Files and the batch tier (issue #6). Files live under ``file_storage_dir`` (default
    # ``data_dir/files``), shared by gateways and workers; uploads and batch outputs expire after
    # ``files_retention_s`` and are deleted by beat.
    file_storage_dir: Path | None = None
    files_max_bytes: int = 200 * 1024 * 1024
    # Tenants' LoRA adapters (issue #39, ``gateway.adapters``): the adapter store is a directory every
    # gateway writes and every engine replica reads as its ``--lora-dir`` (default
    # ``data_dir/adapters``); a bundle (an uploaded archive, purpose ``fine-tune``) is at most
    # ``adapter_max_bytes``, and a tenant owns at most ``max_adapters_per_tenant`` adapters at once.
    adapter_dir: Path | None = None
    adapter_max_bytes: int = 1024 * 1024 * 1024
    max_adapters_per_tenant: int = 100
    files_retention_s: float = 30 * 24 * 3600.0
    batch_max_requests: int = 50_000
    batch_completion_window_s: float = 24 * 3600.0
    # Execution: a Celery task claims ``batch_chunk_size`` lines (leases of ``batch_lease_ttl_s``, renewed
    # while they run) and runs up to ``batch_line_concurrency`` at once; beat sweeps expired leases,
    # expiry and retention every ``batch_sweep_interval_s``. A line whose worker died is retried until
    # it has been started ``batch_max_attempts`` times.
    batch_chunk_size: int = 32
    batch_line_concurrency: int = 8
    batch_tasks_per_batch: int = 2
    batch_lease_ttl_s: float = 60.0
    batch_sweep_interval_s: float = 10.0
    batch_status_poll_interval_s: float = 1.0
    batch_max_attempts: int = 3
    # None: one below the lowest interactive tier (max tier engine_priority + 1).
    batch_engine_priority: int | None = None
    # Soaking: batch lines may run on an interactive replica while its queue is at most this long, its
    # KV cache at most this full, and this worker process has fewer than this many lines on it
    # (benchmarks/batch_soak.py on a 2-core CPU: 1 per process keeps interactive TTFT unchanged, 4 per
    # process raised its p95 up to 1.7x).
    batch_soak_max_waiting: int = 0
    batch_soak_max_kv_usage: float = 0.6
    batch_soak_max_inflight: int = 1

    # Stripe (billing issue).
    stripe_api_key: SecretStr | None = None
    stripe_api_base: str | None = None
    stripe_webhook_secret: SecretStr | None = None
    # Billing: the Stripe meter's event name; the beat exports an hour once it ended this long ago
    # (late usage still goes out later, as a delta); an unpaid invoice suspends the tenant after the
    # grace period; budget alerts are checked (and their webhooks retried) every interval.
    stripe_meter_event_name: str = "tollgate_usage"
    stripe_export_interval_s: float = 300.0
    stripe_export_lag_s: float = 300.0
    stripe_max_network_retries: int = 2
    payment_failed_grace_s: float = 3 * 24 * 3600.0
    budget_alert_interval_s: float = 60.0
    alert_webhook_timeout_s: float = 5.0
    rollup_reconcile_interval_s: float = 600.0
    rollup_reconcile_window_h: int = 48

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> Settings:
        if self.environment == "production":
            for name in ("key_hash_secret", "session_secret"):
                if getattr(self, name).get_secret_value() == DEV_SECRET:
                    raise ValueError(f"TOLLGATE_{name.upper()} must be set outside development")
            if self.internal_token is None:
                raise ValueError("TOLLGATE_INTERNAL_TOKEN must be set outside development (the token "
                                 "engines require of the gateways and workers)")
        token = self.internal_token.get_secret_value() if self.internal_token is not None else None
        if token is not None and (len(token) < MIN_INTERNAL_TOKEN_CHARS or token == DEV_SECRET
                                  or token != token.strip()):
            raise ValueError(f"TOLLGATE_INTERNAL_TOKEN must be a random string of at least "
                             f"{MIN_INTERNAL_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):  # type: ignore[override]
        return (init_settings, env_settings, _TomlSource(settings_cls), file_secret_settings)


class _TomlSource:
    """Reads ``tollgate.toml`` (lowest precedence after defaults)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        self.settings_cls = settings_cls

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("TOLLGATE_CONFIG_FILE")
        candidate = Path(path) if path else Path("tollgate.toml")
        if not candidate.is_file():
            if path:
                raise FileNotFoundError(f"TOLLGATE_CONFIG_FILE={path} does not exist")
            return {}
        with candidate.open("rb") as f:
            return tomllib.load(f)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
