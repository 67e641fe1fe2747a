"""Engines over the tiny model, the prompts the lossless tests decode, and the references they
must equal: plain decoding with no cache code (greedy, or with logit controls adjusting token by
token), and a drafter that knows the answer."""

from __future__ import annotations

from collections import Counter

import torch

from drafting import Draft, TableSlot, TokenHistory, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.sampling import PositionUniforms, choose_tokens
from service.engine.scheduler import SchedulerConfig
from service.model.runner import ModelRunner
from tests.helpers.costs import MEMORY_BOUND

PROMPTS = [
    [5, 9, 13, 2, 7, 7, 30, 41],
    [3, 4, 5, 6, 3, 4, 5, 6, 3, 4],  # repetitive: context lookup has matches
    [11],  # a one-token prompt: nothing to prefill
    list(range(2, 60)),
]
NEW_TOKENS = 40


def reference_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Plain greedy decoding with a full recompute per token: no cache code involved."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def reference_adjusted_logits(
    logits: torch.Tensor, prompt: list[int], output: list[int], sampling: SamplingParams
) -> torch.Tensor:
    """One position's logits [vocab] after logit_bias and the penalties, token by token, as vLLM
    and OpenAI define them (`output`: the tokens generated before the position)."""
    out = logits.float().clone()
    for token, bias in sampling.logit_bias.items():
        out[token] += bias
    for token in set(prompt) | set(output):
        penalty = sampling.repetition_penalty
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    for token, count in Counter(output).items():
        out[token] -= sampling.frequency_penalty * count
        out[token] -= sampling.presence_penalty
    return out


def reference_decode(
    model, prompt: list[int], num_tokens: int, sampling: SamplingParams
) -> list[int]:
    """Plain decoding with a full recompute per token, each token's logits adjusted one token at
    a time (`reference_adjusted_logits`): no cache, tree or vectorised adjustment involved.
    Greedy takes the argmax; sampling the inverse CDF of the position's uniform, as the engine
    reads them."""
    ids = list(prompt)
    uniforms = None if sampling.greedy else PositionUniforms(sampling.seed)
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            # [1, vocab]
            adjusted = reference_adjusted_logits(logits, prompt, ids[len(prompt) :], sampling)[None]
            ids += choose_tokens(
                adjusted, sampling, None if uniforms is None else uniforms.at([len(ids)])
            )
    return ids[len(prompt) :]


class OracleDrafter:
    """Proposes the true continuation (known in advance) among decoys, cut to random lengths.

    Makes long accepted paths happen on a random model, so compaction is exercised deeply.
    """

    name = "oracle"

    def __init__(self, prompt: list[int], truth: list[int], seed: int) -> None:
        self.full = prompt + truth
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        true_next = self.full[len(history) : len(history) + w]
        cut = int(torch.randint(0, w + 1, (1,), generator=self.generator))
        decoys = [tuple(((t + 1 + j) % 64) for t in true_next) for j in range(k)]
        drafts = [tuple(true_next[:cut]) + d[cut:] for d in decoys]
        position = int(torch.randint(0, k, (1,), generator=self.generator))
        drafts[position] = tuple(true_next)
        return [Draft(d, self.name, rank) for rank, d in enumerate(drafts[:k]) if d]


def make_engine(runner: ModelRunner, tables: TableSlot, **limits: int | float | bool) -> Engine:
    """An engine with the scheduler's `limits`, priced as a device where trees are nearly free (so
    auto rows speculate), with no EOS stop (every run goes its full length)."""
    engine = Engine(
        runner,
        default_mixer(tables),
        eos_token_ids=[],
        max_context=512,
        scheduler_config=SchedulerConfig(**limits),
    )
    engine.profile = MEMORY_BOUND
    return engine


# the speculation settings the family tests decode with: off, fixed, and auto
SPECULATIONS = (
    SpeculationParams(),
    SpeculationParams(2, 2),
    SpeculationParams(4, 3),
    SpeculationParams(6, 5, mode="auto"),
)


def assert_decodes_as(
    engine: Engine,
    want: dict[tuple[int, ...], list[int]],
    new_tokens: int,
    speculations: tuple[SpeculationParams, ...] = SPECULATIONS,
) -> None:
    """`engine`'s greedy output of each prompt of `want` (two: the first alone, then both
    batched) equals what `want` says, with each of `speculations`."""
    first, second = want
    for speculation in speculations:
        params = GenerationParams(max_new_tokens=new_tokens, speculation=speculation)
        assert engine.complete(list(first), params).token_ids == want[first], speculation
        batched = engine.complete_many([(list(first), params), (list(second), params)])
        assert [r.token_ids for r in batched] == [want[first], want[second]]
