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
from pathlib import Path

import torch
from transformers import PreTrainedModel

from drafting import ContextNgram, Draft, TokenHistory, common_prefix
from service.draft_cache import DraftCache
from service.draft_checks import check_draft
from service.model_loader import LoadedModel, load_model
from service.self_draft import default_layers, first_layers

COST_SMOOTHING = 0.2  # weight of the newest round in the running seconds-per-token estimate


class ModelDrafter:
    """Strategy `name`: a causal LM's top-k first tokens, each continued greedily to w tokens."""

    def __init__(self, model: PreTrainedModel, name: str, vocab_size: int | None = None,
                 lookahead: ContextNgram | None = None) -> None:
        self.model = model.eval()
        self.name = name
        self.lookahead = lookahead  # staged: context n-gram guesses the draft's own chain
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
        fed = cache.sync(history.token_ids)
        logits = self._chain(cache, fed, logits_wanted=1)[-1]  # [vocab]
        cache.token_ids.extend(fed)
        firsts = logits[: self.vocab_size].topk(k).indices.tolist()
        if self.lookahead is None:
            branches = self._tree(cache, firsts, w)
            cache.record_tree([b[:-1] for b in branches])  # the deepest tokens were never fed
        else:
            chain = self._staged_chain(cache, history, firsts[0], w)
            branches = [chain, *([t] for t in firsts[1:])]
            cache.record_tree([chain[:-1]])
        self._observe_cost(time.perf_counter() - started, sum(map(len, branches)))
        return [Draft(tuple(b), self.name, rank) for rank, b in enumerate(branches)]

    def _tree(self, cache: DraftCache, firsts: list[int], w: int) -> list[list[int]]:
        """Every first token continued greedily to w tokens, all branches in one pass a depth."""
        branches = [[t] for t in firsts]
        for depth in range(2, w + 1):
            logits = self._grow(cache, [b[-1] for b in branches], depth)  # [k, vocab]
            for branch, token in zip(branches, logits[:, : self.vocab_size].argmax(-1).tolist()):
                branch.append(token)
        return branches

    def _staged_chain(self, cache: DraftCache, history: TokenHistory, first: int, w: int) -> list[int]:
        """The draft's greedy chain from `first`, several tokens a pass where the context
        n-gram guesses them: the draft verifies a guess the way the target verifies drafts."""
        assert self.lookahead is not None
        chain = [first]
        while len(chain) < w:
            guesses = self.lookahead.continuations(history, 1, w - len(chain), tail=chain)
            guess = list(guesses[0]) if guesses else []
            fed = [chain[-1], *guess]
            predicted = self._chain(cache, fed, len(fed))[:, : self.vocab_size].argmax(-1).tolist()
            accepted = common_prefix(guess, predicted)
            cache.truncate(cache.length - (len(guess) - accepted))  # entries of its rejected guesses
            chain += [*guess[:accepted], predicted[accepted]]
        cache.truncate(len(cache.token_ids) + w - 1)  # a last pass may overshoot w
        return chain[:w]

    def _chain(self, cache: DraftCache, token_ids: Sequence[int], logits_wanted: int) -> torch.Tensor:
        """Append a chain of tokens after the cache's entries; the logits after each of the
        last `logits_wanted` [logits_wanted, vocab] (the LM head runs on those only)."""
        start = cache.length
        positions = torch.arange(start, start + len(token_ids), device=self.model.device)
        out = self.model(
            input_ids=torch.tensor([list(token_ids)], device=self.model.device), past_key_values=cache.kv,
            use_cache=True, position_ids=positions[None], cache_position=positions, logits_to_keep=logits_wanted,
        )
        return out.logits[0]

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
        """Running seconds per drafted token (what the controller charges a node)."""
        per_token = seconds / tokens
        if self.seconds_per_token == 0.0:
            self.seconds_per_token = per_token
        else:
            self.seconds_per_token += COST_SMOOTHING * (per_token - self.seconds_per_token)


def model_drafters(target: LoadedModel, self_draft_layers: Sequence[int | None] = (),
                   draft: LoadedModel | None = None, staged: bool = False) -> list[ModelDrafter]:
    """Self-drafts of `target` at the given depths, and `draft` as a draft model (raises
    `IncompatibleDraft` if it cannot draft for `target`); with `staged`, each also as a staged
    twin `<name>_staged` (its chain guessed ahead by the context n-gram).

    One self-draft is named `self_draft`; several (to compare depths) `self_draft_<m>`; a depth
    of None is the measured default (`self_draft.default_layers`)."""
    depths = [m or default_layers(target.model) for m in self_draft_layers]  # None: the measured default
    models = [(first_layers(target.model, m), "self_draft" if len(depths) == 1 else f"self_draft_{m}") for m in depths]
    if draft is not None:
        check_draft(target.model, draft.model, target.tokenizer, draft.tokenizer)
        models.append((draft.model, "draft_model"))
    vocab_size = target.model.config.vocab_size
    drafters = [ModelDrafter(model, name, vocab_size) for model, name in models]
    if staged:
        drafters += [ModelDrafter(model, f"{name}_staged", vocab_size, ContextNgram()) for model, name in models]
    return drafters


def load_drafters(target: LoadedModel, self_draft_layers: Sequence[int | None], draft_model: str | None,
                  cache_dir: Path, device: str | None = None, dtype: str | None = None,
                  quantization: str = "auto", staged: bool = False) -> list[ModelDrafter]:
    """`model_drafters`, loading the draft model (a directory or .gguf) like the target."""
    draft = None
    if draft_model:
        packed = quantization if draft_model.endswith(".gguf") else "none"  # packing is for GGUF files only
        draft = load_model(draft_model, device, dtype, cache_dir, packed)
    return model_drafters(target, self_draft_layers, draft, staged)
