"""`ngrammys neighbour`: the server beside a CPU neighbour, as in Kubernetes, where other pods
on the node are the normal case.

Against one server (its cost profile ready): auto vs off on a copy-heavy prompt; then busy
processes take the machine's cores for a while the server serves auto requests and as long
while it is idle (where a server measures its profile again if it believes it drifted); then,
the neighbours gone, auto vs off again. Reported: the server's CPU seconds while idle beside
the neighbours (profiling is all it does then), the cost profile's state from /health, and
the auto/off ratios before and after in the same run. The suffix index of a server started
here is off, so a repeated prompt's earlier answer is not drafted whole for whichever mode
runs later.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.bench.loadtest import wait_warm

PARAGRAPH = (
    "The committee met on Tuesday to review the budget. It approved the new library, postponed the "
    "bridge repairs until spring, and asked the treasurer for a report on the water rates "
    "before the next "
    "meeting. The treasurer said the report would be ready by the end of the month."
)
COPY = [{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"}]


@dataclass(frozen=True)
class Speeds:
    """Tokens a second of the copy prompt, the mean over the runs of each mode."""

    off: float
    auto: float

    @property
    def ratio(self) -> float:
        return self.auto / self.off


def copy_speeds(base: str, max_tokens: int, repeats: int = 2) -> Speeds:
    """Off and auto on the copy prompt, alternating (off, auto, auto, off, ...) so drift hits both
    alike."""
    runs: dict[str, list[float]] = {"off": [], "auto": []}
    for index in range(repeats):
        for mode in ("off", "auto") if index % 2 == 0 else ("auto", "off"):
            runs[mode].append(_tokens_per_second(base, mode, max_tokens))
    return Speeds(*(sum(runs[mode]) / len(runs[mode]) for mode in ("off", "auto")))


def _tokens_per_second(base: str, mode: str, max_tokens: int) -> float:
    body = {
        "messages": COPY,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "speculation": {"mode": mode},
    }
    started = time.perf_counter()
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600).json()
    return reply["usage"]["completion_tokens"] / (time.perf_counter() - started)


def _spin(until: float) -> None:
    while time.monotonic() < until:
        pass


@contextmanager
def neighbours(count: int, seconds: float) -> Iterator[None]:
    """`count` processes each keeping a core busy for up to `seconds` (stopped on leaving)."""
    until = time.monotonic() + seconds
    workers = [
        multiprocessing.Process(target=_spin, args=(until,), daemon=True) for _ in range(count)
    ]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        for worker in workers:
            worker.terminate()
            worker.join()


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(base: str, pid: int, count: int, seconds: float, max_tokens: int, log=print) -> dict:
    """The whole benchmark against the server at `base` (process `pid`); its figures."""
    for mode in ("off", "auto"):  # warm-up: a server's first requests compile and allocate
        _tokens_per_second(base, mode, max_tokens)
    before = copy_speeds(base, max_tokens)
    log(
        f"before: off {before.off:.1f} tok/s, auto {before.auto:.1f} tok/s, "
        f"auto/off {before.ratio:.2f}"
    )
    with neighbours(count, 2 * seconds):
        serving_until = time.monotonic() + seconds
        served = 0
        while time.monotonic() < serving_until:
            _tokens_per_second(base, "auto", max_tokens)
            served += 1
        log(
            f"served {served} auto requests beside {count} busy processes; "
            f"now idle beside them for {seconds:.0f} s"
        )
        cpu_idle = process_cpu_seconds(pid)
        time.sleep(max(serving_until + seconds - time.monotonic(), 0.0))
        cpu_idle = process_cpu_seconds(pid) - cpu_idle
    time.sleep(5)  # the machine quiet again
    health = httpx.get(f"{base}/health", timeout=10).json()
    after = copy_speeds(base, max_tokens)
    log(
        f"after: off {after.off:.1f} tok/s, auto {after.auto:.1f} tok/s, auto/off {after.ratio:.2f}"
    )
    return {
        "server_cpu_seconds_idle_beside_neighbours": cpu_idle,
        "health": health,
        "before": {"off": before.off, "auto": before.auto, "ratio": before.ratio},
        "after": {"off": after.off, "auto": after.auto, "ratio": after.ratio},
    }


def run_command(
    server: AbstractContextManager[str],
    pid: Callable[[], int],
    count: int,
    seconds: float,
    max_tokens: int,
    json_path: Path | None,
) -> None:
    """`ngrammys neighbour`: the benchmark against the server `server` yields, once its cost
    profile and tables exist (`pid()`: its process id, known once it runs); the figures printed
    as JSON."""
    with server as base:
        wait_warm(base, True)
        figures = run(base, pid(), count, seconds, max_tokens)
    print(json.dumps(figures, indent=2))
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2))
