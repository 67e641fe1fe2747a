"""Which tree nodes pay for themselves, at the prices of the cost profile (`cost_profile.py`).

`plan_trees` chooses the trees of ALL running requests jointly. Every candidate node
(a prefix of some request's draft) has a probability of being accepted; adding it adds that
much to the pass's expected tokens and one token to the pass. Nodes are added best first
(a parent is never less likely than its child, so trees stay connected), and the controller
keeps the number of additions with the most expected tokens per second for the whole pass —
plain decoding for everyone unless speculation beats it by `min_gain`. A node drafted by a
model (`service/model_drafts/draft_model.py`) also costs its measured drafting seconds, so an
accurate but slow draft loses to a fast one: nodes are ranked by expected tokens per second of pass
and drafting, and every plan's rate counts both. Likewise every row that speculates costs the
host work of drafting it (measured as the engine runs), once per row. On a device where a
bigger pass is nearly free, many nodes pay; where it costs (a CPU, or a large batch on a
GPU), few or none do, per request, without any table of switch-off points.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from drafting import Acceptance, Draft, ScoredDraft
from service.controller.cost_profile import PassShape

PATIENCE = 32  # nodes in a row that improve no plan before the planner stops adding
PATIENCE_PER_ROW = 8  # ... at most this many per row of the pass (see `_best_counts`)
MIN_GAIN = 1.02  # a plan must beat plain decoding's tokens per second by this factor
SURE = Acceptance(1.0, 1.0)  # a draft every token of which is accepted


@dataclass(frozen=True)
class RowCandidates:
    """One decoding request's say in the plan: its ranked drafts and caps."""

    candidates: Sequence[ScoredDraft]
    k_max: int  # at most this many branches
    w_max: int  # at most this deep
    probe: bool = False  # speculate a little even if the forecast says no (re-measures)
    width: int = 1  # tokens the row brings besides its tree's nodes (root, a last prompt chunk)


@dataclass(frozen=True)
class RowTree:
    """The controller's choice for one request: drafts to verify and what it expects of them."""

    drafts: list[Draft]
    k: int
    w: int
    expected_tokens: float  # Σ P(node accepted), bonus included


PLAIN = RowTree([], 0, 0, 1.0)  # a row's root alone: plain decoding (read only, shared)


@dataclass(frozen=True)
class TreePlan:
    trees: list[RowTree]  # one per RowCandidates, in order
    tokens: int  # total tokens of the pass
    expected_tokens: float  # over the whole pass
    seconds: float  # forecast of the pass
    probed: bool = False  # a row speculates that the forecast alone would not have

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.seconds


class _Node(NamedTuple):
    """A candidate tree node (a named tuple: tens of them a row every step)."""

    probability: float
    depth: int
    row: int
    prefix: tuple[int, ...]
    strategy: str
    rank: int
    draft_seconds: float  # what drafting this node's token cost (0 for table look-ups)


def plan_trees(
    rows: Sequence[RowCandidates],
    cost: Callable[[PassShape], float],
    fixed: PassShape,
    fixed_expected: float,
    budget: int,
    min_gain: float = MIN_GAIN,
    prefill_seconds: float = 0.0,
    row_host_seconds: float = 0.0,
) -> TreePlan:
    """Choose every row's tree for one pass.

    `cost(shape)` is the forecast seconds of a pass of that shape; `fixed` is what the pass
    holds regardless (one root per row here, prefill chunks and fixed-mode trees) and
    `fixed_expected` the tokens it yields for sure; `budget` caps the added nodes.
    `prefill_seconds` is the part of `cost(fixed)` that prompt chunks cost, a row's own last
    chunk (the one that carries its first tree) included: it buys no token this pass, so plans
    are compared by tokens per second of the pass's decoding alone, and a node must pay for
    itself against plain decoding's rate. Counted in, a pass carrying a prompt chunk decodes so
    slowly that almost any tree beats it, and passes carrying other requests' chunks took many
    times the nodes of passes without one (docs/benchmarks.md, figures behind design choices).
    `row_host_seconds` is the host work a row that speculates adds to the step outside the pass
    (drafting it: measured by the engine, `HostCost`), charged once per speculating row (and,
    for ranking, to its first-level nodes). On a GPU a pass of 16 rows costs about the same
    whatever its tokens, so the pass alone says every node is nearly free, while each
    speculating row's host work makes an auto step dearer than a plain one (docs/benchmarks.md).
    """
    if not any(row.candidates for row in rows):  # no row drafted (quiet rounds): the plain pass
        return TreePlan([PLAIN] * len(rows), fixed.tokens, fixed_expected + len(rows), cost(fixed))
    candidates = [n for index, row in enumerate(rows) for n in _row_nodes(index, row)]
    spread = max(len(candidates), 1)
    more_tokens = PassShape(fixed.tokens + spread, fixed.wide_rows)
    node_seconds = max((cost(more_tokens) - cost(fixed)) / spread, 1e-9)  # mean marginal of a token
    one_more = PassShape(fixed.tokens + 1, fixed.wide_rows)
    # a row's first node: its own call
    row_seconds = max(cost(one_more.grown(1)) - cost(one_more), 0.0)

    def seconds(node: _Node) -> float:
        widens = node.depth == 1 and rows[node.row].width == 1
        first_level = row_host_seconds if node.depth == 1 else 0.0
        return node_seconds + node.draft_seconds + first_level + (row_seconds if widens else 0.0)

    # most expected tokens per second of pass and drafting first
    ranked = sorted(candidates, key=lambda n: (-n.probability / seconds(n), n.depth))
    base_expected = fixed_expected + len(rows)
    widths = [row.width for row in rows]

    def decode_cost(shape: PassShape) -> float:
        return cost(shape) - prefill_seconds

    # lazily: the search stops a few dozen nodes past the best plan, of a thousand at 16 rows
    best_count, _, taken = _best_counts(
        islice(_parents_first(ranked), budget),
        decode_cost,
        fixed,
        widths,
        base_expected,
        min_gain,
        row_host_seconds,
    )
    chosen = taken[:best_count]
    probing = next((i for i, row in enumerate(rows) if row.probe), None)
    probed = best_count == 0 and probing is not None
    if probed:
        # Measure the speculation the forecast rejects, one row per pass: rows that start
        # together come due together, and all of them probing at once makes one pass carry
        # many nodes at a multiple of a plain pass's time. The others stay due for the next passes.
        own = [n for n in islice(_parents_first(ranked), budget) if n.row == probing]
        _, count, _ = _best_counts(
            own, decode_cost, fixed, widths, base_expected, min_gain, row_host_seconds
        )
        chosen = own[:count]
    trees = [_row_tree([n for n in chosen if n.row == i]) for i in range(len(rows))]
    total = fixed_expected + sum(t.expected_tokens for t in trees)
    shape = list(_grown_shapes(fixed, widths, chosen))[-1][1] if chosen else fixed
    host_seconds = sum(n.draft_seconds for n in chosen) + row_host_seconds * len(
        {n.row for n in chosen}
    )
    return TreePlan(trees, shape.tokens, total, cost(shape) + host_seconds, probed and bool(chosen))


def best_draft_pays(
    cost: Callable[[PassShape], float],
    fixed: PassShape,
    expected: float,
    row_width: int,
    depth: int,
    prefill_seconds: float = 0.0,
    row_host_seconds: float = 0.0,
    acceptance: Acceptance = SURE,
) -> bool:
    """Whether a draft of up to `depth` tokens accepted as `acceptance` says (the best
    estimate of any draft yet; by default one sure to be accepted), in a row that brings
    `row_width` tokens (the widest decoding row: the cheapest to grow), would beat the plain
    pass (`expected` tokens, `fixed` shape; terms as in `plan_trees`). Each wide row is
    priced its own call (`PassCost.seconds`), so a plan whose rows each lose to plain loses
    too: one row bounds them all (a test checks this against `plan_trees`). No `MIN_GAIN`
    here: several rows share that margin in a plan. If it would not pay, no draft of any row
    can, and drafting them all is host work thrown away (a large share of an auto step at large
    batches; docs/benchmarks.md, figures behind design choices). One test a step, before any
    drafting."""
    plain_rate = expected / (cost(fixed) - prefill_seconds)
    shape, width = fixed, row_width
    for tokens in range(1, depth + 1):
        shape, width = shape.grown(width), width + 1
        gained = acceptance.expected_tokens(tokens)
        if (expected + gained) / (cost(shape) - prefill_seconds + row_host_seconds) > plain_rate:
            return True
    return False


def _grown_shapes(
    fixed: PassShape, widths: Sequence[int], nodes: Iterable[_Node]
) -> Iterator[tuple[_Node, PassShape]]:
    """Each of `nodes` and the pass's shape once it is added, in order, to rows of `widths`
    tokens (lazily: the search draws nodes only as far as it looks)."""
    grown = list(widths)
    shape = fixed
    for node in nodes:
        shape = shape.grown(grown[node.row])
        grown[node.row] += 1
        yield node, shape


def _best_counts(
    nodes: Iterable[_Node],
    cost: Callable[[PassShape], float],
    fixed: PassShape,
    widths: Sequence[int],
    expected: float,
    min_gain: float,
    row_host_seconds: float = 0.0,
) -> tuple[int, int, list[_Node]]:
    """How many of `nodes`, taken in order, maximize expected tokens per second of pass and
    drafting: the best count (0 unless it beats the plain pass by `min_gain`), the best
    count with at least one node (what a probe verifies), and the nodes looked at. The nodes
    come best first, so the search stops after `PATIENCE` nodes in a row that improve neither
    (pricing every node of a batch's candidates costs more than the step can spare), or
    `PATIENCE_PER_ROW` per row where there are fewer than four. The rate dips where a row's
    first node brings its host work and its own call, until its deeper nodes, interleaved with
    other rows', pay them back; a lone row has one such dip, at its start, and after it only
    bends of the cost curve. Replayed recorded plans chose the same or nearly as good trees in
    less time (docs/benchmarks.md, figures behind design choices)."""
    patience = min(PATIENCE, PATIENCE_PER_ROW * len(widths))
    best_count, best_rate = 0, expected / cost(fixed) * min_gain
    speculative_count, speculative_rate = 0, 0.0
    host_seconds = 0.0  # drafting seconds of the nodes taken, and each speculating row's host work
    speculating: set[int] = set()
    taken: list[_Node] = []
    for node, shape in _grown_shapes(fixed, widths, nodes):
        taken.append(node)
        count = len(taken)
        expected += node.probability
        host_seconds += node.draft_seconds
        if node.row not in speculating:
            speculating.add(node.row)
            host_seconds += row_host_seconds
        rate = expected / (cost(shape) + host_seconds)
        if rate > best_rate:
            best_count, best_rate = count, rate
        if rate > speculative_rate:
            speculative_count, speculative_rate = count, rate
        if count - max(best_count, speculative_count) >= patience:
            break
    return best_count, speculative_count, taken


def _row_nodes(index: int, row: RowCandidates) -> list[_Node]:
    """The distinct prefixes of the row's k_max best drafts (cut to w_max). A node belongs to
    the best draft through it, and a later draft's own nodes below it continue from its
    probability: the mixer learns each draft's first-token estimate only on the rounds its
    first token was its own, and a guess shared with a better draft says no more than that
    draft's (`RequestDrafts.observe`)."""
    best: dict[tuple[int, ...], _Node] = {}
    drafts = 0
    for candidate in sorted(
        row.candidates, key=lambda s: s.acceptance.expected_tokens(row.w_max), reverse=True
    ):
        if drafts == row.k_max:
            break
        tokens = candidate.draft.token_ids[: row.w_max]
        if tokens in best:
            continue  # adds no node
        drafts += 1
        draft, (probability, continuation) = candidate.draft, candidate.acceptance
        for depth in range(
            1, len(tokens) + 1
        ):  # P(node accepted) = P(parent accepted)·c, from p at the root
            prefix = tokens[:depth]
            held = best.get(prefix)
            if held is None:
                best[prefix] = _Node(
                    probability,
                    depth,
                    index,
                    prefix,
                    draft.strategy,
                    draft.rank,
                    candidate.seconds_per_token,
                )
            else:
                probability = held.probability
            probability *= continuation
    return list(best.values())


def _parents_first(nodes: Iterable[_Node]) -> Iterator[_Node]:
    """`nodes` in order, but each held back until its parent is out, so every cut is a tree
    (a cheap draft's node may outrank its parent, whose likeliest draft is a costly one)."""
    emitted: set[tuple[int, tuple[int, ...]]] = set()
    waiting: dict[tuple[int, tuple[int, ...]], list[_Node]] = {}
    for node in nodes:
        if node.depth > 1 and (node.row, node.prefix[:-1]) not in emitted:
            waiting.setdefault((node.row, node.prefix[:-1]), []).append(node)
            continue
        if not waiting:  # nothing held back (most nodes): no queue to walk
            emitted.add((node.row, node.prefix))
            yield node
            continue
        ready = [node]  # the node, then the children it held back, depth first in order
        while ready:
            out = ready.pop()
            emitted.add((out.row, out.prefix))
            yield out
            ready.extend(reversed(waiting.pop((out.row, out.prefix), [])))


def _row_tree(nodes: list[_Node]) -> RowTree:
    """Drafts = the chosen prefixes that no other chosen prefix extends (the leaves)."""
    parents = {n.prefix[:-1] for n in nodes}
    leaves = [n for n in nodes if n.prefix not in parents]
    drafts = [Draft(n.prefix, n.strategy, n.rank) for n in leaves]
    return RowTree(
        drafts,
        len(drafts),
        max((n.depth for n in nodes), default=0),
        1.0 + sum(n.probability for n in nodes),
    )
