"""One settings object for the server, read from `NGRAMMYS_*` variables and CLI flags."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from drafting import STRATEGY_NAMES
from service.config import SpeculationMode
from service.model_loader import DEFAULT_CACHE_DIR


Strategy = Literal[STRATEGY_NAMES]  # type: ignore[valid-type]


class Settings(BaseSettings):
    """Server settings; each field is also a `ngrammys serve --flag` and a `NGRAMMYS_FLAG`."""

    model_config = SettingsConfigDict(env_prefix="NGRAMMYS_")

    model: str | None = Field(
        None, description="A local Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    served_model_name: str | None = Field(None, description="Model name reported by the API (default: derived from the model)")
    host: str = Field("0.0.0.0", description="Address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on")
    device: str | None = Field(None, description="torch device, e.g. cpu or cuda:0 (default: cuda if present)")
    dtype: str | None = Field(
        None, description="float32, bfloat16 or float16 (default: bfloat16 on GPU and on CPUs with native bf16, else float32)"
    )
    quantization: Literal["auto", "none", "gguf"] = Field(
        "auto",
        description="gguf: keep a GGUF's Q4_1 linears (and Q8_0 LM head) packed, the CPU fast path; none: float32 "
        "weights; auto: gguf for a GGUF model on a CPU without native bf16 (numba installed), else none",
    )
    cache_dir: Path = Field(DEFAULT_CACHE_DIR, description="Where converted weights are cached")
    spec_mode: SpeculationMode = Field("auto", description="off, fixed (k x w every round) or auto (the controller picks up to k x w)")
    spec_k: int = Field(8, ge=0, le=64, description="Speculations per round (the maximum in auto mode)")
    spec_w: int = Field(6, ge=0, le=64, description="Tokens per speculation (the maximum in auto mode)")
    spec_strategy: Strategy = Field("mixed", description="Draft strategy: context, unigram, bigram, extended_bigram or mixed")
    model_tables: bool = Field(True, description="Derive the unigram/bigram draft tables from the model at start (background)")
    cost_profile: bool = Field(True, description="Measure forward-pass costs at start (background; auto mode needs them)")
    max_waiting: int = Field(64, ge=1, description="Requests that may wait for the engine; more get 429")
    request_timeout: float | None = Field(600.0, gt=0, description="Seconds a request may take, queueing included")
    retry_after_seconds: int = Field(1, ge=0, description="Retry-After sent with 429")
    default_temperature: float = Field(1.0, ge=0, le=2, description="Temperature when a request gives none (OpenAI's default is 1; 0 = greedy)")
    max_tokens: int = Field(256, ge=1, description="Default max_tokens when a request gives none")
    log_level: str = Field("info", description="Logging level")


@lru_cache
def get_settings() -> Settings:
    return Settings()
