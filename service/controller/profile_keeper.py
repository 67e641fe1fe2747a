"""Keeps a valid cost profile in use for as long as the server runs, beside noisy neighbours.

In Kubernetes, other pods on the node and CPU throttling are the normal case. Two rules follow:

- A profile that fails validation is never put in use. The last valid one (loaded from disk or
  measured earlier) stays; a uniform slowdown from other work is the calibration's load level,
  which the controller's comparisons of shapes cancel out. Until a first valid profile exists,
  auto mode prices trees with the device class's conservative default (`default_profile.py`).
- Measure only when it can succeed: the engine idle (the async engine runs these increments only
  then) AND other work's load steady (`MachineLoad.steady`: a steady neighbour cancels out of
  relative costs; on a GPU the host's neighbours do not gate the device's profile). An attempt
  whose load changes while it runs is abandoned; each attempt that fails or is abandoned doubles the
  wait before the next (`BACKOFF_FIRST` .. `BACKOFF_MAX`), and while a valid profile is in use,
  profiling may spend at most `CPU_SHARE` of this process's cores' time in any hour.

When the calibration says the observed relative costs keep disagreeing with the profile
(`Calibration.drifted`), that may be a neighbour (which hits large and small passes unequally
while it runs) or a real change (another machine shape, a changed kernel). A short probe under
a steady load tells them apart: if the probe's relative costs agree with the profile's, the
drift was the neighbour's and the calibration forgets it; if not, the profile is stale and is
measured again, and adopted if valid. Without these rules a server beside a noisy neighbour
can measure back to back while still loaded, every attempt failing, and put a failed profile in
use that misprices passes wildly until restart (docs/benchmarks.md, "Beside a noisy
neighbour").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from service.controller.calibration import DRIFT_LIMIT, Calibration
from service.controller.cost_profile import CostProfile
from service.controller.machine_load import MachineLoad
from service.controller.profiler import (
    load_saved,
    measure_steps,
    probe_steps,
    profile_path,
)
from service.model.runner import ModelRunner

log = logging.getLogger(__name__)
T = TypeVar("T")

# seconds between profiling activities, doubled after each that changed nothing
BACKOFF_FIRST = 60.0
BACKOFF_MAX = 3600.0
# the share of this process's cores' time in any hour spent profiling while a valid profile is used
CPU_SHARE = 0.1
HOUR = 3600.0

Measure = Callable[[], Generator[None, None, tuple[CostProfile, list[str]]]]
Probe = Callable[[CostProfile], Generator[None, None, float]]
OUTCOMES = ("adopted", "failed", "abandoned")


@dataclass(frozen=True)
class ProfileState:
    """What /health and the metrics show of the cost profile."""

    valid: bool  # a valid profile is in use (auto mode speculates)
    valid_since: float | None  # Unix time the profile in use was measured
    # its relative costs no longer hold under a steady load: it is due to be measured again
    stale: bool
    remeasuring: bool
    failed_attempts: int  # attempts in a row that failed validation or were abandoned
    # attempts by outcome: adopted, failed (validation), abandoned (load changed, budget)
    remeasures: dict[str, int]
    next_attempt_in_s: float  # seconds until profiling may start again (back-off)
    cpu_seconds_last_hour: float  # spent profiling


@dataclass
class _Budget:
    """CPU seconds spent profiling in the last hour."""

    entries: deque[tuple[float, float]] = field(default_factory=deque)  # (when, CPU seconds)
    largest: float = 0.0  # the largest increment seen: one more must fit under the cap

    def spend(self, now: float, seconds: float) -> None:
        self.entries.append((now, seconds))
        self.largest = max(self.largest, seconds)

    def fits(self, now: float, seconds: float, cap: float) -> bool:
        """`seconds` more (and one increment) stay within `cap` over the last hour."""
        return self.last_hour(now) + seconds + self.largest <= cap

    def last_hour(self, now: float) -> float:
        while self.entries and self.entries[0][0] <= now - HOUR:
            self.entries.popleft()
        return sum(seconds for _, seconds in self.entries)


class ProfileKeeper:
    """Adopts, probes and re-measures the engine's cost profile (see the module's docstring).
    `steps()` is endless: the async engine runs one increment per idle tick; it yields False
    when there is nothing to do."""

    def __init__(
        self,
        measure: Measure,
        probe: Probe,
        save: Callable[[CostProfile], None],
        adopt: Callable[[CostProfile], None],
        calibration: Calibration,
        steady: Callable[[], bool],
        cpu_cap: float,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._measure, self._probe, self._save, self._adopt = measure, probe, save, adopt
        self.calibration = calibration
        self._steady = steady
        self.cpu_cap = cpu_cap
        self._clock, self._cpu_clock, self._wall_clock = clock, cpu_clock, wall_clock
        self.profile: CostProfile | None = None
        self.valid_since: float | None = None
        self.stale = False
        self.remeasuring = False
        self.failed_attempts = 0
        self.remeasures = dict.fromkeys(OUTCOMES, 0)
        self._budget = _Budget()
        self._costs = {"measure": 0.0, "probe": 0.0}  # CPU seconds of the last whole one of each
        self._next_at = clock()
        # profiling activities in a row that changed nothing: the back-off's exponent
        self._unchanged = 0

    @classmethod
    def for_runner(
        cls,
        runner: ModelRunner,
        cache_dir: Path,
        calibration: Calibration,
        adopt: Callable[[CostProfile], None],
        machine: MachineLoad | None = None,
    ) -> ProfileKeeper:
        """A keeper measuring `runner`'s passes, saving to (and starting from) `cache_dir`."""
        machine = machine or MachineLoad()
        keeper = cls(
            lambda: measure_steps(runner),
            lambda profile: probe_steps(runner, profile),
            lambda profile: profile.save(profile_path(cache_dir, runner)),
            adopt,
            calibration,
            machine.steady if runner.device.type == "cpu" else lambda: True,
            cpu_cap=CPU_SHARE * HOUR * machine.cores,
        )
        saved = load_saved(runner, cache_dir)
        if saved is not None:
            keeper.start_from(saved, profile_path(cache_dir, runner).stat().st_mtime)
        return keeper

    def start_from(self, profile: CostProfile, measured_at: float) -> None:
        """Put a valid profile (loaded from disk) in use."""
        self.profile, self.valid_since = profile, measured_at
        self._adopt(profile)
        log.info("cost profile loaded: auto mode enabled")

    @property
    def state(self) -> ProfileState:
        now = self._clock()
        return ProfileState(
            valid=self.profile is not None,
            valid_since=self.valid_since,
            stale=self.stale,
            remeasuring=self.remeasuring,
            failed_attempts=self.failed_attempts,
            remeasures=dict(self.remeasures),
            next_attempt_in_s=max(self._next_at - now, 0.0),
            cpu_seconds_last_hour=self._budget.last_hour(now),
        )

    def steps(self) -> Generator[bool, None, None]:
        while True:
            if self._clock() < self._next_at or not self._steady():
                yield False
            elif self.profile is None or self.stale:
                yield from self._remeasure()
            elif self.calibration.drifted() and self._fits_budget("probe"):
                yield from self._check_drift()
            else:
                yield False

    def _remeasure(self) -> Generator[bool, None, None]:
        if self.profile is not None and not self._fits_budget("measure"):
            yield False
            return
        self.remeasuring = True
        try:
            result = yield from self._run("measure", self._measure())
        finally:
            self.remeasuring = False
        if result is None:
            outcome = "abandoned"
            log.warning(
                "cost profile measurement abandoned: other work's load changed or the hour's "
                "profiling budget ran out; %s",
                self._keeping(),
            )
        elif result[1]:
            outcome = "failed"
            log.warning(
                "cost profile measurement failed validation: %s; %s",
                "; ".join(result[1]),
                self._keeping(),
            )
        else:
            outcome = "adopted"
            self._save(result[0])
            self.profile, self.valid_since, self.stale = result[0], self._wall_clock(), False
            self._adopt(result[0])
            self.calibration.reset_costs()
            log.info("cost profile measured and in use: auto mode enabled")
        self.remeasures[outcome] += 1
        self.failed_attempts = 0 if outcome == "adopted" else self.failed_attempts + 1
        self._back_off(changed=outcome == "adopted")

    def _check_drift(self) -> Generator[bool, None, None]:
        """Probe the relative costs the profile says; stale if they disagree beyond
        `DRIFT_LIMIT`."""
        assert self.profile is not None
        disagreement = yield from self._run("probe", self._probe(self.profile))
        if disagreement is not None and disagreement > DRIFT_LIMIT:
            log.warning(
                "relative pass costs are off the cost profile's by x%.2f under a steady load: "
                "measuring it again",
                disagreement,
            )
            self.stale = True
            return
        if disagreement is not None:
            log.info(
                "relative pass costs agree with the cost profile under a steady load (x%.2f): "
                "the drift was other work's",
                disagreement,
            )
            self.calibration.reset_costs()
        self._back_off(changed=False)

    def _run(self, kind: str, work: Generator[None, None, T]) -> Generator[bool, None, T | None]:
        """Run a measurement or probe (`kind`) one increment per yield, counting its CPU time;
        None when abandoned: other work's load changed, or (a valid profile in use) one more
        increment would overrun the hour's budget."""
        spent = 0.0
        while True:
            if not self._steady() or (self.profile is not None and not self._fits_budget()):
                work.close()
                return None
            started = self._cpu_clock()
            try:
                next(work)
            except StopIteration as done:
                self._costs[kind] = spent
                return done.value
            finally:
                increment = self._cpu_clock() - started
                spent += increment
                self._budget.spend(self._clock(), increment)
            yield True

    def _fits_budget(self, kind: str | None = None) -> bool:
        """One more increment, or a whole measurement or probe (`kind`: as long as its last),
        stays within the hour's profiling budget."""
        return self._budget.fits(self._clock(), self._costs[kind] if kind else 0.0, self.cpu_cap)

    def _back_off(self, changed: bool) -> None:
        """Wait before profiling again: `BACKOFF_FIRST`, doubling with each activity in a row
        that changed nothing (up to `BACKOFF_MAX`)."""
        self._unchanged = 0 if changed else self._unchanged + 1
        wait = min(BACKOFF_FIRST * 2 ** max(self._unchanged - 1, 0), BACKOFF_MAX)
        self._next_at = self._clock() + wait

    def _keeping(self) -> str:
        if self.profile is None:
            return "auto mode prices trees with the default profile until a measurement passes"
        return "the previous valid cost profile stays in use"
