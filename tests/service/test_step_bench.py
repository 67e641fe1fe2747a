"""`ngrammys steps`: engine steps over C requests, off against auto, timed in process."""

from __future__ import annotations

import pytest

from app.cli import main
from drafting import default_mixer
from service.engine import Engine
from service.model_runner import ModelRunner
from service.step_bench import run_step_bench, run_steps
from tests.conftest import make_tiny_model
from tests.service.test_bench import write_dataset
from tests.service.test_regime import MEMORY_BOUND

PROMPTS = [[5, 9, 13, 2, 7, 7, 30, 41], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], list(range(2, 40))]


def new_engine() -> Engine:
    engine = Engine(ModelRunner(make_tiny_model(seed=5)), default_mixer(None), eos_token_ids=[], max_context=512)
    engine.profile = MEMORY_BOUND  # a device where trees are nearly free: auto speculates
    return engine


def test_a_run_decodes_every_request_to_the_end_and_splits_its_step_time() -> None:
    off, auto = (run_steps(new_engine(), PROMPTS, 4, mode, 12, 4, 3) for mode in ("off", "auto"))
    assert off.tokens == auto.tokens == 4 * 12  # the prompts cycled over 4 requests, none stops early
    assert off.steps >= 12 >= auto.steps
    for run in (off, auto):
        assert 0 <= run.draft_seconds < run.step_seconds <= run.seconds
    assert auto.draft_seconds > off.draft_seconds  # plain decoding neither plans nor drafts


def test_each_concurrency_runs_both_modes_in_alternating_order() -> None:
    seen = []
    runs = run_step_bench(new_engine, PROMPTS, [1, 3], 6, 2, 2, repeats=2, progress=seen.append)
    assert [(r.concurrency, r.mode) for r in runs] == [
        (1, "off"), (1, "auto"), (1, "auto"), (1, "off"), (3, "off"), (3, "auto"), (3, "auto"), (3, "off")]
    assert seen == runs and all(r.tokens == r.concurrency * 6 for r in runs)


@pytest.mark.slow
def test_the_command_prints_a_row_a_run_and_the_ratios(tmp_path, capsys, embedded) -> None:
    main(["steps", "--dataset", write_dataset(tmp_path), "--per-category", "1", "--concurrency", "2",
          "--max-new-tokens", "4", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert "| 2 | off |" in printed and "| 2 | auto |" in printed
    assert "| C | off tokens/s | auto tokens/s | auto/off |" in printed
