"""A step on the host: the policy's trees, one pass over every row, each row verified on its
logits, its drafts taught what the pass showed, and the KV entries the rows keep committed."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from drafting import Mixer, PassDistributions, TokenHistory
from service.engine.logprobs import TokenLogprob, token_logprobs
from service.engine.outputs import RoundOutput
from service.engine.policy import SpeculationPolicy
from service.engine.sampling import greedy_choices_of_rows, top_token_ids_of_rows
from service.engine.scheduler import Scheduler
from service.engine.step_row import PassFailed, StepRounds, StepRow, take_round
from service.engine.timing import StepTimer
from service.engine.verifier import Verdict, verify
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner
from service.model.tree import TokenTree
from service.model_drafts.draft_model import ModelDrafter

log = logging.getLogger(__name__)
T = TypeVar("T")


class HostStep:
    """Runs a step with drafting, verification and the KV commit on the host."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: TreeKVCache,
        mixer: Mixer,
        policy: SpeculationPolicy,
        scheduler: Scheduler,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.mixer = mixer
        self.policy = policy
        self.scheduler = scheduler

    def run(self, rows: list[StepRow], budget: int, timer: StepTimer) -> StepRounds:
        """Trees for the decoding rows (at most `budget` nodes beyond their roots), the pass,
        and each row's round; raises `PassFailed` if the pass does."""
        rows = self._trees(rows, budget)
        timer.mark_drafted(self.runner.capture_seconds)
        try:
            logits = self.runner.forward(self.cache, [row.input() for row in rows])
        except Exception as error:
            raise PassFailed(str(error)) from error
        timer.mark_passed(self.runner.capture_seconds)
        return StepRounds(rows, self._verify(rows, logits, timer))

    def _trees(self, rows: list[StepRow], budget: int) -> list[StepRow]:
        """The rows with their trees: the policy's gate, the drafting strategies prepared for
        the rows that draft, then the policy's trees."""
        policy = self.policy
        speculating, pricing = policy.gate(rows, budget)
        for strategy in self.mixer.batched.values():  # a self-draft drafts in this engine's KV rows
            if isinstance(strategy, ModelDrafter):
                strategy.bind_target(self.cache, self._kv_row_of)
        self.mixer.prepare(
            [
                (
                    row.request.drafts,
                    row.request.speculation.k,
                    policy.max_depth(row.request, row.request.speculation.w),
                )
                for row in speculating
            ]
        )
        return policy.trees(rows, speculating, budget, pricing)

    def _kv_row_of(self, history: TokenHistory) -> int:
        """The KV row of the running request whose history this is."""
        kv_row = next(r.kv_row for r in self.scheduler.running if r.drafts.history is history)
        assert kv_row is not None
        return kv_row

    def _verify(
        self, rows: list[StepRow], logits: list[torch.Tensor], timer: StepTimer
    ) -> list[RoundOutput | Exception | None]:
        """Verify every row against the pass, let its drafts learn, and commit the KV entries
        the rows keep, all rows together. A row's round, its error, or None for a prefill chunk."""
        with timer.learning():
            top_ids = self._top_ids(rows, logits)
        adjusted = [_adjusted(row, row_logits) for row, row_logits in zip(rows, logits)]
        commits: dict[int, list[int]] = {}  # KV row -> pass entries kept
        rounds = [
            self._verify_row(row, *row_outputs, commits, timer)
            for row, *row_outputs in zip(
                rows, logits, adjusted, top_ids, self._greedy_choices(rows, adjusted)
            )
        ]
        self.cache.commit_rows(commits)
        for row in rows:
            if row.chunk:  # a prompt's blocks serve the requests that share them from now on
                self.scheduler.keep_prefix(row.request)
        timer.mark_verified()
        return rounds

    def _verify_row(
        self,
        row: StepRow,
        logits: torch.Tensor,
        adjusted: torch.Tensor,
        top_ids: np.ndarray | None,
        greedy: list[int] | None,
        commits: dict[int, list[int]],
        timer: StepTimer,
    ) -> RoundOutput | Exception | None:
        """A row's prompt chunk joins its cache row; a decoding row's tree is verified (on its
        `adjusted` logits), the pass entries its KV row keeps go into `commits`, and its drafts
        learn the outcome."""
        request, tree = row.request, row.tree
        assert request.kv_row is not None
        request.num_cached += len(row.chunk)
        if tree is None:
            commits[request.kv_row] = list(range(len(row.chunk)))
            return None
        try:
            verdict = verify(
                tree,
                adjusted,
                request.params.sampling,
                request.uniforms,
                first_position=request.context_length,
                greedy=greedy,
                constraint=request.constraint,
                stop_ids=request.stop_ids,
            )
            offset = len(row.chunk)
            commits[request.kv_row] = [
                *range(offset),
                offset,
                *(offset + node for node in verdict.accepted_nodes),
            ]
            if row.forecast is not None:
                request.calibration.observe_round(tree.num_nodes > 1)
            with timer.learning():
                _learn(row, verdict, top_ids)
            return take_round(
                row,
                verdict.token_ids,
                [tree.strategies[i] or "" for i in verdict.accepted_nodes],
                dict(Counter(s for s in tree.strategies[1:] if s)) if tree.num_nodes > 1 else {},
                tree.num_nodes - 1,
                _logprobs(row, verdict, logits),
                0.0 if request.constraint is None else request.constraint.take_seconds(),
            )
        except Exception as error:  # this request fails; the others in the pass go on
            log.exception("request %s failed", request.request_id)
            request.finish_reason = "error"
            return error

    def _top_ids(self, rows: list[StepRow], logits: list[torch.Tensor]) -> list[np.ndarray | None]:
        """Per decoding row, the top-K next tokens at each tree node ([num_nodes, K]), for
        the strategies that learn from every distribution. Only rows whose request drafts next
        round from a successor table take them (`SpeculationPolicy.drafts_next_round`,
        `RequestDrafts.learns_from_passes`): neither plain decoding nor an auto request's quiet
        rounds should pay for drafting; the logit hints describe the next round's position, so
        a row that drafts after a skipped round just has none. Row by row, since each row's
        logits are already a contiguous view (gathering them first costs more)."""
        top_k = self.mixer.distribution_top_k
        if top_k == 0:
            return [None] * len(rows)
        wanted = [
            i
            for i, row in enumerate(rows)
            if row.tree is not None
            and row.request.drafts.learns_from_passes
            and self.policy.drafts_next_round(row)
        ]
        return _scattered(
            len(rows), wanted, top_token_ids_of_rows([logits[i] for i in wanted], top_k)
        )

    @staticmethod
    def _greedy_choices(rows: list[StepRow], logits: list[torch.Tensor]) -> list[list[int] | None]:
        """Each greedy unconstrained decoding row's argmax token at each of its tree's nodes (of
        the `_adjusted` logits), every row's taken together (off the CPU one device call for the
        pass, not one a row)."""
        wanted = [
            i
            for i, row in enumerate(rows)
            if row.tree is not None
            and row.request.params.sampling.greedy
            and row.request.constraint is None
        ]
        return _scattered(
            len(rows),
            wanted,
            greedy_choices_of_rows([logits[i][: rows[i].tree.num_nodes] for i in wanted]),
        )  # type: ignore[union-attr]


def _adjusted(row: StepRow, logits: torch.Tensor) -> torch.Tensor:
    """A decoding row's logits after its request's logit_bias and penalties, each node's from
    its own path; the raw logits themselves for every other row. The raw ones stay what the
    successor tables (shared by all requests) learn from and what logprobs report."""
    adjuster = row.request.logits_adjuster
    if row.tree is None or adjuster is None:
        return logits
    return adjuster(logits, row.tree, row.request.token_ids)


def _logprobs(
    row: StepRow, verdict: Verdict, logits: torch.Tensor
) -> Callable[[list[int]], list[TokenLogprob]] | None:
    """The logprobs of the tokens a round takes, when its request asked for them."""
    asked = row.request.params.logprobs
    if asked is None:
        return None
    return lambda token_ids: token_logprobs(
        logits, verdict.choosing_nodes[: len(token_ids)], token_ids, asked
    )


def _scattered(size: int, at: list[int], values: Sequence[T]) -> list[T | None]:
    """A list of `size` Nones with `values` placed at the indices `at`."""
    out: list[T | None] = [None] * size
    for index, value in zip(at, values):
        out[index] = value
    return out


def _learn(row: StepRow, verdict: Verdict, top_ids: np.ndarray | None) -> None:
    """The request's drafts learn what the round committed and, where taken, what the pass's
    distributions showed at each node."""
    drafts, tree = row.request.drafts, row.tree
    assert tree is not None
    history = drafts.history
    # before this round's tokens join
    root_parent = history.token_ids[-2] if len(history) > 1 else -1
    drafts.observe(verdict.token_ids)
    if top_ids is not None:
        stop_node = verdict.accepted_nodes[-1] if verdict.accepted_nodes else 0
        drafts.observe_distributions(_pass_distributions(tree, top_ids, stop_node, root_parent))


def _pass_distributions(
    tree: TokenTree, top_ids: np.ndarray, stop_node: int, root_parent: int
) -> PassDistributions:
    """What a row's pass showed, each node with the token before it (its parent's; the root's
    from the context, -1 where it has none)."""
    tokens = np.asarray(tree.token_ids)
    # the root's parent index, -1, reads the last node: replaced
    parent_tokens = tokens[tree.parents]
    parent_tokens[0] = root_parent
    return PassDistributions(tokens, top_ids, stop_node, parent_tokens)
