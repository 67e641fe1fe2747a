"""Whether other work keeps this machine's cores busy: the condition for measuring pass costs.

A cost profile measured while a neighbour (another pod on the node, a test run, a hypervisor
stealing time) takes cores from the passes fails validation, or worse, looks valid and prices
passes by the neighbour's schedule. So the profile is measured only when the cores this
process may run on are free of other work. Linux counts each core's busy, idle and stolen time
in `/proc/stat`; what this process used itself (`time.process_time`, all its threads) is
subtracted, so a pass of our own never makes the machine look busy. Where there is no
`/proc/stat` the machine is taken as quiet and the profile's own validation is the only guard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

# other work is judged over at least this long (one sample of /proc/stat per window)
WINDOW_SECONDS = 1.0
SLACK_CORES = 0.3  # other work using less than this much of the cores the passes need is quiet
STAT = Path("/proc/stat")
# idle, iowait; every other field of a `cpuN` line is time the core was not ours to use
IDLE_FIELDS = (3, 4)


def read_busy_seconds(cores: set[int], stat: Path = STAT) -> float | None:
    """Seconds the `cores` spent busy so far (stolen time included), summed over them; None
    where `stat` cannot be read."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy_ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
            continue
        # guest time is counted within user time already
        fields = [int(v) for v in rest.split()[:8]]
        busy_ticks += sum(fields) - sum(fields[i] for i in IDLE_FIELDS)
    return busy_ticks / os.sysconf("SC_CLK_TCK")


def own_cores() -> set[int]:
    """The cores this process may run on (a container's cpuset, a `taskset`)."""
    return (
        set(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else set(range(os.cpu_count() or 1))
    )


class MachineLoad:
    """How many cores other work kept busy over the last window: `quiet(threads)` when at
    least `threads` of this process's cores were free of it."""

    def __init__(
        self,
        busy_seconds: Callable[[], float | None] | None = None,
        own_cpu: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        cores: int | None = None,
    ) -> None:
        allowed = own_cores()
        self.cores = len(allowed) if cores is None else cores
        self._busy_seconds = busy_seconds or (lambda: read_busy_seconds(allowed))
        self._own_cpu = own_cpu
        self._clock = clock
        self._last = self._sample()
        self.others_cores: float | None = None  # over the last complete window; None: not known yet

    def _sample(self) -> tuple[float, float, float | None]:
        return self._clock(), self._own_cpu(), self._busy_seconds()

    def update(self) -> None:
        """Close the window if it is `WINDOW_SECONDS` old (cheap to call every few ms)."""
        now = self._clock()
        if now - self._last[0] < WINDOW_SECONDS:
            return
        sample = self._sample()
        (then, own_then, busy_then), (_, own_now, busy_now) = self._last, sample
        self._last = sample
        if busy_then is None or busy_now is None:
            self.others_cores = 0.0  # nothing to read: taken as quiet (see the module's docstring)
            return
        others = (busy_now - busy_then) - (own_now - own_then)
        self.others_cores = max(others, 0.0) / (now - then)

    def quiet(self, threads: int) -> bool:
        """Other work left at least `threads` cores (of this process's) free over the last
        window."""
        self.update()
        if self.others_cores is None:
            return False
        return self.others_cores <= max(self.cores - threads, 0) + SLACK_CORES
