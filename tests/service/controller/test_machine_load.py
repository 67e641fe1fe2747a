"""Other work on the machine, from the kernel's per-core counters less this process's own CPU
time."""

from __future__ import annotations

from pathlib import Path

from service.controller.machine_load import WINDOW_SECONDS, MachineLoad, read_busy_seconds

STAT = """cpu  300 0 100 800 20 0 5 15 0 0
cpu0 100 0 50 400 10 0 0 10 0 0
cpu1 200 0 50 400 10 0 5 5 0 0
cpu2 999 0 0 0 0 0 0 0 0 0
intr 1 2 3
"""


def test_busy_seconds_sum_the_cores_of_this_process_with_stolen_time_and_without_idle_ones(
    tmp_path: Path,
) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    # user, system, irq/softirq, steal; not idle nor iowait
    ticks = (100 + 50 + 10) + (200 + 50 + 5 + 5)
    assert read_busy_seconds({0, 1}, stat) * 100 == ticks  # cpu2 is another cpuset's
    assert read_busy_seconds({0, 1}, tmp_path / "absent") is None


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


def test_our_own_passes_never_make_the_machine_look_busy() -> None:
    clocks = Clocks()
    load = machine(clocks)
    assert not load.quiet(2)  # nothing known before a whole window
    clocks.advance(WINDOW_SECONDS, own_cores=2.0, other_cores=0.0)
    assert load.quiet(2) and load.others_cores == 0.0


def test_a_neighbour_on_the_cores_the_passes_need_is_busy_and_one_beside_them_is_not() -> None:
    clocks = Clocks()
    load = machine(clocks, cores=4)
    clocks.advance(WINDOW_SECONDS, own_cores=0.5, other_cores=1.0)
    assert load.quiet(2) and load.others_cores == 1.0 and load.quiet(3) and not load.quiet(4)
    clocks.advance(WINDOW_SECONDS, own_cores=0.0, other_cores=0.2)  # stolen time and daemons: slack
    assert load.quiet(4)


def test_the_window_closes_only_after_its_length() -> None:
    clocks = Clocks()
    load = machine(clocks)
    clocks.advance(WINDOW_SECONDS, own_cores=0.0, other_cores=0.0)
    assert load.quiet(2)
    clocks.advance(WINDOW_SECONDS / 2, own_cores=0.0, other_cores=2.0)
    assert load.quiet(2)  # half a window of a neighbour: still judged by the last whole window
    clocks.advance(WINDOW_SECONDS / 2, own_cores=0.0, other_cores=2.0)
    assert not load.quiet(2)


def test_without_the_kernels_counters_the_machine_counts_as_quiet() -> None:
    clocks = Clocks()
    load = MachineLoad(lambda: None, lambda: clocks.own, lambda: clocks.now, cores=2)
    clocks.advance(WINDOW_SECONDS, own_cores=0.0, other_cores=2.0)
    assert load.quiet(2)
