"""How much other work keeps this machine's cores busy, and whether that load holds steady:
the condition for measuring pass costs.

The controller trades on *relative* pass costs (a 16-token pass against a 1-token pass). A
neighbour that takes the same share of the cores all along (another pod on the node, a test
run, a hypervisor's steady steal) slows every size alike, so it cancels out of those ratios;
one that starts, stops or swings while a profile is measured bends them, since it hits some
sizes and not others. So a measurement starts once the load of other work has held within
`LOAD_CHANGE_CORES` for `STEADY_WINDOWS` windows, at whatever level, and is abandoned if it
leaves that band. Linux counts each core's busy, idle and stolen time in `/proc/stat`; what
this process used itself (`time.process_time`, all its threads) is subtracted, so a pass of our
own never makes the load look changed. Work at a lower priority than this process (`nice`)
is not counted: the scheduler gives it what our threads leave. Where there is no `/proc/stat`
the load counts as steady and the profile's own validation is the only guard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

# other work is judged over at least this long (one sample of /proc/stat per window)
WINDOW_SECONDS = 1.0
# other work whose windows stay within this many cores of each other holds steady
LOAD_CHANGE_CORES = 0.5
STEADY_WINDOWS = 3  # windows of a steady load before a measurement may start
STAT = Path("/proc/stat")
# idle, iowait; every other field of a `cpuN` line is time the core was not ours to use
IDLE_FIELDS = (3, 4)
NICE_FIELD = 1  # time in processes of a raised niceness


def read_busy_seconds(cores: set[int], stat: Path = STAT) -> float | None:
    """Seconds the `cores` spent busy so far (stolen time included, work niced below this
    process's not), summed over them; None where `stat` cannot be read."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    # work niced below ours yields the cores to us; were we niced, it competes like any other
    free = (*IDLE_FIELDS, NICE_FIELD) if os.getpriority(os.PRIO_PROCESS, 0) <= 0 else IDLE_FIELDS
    busy_ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
            continue
        # guest time is counted within user time already
        fields = [int(v) for v in rest.split()[:8]]
        busy_ticks += sum(fields) - sum(fields[i] for i in free)
    return busy_ticks / os.sysconf("SC_CLK_TCK")


def own_cores() -> set[int]:
    """The cores this process may run on (a container's cpuset, a `taskset`)."""
    return (
        set(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else set(range(os.cpu_count() or 1))
    )


class MachineLoad:
    """How many cores other work kept busy over the last window (`others_cores`), and for how
    many windows in a row it has held within `LOAD_CHANGE_CORES` (`steady`)."""

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
        self.changes = 0  # times the load left its band (a new steady stretch began)
        self._band: tuple[float, float] | None = None  # lowest and highest of the stretch
        self._stretch = 0  # windows in the current stretch

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
            others = 0.0  # nothing to read: a steady, empty load (see the module's docstring)
        else:
            others = max((busy_now - busy_then) - (own_now - own_then), 0.0) / (now - then)
        self.others_cores = others
        low, high = self._band or (others, others)
        low, high = min(low, others), max(high, others)
        if high - low > LOAD_CHANGE_CORES:
            self.changes += 1
            low = high = others
            self._stretch = 0
        self._band, self._stretch = (low, high), self._stretch + 1

    def steady(self) -> bool:
        """Other work's load has held within `LOAD_CHANGE_CORES` for the last `STEADY_WINDOWS`
        windows or more."""
        self.update()
        return self._stretch >= STEADY_WINDOWS
