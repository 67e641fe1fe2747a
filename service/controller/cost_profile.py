"""What a pass costs here: the measured `CostProfile` and its prices by pass shape.

A forward pass over N tokens costs about as much as over one while the device is
memory-bound (weights dominate the bytes moved), then grows once it is compute-bound. Where
that knee lies depends on the device, model, dtype, the number of rows (requests) in the pass
and their context length, so it is measured (`service/controller/profiler.py`) into a `CostProfile`
T(N tokens, R rows, L context), measured with every row equally wide. A pass whose rows differ
costs more than that curve says: one tree among one-token rows gets an attention call of its
own (or pads every row), a cost beyond its tokens' share of the curve (docs/benchmarks.md). The
profile therefore also measures what one wide row adds (`wide_row_seconds`), and the controller
charges it to a row's first node.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from service.cache_files import read_checked_json, write_checked_json

PROFILE_VERSION = 3  # the wide-row cost; older files are measured again


class PassShape(NamedTuple):
    """What a pass holds, as far as its cost goes: its tokens, the rows that bring more than
    one token (a tree or a prompt chunk, each priced as a wide row). A named tuple: the
    controller prices a shape per candidate node every step."""

    tokens: int
    wide_rows: int = 0

    def grown(self, row_width: int) -> PassShape:
        """This pass with one more token in a row that brought `row_width` tokens."""
        return PassShape(self.tokens + 1, self.wide_rows + (row_width == 1))


@dataclass(frozen=True)
class CostProfile:
    """Median seconds of one pass, measured per rows × context length × total tokens."""

    rows: list[int]  # ascending, starting at 1
    context_lengths: list[int]  # ascending
    tree_sizes: list[list[int]]  # [rows]: total tokens measured (ascending) for that row count
    seconds: list[list[list[float]]]  # [rows][context_lengths][tree_sizes[rows]]
    # [rows][context_lengths]: what one row of a few tokens among one-token rows adds beyond
    # its tokens' share of `seconds` (0 at one row; empty: not measured, priced as 0)
    wide_row_seconds: list[list[float]] = field(default_factory=list)
    device: str = ""
    model: str = ""
    dtype: str = ""
    version: int = PROFILE_VERSION

    def cost(self, n: int, context_length: float, rows: int = 1, wide_rows: int = 0) -> float:
        """Seconds of a pass of `n` tokens over `rows` rows at mean context `context_length`,
        `wide_rows` of them wider than one token: see `PassCost`."""
        return self.at(context_length, rows).seconds(PassShape(n, wide_rows))

    def at(self, context_length: float, rows: int) -> PassCost:
        """The profile at one mean context length (linear in L, clamped) and row count (linear,
        extrapolated past the largest measured)."""
        lower, upper, a = _interpolate(self.context_lengths, context_length)
        below, above, weight = _interpolate(self.rows, rows, extrapolate=True)
        parts = tuple(
            (w, self.tree_sizes[index], self.seconds[index][lower], self.seconds[index][upper])
            for w, index in ((1 - weight, below), (weight, above))
            if w != 0.0
        )  # a measured count: one
        wide = self.wide_row_cost(context_length, rows) if self.wide_row_seconds else 0.0
        return PassCost(parts, a, wide)

    def wide_row_cost(self, context_length: float, rows: int) -> float:
        """What one wide row adds to a pass of `rows` rows (interpolated, clamped)."""
        lower, upper, a = _interpolate(self.context_lengths, context_length)
        per_rows = [(1 - a) * table[lower] + a * table[upper] for table in self.wide_row_seconds]
        lower, upper, b = _interpolate(self.rows, rows)
        return (1 - b) * per_rows[lower] + b * per_rows[upper]

    def slowdown(self, n: int, context_length: float) -> float:
        return self.cost(n, context_length) / self.cost(1, context_length)

    def save(self, path: Path) -> None:
        """Write this profile to `path` atomically, with a sha256 of its content."""
        write_checked_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> CostProfile:
        """The profile `save` wrote at `path`; a ValueError naming the file if it is damaged
        (`CorruptCacheFile`) or of another format."""
        data = read_checked_json(path)
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"{path} is a profile of another format (version {data.get('version')})"
            )
        return cls(**data)


def _interpolate(
    grid: Sequence[float], x: float, extrapolate: bool = False
) -> tuple[int, int, float]:
    """(lower index, upper index, weight of upper) for linear interpolation on `grid`."""
    if len(grid) == 1:
        return 0, 0, 0.0
    upper = min(max(bisect.bisect_left(grid, x), 1), len(grid) - 1)
    lower = upper - 1
    weight = (x - grid[lower]) / (grid[upper] - grid[lower])
    return lower, upper, weight if extrapolate else min(max(weight, 0.0), 1.0)


@dataclass(frozen=True)
class PassCost:
    """A `CostProfile` at one context length and row count: seconds by pass shape. Every step
    takes one (the pass's observed time is compared with it) and the controller prices tens of
    shapes with it, so it interpolates lazily: each shape costs two look-ups on the pass-size
    axis, and taking one builds no curve."""

    # (weight, pass sizes, seconds at the context length below, seconds at the one above)
    parts: tuple[tuple[float, Sequence[int], Sequence[float], Sequence[float]], ...]
    context_weight: float  # of the context length above
    wide_row_seconds: float

    def equal_rows(self, n: int) -> float:
        """A pass of `n` tokens with every row alike (linear in n, extrapolated). The
        interpolation is written out: the controller prices tens of shapes a step, and a call
        per axis was a large share of the price."""
        a = self.context_weight
        total = 0.0
        for weight, sizes, below, above in self.parts:
            if len(sizes) == 1:
                total += weight * ((1 - a) * below[0] + a * above[0])
                continue
            upper = bisect.bisect_left(sizes, n)
            upper = 1 if upper < 1 else len(sizes) - 1 if upper >= len(sizes) else upper
            lower = upper - 1
            b = (n - sizes[lower]) / (sizes[upper] - sizes[lower])
            at_lower = (1 - a) * below[lower] + a * above[lower]
            at_upper = (1 - a) * below[upper] + a * above[upper]
            total += weight * ((1 - b) * at_lower + b * at_upper)
        return max(total, 1e-9)

    def seconds(self, shape: PassShape) -> float:
        """The equal-rows curve plus each wide row's own cost. Not capped at a pass with every
        row as wide as the widest (one padded call): the attention layout gives each wide row
        its own call until padding every row is cheaper in its own reckoning (on a GPU, not
        before most rows are wide), so that cap would price many wide rows as one, and auto
        would take rows whose own calls cost more than they bring (docs/benchmarks.md, "Wide
        rows and the sure-draft bound")."""
        equal_rows = self.equal_rows(shape.tokens)
        return (
            equal_rows + shape.wide_rows * self.wide_row_seconds if shape.wide_rows else equal_rows
        )

    def tokens_within(self, seconds: float, base: PassShape, most: int) -> int:
        """The most tokens (`base.tokens` .. `most`) a pass of `base`'s wide rows can hold and
        cost at most `seconds`; `base.tokens` when even that costs more (the costs rise with
        the tokens: the profile is monotone)."""
        low, high = base.tokens, max(most, base.tokens)
        while low < high:
            middle = (low + high + 1) // 2
            if self.seconds(PassShape(middle, base.wide_rows)) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low


def slowdown_grid(
    profile: CostProfile, context_length: int, k_max: int, w_max: int
) -> list[list[float]]:
    """[w][k] slowdown of a pass over 1 + k·w tokens (the tree with no shared prefix)."""
    return [
        [profile.slowdown(1 + k * w, context_length) for k in range(1, k_max + 1)]
        for w in range(1, w_max + 1)
    ]
