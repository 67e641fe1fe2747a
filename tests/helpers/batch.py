"""A mixed batch: prompts of every kind, each with its own speculation mode and length, which
must come out of one engine as each would alone."""

from __future__ import annotations

from service.engine.params import SpeculationParams

PROMPTS = [
    [5, 9, 13, 2, 7, 7, 30, 41],
    [3, 4, 5, 6, 3, 4, 5, 6, 3, 4],
    [11],
    list(range(2, 60)),
    [8, 8, 8, 8, 9, 8, 8, 8],
]
MODES = [
    SpeculationParams(0, 0, "off"),
    SpeculationParams(4, 4, "fixed"),
    SpeculationParams(6, 5, "auto"),
    SpeculationParams(2, 3, "fixed"),
    SpeculationParams(6, 5, "auto"),
]
LENGTHS = [20, 12, 24, 16, 8]
