"""Generations that reach the model's last position or cross a KV buffer growth point.

A speculation tree's node at depth d sits at position context_length - 1 + d, so near the
end of the context a deep tree would ask the model for positions it has no embedding for;
and the KV buffers are reallocated (and copied) when a row outgrows them. Both must leave
the output exactly plain greedy decoding's.
"""

from __future__ import annotations

import pytest
import torch

from drafting import Mixer, TableSlot, default_mixer
from service.controller.profiler import measure_profile
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.model.kv_cache import INITIAL_CAPACITY
from service.model.runner import ModelRunner
from tests.helpers.engines import OracleDrafter, reference_greedy
from tests.helpers.models import make_tiny_model


class PositionGuard:
    """Fails any pass that gives the model a position id it has no embedding for (Llama's
    rotary embedding would silently extrapolate). It watches the rotary embedding, which
    every pass calls (the lean decoder pass and transformers' own forward alike)."""

    def __init__(self, model) -> None:
        self.limit = model.config.max_position_embeddings
        self.highest = -1
        model.base_model.rotary_emb.register_forward_pre_hook(self._check, with_kwargs=True)

    def _check(self, module, args, kwargs) -> None:
        highest = int(kwargs["position_ids"].max())
        assert highest < self.limit, (
            f"position {highest} passed to a model of {self.limit} positions"
        )
        self.highest = max(self.highest, highest)


def guarded_engine(
    max_positions: int, tables: TableSlot | None = None
) -> tuple[Engine, PositionGuard, torch.nn.Module]:
    """An engine over its own tiny model (the hook stays on it), of `max_positions` positions."""
    model = make_tiny_model()
    model.config.max_position_embeddings = max_positions
    guard = PositionGuard(model)
    engine = Engine(
        ModelRunner(model), default_mixer(tables), eos_token_ids=[], max_context=max_positions
    )
    return engine, guard, model


@pytest.mark.parametrize("mode", ["fixed", "auto"])
def test_trees_never_reach_past_the_last_position(mode: str) -> None:
    model = make_tiny_model()
    model.config.max_position_embeddings = 64
    guard = PositionGuard(model)
    prompt = [5, 9, 13, 2, 7, 7, 30, 41] * 6
    new_tokens = 64 - len(prompt)  # exactly to the end of the context
    truth = reference_greedy(model, prompt, new_tokens)
    # drafts as deep as w that are always right: without a cap the last trees would run past the end
    drafter = OracleDrafter(prompt, truth + [0] * 8, seed=1)
    engine = Engine(ModelRunner(model), Mixer([drafter]), eos_token_ids=[], max_context=64)
    # auto mode speculates as deep as it may where passes are nearly free, as the tiny model's
    # are: its costs as measured (on a twin without the guard: the profiler's passes run past
    # position 64). A flat profile of made-up seconds left the pass-cost calibration pricing
    # tree sizes it had not seen yet at the prompt pass's ratio, and trees stopped.
    engine.profile, _ = measure_profile(
        ModelRunner(make_tiny_model()), rows=(1,), context_lengths=(32, 64), repeats=3
    )
    params = GenerationParams(
        new_tokens, speculation=SpeculationParams(4, 8, mode), strategy="oracle"
    )
    guard.highest = -1  # the engine's passes only, not the reference decode's
    completion = engine.complete(prompt, params)
    assert completion.token_ids == truth
    assert completion.num_accepted_tokens > new_tokens // 2
    assert guard.highest == 62  # the last token's root; the token it yields needs no position


def test_outputs_cross_the_kv_growth_point_and_reach_the_context_end(tiny_tables) -> None:
    """Rows of different lengths outgrow the initial buffer in different passes, in one batch."""
    max_context = 2 * INITIAL_CAPACITY
    engine, guard, model = guarded_engine(max_context, tiny_tables)
    prompts = [
        [7, 8, 9, 10] * 56,  # 224 tokens: crosses INITIAL_CAPACITY while generating
        list(range(2, 60)) * 4,  # 232
        [5, 9, 13, 2, 7, 7, 30, 41] * 55,  # 440: ends on the model's last position
        [11, 12],
    ]
    lengths = [48, 40, max_context - 440, 30]
    shapes = [
        SpeculationParams(4, 6),
        SpeculationParams(0, 0, "off"),
        SpeculationParams(6, 8),
        SpeculationParams(2, 3),
    ]
    requests = [
        (p, GenerationParams(n, speculation=s)) for p, n, s in zip(prompts, lengths, shapes)
    ]
    completions = engine.complete_many(requests)
    assert guard.highest == max_context - 2  # the engine's passes (before the reference decodes)
    for (prompt, params), completion in zip(requests, completions):
        assert completion.token_ids == reference_greedy(model, prompt, params.max_new_tokens)
    assert sum(c.num_accepted_tokens for c in completions) > 0
