"""The cost profile beside a noisy neighbour: a failed measurement is never put in use, nothing
is measured while other work's load changes, attempts back off, a real change of relative costs is
measured again and adopted, and profiling's CPU time per hour stays under its cap.

The keeper runs against a simulated clock and CPU clock, a scripted machine (its load changing
or steady) and scripted measurements and probes, the way the async engine drives it: one
increment per idle tick, each tick that has nothing to do a second of simulated time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.controller.calibration import DRIFT_LIMIT, Calibration
from service.controller.cost_profile import CostProfile, PassShape
from service.controller.planner import RowCandidates, plan_trees
from service.controller.profile_keeper import BACKOFF_FIRST, BACKOFF_MAX, HOUR, ProfileKeeper
from tests.helpers.costs import CPU_LIKE, candidates

OLD = CPU_LIKE
NEW = CostProfile([1], [100], [CPU_LIKE.tree_sizes[0]], [[[s * 2 for s in CPU_LIKE.seconds[0][0]]]])
CAP = 720.0  # CPU seconds an hour: a tenth of two cores
MEASURE_CPU = 300.0  # a whole measurement, in increments of a tenth
PROBE_CPU = 6.0


class World:
    """The simulated machine: clocks, a neighbour, and what the scripted profiler did."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0
        self.changing = False  # other work's load changes (not steady)
        self.measures: list[float] = []  # when each measurement started
        self.probes: list[float] = []
        # (when, CPU seconds) of every profiling increment
        self.spent: list[tuple[float, float]] = []

    def work(self, cpu_seconds: float) -> None:
        self.cpu += cpu_seconds
        self.now += cpu_seconds / 2  # two threads
        self.spent.append((self.now, cpu_seconds))


class Keeper:
    """A keeper over `World` whose measurements give `problems` in turn (then the last one
    forever) and whose probes report `disagreement`."""

    def __init__(
        self,
        world: World,
        problems: list[list[str]],
        disagreement: float = 1.0,
        start: CostProfile | None = OLD,
    ) -> None:
        self.world, self.problems, self.disagreement = world, iter(problems), disagreement
        self.last_problems: list[str] = []
        self.calibration = Calibration()
        self.adopted: list[CostProfile] = []
        self.saved: list[CostProfile] = []
        self.keeper = ProfileKeeper(
            self._measure,
            self._probe,
            self.saved.append,
            self.adopted.append,
            self.calibration,
            lambda: not world.changing,
            CAP,
            clock=lambda: world.now,
            cpu_clock=lambda: world.cpu,
            wall_clock=lambda: 1e9 + world.now,
        )
        if start is not None:
            self.keeper.start_from(start, measured_at=1e9)
        self.steps = self.keeper.steps()

    def _measure(self) -> Iterator[None]:
        self.world.measures.append(self.world.now)
        for _ in range(10):
            self.world.work(MEASURE_CPU / 10)
            yield
        self.last_problems = next(self.problems, self.last_problems)
        return NEW, self.last_problems

    def _probe(self, profile: CostProfile) -> Iterator[None]:
        assert profile is self.keeper.profile
        self.world.probes.append(self.world.now)
        for _ in range(3):
            self.world.work(PROBE_CPU / 3)
            yield
        return self.disagreement

    def run(self, seconds: float) -> None:
        end = self.world.now + seconds
        while self.world.now < end:
            if next(self.steps) is False:
                self.world.now += 1.0


def drift(calibration: Calibration) -> None:
    """A neighbour that hits large passes harder than small ones while requests are served."""
    for _ in range(20):
        calibration.observe_pass(1, 0.1, 0.1)
        calibration.observe_pass(8, 0.2, 0.6)
    assert calibration.drifted()


def decision(profile: CostProfile, calibration: Calibration) -> int:
    """The tokens the controller puts in a one-row pass with drafts that pay on the CPU-like
    curve."""
    row = RowCandidates(candidates(0.9, 0.8, k=2, w=4), 2, 4)
    price = lambda shape: profile.cost(shape.tokens, 100) * calibration.shape_factor(shape.tokens)  # noqa: E731
    return plan_trees([row], price, PassShape(1), 0.0, 8).tokens


def test_a_neighbours_spike_while_idle_starts_nothing_and_decisions_return_to_the_pre_spike_ones() -> (  # noqa: E501
    None
):
    world = World()
    # the profile's relative costs still hold under a steady load
    scripted = Keeper(world, [[]], disagreement=1.2)
    before = decision(OLD, scripted.calibration)
    drift(scripted.calibration)
    world.changing = True
    scripted.run(1800)
    assert world.measures == [] and world.probes == []  # nothing measured beside the neighbour
    assert scripted.keeper.state.valid and not scripted.keeper.state.stale
    world.changing = False
    scripted.run(60)
    assert (
        len(world.probes) == 1 and world.measures == []
    )  # a probe under a steady load; no measurement
    assert not scripted.calibration.drifted()  # the drift was the neighbour's: forgotten
    assert scripted.adopted == [OLD] and decision(OLD, scripted.calibration) == before
    scripted.run(3 * HOUR)
    assert world.measures == []


def test_when_every_measurement_fails_the_previous_valid_profile_stays_and_attempts_back_off() -> (
    None
):
    world = World()
    scripted = Keeper(world, [["rows=1 L=32: the repeats disagree"]], disagreement=3.0)
    drift(scripted.calibration)
    scripted.run(6 * HOUR)
    assert scripted.adopted == [OLD] and scripted.saved == []  # never put in use, never saved
    state = scripted.keeper.state
    assert state.valid and state.stale and state.failed_attempts == len(world.measures) >= 4
    assert state.remeasures == {"adopted": 0, "failed": len(world.measures), "abandoned": 0}
    gaps = [b - a - MEASURE_CPU / 2 for a, b in zip(world.measures, world.measures[1:])]
    print("waits between attempts, s:", [round(g) for g in gaps])
    # the waits double up to the back-off's cap (and the hour's CPU budget may add to them)
    assert all(gap >= min(BACKOFF_FIRST * 2**i, BACKOFF_MAX) - 1 for i, gap in enumerate(gaps))
    assert len(world.measures) <= 10  # not three back to back, nor one a minute


def test_a_persistent_change_of_relative_costs_is_measured_again_once_steady_and_adopted() -> None:
    world = World()
    scripted = Keeper(world, [[]], disagreement=2 * DRIFT_LIMIT)
    drift(scripted.calibration)
    world.changing = True
    scripted.run(300)
    assert world.probes == [] and world.measures == []
    world.changing = False
    scripted.run(600)
    assert len(world.probes) == 1 and len(world.measures) == 1
    assert (
        scripted.adopted == [OLD, NEW]
        and scripted.saved == [NEW]
        and scripted.keeper.profile is NEW
    )
    state = scripted.keeper.state
    assert state.valid and not state.stale and state.failed_attempts == 0
    assert (
        state.remeasures["adopted"] == 1
        and state.valid_since == 1e9 + world.measures[0] + MEASURE_CPU / 2
    )
    assert not scripted.calibration.drifted()  # the new profile starts from clean factors


def test_a_measurement_whose_load_changes_is_abandoned_and_retried_once_steady() -> None:
    world = World()
    scripted = Keeper(world, [[]], start=None)
    assert next(scripted.steps) is True  # the first measurement starts at once: there is no profile
    world.changing = True
    assert next(scripted.steps) is False  # its next increment is not run
    assert len(world.spent) == 1
    state = scripted.keeper.state
    assert (
        state.remeasures["abandoned"] == 1
        and not state.valid
        and state.next_attempt_in_s == BACKOFF_FIRST
    )
    assert scripted.adopted == []  # auto mode decodes plainly meanwhile
    world.changing = False
    scripted.run(BACKOFF_FIRST + 300)
    assert scripted.adopted == [NEW] and scripted.keeper.state.valid


@pytest.mark.parametrize(
    "problems", [[], ["a bigger pass measured cheaper"]], ids=["valid", "failing"]
)
def test_profiling_cpu_time_per_hour_stays_under_its_cap_under_a_pathological_drift_signal(
    problems,
) -> None:
    world = World()
    scripted = Keeper(world, [problems], disagreement=10.0)
    scripted.calibration.drifted = lambda: True  # every idle tick says the profile is off
    scripted.run(8 * HOUR)
    worst = max(
        sum(cpu for when, cpu in world.spent if start <= when < start + HOUR)
        for start, _ in world.spent
    )
    print(
        f"measurements {len(world.measures)}, probes {len(world.probes)}, "
        f"worst hour {worst:.0f} CPU s of {CAP:.0f}"
    )
    assert worst <= CAP
    assert len(world.measures) >= 2  # the cap limits profiling; it does not stop it
