"""Defects the lossless tests must catch: small mistakes in where a draft tree's tokens sit,
what they attend to, or where their KV goes, injected into the pass layout.

Where they are caught: each one fails the pass-level check (every tree node's logits against
decoding its path token by token), in float32 and in bf16 under the rounding rule of
`service/bench/near_ties.py`; and the KV one also parts greedy answers beyond a tie. A random
model attends almost uniformly, so positions barely matter to it: its queries and keys are
scaled up (`peaked`) to attend as a trained model does; even so a wrong position or a masked
root moves its logits by less than the gap between its top two tokens but at near ties, so
greedy answers alone show them only now and then (measured: 0-3 of 3 prompts part, the bf16
ones often at a tie) — which is why the pass-level check exists."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import service.model.runner as runner_module
from drafting import Draft, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.model.attention import PassLayout
from service.model.runner import ModelRunner, RowInput
from service.model.tree import build_tree
from tests.helpers.embedded import compare
from tests.helpers.models import make_tiny_model
from tests.helpers.passes import (
    DRAFTS,
    PROMPT,
    assert_nodes_match,
    assert_nodes_within_rounding,
    prefilled,
)

# k=4 w=4 trees and the root: the defects touch rows of 2..17 tokens, never a prompt
TREE_NODES = 17
PROMPTS = [[5, 9, 13, 2, 6] * 5, [7, 7, 3, 1, 8, 4] * 4, [11, 12, 13, 14, 15, 16, 17, 18] * 3]
NEW_TOKENS = 40
Defect = Callable[[PassLayout], None]


def _tree_rows(layout: PassLayout) -> list[tuple[int, int, int]]:
    """(row, first flat token, width) of the rows that carry a draft tree."""
    return [
        (row, offset, width)
        for row, (offset, width) in enumerate(zip(layout.offsets, layout.widths))
        if 2 <= width <= TREE_NODES
    ]


def position_off_by_one(layout: PassLayout) -> None:
    """Every draft node one position further than its depth."""
    for _, offset, width in _tree_rows(layout):
        layout.position_ids[0, offset + 1 : offset + width] += 1


def mask_bit_flipped(layout: PassLayout) -> None:
    """A tree's last node does not see the tree's root, its ancestor."""
    for row, offset, width in _tree_rows(layout):
        root = int(layout.write_positions[offset])
        if layout.batched_mask is not None and row < layout.batched_mask.shape[0]:
            slots = layout.batched_mask.shape[2] // layout.query_groups
            layout.batched_mask[row, 0, width - 1 :: slots, root] = float("-inf")
        if row in layout.row_masks:
            layout.row_masks[row][0, 0, width - 1 :: width, root] = float("-inf")


def kv_from_the_wrong_row(layout: PassLayout) -> None:
    """The last node of each tree row writes its KV entry into the next row."""
    for row, offset, width in _tree_rows(layout):
        if layout.rows > 1:
            layout.write_rows[offset + width - 1] = (row + 1) % layout.rows


DEFECTS = [position_off_by_one, mask_bit_flipped, kv_from_the_wrong_row]
ROW_PROMPTS = [PROMPT, [7, 3], list(range(2, 40)), [11, 12, 13]]
ROW_DRAFTS = [DRAFTS, [Draft((4, 5), "x")], DRAFTS, [Draft((6,), "x"), Draft((8, 9), "x")]]


def injected(monkeypatch: pytest.MonkeyPatch, defect: Defect) -> None:
    original = runner_module.build_layout

    def faulty(*args, **kwargs) -> PassLayout:
        layout = original(*args, **kwargs)
        defect(layout)
        return layout

    monkeypatch.setattr(runner_module, "build_layout", faulty)


def check_pass(model, check, monkeypatch: pytest.MonkeyPatch, defect: Defect | None) -> None:
    """Four rows with trees in one pass (batched and separate calls), checked node by node."""
    runner = ModelRunner(model)
    cache = prefilled(runner, ROW_PROMPTS)
    trees = [build_tree(prompt[-1], drafts) for prompt, drafts in zip(ROW_PROMPTS, ROW_DRAFTS)]
    if defect is not None:
        injected(monkeypatch, defect)
    logits = runner.forward(cache, [RowInput(tree) for tree in trees])
    for prompt, tree, row_logits in zip(ROW_PROMPTS, trees, logits):
        check(model, prompt, tree, row_logits)


def peaked(model, factor: float = 4.0):
    """`model` with its queries and keys scaled by `factor`: attention peaked as a trained
    model's, where random weights attend almost uniformly and ignore positions (unscaled, a
    wrong position moved bf16 logits less than their rounding)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= factor
            layer.self_attn.k_proj.weight *= factor
    return model


CHECKS = {
    "float32": (torch.float32, assert_nodes_match),
    "bf16": (torch.bfloat16, assert_nodes_within_rounding),
}


@pytest.mark.parametrize("dtype", CHECKS)
def test_the_pass_check_holds_without_a_defect(dtype: str, monkeypatch) -> None:
    torch_dtype, check = CHECKS[dtype]
    check_pass(peaked(make_tiny_model(seed=3)).to(torch_dtype), check, monkeypatch, None)


@pytest.mark.parametrize("dtype", CHECKS)
@pytest.mark.parametrize("defect", DEFECTS, ids=lambda d: d.__name__)
def test_an_injected_defect_fails_the_pass_check(dtype: str, defect: Defect, monkeypatch) -> None:
    torch_dtype, check = CHECKS[dtype]
    with pytest.raises(AssertionError):
        check_pass(peaked(make_tiny_model(seed=3)).to(torch_dtype), check, monkeypatch, defect)


def judged(model, prompts: list[list[int]]) -> tuple[list[str], int]:
    """Each prompt's speculative answer (all in one batch, k=4 w=4 context drafts) judged
    against its plain answer by the near-tie rule; and the draft tokens accepted."""
    engine = Engine(ModelRunner(model), default_mixer(None), eos_token_ids=[], max_context=512)
    plain = [
        engine.complete(
            p, GenerationParams(NEW_TOKENS, speculation=SpeculationParams(mode="off"))
        ).token_ids
        for p in prompts
    ]
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(4, 4), strategy="context")
    completions = engine.complete_many([(p, params) for p in prompts])
    accepted = sum(sum(c.accepted_by_strategy.values()) for c in completions)
    return [
        compare(model, p, c.token_ids, want) for p, c, want in zip(prompts, completions, plain)
    ], accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_greedy_answers_part_beyond_a_tie_only_with_a_defect(
    dtype: torch.dtype, monkeypatch
) -> None:
    model = make_tiny_model(seed=5).to(dtype)
    clean, accepted = judged(model, PROMPTS)
    assert all(outcome in ("identical", "tie") for outcome in clean), clean
    assert accepted >= 20  # trees were verified: the defect below had passes to corrupt
    injected(monkeypatch, kv_from_the_wrong_row)
    faulty, _ = judged(model, PROMPTS)
    print(
        f"\n{dtype}: clean {clean}, {accepted} draft tokens accepted; "
        f"a KV entry in the wrong row: {faulty}"
    )
    assert any(outcome.startswith("differs") for outcome in faulty), faulty
