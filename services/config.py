"""The one settings object every SparseGuard process is built from (env prefix SPARSEGUARD_,
nested sections with `__`, e.g. SPARSEGUARD_ENGINE__MODEL, SPARSEGUARD_SIGNALS__SPIKE_SILENCE)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.judgement_config import (
    DEFAULT_ACT_ON,
    ROUTE_PATHS,
    SignalSettings,
    TrustSettings,
    refuse_moved,
)

__all__ = [  # the judgement sections live in services.judgement_config
    "DEFAULT_ACT_ON",
    "DEFAULT_MODEL",
    "ROUTE_PATHS",
    "AggregatorSettings",
    "AlertSettings",
    "EngineSettings",
    "GatewaySettings",
    "JobSettings",
    "OtelSettings",
    "Settings",
    "SignalSettings",
    "StorageSettings",
    "TelemetrySettings",
    "TrustSettings",
    "WebhookReceiver",
]

# Settings import no other service package and no ML library (tests/test_layout.py), so
# the model's name is written out; tests/test_signal_settings.py holds it equal to
# sparse_engine.model.catalog.DEFAULT_MODEL.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class EngineSettings(BaseModel):
    model: str = DEFAULT_MODEL
    default_level: str = "balanced"
    # One source calibrated over-sparsifies on others, and a pooled bound on a mix let Qwen2's
    # balanced level miss its budget on technical prose (README, "Not the sample alone").
    calibration_corpus: str = "wiki+c4+technical"
    # A level's perplexity bound on each part of a mixed corpus, the worst kept (`calibrate
    # --per-source`; CLI and recalibration jobs on the corpus): held on every source the corpus
    # lacks, on all three families and levels, at 4-25 points less sparsity (README, "A bound
    # on each part"). A one-part corpus has one bound: pooled.
    calibration_per_source: bool = True
    calibration_samples: int = Field(100, ge=1)
    heldout_tokens: int = Field(4096, ge=64)
    seq_len: int = Field(256, ge=16)
    # Tokens of the pass that measures each layer's sensitivity (one forward pass per layer
    # and role: about a third of a recalibration on 2 cores at the default).
    sensitivity_tokens: int = Field(256, ge=16)
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    drift_sample_rate: float = Field(0.1, ge=0.0, le=1.0, description="share of requests with KL")
    prefix_cache_entries: int = Field(32, ge=0)
    # The lean decode path and its weight type ("off": Hugging Face forward passes only).
    # float32 gives the reference's tokens; bfloat16 and int8 read 2x and 4x fewer bytes.
    fast_path: Literal["off", "float32", "bfloat16", "int8"] = "float32"
    fast_path_max_len: int = Field(2048, ge=16, description="tokens the fast path's KV cache holds")
    # Continuous batching (sparse_engine.runtime.scheduler): sequences decoding at once, the
    # tokens (prompt + max_tokens each) they may hold between them, and from how many
    # fast-path sequences a step runs as one batched product (fewer: row by row on the
    # compiled kernel; `sparseguard bench batch-step` measures the crossover), and from how
    # many fast-path prompts starting at one step boundary they prefill in one packed pass
    # (fewer: one by one; `bench batch-step` compares the two under load).
    max_batch: int = Field(16, ge=1)
    kv_tokens: int = Field(16384, ge=16)
    batch_from: int = Field(4, ge=2)
    pack_from: int = Field(2, ge=2)
    # The baseline pass that ends every calibration: healthy prompts per level (and dense),
    # of these kinds (sparse_engine.data.traffic), answered greedily to this many tokens. A
    # reason holds its budget on each kind on average when each kind has 1 / budget - 1
    # requests (99 at 1 %), and with 90 % confidence from 230 (`calibration.conformal`):
    # 1150 over five kinds (the code corpus's baseline half holds 184: 84 %).
    baseline_requests: int = Field(1150, ge=10)
    baseline_max_new_tokens: int = Field(16, ge=1)
    # The share of each kind's baseline requests that measure KL drift (a dense pass each,
    # about half of a sparse level's pass when all do): `SemanticDriftHigh` reads only their
    # mean, spread and per-kind means, and its margin with this share is measured (README).
    baseline_drift_share: float = Field(0.25, gt=0.0, le=1.0)
    baseline_kinds: list[str] = Field(
        default_factory=lambda: ["chat", "qa", "code", "prose", "data"]
    )

    def per_source_for(self, corpus: str) -> bool:
        """Whether a calibration on `corpus` takes its bound on each part: on by default for a
        mixed corpus; a one-part corpus has nothing to split."""
        return self.calibration_per_source and "+" in corpus

    @model_validator(mode="after")
    def _per_source_needs_parts(self) -> EngineSettings:
        asked = "calibration_per_source" in self.model_fields_set  # set, not the default
        if asked and self.calibration_per_source and "+" not in self.calibration_corpus:
            raise ValueError(
                "calibration_per_source takes a bound on each part of a mixed calibration "
                f"corpus, and '{self.calibration_corpus}' has one part: set "
                "SPARSEGUARD_ENGINE__CALIBRATION_CORPUS to parts joined by '+' (e.g. "
                "wiki+c4+technical) or turn calibration_per_source off"
            )
        return self


class GatewaySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    mode: Literal["serve", "proxy"] = "serve"
    upstream_url: str | None = None
    upstream_api_key: SecretStr | None = None
    upstream_model: str | None = None
    upstream_timeout_s: float = Field(60.0, gt=0)
    queue_size: int = Field(16, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    max_body_bytes: int = Field(1_000_000, ge=1024)
    max_tokens_limit: int = Field(4096, ge=1)
    # Opt-in: temperature 0 on a sparse level sampled at 0.3 instead (README, "Policy").
    raise_zero_temperature: bool = False
    # sha256 hex digests of accepted API keys; empty means no authentication.
    api_key_hashes: list[str] = Field(default_factory=list)
    admin_key_hashes: list[str] = Field(default_factory=list)


class OtelSettings(BaseModel):
    # OTLP/HTTP collector base URL (spans go to <endpoint>/v1/traces); unset: no export.
    endpoint: str | None = None
    service_name: str = "sparseguard-gateway"
    export_delay_ms: int = Field(2000, ge=1)  # how long spans wait to be sent in a batch


class TelemetrySettings(BaseModel):
    enabled: bool = True
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "sparseguard.telemetry"
    control_topic: str = "sparseguard.control"
    dead_letter_topic: str = "sparseguard.dead-letter"
    partitions: int = Field(4, ge=1)
    spool_dir: Path | None = None  # default: <home>/spool
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    client_id: str = "sparseguard-gateway"
    # Off by default: prompt text leaves the gateway only when an operator opts in, and then
    # only for this share of requests (recalibration samples it as production-like data).
    keep_prompt_text: bool = False
    prompt_sample_rate: float = Field(0.1, ge=0.0, le=1.0)


class StorageSettings(BaseModel):
    # SQLAlchemy URL; default: SQLite at <home>/sparseguard.db. Production: postgresql+psycopg://...
    url: str | None = None


class AggregatorSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8001, ge=0, le=65535)
    group_id: str = "sparseguard-aggregator"
    lateness_s: float = Field(120.0, ge=0)
    poll_timeout_ms: int = Field(500, ge=10)
    max_poll_records: int = Field(500, ge=1)
    snapshot_interval_s: float = Field(60.0, gt=0)
    session_timeout_ms: int = Field(6000, ge=1000)
    heartbeat_interval_ms: int = Field(500, ge=100)


class WebhookReceiver(BaseModel):
    name: str
    url: str
    # Standard Webhooks secret, "whsec_" + base64; never logged.
    secret: SecretStr
    timeout_s: float = Field(5.0, gt=0)


class AlertSettings(BaseModel):
    rules_file: Path | None = None  # default: the packaged alerts/default_rules.yaml
    evaluation_interval_s: float = Field(15.0, gt=0)
    repeat_interval_s: float = Field(4 * 3600.0, gt=0)
    group_by: list[str] = Field(default_factory=lambda: ["alertname", "model"])
    receivers: list[WebhookReceiver] = Field(default_factory=list)
    max_attempts: int = Field(8, ge=1)
    backoff_base_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(300.0, gt=0)


class JobSettings(BaseModel):
    _moved = model_validator(mode="before")(refuse_moved)

    # Celery broker; default: the embedded SQLite transport at <home>/celery-broker.db, which
    # needs no server. Production: redis://host:6379/0.
    broker_url: str | None = None
    queue: str = "sparseguard"
    # Redis only: an unacknowledged task (its worker died) is delivered again after this long;
    # it must exceed the longest task.
    visibility_timeout_s: float = Field(3 * 3600.0, gt=0)
    recalibrate_time_limit_s: int = Field(2 * 3600, gt=0)
    golden_time_limit_s: int = Field(2 * 3600, gt=0)
    max_retries: int = Field(5, ge=0)
    retry_backoff_max_s: int = Field(600, ge=1)
    # Beat schedules, as cron expressions in UTC ("minute hour day month weekday").
    golden_cron: str = "0 3 * * *"
    recalibrate_cron: str | None = None  # off unless set
    redispatch_interval_s: float = Field(60.0, gt=0)  # re-send jobs whose message was lost
    redispatch_after_s: float = Field(300.0, gt=0)
    beat_lock_ttl_s: float = Field(30.0, gt=1)
    # Golden set: JSONL of {"id", "prompt", "reference", "metric"}; default: MT-Bench questions
    # with GPT-4 references and HaluEval questions with gold answers (packaged data).
    golden_set: Path | None = None
    golden_max_new_tokens: int = Field(64, ge=1)
    golden_levels: list[str] = Field(
        default_factory=lambda: ["conservative", "balanced", "aggressive"]
    )
    # Recalibration on recent traffic (when prompt text is kept), else the calibration corpus.
    traffic_window_h: float = Field(24.0, gt=0)
    traffic_min_prompts: int = Field(200, ge=1)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPARSEGUARD_", env_nested_delimiter="__")

    home: Path = Field(default_factory=lambda: Path.home() / ".cache" / "sparseguard")
    # Fetched models, package wheels and corpora; default: home. Separate from home when state
    # (calibrations, database, spool) should not share a directory with the download cache.
    cache_dir: Path | None = None
    log_level: str = "INFO"
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings())
    gateway: GatewaySettings = Field(default_factory=lambda: GatewaySettings())
    telemetry: TelemetrySettings = Field(default_factory=lambda: TelemetrySettings())
    otel: OtelSettings = Field(default_factory=lambda: OtelSettings())
    storage: StorageSettings = Field(default_factory=lambda: StorageSettings())
    aggregator: AggregatorSettings = Field(default_factory=lambda: AggregatorSettings())
    alerts: AlertSettings = Field(default_factory=lambda: AlertSettings())
    jobs: JobSettings = Field(default_factory=lambda: JobSettings())
    trust: TrustSettings = Field(default_factory=lambda: TrustSettings())
    signals: SignalSettings = Field(default_factory=lambda: SignalSettings())

    @model_validator(mode="after")
    def _proxy_routes(self) -> Settings:
        """A proxy gateway scores another model's answers: a route judged by serve- or
        closed-mode models (fit on this model's own answers) would be judged by the wrong
        model."""
        wrong = {r: m for r, m in self.trust.route_modes.items() if m != "proxy"}
        if self.gateway.mode == "proxy" and wrong:
            raise ValueError(
                f"a proxy gateway judges another model's answers, but route_modes judges "
                f"{', '.join(f'{r} by {m}-mode' for r, m in wrong.items())} trust models (fit "
                f"on this model's own answers): unset SPARSEGUARD_TRUST__ROUTE_MODES or map "
                f"those routes to proxy"
            )
        return self

    @property
    def cache_home(self) -> Path:
        return self.cache_dir or self.home

    @property
    def calibrations_dir(self) -> Path:
        return self.home / "calibrations"

    @property
    def database_url(self) -> str:
        return self.storage.url or f"sqlite:///{self.home / 'sparseguard.db'}"

    @property
    def celery_broker_url(self) -> str:
        return self.jobs.broker_url or f"sqla+sqlite:///{self.home / 'celery-broker.db'}"

    @property
    def golden_set_path(self) -> Path:
        # Not the old mt-bench.jsonl, whose references were partly dense-model answers.
        return self.jobs.golden_set or self.home / "golden" / "external-v1.jsonl"

    @property
    def trust_dir(self) -> Path:
        return self.trust.dir or self.home / "trust"

    @property
    def spool_dir(self) -> Path:
        return self.telemetry.spool_dir or self.home / "spool"
