"""The step's timer: learning after the pass is drafting time, graph recordings are told apart."""

from __future__ import annotations

import pytest

from service.engine import timing
from service.engine.timing import StepTimer


def test_learning_after_the_pass_moves_from_forward_to_drafting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # start, drafted, passed, learn in/out, verified
    clock = iter([10.0, 10.5, 11.5, 11.7, 11.9, 12.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    timer = StepTimer()
    timer.mark_drafted(capture_seconds=3.0)
    timer.mark_passed(capture_seconds=3.0)
    with timer.learning():
        pass
    timer.mark_verified()
    assert timer.seconds == pytest.approx(2.0)
    assert timer.pass_seconds == pytest.approx(1.0)
    assert timer.draft_seconds == pytest.approx(
        0.5 + 0.2
    )  # before the pass, and the learning after it
    assert timer.forward_seconds == pytest.approx(
        1.5 - 0.2
    )  # the pass and verification, less the learning
    assert timer.capture_seconds == 0.0


def test_a_recording_during_the_pass_is_counted_apart() -> None:
    timer = StepTimer()
    timer.mark_drafted(capture_seconds=1.0)
    timer.mark_passed(capture_seconds=1.25)
    assert timer.capture_seconds == pytest.approx(0.25)
