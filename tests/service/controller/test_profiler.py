"""Measuring the cost profile on a real (tiny) model, validating it, and keeping it."""

from __future__ import annotations

import pytest
import torch

from service.controller.cost_profile import CostProfile
from service.controller.profiler import (
    load_or_measure,
    measure_profile,
    own_cost,
    pass_sizes,
    probe_steps,
    profile_path,
    profiled_rows,
    validate,
)
from service.model.runner import ModelRunner
from service.model.tables import run_to_end
from tests.helpers.models import make_tiny_model

GRID = {"rows": (1, 4), "context_lengths": (8, 64), "repeats": 2}


def test_profile_covers_the_grid(tiny_runner: ModelRunner) -> None:
    profile, _ = measure_profile(tiny_runner, **GRID)
    assert profile.rows == [1, 4] and profile.context_lengths == [8, 64]
    assert profile.tree_sizes[0][:3] == [1, 2, 4] and profile.tree_sizes[1][:3] == [4, 8, 16]
    assert all(s > 0 for table in profile.seconds for row in table for s in row)
    assert profile.dtype == "torch.float32" and profile.device
    assert profile.wide_row_seconds[0] == [0.0, 0.0]  # one row: the curve itself
    assert len(profile.wide_row_seconds[1]) == 2 and all(
        s >= 0 for s in profile.wide_row_seconds[1]
    )


def test_a_wide_rows_own_cost_is_what_the_curve_does_not_explain(
    tiny_runner: ModelRunner, monkeypatch
) -> None:
    """Four one-token rows cost 1.0 s, eight tokens (every row 2 wide) 1.4 s; one row of four
    among three of one (seven tokens) measured 1.5 s: 0.5 s over the plain pass, of which the
    curve explains 0.3; the row's own is 0.2."""
    import service.controller.profiler as profiler

    def timed(runner, cache, rows) -> float:
        widths = sorted(row.tree.num_nodes for row in rows)
        if widths == [1, 1, 1, profiler.WIDE_ROW_TOKENS]:
            return 1.5
        return 1.0 + 0.1 * (sum(widths) - 4)

    monkeypatch.setattr(profiler, "_timed_pass", timed)
    profile, _ = measure_profile(tiny_runner, rows=(4,), context_lengths=(8,), repeats=2)
    assert profile.wide_row_seconds == [[pytest.approx(0.2)]]


def test_a_dip_is_flattened_to_the_cost_before_it_and_reported(
    tiny_runner: ModelRunner, monkeypatch
) -> None:
    """A bigger pass measured cheaper is noise the controller must not bet on: it is recorded at
    the cost of the pass before it (the others keep their own costs), and flagged."""
    import service.controller.profiler as profiler

    measured = {
        1: 1.0,
        2: 2.0,
        4: 1.5,
        8: 8.0,
        16: 7.0,
        32: 32.0,
        64: 64.0,
    }  # dips at 4 and 16 tokens
    monkeypatch.setattr(
        profiler,
        "_timed_pass",
        lambda runner, cache, rows: measured[sum(row.tree.num_nodes for row in rows)],
    )
    profile, problems = measure_profile(tiny_runner, rows=(1,), context_lengths=(8,), repeats=2)
    assert profile.tree_sizes == [[1, 2, 4, 8, 16, 32, 64]]
    assert profile.seconds == [[[1.0, 2.0, 2.0, 8.0, 8.0, 32.0, 64.0]]]
    assert any("a bigger pass measured cheaper" in p for p in problems)


class Neighbours:
    """A machine whose other work keeps `cores` cores busy, and changes its load `changing`
    times while a profile is measured (0: a steady load, whatever its level)."""

    def __init__(self, cores: float, changing: int = 0) -> None:
        self.others_cores = cores
        self.changes = 0
        self._changing = changing

    def update(self) -> None:
        if self._changing:
            self._changing -= 1
            self.changes += 1


QUIET = Neighbours(0.0)


def test_profile_is_saved_and_reused(tmp_path, monkeypatch) -> None:
    import service.controller.profiler as profiler

    # the tiny model's timings are noise
    monkeypatch.setattr(profiler, "validate", lambda *args: [])
    runner = ModelRunner(make_tiny_model(seed=3))
    grid = {"rows": (1,), "context_lengths": (4,), "repeats": 2}
    first = load_or_measure(runner, tmp_path, machine=QUIET, **grid)
    assert profile_path(tmp_path, runner).exists()
    assert load_or_measure(runner, tmp_path, machine=QUIET, **grid) == first  # loaded, not measured
    assert (
        load_or_measure(runner, tmp_path, remeasure=True, machine=QUIET, **grid) != first
    )  # new timings


def test_a_profile_measured_while_other_work_changed_is_used_but_never_saved(
    tmp_path, monkeypatch
) -> None:
    """Valid by every rule of its own, yet measured while a neighbour came and went: this
    command gets it, the cache does not; one measured beside a steady neighbour is saved."""
    import service.controller.profiler as profiler

    monkeypatch.setattr(profiler, "validate", lambda *args: [])
    runner = ModelRunner(make_tiny_model(seed=3))
    grid = {"rows": (1,), "context_lengths": (4,), "repeats": 2}
    profile = load_or_measure(runner, tmp_path, machine=Neighbours(1.5, changing=99), **grid)
    assert profile.rows == [1] and not profile_path(tmp_path, runner).exists()
    _, problems = measure_profile(runner, Neighbours(1.5, changing=2), **grid)
    assert problems == ["other work's load changed while it was measured"]
    load_or_measure(runner, tmp_path, machine=Neighbours(1.5), **grid)
    assert profile_path(tmp_path, runner).exists()


def test_a_profile_of_other_pass_code_is_not_reused(tmp_path, monkeypatch) -> None:
    """Kernels or attention that changed since the profile was saved: measure again."""
    import service.controller.profiler as profiler

    monkeypatch.setattr(profiler, "validate", lambda *args: [])
    runner = ModelRunner(make_tiny_model(seed=3))
    load_or_measure(runner, tmp_path, machine=QUIET, rows=(1,), context_lengths=(4,), repeats=2)
    assert profiler.load_saved(runner, tmp_path) is not None
    monkeypatch.setattr(profiler, "pass_code_version", lambda: "changed")
    assert profiler.load_saved(runner, tmp_path) is None


def profile_from(l32: list[float], l1024: list[float]) -> CostProfile:
    return CostProfile([1], [32, 1024], [[1, 2, 4, 8]], [[l32, l1024]])


def test_a_profile_measured_under_changing_load_is_rejected() -> None:
    # the real case: one-token passes at L=32 "cost" 348 ms, at L=1024 105 ms
    assert validate(profile_from([0.348, 0.35, 0.36, 0.37], [0.105, 0.17, 0.18, 0.19]))
    # bigger passes measured much cheaper than smaller ones
    assert validate(profile_from([0.1, 0.05, 0.05, 0.06], [0.1, 0.17, 0.18, 0.19]))
    assert validate(profile_from([0.1, 0.17, 0.18, 0.19], [0.11, 0.18, 0.19, 0.2])) == []


def test_a_slow_tail_is_the_neighbours_but_repeats_that_disagree_are_rejected() -> None:
    good = profile_from([0.1, 0.17, 0.18, 0.19], [0.11, 0.18, 0.19, 0.2])
    steady = {(1, 32): [[0.1, 0.1, 0.101, 0.099]] * 4}
    # a shared host: other work delays some repeats, most still agree (measured cells)
    slow_tail = {
        (1, 32): [[0.041, 0.043, 0.043, 0.062, 0.069], [0.093, 0.1, 0.113, 0.14, 0.154]] * 2
    }
    # the repeats scatter
    noisy = {(1, 32): [[0.1, 0.3, 0.05, 0.2]] * 4}
    assert validate(good, steady) == []
    assert validate(good, slow_tail) == []
    assert validate(good, noisy)


def test_a_pass_costs_what_its_fastest_repeats_took() -> None:
    # repeats of one pass, two of them delayed by other work
    assert own_cost([0.062, 0.041, 0.069, 0.043, 0.043]) == pytest.approx(0.042)


def test_a_gpu_profile_measures_larger_passes() -> None:
    """A GPU's pass cost stays flat far past a CPU's, so its curve is measured further."""
    assert pass_sizes(16, torch.device("cpu")) == [16, 32, 64, 128]
    assert pass_sizes(16, torch.device("cuda")) == [16, 32, 64, 128, 256, 512]
    assert pass_sizes(1, torch.device("cuda")) == [1, 2, 4, 8, 16, 32, 64]
    assert pass_sizes(64, torch.device("cuda")) == [64, 128, 256, 512]
    assert (
        max(profiled_rows(torch.device("cuda"))) == 64
        and max(profiled_rows(torch.device("cpu"))) == 16
    )


def test_a_probe_measures_how_far_relative_costs_moved_whatever_the_load_level(
    tiny_runner: ModelRunner, monkeypatch
) -> None:
    """Passes of n tokens over R rows cost 1 + n/R seconds when the profile is measured. Every
    pass twice as slow (a neighbour's level): the probe agrees with the profile. Large passes
    three times as slow and small ones not (another kernel): it reports the 3x."""
    import service.controller.profiler as profiler

    def machine(slow_large: float, level: float):
        def timed(runner, cache, rows) -> float:
            tokens = sum(row.tree.num_nodes for row in rows)
            return level * (1.0 + tokens / len(rows)) * (slow_large if tokens > len(rows) else 1.0)

        return timed

    monkeypatch.setattr(profiler, "_timed_pass", machine(1.0, 1.0))
    profile, _ = measure_profile(tiny_runner, rows=(1, 4), context_lengths=(8,), repeats=2)
    monkeypatch.setattr(profiler, "_timed_pass", machine(1.0, 2.0))
    assert run_to_end(probe_steps(tiny_runner, profile)) == pytest.approx(1.0)
    monkeypatch.setattr(profiler, "_timed_pass", machine(3.0, 1.0))
    assert run_to_end(probe_steps(tiny_runner, profile)) == pytest.approx(3.0)
