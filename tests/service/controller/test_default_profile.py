"""The default cost profile: on the profiler's grid, valid, and more conservative about extra
tokens than a measured CPU profile."""

from __future__ import annotations

import torch

from service.controller.default_profile import default_profile
from service.controller.profiler import CONTEXT_LENGTHS, pass_sizes, profiled_rows, validate
from service.model.runner import ModelRunner
from tests.helpers.costs import CPU_LIKE


def test_the_default_profile_covers_the_profilers_grid_and_passes_its_validation(
    tiny_model,
) -> None:
    runner = ModelRunner(tiny_model)
    profile = default_profile(runner)
    assert profile.rows == list(profiled_rows(torch.device("cpu")))
    assert profile.context_lengths == list(CONTEXT_LENGTHS)
    assert profile.tree_sizes == [pass_sizes(r, runner.device) for r in profile.rows]
    assert validate(profile) == []
    assert profile.device == "default (cpu)"


def test_each_pass_size_costs_more_than_in_a_measured_cpu_profile(tiny_model) -> None:
    """Conservative: a tree's tokens are priced dearer relative to a plain pass, so auto only
    speculates where acceptance clearly pays."""
    default = default_profile(ModelRunner(tiny_model))
    for tokens in (2, 4, 16, 64):
        ratio = default.cost(tokens, 256) / default.cost(1, 256)
        assert ratio > CPU_LIKE.cost(tokens, 256) / CPU_LIKE.cost(1, 256)
