"""Server-wide figures for the web page's live panel (`GET /v1/speculation/status`): tokens per
second over the last seconds, and drafted and accepted tokens by strategy since the start.

Prometheus keeps the same counts for dashboards; these are read back as plain numbers without
a scrape, and fed by the same calls (app/metrics.py): steps from the engine's thread, rounds
from the event loop, hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

from service.engine.outputs import RoundOutput, StepStats

WINDOW_SECONDS = 10.0  # the tokens-per-second figure counts the passes that ended this recently


class LiveStats:
    """What the server committed lately and what its strategies drafted and got accepted."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS) -> None:
        self.window_seconds = window_seconds
        self._lock = threading.Lock()
        self._steps: deque[tuple[float, int]] = deque()  # (when, tokens committed)
        self._drafted: Counter[str] = Counter()
        self._accepted: Counter[str] = Counter()

    def record_step(self, stats: StepStats) -> None:
        now = time.monotonic()
        with self._lock:
            self._steps.append((now, stats.committed_tokens))
            self._forget(now)

    def record_round(self, output: RoundOutput) -> None:
        with self._lock:
            self._drafted.update(output.drafted_by_strategy)
            self._accepted.update(output.accepted_strategies)

    def tokens_per_second(self) -> float:
        """Tokens committed per second over the window (0 when idle)."""
        with self._lock:
            self._forget(time.monotonic())
            return sum(tokens for _, tokens in self._steps) / self.window_seconds

    def acceptance(self) -> list[dict[str, Any]]:
        """Per strategy that drafted: its tree nodes, those accepted and their ratio."""
        with self._lock:
            return [
                {
                    "strategy": strategy,
                    "drafted": drafted,
                    "accepted": self._accepted[strategy],
                    "rate": self._accepted[strategy] / drafted if drafted else 0.0,
                }
                for strategy, drafted in sorted(self._drafted.items())
            ]

    def _forget(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_seconds:
            self._steps.popleft()
