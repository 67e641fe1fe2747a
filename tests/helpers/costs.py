"""Synthetic cost profiles (a device's pass time by tokens and rows) and scored drafts, for the
planner and for engines that must speculate (or not) whatever the machine the tests run on."""

from __future__ import annotations

from drafting import Acceptance, Draft, ScoredDraft
from service.controller.cost_profile import CostProfile

SIZES = [1, 2, 4, 8, 16, 32, 64]


def linear_profile(first: float, per_token: float) -> CostProfile:
    """T(n) = first + per_token·n seconds, whatever the rows and context."""
    return CostProfile([1], [100], [SIZES], [[[first + per_token * n for n in SIZES]]])


def flat_profile(slope: float) -> CostProfile:
    """T(n) = 1 + slope·(n − 1) seconds, whatever the rows and context."""
    return linear_profile(1.0 - slope, slope)


MEMORY_BOUND = flat_profile(0.001)  # a GPU below its knee: 64 tokens cost 6% more than 1
COMPUTE_BOUND = flat_profile(0.5)  # every extra token costs half a pass
CPU_LIKE = CostProfile([1], [100], [SIZES], [[[0.110, 0.165, 0.20, 0.23, 0.30, 0.37, 0.55]]])


def gpu_like(rows: int, wide_row_seconds: float) -> CostProfile:
    """A nearly flat pass (0.014 s, 10 us a token) whose wide rows each add `wide_row_seconds`."""
    sizes = [rows * m for m in (1, 2, 4, 8)]
    return CostProfile(
        [1, rows],
        [100],
        [sizes, sizes],
        [[[0.014 + 1e-5 * n for n in sizes]]] * 2,
        wide_row_seconds=[[0.0], [wide_row_seconds]],
    )


def candidates(p: float, c: float, k: int = 8, w: int = 8, first: int = 1) -> list[ScoredDraft]:
    """k disjoint drafts (distinct first tokens) of w tokens; rank r accepted with p/(r+1)."""
    return [
        ScoredDraft(
            Draft(tuple(range(first + 10 * r, first + 10 * r + w)), "s", r),
            Acceptance(p / (r + 1), c),
        )
        for r in range(k)
    ]
