"""A speculating step with the host off the device's path: drafts, check and KV commit on the
model's device, and one copy back.

On a GPU a speculating step cost about twice a plain one because of what the host did around
the pass: drafting row by row, building each tree, pulling the top tokens and choices back,
walking each tree in Python, compacting the KV row by row (docs/benchmarks.md). Here every
row of the step drafts into one `TreeTemplate` (the same shape for all rows, so every tensor
has a size fixed by the step's row count and template):

    upload the rows' recent tokens and KV starts (host → device, no wait)
    → draft: the context match (`context.py`) and the successor-table walk (`tables.py`), gathers
    → the pass over the fixed-shape trees, its tokens taken from the device
    → the model's choice at each node (argmax, or a sample), the batched acceptance (`accept.py`)
    → the accepted entries moved in the KV (`TreeKVCache.keep_paths`)
    → the table refreshed from the pass's top-K (a scatter)
    → ONE copy to the host: each row's committed tokens, path, count and drafted nodes.

The host then only commits the counts and turns tokens into outputs. Which steps go this way
(the engine asks): every row decoding (no prompt chunk), with nothing that needs a
row's logits on the host (logprobs, a grammar, logit_bias or penalties), with a strategy the
device drafts, and all rows in fixed mode with the same (k, w) (`fixed_template`) or all in
auto mode (`auto_template`: the step's template from a menu). Greedy rows take the argmax,
sampled rows a sample of each node's distribution (`Chooser`). Anything else takes the host
path, which gives the same tokens.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from drafting import MIXED, Mixer, SuccessorTable, TokenHistory
from service.controller.cost_profile import CostProfile
from service.device_round.accept import accept_greedy
from service.device_round.context import WINDOW
from service.device_round.drafts import draft_trees
from service.device_round.graphs import RoundGraphs
from service.device_round.menu import TemplateChooser, menu
from service.device_round.tables import DeviceTable
from service.device_round.template import TreeTemplate
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner, RowInput

# strategy -> (context chain?, successor table: the mix's "recycled" one or Token Recycling's own)
DEVICE_STRATEGIES = {
    MIXED: (True, "recycled"),
    "context+recycled": (True, "recycled"),
    "recycled": (False, "recycled"),
    "token_recycling": (False, "token_recycling"),
    "context": (True, None),
}


# the model's choice after every node of a step's rows, from their logits [R * N, vocab], on the
# device
Chooser = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TemplateChoice:
    """What a device step drafts: the template every row fills, and from which table; in auto
    mode, a row's tokens per second the menu's chooser expects of it."""

    template: TreeTemplate
    table: str | None
    forecast: float | None = None


@dataclass(frozen=True)
class DeviceRoundOutput:
    """A device step's rounds, as the host reads them after its one copy."""

    # int64 [R, W + 1]: row r's accepted drafts then its bonus token in [: counts[r] + 1]
    tokens: np.ndarray
    # int64 [R, W + 1]: the accepted path's template node at each depth (root at 0)
    paths: np.ndarray
    counts: np.ndarray  # int64 [R]: accepted drafts
    drafted: np.ndarray  # bool [R, N]: the template nodes each row filled (the root included)
    wait_seconds: float  # the host waiting for the device in the step's one copy back

    def token_ids(self, row: int) -> list[int]:
        return self.tokens[row, : self.counts[row] + 1].tolist()

    def accepted_nodes(self, row: int) -> list[int]:
        return self.paths[row, 1 : self.counts[row] + 1].tolist()


class RecentWindows:
    """Each request's last `width` tokens as an array, kept up to date with the few tokens it
    gained since the last step: building the rows' windows from the histories' lists every step
    would put work that grows with the batch on the host's critical path."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._windows: weakref.WeakKeyDictionary[TokenHistory, tuple[np.ndarray, int]] = (
            weakref.WeakKeyDictionary()
        )

    def of(self, history: TokenHistory) -> np.ndarray:
        """The history's last `width` tokens, -1 before its first."""
        tokens, length = history.token_ids, len(history)
        window, seen = self._windows.get(history, (None, 0))
        if window is None or length - seen > self.width or length < seen:
            window = np.full(self.width, -1, dtype=np.int64)
            tail = tokens[-self.width :]
            window[self.width - len(tail) :] = tail
        elif length > seen:
            gained = length - seen
            window[:-gained] = window[gained:]
            window[-gained:] = tokens[seen:]
        self._windows[history] = (window, length)
        return window


class DeviceRound:
    """The device's drafting state (tables, templates) and the step that uses it."""

    def __init__(self, runner: ModelRunner, mixer: Mixer) -> None:
        self.runner = runner
        self.device = runner.device
        self.tables: dict[str, DeviceTable] = {}
        for name in ("recycled", "token_recycling"):
            table = getattr(mixer.strategies.get(name) or mixer.standalone.get(name), "table", None)
            if isinstance(table, SuccessorTable):
                self.tables[name] = DeviceTable(table, runner.vocab_size, self.device)
        self.chooser = TemplateChooser()  # auto mode's template each step
        self.copies = 0  # device → host copies made (one a step)
        # which side's tables the last round refreshed: the other takes them before it drafts
        self._newest_on_device = False
        self._windows = RecentWindows(WINDOW)
        static = runner.static
        self.graphs = RoundGraphs(self.device, static is not None and static.capture)

    def hand_tables_to_host(self) -> None:
        """Before a step drafted on the host: the host tables take what device rounds learned
        since the last one (a copy back, on such steps only)."""
        if self._newest_on_device:
            for table in self.tables.values():
                table.pull()
            self._newest_on_device = False

    def fixed_template(self, k: int, w: int, strategy: str) -> TemplateChoice | None:
        """The template of a step whose rows all ask for (k, w) drafts of `strategy` (fixed mode;
        the root alone where no draft fits, as at a request's last token); None where the device
        does not draft that strategy."""
        drafts = self._drafts(strategy)
        if drafts is None:
            return None
        chain, table = drafts
        if k <= 0 or w <= 0:
            return TemplateChoice(TreeTemplate.of(0, 0, 0), table)
        return TemplateChoice(TreeTemplate.of(k if table else 0, w, w if chain else 0), table)

    def auto_template(
        self,
        k: int,
        w: int,
        strategy: str,
        profile: CostProfile,
        context: float,
        rows: int,
        budget: int,
    ) -> TemplateChoice | None:
        """The template of a step whose rows are all in auto mode with at most (k, w) drafts of
        `strategy`: of the menu's templates whose drafted nodes fit the pass's `budget` for all
        rows, the one that buys the most tokens per second (`menu.choose`), the root alone
        included."""
        drafts = self._drafts(strategy)
        if drafts is None:
            return None
        chain, table = drafts
        templates = [
            t for t in menu(k, w, chain, table is not None) if rows * (t.num_nodes - 1) <= budget
        ]
        template, forecast = self.chooser(templates, profile, rows, context)
        return TemplateChoice(template, table, forecast)

    def _drafts(self, strategy: str) -> tuple[bool, str | None] | None:
        """(a context chain?, the table) of `strategy`; None where the device drafts none of it."""
        chain, table = DEVICE_STRATEGIES.get(strategy, (False, None))
        if table is not None and table not in self.tables:
            table = None
        return None if not chain and table is None else (chain, table)

    @torch.inference_mode()
    def run(
        self,
        cache: TreeKVCache,
        histories: Sequence[TokenHistory],
        choice: TemplateChoice,
        choose: Chooser | None = None,
    ) -> DeviceRoundOutput:
        """The step over rows [0, R) of `cache`, row r's committed tokens `histories[r]` (its
        KV row holding all but the newest). The model's choice after each node is its argmax,
        or what `choose` makes of the logits [R * N, vocab] (sampled rows: a sample of each
        node's distribution, on the device; accepting along samples is speculative sampling's
        rule, as on the host)."""
        template, device = choice.template, self.device
        shape = template.tensors(device)
        rows = len(histories)
        if (
            not self._newest_on_device
        ):  # host rounds refreshed the host tables since the last device round
            for device_table in self.tables.values():
                device_table.push()
            self._newest_on_device = True
        staging = self._staging(histories, cache.lengths, choice)
        width = staging.shape[1] - 1  # the recent tokens', then the KV start
        table = None if choice.table is None else self.tables[choice.table]
        if table is not None:
            table.sync_fallback()

        def draft(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return draft_trees(inputs[:, :width], template, table)  # [R, N] each

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            return self.runner.every_node_hidden(
                cache, [RowInput(template.shape_tree)] * rows, tokens.flatten()
            )

        def after(
            inputs: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, hidden: torch.Tensor
        ) -> torch.Tensor:
            recent, starts = inputs[:, :width], inputs[:, width]
            logits = self.runner.logits(hidden)  # [R * N, vocab]
            choices = (logits.argmax(-1) if choose is None else choose(logits)).view(
                rows, template.num_nodes
            )
            accepted = accept_greedy(tokens, valid, choices, shape, template.max_depth)
            cache.keep_paths(starts, accepted.path, accepted.counts)
            if table is not None:
                top = logits.topk(table.top_k, dim=-1).indices
                parents = tokens[:, shape.parents].clone()
                parents[:, 0] = recent[:, -2]
                table.refresh(tokens.flatten(), parents.flatten(), top, valid.flatten())
            return torch.cat(
                [accepted.tokens, accepted.path, accepted.counts[:, None], valid.long()], dim=1
            )

        # a sampled round's chooser reads uniforms uploaded afresh each step: it runs eagerly
        key = None
        if choose is None:
            key = (template, rows, choice.table, None if table is None else id(table.fallback))
        packed = self.graphs.run(
            key,
            staging,
            draft,
            forward,
            after,
            cache.buffer_identity,
            keep=() if table is None else (table.fallback,),
        )
        began = time.perf_counter()
        host = self._to_host(packed)
        depth = template.max_depth + 1
        result = DeviceRoundOutput(
            tokens=host[:, :depth],
            paths=host[:, depth : 2 * depth],
            counts=host[:, 2 * depth],
            drafted=host[:, 2 * depth + 1 :].astype(bool),
            wait_seconds=time.perf_counter() - began,
        )
        for row, count in enumerate(result.counts.tolist()):
            cache.advance(row, 1 + count)
        self.chooser.acceptance.observe(template, result.paths, result.counts)
        return result

    def _staging(
        self, histories: Sequence[TokenHistory], starts: Sequence[int], choice: TemplateChoice
    ) -> torch.Tensor:
        """Each row's recent tokens (-1 before its first), then its KV start [R, L + 1], on
        the host: the step's one upload."""
        width = WINDOW if choice.template.chain else 2
        host = np.empty((len(histories), width + 1), dtype=np.int64)
        for row, history in enumerate(histories):
            host[row, :width] = self._windows.of(history)[-width:]
        host[:, width] = starts
        return torch.from_numpy(host)

    def _to_host(self, packed: torch.Tensor) -> np.ndarray:
        """The step's one device → host copy: where the host waits for the device."""
        self.copies += 1
        return packed.cpu().numpy()
