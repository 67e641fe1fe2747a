"""`ngrammys steps`: engine steps over C requests, off against auto, timed in process."""

from __future__ import annotations

import time

import pytest

from app.cli import main
from drafting import RequestDrafts, default_mixer
from service.bench.step_bench import run_step_bench, run_steps
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.engine.scheduler import SchedulerConfig
from service.model.runner import ModelRunner
from tests.helpers.bench import write_dataset
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.models import make_tiny_model

PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 41], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], list(range(2, 40))]
SLOW_SCORING = 0.05  # seconds a round's scoring takes in the test that slows it down


def new_engine() -> Engine:
    engine = Engine(
        ModelRunner(make_tiny_model(seed=5)), default_mixer(None), eos_token_ids=[], max_context=512
    )
    engine.profile = MEMORY_BOUND  # a device where trees are nearly free: auto speculates
    return engine


def test_a_run_decodes_every_request_to_the_end_and_splits_its_step_time() -> None:
    off, auto = (
        run_steps(new_engine(), PROMPTS, 4, mode, 12, 4, 3, requests_per_slot=2)
        for mode in ("off", "auto")
    )
    assert off.tokens == auto.tokens == 8 * 12  # 8 requests (the prompts cycled), none stops early
    assert (
        off.steps >= 2 * 12 >= auto.steps
    )  # 4 in flight at a time: at least two rounds of 12 steps
    for run in (off, auto):
        assert 0 <= run.draft_seconds < run.step_seconds <= run.seconds
        assert (
            0 < run.pass_seconds < run.step_seconds - run.draft_seconds
        )  # verification takes the rest
        assert (
            2.5 < run.rows / run.steps <= 4
        )  # C=4 in the pass, fewer only as the last requests end
    assert auto.draft_seconds > off.draft_seconds  # plain decoding neither plans nor drafts


def test_scoring_the_candidates_counts_as_drafting_not_as_the_pass(monkeypatch) -> None:
    """Scoring a round's candidates against what was committed runs after the pass, but it is
    the drafting layer's work: a slow scorer shows in each round's draft time."""
    scored = RequestDrafts.observe

    def slow_observe(self: RequestDrafts, committed) -> None:
        time.sleep(SLOW_SCORING)
        scored(self, committed)

    monkeypatch.setattr(RequestDrafts, "observe", slow_observe)
    engine = new_engine()
    completion = engine.complete(
        PROMPTS[0], GenerationParams(max_new_tokens=6, speculation=SpeculationParams(2, 2))
    )
    assert completion.draft_seconds >= completion.num_passes * SLOW_SCORING
    assert completion.forward_seconds < completion.num_passes * SLOW_SCORING


def test_each_concurrency_runs_both_modes_in_alternating_order() -> None:
    seen = []
    runs = run_step_bench(
        new_engine, PROMPTS, [1, 3], 6, 2, 2, repeats=2, requests_per_slot=3, progress=seen.append
    )
    assert [(r.concurrency, r.mode) for r in runs] == [
        (1, "off"),
        (1, "auto"),
        (1, "auto"),
        (1, "off"),
        (3, "off"),
        (3, "auto"),
        (3, "auto"),
        (3, "off"),
    ]
    assert seen == runs and all(r.tokens == r.concurrency * 3 * 6 for r in runs)
    assert all(r.steps >= 3 * 6 for r in runs if r.mode == "off")  # never more than C in flight


@pytest.mark.slow
def test_the_command_prints_a_row_a_run_and_the_ratios(tmp_path, capsys, embedded) -> None:
    # C=17 is past the scheduler's default of 16 running requests:
    # the command sizes its engines to C
    main(
        [
            "steps",
            "--dataset",
            write_dataset(tmp_path),
            "--per-category",
            "1",
            "--concurrency",
            "17",
            "--max-new-tokens",
            "4",
            "--repeats",
            "1",
            "--requests-per-slot",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert "| 17 | off |" in printed and "| 17 | auto |" in printed
    assert (
        "| rows/step |" in printed
        and "| pass ms |" in printed
        and "| verify+commit ms |" in printed
    )
    assert "| C | off tokens/s | auto tokens/s | auto/off |" in printed


def test_a_run_refuses_an_engine_that_would_queue_part_of_its_batch() -> None:
    """C=64 on an engine running 16 at a time would time 16-row passes under C=64's name."""
    small = Engine(
        ModelRunner(make_tiny_model(seed=5)),
        default_mixer(None),
        eos_token_ids=[],
        max_context=512,
        scheduler_config=SchedulerConfig(max_running_requests=2),
    )
    with pytest.raises(ValueError, match="C=3"):
        run_steps(small, PROMPTS, 3, "off", 4, 4, 3)
