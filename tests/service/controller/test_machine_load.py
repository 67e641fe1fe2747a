"""Other work on the machine, from the kernel's per-core counters less this process's own CPU
time, and whether its load holds steady."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.controller.machine_load import (
    LOAD_CHANGE_CORES,
    STEADY_WINDOWS,
    WINDOW_SECONDS,
    MachineLoad,
    read_busy_seconds,
)

STAT = """cpu  300 0 100 800 20 0 5 15 0 0
cpu0 100 30 50 400 10 0 0 10 0 0
cpu1 200 0 50 400 10 0 5 5 0 0
cpu2 999 0 0 0 0 0 0 0 0 0
intr 1 2 3
"""


def test_busy_seconds_sum_the_cores_of_this_process_with_stolen_time_not_idle_nor_niced_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    # user, system, irq/softirq, steal; not idle nor iowait, nor work niced below this process
    ticks = (100 + 50 + 10) + (200 + 50 + 5 + 5)
    monkeypatch.setattr("os.getpriority", lambda *_: 0)
    assert read_busy_seconds({0, 1}, stat) * 100 == ticks  # cpu2 is another cpuset's
    assert read_busy_seconds({0, 1}, tmp_path / "absent") is None
    monkeypatch.setattr("os.getpriority", lambda *_: 10)
    assert read_busy_seconds({0, 1}, stat) * 100 == ticks + 30  # cpu0's niced work competes


class Clocks:
    def __init__(self) -> None:
        self.now = 0.0
        self.own = 0.0
        self.busy = 0.0  # all cores' busy seconds, ours included

    def advance(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def machine(clocks: Clocks, cores: int = 2) -> MachineLoad:
    return MachineLoad(lambda: clocks.busy, lambda: clocks.own, lambda: clocks.now, cores=cores)


def steady_after(load: MachineLoad, clocks: Clocks, own: float, other: float) -> int:
    """Windows of the given load until `load` calls it steady (at most twice the rule's)."""
    for window in range(1, 2 * STEADY_WINDOWS + 1):
        clocks.advance(WINDOW_SECONDS, own_cores=own, other_cores=other)
        if load.steady():
            return window
    return 0


def test_our_own_passes_never_make_the_load_look_changed() -> None:
    clocks = Clocks()
    load = machine(clocks)
    assert not load.steady()  # nothing known before whole windows
    assert steady_after(load, clocks, own=2.0, other=0.0) == STEADY_WINDOWS
    for own in (0.0, 2.0, 1.0, 2.0):  # our passes come and go
        clocks.advance(WINDOW_SECONDS, own_cores=own, other_cores=0.0)
        assert load.steady() and load.others_cores == 0.0
    assert load.changes == 0


def test_a_steady_neighbour_is_steady_at_its_level_and_one_that_starts_is_not() -> None:
    clocks = Clocks()
    load = machine(clocks, cores=2)
    assert steady_after(load, clocks, own=1.0, other=1.0) == STEADY_WINDOWS
    assert load.others_cores == 1.0
    clocks.advance(WINDOW_SECONDS, own_cores=1.0, other_cores=1.0 + LOAD_CHANGE_CORES / 2)
    assert load.steady()  # within the band
    clocks.advance(WINDOW_SECONDS, own_cores=1.0, other_cores=1.0 + 1.5 * LOAD_CHANGE_CORES)
    assert not load.steady() and load.changes == 1  # a second neighbour started
    assert steady_after(load, clocks, own=1.0, other=1.0 + 1.5 * LOAD_CHANGE_CORES) == (
        STEADY_WINDOWS - 1
    )


def test_a_load_that_creeps_leaves_its_band() -> None:
    clocks = Clocks()
    load = machine(clocks, cores=4)
    assert steady_after(load, clocks, own=0.0, other=0.0) == STEADY_WINDOWS
    step = LOAD_CHANGE_CORES / 3
    for window in range(1, 5):
        clocks.advance(WINDOW_SECONDS, own_cores=0.0, other_cores=window * step)
        load.update()
    assert load.changes == 1


def test_the_window_closes_only_after_its_length() -> None:
    clocks = Clocks()
    load = machine(clocks)
    steady_after(load, clocks, own=0.0, other=0.0)
    clocks.advance(WINDOW_SECONDS / 2, own_cores=0.0, other_cores=2.0)
    assert load.steady()  # half a window of a neighbour: still judged by the last whole window
    clocks.advance(WINDOW_SECONDS / 2, own_cores=0.0, other_cores=2.0)
    assert not load.steady()


def test_without_the_kernels_counters_the_load_counts_as_steady() -> None:
    clocks = Clocks()
    load = MachineLoad(lambda: None, lambda: clocks.own, lambda: clocks.now, cores=2)
    assert steady_after(load, clocks, own=0.0, other=2.0) == STEADY_WINDOWS
