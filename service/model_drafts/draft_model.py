"""A draft strategy that runs a causal LM: a separate small model, or the target's own first
layers (`service/model_drafts/self_draft.py`).

Each round it drafts a small tree, not one chain: the draft's top-k tokens after the context
are the k branches, then every branch grows greedily, all k in one pass per depth (each node
sees the context and its own branch only). And every request that drafts this step is drafted
in the same passes: the engine hands the drafter all of the step's asks first (`prepare`), so
a round costs w draft passes whatever k and however many requests draft. Each request holds a
row of the draft's own KV cache (`service/model_drafts/draft_rows.py`), synced to its history before
drafting (accepted draft tokens kept, the rest forgotten) and freed when it ends; a
self-draft drafts in the target's own rows instead, which hold its entries already.

The measured seconds per drafted token are exposed as `seconds_per_token`, which the mixer
hands to the controller so that a slow draft pays for its own time
(`service/controller/planner.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from drafting import ContextNgram, Draft, TokenHistory, common_prefix
from service.model.kv_cache import TreeKVCache
from service.model.loader import LoadedModel, load_model
from service.model.runner import ModelRunner, RowInput
from service.model.tree import TokenTree, chain_tree
from service.model_drafts.draft_checks import check_draft
from service.model_drafts.draft_rows import DraftRow, DraftRows, RowOf, TargetRows, tree_of
from service.model_drafts.self_draft import default_layers, first_layers

COST_SMOOTHING = 0.2  # weight of the newest round in the running seconds-per-token estimate
Ask = tuple[TokenHistory, int, int]  # a request's history, k drafts, w tokens each


class ModelDrafter:
    """Strategy `name`: a causal LM's top-k first tokens, each continued greedily to w tokens.

    With `shares_target_cache` (a self-draft: the target's first layers) it drafts in the
    target's own KV rows (`TargetRows`), which the engine binds each step; otherwise in rows
    of its own cache (`DraftRows`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        name: str,
        vocab_size: int | None = None,
        lookahead: ContextNgram | None = None,
        shares_target_cache: bool = False,
    ) -> None:
        runner = ModelRunner(model)
        self.rows: DraftRows | TargetRows = (
            TargetRows(runner) if shares_target_cache else DraftRows(runner)
        )
        self.name = name
        self.lookahead = lookahead  # staged: context n-gram guesses the draft's own chain
        # proposals stay inside the target's vocabulary (a draft's may be padded larger)
        self.vocab_size = min(vocab_size or model.config.vocab_size, model.config.vocab_size)
        self.seconds_per_token = 0.0  # measured; 0 until the first round
        # id(history) -> drafts
        self._prepared: dict[int, tuple[TokenHistory, int, list[Draft]]] = {}

    @property
    def model(self) -> PreTrainedModel:
        return self.rows.runner.model

    @property
    def kv_bytes_per_token(self) -> int:
        """KV memory the draft holds per token of a request (the scheduler's budget counts it)."""
        return self.rows.kv_bytes_per_token

    def bind_target(self, cache: TreeKVCache, row_of: RowOf) -> None:
        """The engine's cache and rows, for a draft that drafts in them (else nothing to do)."""
        if isinstance(self.rows, TargetRows):
            self.rows.bind(cache, row_of)

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        """The drafts `prepare` made for this history this round (drafted now if it made none)."""
        if k <= 0 or w <= 0:
            return []
        entry = self._prepared.pop(id(history), None)
        if entry is None or entry[0] is not history or entry[1] != len(history):
            self.prepare([(history, k, w)])
            entry = self._prepared.pop(id(history))
        drafts = entry[2][:k]
        return [Draft(d.token_ids[:w], d.strategy, d.rank) for d in drafts]

    @torch.inference_mode()
    def prepare(self, asks: Sequence[Ask]) -> None:
        """Draft for every ask at once: one pass feeds each request's new tokens, then one pass
        per depth grows every request's branches (a staged chain, as far as its guesses go)."""
        started = time.perf_counter()
        jobs = [
            _Job(h, k, w, self.rows.row(h), self.lookahead) for h, k, w in asks if k > 0 and w > 0
        ]
        if not jobs:
            return
        for job in jobs:
            job.fed = self.rows.sync(job.row, job.history.token_ids)
        while inputs := {job.row.index: i for job in jobs if (i := job.next_input()) is not None}:
            logits = self._pass(inputs)
            for job in jobs:
                if job.row.index in inputs:
                    job.take(logits[job.row.index][:, : self.vocab_size])
        drafted = 0
        for job in jobs:
            job.row.scratch = job.scratch()
            branches = job.branches()
            drafted += sum(map(len, branches))
            self._prepared[id(job.history)] = (
                job.history,
                len(job.history),
                [Draft(tuple(b), self.name, rank) for rank, b in enumerate(branches)],
            )
        self._observe_cost(time.perf_counter() - started, drafted)

    def release(self, history: TokenHistory) -> None:
        """The request ended: free its row of the draft's cache."""
        self._prepared.pop(id(history), None)
        self.rows.release(history)

    def _pass(self, inputs: dict[int, RowInput]) -> list[torch.Tensor]:
        """One draft pass: the given rows bring their nodes, every other row nothing."""
        idle = RowInput(chain_tree([]))
        rows = [inputs.get(index, idle) for index in range(self.rows.cache.num_rows)]
        return self.rows.runner.forward(self.rows.cache, rows)

    def _observe_cost(self, seconds: float, tokens: int) -> None:
        """Running seconds per drafted token (what the controller charges a node)."""
        per_token = seconds / max(tokens, 1)
        if self.seconds_per_token == 0.0:
            self.seconds_per_token = per_token
        else:
            self.seconds_per_token += COST_SMOOTHING * (per_token - self.seconds_per_token)


@dataclass
class _Job:
    """One request's drafting this round, as one tree grown pass by pass in its row: the fed
    tokens (a chain, the newest last), then below the newest either k branches a depth a pass,
    or (staged) one chain the context n-gram guesses ahead and the draft verifies, several
    tokens a pass where the guesses hold."""

    history: TokenHistory
    k: int
    w: int
    row: DraftRow
    lookahead: ContextNgram | None
    fed: list[int] = field(default_factory=list)  # what the row lacks of the history
    firsts: list[int] = field(default_factory=list)  # the draft's top-k after the newest token
    # levels[d][b]: branch b's token at depth d + 1
    levels: list[list[int]] = field(default_factory=list)
    chain: list[int] = field(default_factory=list)  # staged: the draft's greedy chain
    guess: list[int] = field(default_factory=list)  # staged: this pass's guess after the chain

    def next_input(self) -> RowInput | None:
        """This job's nodes for the next pass (None: done)."""
        f = len(self.fed)
        if not self.firsts:  # first pass: the fed tokens, logits after the newest
            return RowInput(chain_tree(self.fed), f - 1)
        if self.lookahead is None:
            if len(self.levels) >= self.w:
                return None
            tree = self._tree(len(self.levels))
            return RowInput(
                tree, tree.num_nodes - len(self.firsts), tree.num_nodes - len(self.firsts)
            )
        if len(self.chain) >= self.w:
            return None
        guesses = self.lookahead.continuations(
            self.history, 1, self.w - len(self.chain), tail=self.chain
        )
        self.guess = list(guesses[0]) if guesses else []
        tokens = [*self.fed, *self.chain, *self.guess]
        cached = f + len(self.chain) - 1  # all but the chain's newest token have entries
        return RowInput(tree_of(tokens, list(range(-1, len(tokens) - 1))), cached, cached)

    def take(self, logits: torch.Tensor) -> None:
        """The draft's logits [nodes, vocab] after each node the last pass asked for."""
        if not self.firsts:
            self.firsts = logits[-1].topk(self.k).indices.tolist()
            self.levels, self.chain = [self.firsts], [self.firsts[0]]
            return
        predicted = logits.argmax(-1).tolist()
        if self.lookahead is None:
            self.levels.append(predicted)
            return
        accepted = common_prefix(self.guess, predicted)
        self.chain += [*self.guess[:accepted], predicted[accepted]]

    def branches(self) -> list[list[int]]:
        if self.lookahead is None:
            return [list(branch) for branch in zip(*self.levels)]
        return [self.chain[: self.w], *([t] for t in self.firsts[1:])]

    def scratch(self) -> TokenTree:
        """The nodes that now hold entries past the row's committed ones: the fed tokens and
        the drafted ones but the deepest."""
        if self.lookahead is None:
            return self._tree(len(self.levels) - 1)
        tokens = [*self.fed, *self.chain[: self.w - 1]]
        return tree_of(tokens, list(range(-1, len(tokens) - 1)))

    def _tree(self, depth: int) -> TokenTree:
        """The fed chain, then the branches' first `depth` levels breadth-first."""
        f, width = len(self.fed), len(self.firsts)
        tokens = [*self.fed, *(t for level in self.levels[:depth] for t in level)]
        parents = [
            *range(-1, f - 1),
            *(f - 1 if i < width else f + i - width for i in range(len(tokens) - f)),
        ]
        return tree_of(tokens, parents)


def model_drafters(
    target: LoadedModel,
    self_draft_layers: Sequence[int | None] = (),
    draft: LoadedModel | None = None,
    staged: bool = False,
) -> list[ModelDrafter]:
    """Self-drafts of `target` at the given depths, and `draft` as a draft model (raises
    `IncompatibleDraft` if it cannot draft for `target`); with `staged`, each also as a staged
    twin `<name>_staged` (its chain guessed ahead by the context n-gram).

    One self-draft is named `self_draft`; several (to compare depths) `self_draft_<m>`; a depth
    of None is the measured default (`self_draft.default_layers`)."""
    # None: the measured default
    depths = [m or default_layers(target.model) for m in self_draft_layers]
    # (model, name, whether it drafts in the target's own KV rows: a self-draft does)
    models = [
        (
            first_layers(target.model, m),
            "self_draft" if len(depths) == 1 else f"self_draft_{m}",
            True,
        )
        for m in depths
    ]
    if draft is not None:
        check_draft(target.model, draft.model, target.tokenizer, draft.tokenizer)
        models.append((draft.model, "draft_model", False))
    vocab_size = target.model.config.vocab_size
    drafters = [
        ModelDrafter(model, name, vocab_size, shares_target_cache=shared)
        for model, name, shared in models
    ]
    if staged:
        drafters += [
            ModelDrafter(model, f"{name}_staged", vocab_size, ContextNgram(), shared)
            for model, name, shared in models
        ]
    return drafters


def load_drafters(
    target: LoadedModel,
    self_draft_layers: Sequence[int | None],
    draft_model: str | None,
    cache_dir: Path,
    device: str | None = None,
    dtype: str | None = None,
    quantization: str = "auto",
    staged: bool = False,
) -> list[ModelDrafter]:
    """`model_drafters`, loading the draft model (a directory or .gguf) like the target."""
    draft = None
    if draft_model:
        # packing is for GGUF files only
        packed = quantization if draft_model.endswith(".gguf") else "none"
        draft = load_model(draft_model, device, dtype, cache_dir, packed)
    return model_drafters(target, self_draft_layers, draft, staged)
