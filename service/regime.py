"""The hardware policy: what a pass costs here, and which speculation shape pays most.

A forward pass over n new tokens costs about as much as over one while the device is
memory-bound (weights dominate the bytes moved), then grows once it is compute-bound. Where
that knee lies depends on the device, model, dtype and context length, so it is measured
(`service/profiler.py`) into a `CostProfile` T(n, L). The `choose_shape` controller then
weighs, for every (k, w), the expected tokens a round yields against T(tree size, L) and
picks the best tokens per second — k = 0 (plain decoding) whenever nothing beats it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from drafting import Draft, ScoredDraft


@dataclass(frozen=True)
class CostProfile:
    """Median seconds of one pass, measured on a grid of tree sizes × context lengths."""

    tree_sizes: list[int]  # ascending, starting at 1
    context_lengths: list[int]  # ascending
    seconds: list[list[float]]  # [len(context_lengths)][len(tree_sizes)]
    device: str = ""
    model: str = ""
    dtype: str = ""

    def cost(self, n: int, context_length: int) -> float:
        """Seconds of a pass of `n` tokens at `context_length`: interpolated in L (clamped)
        and in n (extrapolated linearly past the largest measured tree)."""
        lower, upper, a = _interpolate(self.context_lengths, context_length)
        row = [(1 - a) * x + a * y for x, y in zip(self.seconds[lower], self.seconds[upper])]
        lower, upper, b = _interpolate(self.tree_sizes, n, extrapolate=True)
        return (1 - b) * row[lower] + b * row[upper]

    def slowdown(self, n: int, context_length: int) -> float:
        return self.cost(n, context_length) / self.cost(1, context_length)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> CostProfile:
        return cls(**json.loads(path.read_text()))


def _interpolate(grid: Sequence[int], x: float, extrapolate: bool = False) -> tuple[int, int, float]:
    """(lower index, upper index, weight of upper) for linear interpolation on `grid`."""
    if len(grid) == 1:
        return 0, 0, 0.0
    upper = min(max(bisect.bisect_left(grid, x), 1), len(grid) - 1)
    lower = upper - 1
    weight = (x - grid[lower]) / (grid[upper] - grid[lower])
    return lower, upper, weight if extrapolate else min(max(weight, 0.0), 1.0)


@dataclass(frozen=True)
class Correction:
    """Multipliers for a forecast, realized over predicted (learned by `calibration.py`)."""

    draft_tokens: float = 1.0  # accepted draft tokens
    spec_seconds: float = 1.0  # seconds of a speculative pass
    plain_seconds: float = 1.0  # seconds of a one-token pass


@dataclass(frozen=True)
class Forecast:
    """What the controller expects of a round: the model's raw figures and their correction."""

    tree_nodes: int  # root included
    draft_tokens: float  # Σ P(node accepted): expected accepted draft tokens, uncorrected
    seconds: float  # the profile's cost of the pass, uncorrected
    correction: Correction = Correction()

    @property
    def expected_tokens(self) -> float:
        """Per pass, bonus included."""
        return 1.0 + self.draft_tokens * self.correction.draft_tokens

    @property
    def expected_seconds(self) -> float:
        factor = self.correction.spec_seconds if self.tree_nodes > 1 else self.correction.plain_seconds
        return self.seconds * factor

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.expected_seconds


@dataclass(frozen=True)
class Shape:
    """A round's speculation: k drafts of ≤ w tokens, and the forecast when one was made."""

    k: int
    w: int
    drafts: list[Draft]
    forecast: Forecast | None = None


def choose_shape(
    candidates: Sequence[ScoredDraft],
    profile: CostProfile,
    context_length: int,
    k_max: int,
    w_max: int,
    correction: Correction = Correction(),
    min_gain: float = 1.02,
) -> Shape:
    """The (k, w) with the most expected tokens per second; plain decoding unless a shape
    beats it by `min_gain` (estimates are noisy, and a loss costs more than a tie gains).

    Expected tokens of a tree = 1 (bonus) + Σ over its nodes of P(node accepted), each node's
    probability from the draft that put it there (its (strategy, rank) acceptance at that
    depth; the most likely one when drafts share a node), scaled by the learned `correction`.
    """
    plain = Shape(0, 0, [], Forecast(1, 0.0, profile.cost(1, context_length), correction))
    best, best_rate = plain, plain.forecast.tokens_per_second * min_gain
    for w in range(1, w_max + 1):
        ranked = sorted(candidates, key=lambda s: s.acceptance.expected_tokens(w), reverse=True)
        node_probability: dict[tuple[int, ...], float] = {}
        drafts: list[Draft] = []
        for candidate in ranked:
            if len(drafts) == k_max:
                break
            tokens = candidate.draft.token_ids[:w]
            if tokens in node_probability:
                continue  # adds no node
            for depth in range(1, len(tokens) + 1):
                prefix = tokens[:depth]
                probability = candidate.acceptance.node_probability(depth)
                node_probability[prefix] = max(probability, node_probability.get(prefix, 0.0))
            drafts.append(Draft(tokens, candidate.draft.strategy, candidate.draft.rank))
            nodes = 1 + len(node_probability)
            forecast = Forecast(nodes, sum(node_probability.values()), profile.cost(nodes, context_length), correction)
            if forecast.tokens_per_second > best_rate:
                best, best_rate = Shape(len(drafts), w, list(drafts), forecast), forecast.tokens_per_second
    return best
