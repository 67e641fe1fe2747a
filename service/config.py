"""Typed, validated parameters at the engine's boundary (no environment reading here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculationParams:
    """k speculations of up to w tokens per round; k = 0 is plain decoding."""

    k: int = 0
    w: int = 0

    def __post_init__(self) -> None:
        if self.k < 0 or self.w < 0:
            raise ValueError(f"k and w must be >= 0, got k={self.k}, w={self.w}")
        if self.k > 0 and self.w == 0:
            raise ValueError("w must be >= 1 when k > 0")

    @property
    def max_tree_nodes(self) -> int:
        """Root plus every drafted token if no two drafts shared a prefix."""
        return 1 + self.k * self.w


@dataclass(frozen=True)
class GenerationParams:
    """What to generate for one request (greedy for now)."""

    max_new_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    strategy: str = "mixed"  # a draft strategy name, or "mixed" for all of them

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
