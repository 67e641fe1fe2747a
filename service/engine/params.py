"""Typed, validated parameters at the engine's boundary (no environment reading here)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from xgrammar import CompiledGrammar

from service.grammar import GrammarSpec

SpeculationMode = Literal["off", "fixed", "auto"]
# When a request may run: "interactive" first come, first served; "batch" (offline work) only in
# the room interactive requests leave (`service/engine/scheduler.py`, `Scheduler.admit`)
Priority = Literal["interactive", "batch"]


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
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| at most this (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values at most this (OpenAI's range)
# repetition_penalty's range: any value beyond already saturates (a penalized logit ~0, or far
# above or below every other), while logits times or over it, then over MIN_TEMPERATURE, would
# overflow float32 (and inf - inf in softmax is NaN)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-30, 1e30


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 is greedy; otherwise sample from p after min-p, top-k and top-p.

    `logit_bias` and the penalties change the logits before either (greedy takes the argmax of
    the adjusted logits); `service/engine/logits_adjuster.py` says which tokens each counts.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k cut
    seed: int | None = None
    # keep tokens with p >= min_p × the largest p (after temperature); 0 = no cut
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # subtracted once per occurrence of the token in the output
    presence_penalty: float = 0.0  # subtracted once if the token occurs in the output
    # divides (multiplies, if negative) logits of prompt and output tokens
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), "
                f"got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self._check_adjustments()

    def _check_adjustments(self) -> None:
        """logit_bias and the penalties within OpenAI's ranges (repetition_penalty within
        float32's)."""
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}"
                )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                "repetition_penalty must be in "
                f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias.items():
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: token ids must be >= 0 and biases in "
                    f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {token}: {bias}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias or a penalty asks for anything: requests without them skip that
        work."""
        return (
            bool(self.logit_bias)
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )


@dataclass(frozen=True)
class GenerationParams:
    """What to generate for one request, and how to speculate while doing it."""

    max_new_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    strategy: str = "mixed"  # a draft strategy name, or "mixed" for all of them
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # None: none; n: each token's logprob and its n likeliest alternatives
    logprobs: int | None = None
    grammar: GrammarSpec | None = None  # structured output: what the output must match
    # `grammar` compiled already (the HTTP edge's `BoundedCompiler`); None: the engine compiles it
    compiled_grammar: CompiledGrammar | None = field(default=None, compare=False, repr=False)
    # "batch": admitted only while no interactive request waits, and beside running interactive
    # ones only where one more row barely slows their pass; it changes when a request runs,
    # never what it generates
    priority: Priority = "interactive"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.priority not in ("interactive", "batch"):
            raise ValueError(f"priority must be interactive or batch, got {self.priority!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
