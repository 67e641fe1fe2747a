"""A draft strategy that runs a causal LM: a separate small model, or the target's own first
layers (`service/self_draft.py`).

Each round it drafts a small tree, not one chain: the draft's top-k tokens after the context
are the k branches, then every branch grows greedily, all k in one pass per depth (each node
sees the context and its own branch only). And every request that drafts this step is drafted
in the same passes: the engine hands the drafter all of the step's asks first (`prepare`), so
a round costs w draft passes whatever k and however many requests draft. Each request holds a
row of the draft's own KV cache (`service/draft_rows.py`), synced to its history before
drafting (accepted draft tokens kept, the rest forgotten) and freed when it ends.

The measured seconds per drafted token are exposed as `seconds_per_token`, which the mixer
hands to the controller so that a slow draft pays for its own time (`service/regime.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from drafting import ContextNgram, Draft, TokenHistory, common_prefix
from service.draft_checks import check_draft
from service.draft_rows import DraftRow, DraftRows, forest_tree
from service.model_loader import LoadedModel, load_model
from service.model_runner import ModelRunner, RowInput
from service.self_draft import default_layers, first_layers
from service.tree import chain_tree

COST_SMOOTHING = 0.2  # weight of the newest round in the running seconds-per-token estimate
Ask = tuple[TokenHistory, int, int]  # a request's history, k drafts, w tokens each


class ModelDrafter:
    """Strategy `name`: a causal LM's top-k first tokens, each continued greedily to w tokens."""

    def __init__(self, model: PreTrainedModel, name: str, vocab_size: int | None = None,
                 lookahead: ContextNgram | None = None) -> None:
        self.rows = DraftRows(ModelRunner(model))
        self.name = name
        self.lookahead = lookahead  # staged: context n-gram guesses the draft's own chain
        # proposals stay inside the target's vocabulary (a draft's may be padded larger)
        self.vocab_size = min(vocab_size or model.config.vocab_size, model.config.vocab_size)
        self.seconds_per_token = 0.0  # measured; 0 until the first round
        self._prepared: dict[int, tuple[TokenHistory, int, list[Draft]]] = {}  # id(history) -> drafts

    @property
    def model(self) -> PreTrainedModel:
        return self.rows.runner.model

    @property
    def kv_bytes_per_token(self) -> int:
        """KV memory the draft holds per token of a request (the scheduler's budget counts it)."""
        return self.rows.runner.kv_bytes_per_token

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
        jobs = [_Job(h, k, w, self.rows.row(h)) for h, k, w in asks if k > 0 and w > 0]
        if not jobs:
            return
        for job in jobs:
            job.fed = self.rows.sync(job.row, job.history.token_ids)
        logits = self._pass({job.row.index: RowInput(chain_tree(job.fed), len(job.fed) - 1) for job in jobs})
        for job in jobs:
            self.rows.commit_fed(job.row, job.fed)
            firsts = logits[job.row.index][-1, : self.vocab_size].topk(job.k).indices.tolist()
            job.start(firsts, self.lookahead)
        while inputs := {job.row.index: i for job in jobs if (i := job.next_input()) is not None}:
            logits = self._pass(inputs)
            for job in jobs:
                if job.row.index in inputs:
                    job.take(logits[job.row.index][:, : self.vocab_size].argmax(-1).tolist())
        drafted = 0
        for job in jobs:
            job.row.forest_tokens, job.row.forest_parents = job.fed_forest()
            branches = job.branches()
            drafted += sum(map(len, branches))
            self._prepared[id(job.history)] = (
                job.history, len(job.history), [Draft(tuple(b), self.name, rank) for rank, b in enumerate(branches)])
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
    """One request's drafting this round: its branches grown a depth per pass, or (staged) a
    chain the context n-gram guesses ahead and the draft verifies, several tokens a pass."""

    history: TokenHistory
    k: int
    w: int
    row: DraftRow
    fed: list[int] = field(default_factory=list)  # committed tokens the first pass feeds
    lookahead: ContextNgram | None = None
    firsts: list[int] = field(default_factory=list)
    levels: list[list[int]] = field(default_factory=list)  # tree: levels[d][b] = branch b's token at depth d + 1
    chain: list[int] = field(default_factory=list)  # staged: the draft's greedy chain
    guess: list[int] = field(default_factory=list)  # staged: this pass's guess after the chain

    def start(self, firsts: list[int], lookahead: ContextNgram | None) -> None:
        self.firsts, self.lookahead = firsts, lookahead
        self.levels, self.chain = [firsts], [firsts[0]]

    def next_input(self) -> RowInput | None:
        """This job's nodes for the next pass (None: done)."""
        if self.lookahead is None:
            if len(self.levels) >= self.w:
                return None
            tokens, parents = self._levels(len(self.levels))
            return RowInput(forest_tree(tokens, parents), len(tokens) - len(self.firsts),
                            len(tokens) - len(self.firsts))
        if len(self.chain) >= self.w:
            return None
        guesses = self.lookahead.continuations(self.history, 1, self.w - len(self.chain), tail=self.chain)
        self.guess = list(guesses[0]) if guesses else []
        tokens = [*self.chain, *self.guess]
        cached = len(self.chain) - 1  # the chain but its newest token has entries
        return RowInput(forest_tree(tokens, list(range(-1, len(tokens) - 1))), cached, cached)

    def take(self, predicted: list[int]) -> None:
        """The draft's greedy choice after each node the last pass fed."""
        if self.lookahead is None:
            self.levels.append(predicted)
            return
        accepted = common_prefix(self.guess, predicted)
        self.chain += [*self.guess[:accepted], predicted[accepted]]

    def branches(self) -> list[list[int]]:
        if self.lookahead is None:
            return [list(branch) for branch in zip(*self.levels)]
        return [self.chain[: self.w], *([t] for t in self.firsts[1:])]

    def fed_forest(self) -> tuple[list[int], list[int]]:
        """The drafted nodes that now hold entries (all but the deepest), breadth-first."""
        if self.lookahead is None:
            return self._levels(len(self.levels) - 1)
        fed = self.chain[: self.w - 1]
        return fed, list(range(-1, len(fed) - 1))

    def _levels(self, depth: int) -> tuple[list[int], list[int]]:
        """The tree's first `depth` levels as a breadth-first forest (tokens, parents)."""
        width = len(self.firsts)
        tokens = [t for level in self.levels[:depth] for t in level]
        parents = [-1 if node < width else node - width for node in range(len(tokens))]
        return tokens, parents


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
