"""Where a step's time goes: drafting (what plain decoding does not do), the pass, and the
verification and KV commit after it.

Learning from the pass (scoring drafts against the committed tokens, the successor tables'
refresh from the pass's top tokens) runs after the pass but is drafting work, so it is timed
apart (`learning`) and moved from the forward part to the drafting part.
"""

from __future__ import annotations

import time
from types import TracebackType


class StepTimer:
    """The marks of one step; read once the step is verified."""

    __slots__ = (
        "started",
        "drafted",
        "passed",
        "verified",
        "learn_seconds",
        "_capture_before",
        "_capture_after",
        "_learn_began",
    )

    def __init__(self) -> None:
        self.started = self.drafted = self.passed = self.verified = time.perf_counter()
        self.learn_seconds = 0.0
        self._capture_before = self._capture_after = 0.0
        self._learn_began = 0.0

    def mark_drafted(self, capture_seconds: float) -> None:
        """`capture_seconds`, here and after the pass: the runner's CUDA-graph recording time so
        far (recording a new pass shape is a one-off, told apart from the pass's own time)."""
        self.drafted = time.perf_counter()
        self._capture_before = self._capture_after = capture_seconds

    def mark_passed(self, capture_seconds: float) -> None:
        self.passed = time.perf_counter()
        self._capture_after = capture_seconds

    def mark_verified(self) -> None:
        self.verified = time.perf_counter()

    def learning(self) -> StepTimer:
        """`with timer.learning(): ...` books the block as drafting time."""
        return self

    def __enter__(self) -> None:
        self._learn_began = time.perf_counter()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.learn_seconds += time.perf_counter() - self._learn_began

    @property
    def seconds(self) -> float:
        return self.verified - self.started

    @property
    def draft_seconds(self) -> float:
        """Planning and drafting before the pass, and learning after it."""
        return self.drafted - self.started + self.learn_seconds

    @property
    def forward_seconds(self) -> float:
        """The pass, verification and the KV commit (shared by the step's batch)."""
        return self.verified - self.drafted - self.learn_seconds

    @property
    def pass_seconds(self) -> float:
        return self.passed - self.drafted

    @property
    def capture_seconds(self) -> float:
        return self._capture_after - self._capture_before
