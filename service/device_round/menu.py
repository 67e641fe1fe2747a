"""Auto mode on the device: one template for the whole step, the one that buys the most tokens
per second.

A device step drafts every row into one template, so the choice is the step's, from a short
menu of templates (the plain root alone, then growing (k, w)): one fixed shape per menu entry
and row count, which is what a recorded graph needs. Each entry is valued as the host
controller values trees: expected tokens a row commits, from measured acceptance, over the
cost profile's price of the pass.

Acceptance is measured per template node, keyed by what the node is (a table node by its
rank path from the root, a context node by its depth), as "accepted, once its parent was":
a key means the same in every template, so rounds of any entry value all of them. A round
commits one token plus the accepted nodes, and a node is accepted only along its path, so a
template's expected tokens are 1 + the sum over its nodes of the product of their path's
rates. The counts decay, so they follow the text being written. A step of the root alone
measures nothing, so after `PROBE_EVERY` of them in a row the next drafts the menu's smallest
tree: where drafts start to pay (the text turns repetitive), the rates find out.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from drafting.recycled import RANK_PRIOR
from service.controller.cost_profile import CostProfile
from service.device_round.template import TreeTemplate

# (k, w) besides the root alone, cut to the rows' maxima; k = 0: the context chain alone (for
# strategies with one). Small entries matter where a pass's price grows with its tokens (a CPU).
MENU = ((0, 1), (1, 1), (0, 2), (1, 2), (0, 4), (2, 3), (4, 4), (0, 8), (8, 6), (8, 8))
CONTEXT_PRIOR = 0.5  # a context node's rate before any round measured it
PRIOR_WEIGHT = 2.0  # the prior counts as this many rounds
DECAY = 0.995  # a round's weight after the next one
# after this many steps of the root alone, one step drafts the smallest tree (to measure)
PROBE_EVERY = 16


class NodeAcceptance:
    """Decaying counts of each node key's trials (its parent accepted) and acceptances."""

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}
        self.priors: list[float] = []
        self.trials = np.zeros(0)
        self.accepted = np.zeros(0)

    def observe(self, template: TreeTemplate, paths: np.ndarray, counts: np.ndarray) -> None:
        """One step's rounds: `paths` [R, W + 1] the accepted nodes by depth, `counts` [R]."""
        ids = self._ids(template)
        if len(ids) == 1:
            return
        on_path = np.zeros((len(counts), template.num_nodes), dtype=bool)
        depth = np.arange(paths.shape[1])
        rows, nodes = np.nonzero(depth[None] <= counts[:, None])
        on_path[rows, paths[rows, nodes]] = True
        parents = np.maximum(np.asarray(template.parents), 0)
        self.trials *= DECAY
        self.accepted *= DECAY
        np.add.at(self.trials, ids[1:], on_path[:, parents[1:]].sum(0))
        np.add.at(self.accepted, ids[1:], on_path[:, 1:].sum(0))

    def expected_tokens(self, template: TreeTemplate) -> float:
        """Tokens a row's round is expected to commit with `template`."""
        ids = self._ids(template)
        rates = (self.accepted[ids] + PRIOR_WEIGHT * np.asarray(self.priors)[ids]) / (
            self.trials[ids] + PRIOR_WEIGHT
        )
        rates[0] = 1.0  # the root: the bonus token, always committed
        # a node is reached with the product of its path's rates: a sum of logs over the ancestor
        # matrix
        return float(np.exp(_ancestors(template) @ np.log(np.maximum(rates, 1e-12))).sum())

    def _ids(self, template: TreeTemplate) -> np.ndarray:
        keys = node_keys(template)
        for key in keys:
            if key not in self.keys:
                self.keys[key] = len(self.priors)
                self.priors.append(_prior(key))
                self.trials, self.accepted = (
                    np.append(self.trials, 0.0),
                    np.append(self.accepted, 0.0),
                )
        return np.array([self.keys[key] for key in keys])


@lru_cache(maxsize=64)
def node_keys(template: TreeTemplate) -> tuple[tuple, ...]:
    """Each node's key: ("root",), ("context", depth) or ("table", rank, rank, ...)."""
    keys: list[tuple] = []
    for node, (parent, rank) in enumerate(zip(template.parents, template.ranks)):
        if parent < 0:
            keys.append(("root",))
        elif rank < 0:
            keys.append(("context", template.depths[node]))
        else:
            keys.append(keys[parent] + (rank,) if keys[parent][0] == "table" else ("table", rank))
    return tuple(keys)


@lru_cache(maxsize=64)
def _ancestors(template: TreeTemplate) -> np.ndarray:
    """[N, N] float: 1 where node j is node i or one of its ancestors."""
    matrix = np.zeros((template.num_nodes, template.num_nodes))
    for node, parent in enumerate(template.parents):
        if parent >= 0:
            matrix[node] = matrix[parent]
        matrix[node, node] = 1.0
    return matrix


def _prior(key: tuple) -> float:
    if key[0] == "context":
        return CONTEXT_PRIOR
    if key[0] == "table":
        return RANK_PRIOR[min(key[-1], len(RANK_PRIOR) - 1)]
    return 1.0


def menu(k_max: int, w_max: int, chain: bool, table: bool) -> list[TreeTemplate]:
    """The templates a step may choose from: the root alone, then the menu's (k, w) cut to the
    rows' maxima (each once)."""
    templates = {TreeTemplate.of(0, 0, 0)}
    for k, w in MENU:
        k, w = min(k, k_max), min(w, w_max)
        if w > 0 and (k > 0 or chain):
            templates.add(TreeTemplate.of(k if table else 0, w, w if chain else 0))
    return sorted(templates, key=lambda t: t.num_nodes)


def row_rate(
    template: TreeTemplate,
    acceptance: NodeAcceptance,
    profile: CostProfile,
    rows: int,
    context: float,
) -> float:
    """A row's expected tokens per second in a step of `rows` rows drafting into `template`."""
    wide = rows if template.num_nodes > 1 else 0
    return acceptance.expected_tokens(template) / profile.cost(
        rows * template.num_nodes, context, rows, wide
    )


def choose(
    templates: list[TreeTemplate],
    acceptance: NodeAcceptance,
    profile: CostProfile,
    rows: int,
    context: float,
) -> TreeTemplate:
    """The template whose step commits the most tokens per second of its pass."""
    return max(
        templates, key=lambda template: row_rate(template, acceptance, profile, rows, context)
    )


class TemplateChooser:
    """`choose` every step, with a probe after `PROBE_EVERY` steps of the root alone."""

    def __init__(self) -> None:
        self.acceptance = NodeAcceptance()
        self.plain_steps = 0

    def __call__(
        self, templates: list[TreeTemplate], profile: CostProfile, rows: int, context: float
    ) -> tuple[TreeTemplate, float]:
        """The step's template, and a row's tokens per second expected of it (the forecast)."""
        chosen = choose(templates, self.acceptance, profile, rows, context)
        if chosen.num_nodes > 1 or len(templates) == 1:
            self.plain_steps = 0
        else:
            self.plain_steps += 1
            if self.plain_steps > PROBE_EVERY:
                self.plain_steps = 0
                chosen = templates[1]  # the smallest that drafts
        return chosen, row_rate(chosen, self.acceptance, profile, rows, context)
