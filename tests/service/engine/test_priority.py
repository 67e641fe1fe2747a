"""Batch priority through the engine: it changes when a request runs, never what it generates.
(The admission rules themselves: tests/service/engine/test_scheduler.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from service.engine.params import GenerationParams, SamplingParams
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
    engine = make_engine(tiny_runner, tiny_tables, batch_idle_seconds=0.0)
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


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preempted_batch_requests_generate_what_they_would_have(
    tiny_model, tiny_runner, tiny_tables, prefix_cache: bool, temperature: float
) -> None:
    """Three batch requests run a few steps, then interactive ones arrive and (unpriced) take
    the batch rows' places; the batch requests come back, recompute their prompt and output
    (from the prefix cache's blocks, or all of it without one) and go on: greedy, the plain
    reference's tokens; seeded sampling, the tokens the same requests draw never preempted."""

    def run(preempted: bool) -> list[list[int]]:
        engine = make_engine(
            tiny_runner, tiny_tables, prefix_cache=prefix_cache, batch_idle_seconds=0.0
        )
        engine.scheduler.profile = None
        batch = [
            engine.add_request(p, dataclasses.replace(q, priority="batch"))
            for p, q in zip(PROMPTS[2:], params[2:])
        ]
        for _ in range(3):
            engine.step()
        if preempted:
            for prompt, length in zip(PROMPTS[:2], LENGTHS[:2]):
                engine.add_request(prompt, GenerationParams(length))
        while engine.has_work:
            engine.step()
        assert all(r.preemptions == int(preempted) for r in batch)
        assert all(r.finish_reason == "length" for r in batch)
        return [r.output_ids for r in batch]

    params = [
        GenerationParams(n, speculation=s, sampling=SamplingParams(temperature, seed=7 + i))
        for i, (n, s) in enumerate(zip(LENGTHS, MODES))
    ]
    outputs = run(preempted=True)
    if temperature == 0.0:
        for output, prompt, length in zip(outputs, PROMPTS[2:], LENGTHS[2:]):
            assert output == reference_greedy(tiny_model, prompt, length)
    else:
        assert outputs == run(preempted=False)
