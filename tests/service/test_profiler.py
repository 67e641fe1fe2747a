"""Measuring the cost profile on a real (tiny) model, and keeping it per device/model/dtype."""

from __future__ import annotations

from service.model_runner import ModelRunner
from service.profiler import load_or_measure, measure_profile, profile_path
from tests.conftest import make_tiny_model


def test_profile_covers_the_grid_and_leaves_the_cache_length_alone(tiny_runner: ModelRunner) -> None:
    profile = measure_profile(tiny_runner, tree_sizes=(1, 4, 16), context_lengths=(8, 64), repeats=2)
    assert profile.tree_sizes == [1, 4, 16] and profile.context_lengths == [8, 64]
    assert len(profile.seconds) == 2 and all(len(row) == 3 for row in profile.seconds)
    assert all(s > 0 for row in profile.seconds for s in row)
    # a tiny model's passes are all about as fast, so noise would make dips: they are flattened
    assert all(row == sorted(row) for row in profile.seconds)
    assert profile.dtype == "torch.float32" and profile.device


def test_profile_is_saved_and_reused(tmp_path) -> None:
    runner = ModelRunner(make_tiny_model(seed=3))
    grid = {"tree_sizes": (1, 2), "context_lengths": (4,)}
    first = load_or_measure(runner, tmp_path, **grid)
    assert profile_path(tmp_path, runner).exists()
    assert load_or_measure(runner, tmp_path, tree_sizes=(1, 8)) == first  # loaded, not measured
    assert load_or_measure(runner, tmp_path, remeasure=True, **grid) != first  # new timings
