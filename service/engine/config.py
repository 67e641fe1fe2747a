"""What the engine and its runtime take from the server's settings, in one value.

The server builds it from its settings (`Settings.engine_config`) and the bench commands from
their flags; nothing here reads the environment, so an engine built twice from equal configs
is built alike. `EngineConfig()` is the engine's own defaults (tests build it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from drafting.suffix import DEFAULT_CAPACITY
from service.engine.scheduler import SchedulerConfig
from service.grammar import GrammarLimits
from service.model.loader import DEFAULT_CACHE_DIR


@dataclass(frozen=True)
class EngineConfig:
    """The running batch, the queue in front of it, the background warm-up and the drafts."""

    scheduler: SchedulerConfig = SchedulerConfig()
    max_waiting: int = 64  # requests that may wait for the engine; more are refused
    request_timeout: float | None = None  # seconds a request may take, queueing included
    model_tables: bool = True  # derive the unigram/bigram tables in the background
    cost_profile: bool = True  # measure (or load) the pass costs auto mode plans with
    cache_dir: Path = DEFAULT_CACHE_DIR  # tables, profiles, a GGUF's config and tiles
    enforce_eager: bool = False  # every pass eagerly: no CUDA graphs of the small passes
    # steps on the device where they can be (`service/device_round/`); None: on a GPU
    device_round: bool | None = None
    suffix_cache_tokens: int = DEFAULT_CAPACITY  # recent output tokens the suffix strategy indexes
    # Model drafts (`service/model_drafts/`): self-draft depths (None: the measured default; several
    # are served as self_draft_<m>), a draft model's path, and their staged twins.
    self_draft_layers: tuple[int | None, ...] = ()
    draft_model: str | None = None
    draft_staged: bool = False
    # How a draft model loads: as the target did, from the same settings.
    device: str | None = None
    dtype: str | None = None
    quantization: str = "auto"
    # what a request's structured output may cost to compile (`service/grammar/limits.py`)
    grammar_limits: GrammarLimits = GrammarLimits()

    @property
    def static_passes(self) -> bool | None:
        """`ModelRunner`'s switch: None lets the device decide, False keeps every pass eager."""
        return False if self.enforce_eager else None
