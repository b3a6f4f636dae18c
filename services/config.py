"""The one settings object every SparseGuard process is built from (env prefix SPARSEGUARD_,
nested sections with `__`, e.g. SPARSEGUARD_ENGINE__MODEL)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from sparse_engine.models import DEFAULT_MODEL


class EngineSettings(BaseModel):
    model: str = DEFAULT_MODEL
    default_level: str = "balanced"
    calibration_corpus: str = "wiki"
    calibration_samples: int = Field(100, ge=1)
    heldout_tokens: int = Field(4096, ge=64)
    seq_len: int = Field(256, ge=16)
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; None = torch default"
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPARSEGUARD_", env_nested_delimiter="__")

    home: Path = Field(default_factory=lambda: Path.home() / ".cache" / "sparseguard")
    log_level: str = "INFO"
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings())

    @property
    def calibrations_dir(self) -> Path:
        return self.home / "calibrations"
