"""Batch priority through the engine: it changes when a request runs, never what it generates.
(The admission rules themselves: tests/service/engine/test_scheduler.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from service.engine.params import GenerationParams
from service.engine.request import Status
from tests.helpers.batch import LENGTHS, MODES, PROMPTS
from tests.helpers.engines import make_engine, reference_greedy


@pytest.mark.parametrize("priced", [True, False])
def test_batch_requests_generate_the_greedy_tokens_interactive_ones_do(
    tiny_model, tiny_runner, tiny_tables, priced: bool
) -> None:
    """Two interactive requests and three batch ones, every speculation mode. Priced as a device
    where a row more costs next to nothing, the batch rows run beside the interactive ones;
    unpriced, each waits until no interactive request runs."""
    engine = make_engine(tiny_runner, tiny_tables)
    if not priced:
        engine.scheduler.profile = None  # auto rows still price their trees (the policy's)
    params = [GenerationParams(n, speculation=s) for n, s in zip(LENGTHS, MODES)]
    interactive = [engine.add_request(p, q) for p, q in zip(PROMPTS[:2], params[:2])]
    batch = [
        engine.add_request(p, dataclasses.replace(q, priority="batch"))
        for p, q in zip(PROMPTS[2:], params[2:])
    ]
    beside = False
    while engine.has_work:
        engine.step()
        interactive_running = any(r.status is Status.RUNNING for r in interactive)
        beside |= interactive_running and any(r.status is Status.RUNNING for r in batch)
    assert beside is priced
    for request, prompt, length in zip([*interactive, *batch], PROMPTS, LENGTHS):
        assert request.finish_reason == "length"
        assert request.output_ids == reference_greedy(tiny_model, prompt, length)
