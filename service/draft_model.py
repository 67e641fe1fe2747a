"""A draft strategy that runs a causal LM: a separate small model, or the target's own first
layers (`service/self_draft.py`).

Each round it drafts a small tree, not one chain: the draft's top-k tokens after the context
are the k branches, then every branch grows greedily, all k in one pass per depth (each
query sees the context and its own branch only: `DraftCache.tree_mask`). So a round costs w
draft passes whatever k is. Each request keeps its own `DraftCache`, synced to the
request's history before drafting (accepted draft tokens kept, the rest rolled back).

Requests are drafted one after another (the engine asks each request's session in turn);
batching the draft passes across requests is left for later. The measured seconds per
drafted token are exposed as `seconds_per_token`, which the mixer hands to the controller so
that a slow draft pays for its own time (`service/regime.py`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from drafting import Draft, TokenHistory
from service.draft_cache import DraftCache
from service.draft_checks import check_draft
from service.model_loader import LoadedModel
from service.self_draft import first_layers

COST_SMOOTHING = 0.2  # weight of the newest round in the running seconds-per-token estimate


class ModelDrafter:
    """Strategy `name`: a causal LM's top-k first tokens, each continued greedily to w tokens."""

    def __init__(self, model: PreTrainedModel, name: str, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.name = name
        # proposals stay inside the target's vocabulary (a draft's may be padded larger)
        self.vocab_size = min(vocab_size or model.config.vocab_size, model.config.vocab_size)
        self.seconds_per_token = 0.0  # measured; 0 until the first round
        self._caches: weakref.WeakKeyDictionary[TokenHistory, DraftCache] = weakref.WeakKeyDictionary()

    def cache_for(self, history: TokenHistory) -> DraftCache:
        """The request's draft cache (it lives as long as the request's history)."""
        cache = self._caches.get(history)
        if cache is None:
            cache = self._caches[history] = DraftCache(self.model.config)
        return cache

    @torch.inference_mode()
    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        if k <= 0 or w <= 0:
            return []
        started = time.perf_counter()
        cache = self.cache_for(history)
        logits = self._feed(cache, cache.sync(history.token_ids))  # [vocab]
        branches = [[int(t)] for t in logits[: self.vocab_size].topk(k).indices]
        for depth in range(2, w + 1):
            logits = self._grow(cache, [b[-1] for b in branches], depth)  # [k, vocab]
            for branch, token in zip(branches, logits[:, : self.vocab_size].argmax(-1).tolist()):
                branch.append(token)
        cache.record_tree([b[:-1] for b in branches])  # the deepest tokens were never fed
        self._observe_cost(time.perf_counter() - started, k * w)
        return [Draft(tuple(b), self.name, rank) for rank, b in enumerate(branches)]

    def _feed(self, cache: DraftCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Append committed tokens; the next-token logits after the last one."""
        start = cache.length
        positions = torch.arange(start, start + len(token_ids), device=self.model.device)
        out = self.model(
            input_ids=torch.tensor([list(token_ids)], device=self.model.device), past_key_values=cache.kv,
            use_cache=True, position_ids=positions[None], cache_position=positions, logits_to_keep=1,
        )
        cache.token_ids.extend(token_ids)
        return out.logits[0, -1]

    def _grow(self, cache: DraftCache, last: list[int], depth: int) -> torch.Tensor:
        """Feed each branch's newest token (at depth - 1); their next-token logits [k, vocab]."""
        width, committed = len(last), len(cache.token_ids)
        mask = cache.tree_mask(width, depth - 1, self.model.dtype, self.model.device)
        slots = torch.arange(cache.length, cache.length + width, device=self.model.device)
        positions = torch.full((1, width), committed + depth - 2, device=self.model.device)
        out = self.model(
            input_ids=torch.tensor([last], device=self.model.device), past_key_values=cache.kv, use_cache=True,
            attention_mask=mask, position_ids=positions, cache_position=slots,
            logits_to_keep=width,
        )
        return out.logits[0]

    def _observe_cost(self, seconds: float, tokens: int) -> None:
        per_token = seconds / tokens
        if self.seconds_per_token == 0.0:
            self.seconds_per_token = per_token
        else:
            self.seconds_per_token += COST_SMOOTHING * (per_token - self.seconds_per_token)


@dataclass(frozen=True)
class DraftSetup:
    """Which model-running drafts to serve: self-drafts at these depths, and a draft model."""

    self_draft_layers: tuple[int, ...] = ()
    draft_model: LoadedModel | None = None


def model_drafters(target: LoadedModel, setup: DraftSetup) -> list[ModelDrafter]:
    """The drafters of `setup` for `target` (raises `IncompatibleDraft` for an unfit draft).

    One self-draft is named `self_draft`; several (to compare depths) `self_draft_<m>`."""
    vocab_size = target.model.config.vocab_size
    drafters = [
        ModelDrafter(first_layers(target.model, m), "self_draft" if len(setup.self_draft_layers) == 1
                     else f"self_draft_{m}", vocab_size)
        for m in setup.self_draft_layers
    ]
    if setup.draft_model is not None:
        draft = setup.draft_model
        check_draft(target.model, draft.model, target.tokenizer, draft.tokenizer)
        drafters.append(ModelDrafter(draft.model, "draft_model", vocab_size))
    return drafters
