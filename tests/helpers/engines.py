"""Engines over the tiny model, the prompts the lossless tests decode, and the references they
must equal: plain greedy decoding with no cache code, and a drafter that knows the answer."""

from __future__ import annotations

import torch

from drafting import Draft, TableSlot, TokenHistory, default_mixer
from service.engine.engine import Engine
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


def make_engine(runner: ModelRunner, tables: TableSlot, **limits: int) -> Engine:
    """An engine with the scheduler's `limits`, priced as a device where trees are nearly free (so
    auto rows speculate), with no EOS stop (every run goes its full length)."""
    engine = Engine(runner, default_mixer(tables), eos_token_ids=[], max_context=512,
                    scheduler_config=SchedulerConfig(**limits))
    engine.profile = MEMORY_BOUND
    return engine
