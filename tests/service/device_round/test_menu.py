"""Auto mode on the device: the menu, the acceptance it learns per node, and the choice."""

from __future__ import annotations

import numpy as np

from service.device_round.menu import (
    PROBE_EVERY,
    NodeAcceptance,
    TemplateChooser,
    choose,
    menu,
    node_keys,
)
from service.device_round.template import TreeTemplate
from tests.helpers.costs import COMPUTE_BOUND, MEMORY_BOUND


def test_the_menu_starts_with_the_root_alone_and_keeps_to_the_maxima() -> None:
    templates = menu(4, 3, chain=True, table=True)
    assert templates[0].num_nodes == 1
    assert all(t.k <= 4 and t.w <= 3 and t.chain == t.w for t in templates[1:])
    assert [t.num_nodes for t in templates] == sorted(t.num_nodes for t in templates)
    assert all(t.k == 0 for t in menu(8, 8, chain=True, table=False)[1:])  # the context chain alone


def test_node_keys_mean_the_same_node_in_every_template() -> None:
    small, large = TreeTemplate.of(2, 2, 2), TreeTemplate.of(8, 6, 6)
    assert set(node_keys(small)) <= set(node_keys(large))
    assert node_keys(small)[:3] == (("root",), ("context", 1), ("context", 2))


def _rounds(
    acceptance: NodeAcceptance, template: TreeTemplate, accepted_paths: list[list[int]]
) -> None:
    paths = np.zeros((len(accepted_paths), template.max_depth + 1), dtype=np.int64)
    for row, path in enumerate(accepted_paths):
        paths[row, 1 : len(path) + 1] = path
    acceptance.observe(template, paths, np.array([len(p) for p in accepted_paths]))


def test_measured_acceptance_values_every_template() -> None:
    """Rounds in which the context chain is always accepted to its end: its nodes' rates go to
    1, so a template's expected tokens approach 1 + its chain's length, the table's nodes
    (never accepted) adding nothing."""
    acceptance = NodeAcceptance()
    template = TreeTemplate.of(4, 4, 4)
    before = acceptance.expected_tokens(template)
    for _ in range(400):
        _rounds(acceptance, template, [[1, 2, 3, 4]] * 4)
    assert acceptance.expected_tokens(template) > 4.8 > before
    chain_only = TreeTemplate.of(0, 3, 3)
    assert 3.8 < acceptance.expected_tokens(chain_only) <= 4.0
    assert acceptance.expected_tokens(TreeTemplate.of(0, 0, 0)) == 1.0


def test_the_choice_follows_acceptance_and_the_price_of_a_wider_pass() -> None:
    template = TreeTemplate.of(8, 6, 6)
    templates = menu(8, 6, chain=True, table=True)
    hits, misses = NodeAcceptance(), NodeAcceptance()
    for _ in range(200):
        _rounds(hits, template, [[1, 2, 3, 4, 5, 6]] * 4)  # the context chain accepted to its end
        _rounds(misses, template, [[]] * 4)  # nothing accepted
    assert choose(templates, hits, MEMORY_BOUND, rows=4, context=200).chain == 6
    assert (
        choose(templates, hits, COMPUTE_BOUND, rows=4, context=200).chain == 6
    )  # sure tokens pay even there
    assert choose(templates, misses, COMPUTE_BOUND, rows=4, context=200).num_nodes == 1


def test_after_many_plain_steps_one_step_drafts_the_smallest_tree() -> None:
    """With nothing accepted the root alone is chosen, yet every 17th step probes."""
    chooser = TemplateChooser()
    template = TreeTemplate.of(8, 6, 6)
    for _ in range(200):
        _rounds(chooser.acceptance, template, [[]] * 4)
    templates = menu(8, 6, chain=True, table=True)
    chosen = [
        chooser(templates, COMPUTE_BOUND, 4, 200)[0].num_nodes for _ in range(3 * (PROBE_EVERY + 1))
    ]
    assert chosen.count(templates[1].num_nodes) == 3 and chosen.count(1) == 3 * PROBE_EVERY
