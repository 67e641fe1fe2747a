"""Typed, validated parameters at the engine's boundary (no environment reading here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


SpeculationMode = Literal["off", "fixed", "auto"]


@dataclass(frozen=True)
class SpeculationParams:
    """How to speculate.

    `fixed`: k speculations of up to w tokens every round (k = 0 is plain decoding).
    `auto`: before each round the controller picks the shape with the most expected tokens
    per second, at most k × w (plain decoding included). `off`: plain decoding.
    """

    k: int = 0
    w: int = 0
    mode: SpeculationMode = "fixed"

    def __post_init__(self) -> None:
        if self.k < 0 or self.w < 0:
            raise ValueError(f"k and w must be >= 0, got k={self.k}, w={self.w}")
        if self.k > 0 and self.w == 0:
            raise ValueError("w must be >= 1 when k > 0")
        if self.mode not in ("off", "fixed", "auto"):
            raise ValueError(f"mode must be off, fixed or auto, got {self.mode!r}")

    @property
    def max_tree_nodes(self) -> int:
        """Root plus every drafted token if no two drafts shared a prefix."""
        return 1 + self.k * self.w


# Smallest sampling temperature. Logits divided by less overflow float32 (1e-45 gives inf, and
# softmax then NaN); so close to 0 the distribution is the argmax anyway. The HTTP edge sends
# temperatures below this as 0 (greedy); the engine refuses them.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 is greedy; otherwise sample from p after top-k and top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class GenerationParams:
    """What to generate for one request, and how to speculate while doing it."""

    max_new_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    strategy: str = "mixed"  # a draft strategy name, or "mixed" for all of them
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # None: none; n: each token's logprob and its n likeliest alternatives

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
