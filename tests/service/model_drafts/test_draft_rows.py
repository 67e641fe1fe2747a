"""The draft model's KV rows follow the committed tokens: after full acceptance, partial
acceptance and rejection a row holds exactly the entries a fresh draft pass would compute;
requests drafted in one batch get the drafts each would get alone, and rows are freed."""

from __future__ import annotations

import pytest
import torch

from drafting import ContextNgram, TokenHistory
from service.model_drafts.draft_model import ModelDrafter
from service.model_drafts.draft_rows import matching_path
from tests.helpers.models import make_tiny_model

PROMPT = [5, 9, 13, 2, 7, 7, 30]
K, W = 3, 4


@pytest.fixture
def drafter() -> ModelDrafter:
    return ModelDrafter(make_tiny_model(seed=2), "draft_model")


def fresh_entries(drafter: ModelDrafter, token_ids: list[int]) -> torch.Tensor:
    """Layer 0's keys of the draft model run over `token_ids` from scratch: [1, heads, n, d]."""
    with torch.inference_mode():
        out = drafter.model(torch.tensor([token_ids], device=drafter.model.device), use_cache=True)
    return out.past_key_values.layers[0].keys


def held_keys(drafter: ModelDrafter, history: TokenHistory) -> tuple[list[int], torch.Tensor]:
    """The tokens of `history` a request's row holds entries for (committed, then the path of
    its scratch tree that `history` continues with), and layer 0's keys of them [1, heads, n, d]."""
    row = drafter.rows.row(history)
    committed = len(row.token_ids)
    path = (
        matching_path(row.scratch, history.token_ids[committed:]) if row.scratch is not None else []
    )
    slots = [*range(committed), *(committed + node for node in path)]
    keys = drafter.rows.cache.layers[0].keys[row.index : row.index + 1, :, slots]
    return history.token_ids[: len(slots)], keys


def assert_in_step(drafter: ModelDrafter, history: TokenHistory) -> None:
    held, keys = held_keys(drafter, history)
    assert held == history.token_ids[: len(held)] and len(held) < len(history)
    assert torch.allclose(keys, fresh_entries(drafter, held), atol=1e-5)


@pytest.mark.parametrize(
    "commit",
    [
        lambda drafts: [
            *drafts[0].token_ids,
            11,
        ],  # full acceptance of the best branch, then a bonus
        lambda drafts: [*drafts[2].token_ids[:2], 11],  # partial acceptance of another branch
        lambda drafts: [63],  # rejection: only the bonus token
    ],
    ids=["full", "partial", "rejected"],
)
def test_the_cache_keeps_what_was_committed_and_drops_the_rest(
    drafter: ModelDrafter, commit
) -> None:
    history = TokenHistory(PROMPT)
    drafts = drafter.propose(history, K, W)
    assert len(drafts) == K and all(len(d.token_ids) == W for d in drafts)
    committed = commit(drafts)
    history.extend(committed)
    drafter.propose(history, K, W)  # syncs, then drafts the next tree on top
    held, keys = held_keys(drafter, history)
    assert held == history.token_ids  # everything committed is in the row now
    assert torch.allclose(keys, fresh_entries(drafter, history.token_ids), atol=1e-5)


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_accepted_draft_entries_are_reused_not_recomputed(
    drafter: ModelDrafter, accepted: int
) -> None:
    history = TokenHistory(PROMPT)
    drafts = drafter.propose(history, K, W)
    history.extend([*drafts[1].token_ids[:accepted], 11])
    fed = drafter.rows.sync(drafter.rows.row(history), history.token_ids)
    assert fed == history.token_ids[len(PROMPT) + accepted :]  # the kept branch plus what is new
    assert_in_step(drafter, history)


def test_a_history_the_row_never_saw_starts_over(drafter: ModelDrafter) -> None:
    history = TokenHistory(PROMPT)
    drafter.propose(history, K, W)
    row = drafter.rows.row(history)
    assert drafter.rows.sync(row, [5, 9, 1, 1]) == [
        1,
        1,
    ]  # diverges after two tokens: rolled back to them
    assert drafter.rows.cache.lengths[row.index] == 2


def test_drafts_are_the_draft_models_top_branches_continued_greedily(drafter: ModelDrafter) -> None:
    history = TokenHistory(PROMPT)
    drafts = drafter.propose(history, K, W)
    with torch.inference_mode():
        first = (
            drafter.model(torch.tensor([PROMPT], device=drafter.model.device))
            .logits[0, -1]
            .topk(K)
            .indices.tolist()
        )
        assert [d.token_ids[0] for d in drafts] == first
        for draft in drafts:
            ids = [*PROMPT, draft.token_ids[0]]
            for token in draft.token_ids[1:]:
                assert (
                    int(
                        drafter.model(torch.tensor([ids], device=drafter.model.device))
                        .logits[0, -1]
                        .argmax()
                    )
                    == token
                )
                ids.append(token)
    assert [d.rank for d in drafts] == list(range(K))
    assert drafter.seconds_per_token > 0


def test_requests_drafted_in_one_batch_get_what_each_gets_alone(drafter: ModelDrafter) -> None:
    prompts = [PROMPT, [3, 4, 5], list(range(2, 30)), [60, 61]]
    asks = [(TokenHistory(p), k, w) for p, k, w in zip(prompts, [3, 1, 2, 4], [4, 2, 1, 3])]
    drafter.prepare(asks)
    batched = [drafter.propose(h, k, w) for h, k, w in asks]
    for (history, k, w), drafts in zip(asks, batched):
        alone = ModelDrafter(drafter.model, "draft_model").propose(
            TokenHistory(history.token_ids), k, w
        )
        assert [d.token_ids for d in drafts] == [d.token_ids for d in alone]
        held, keys = held_keys(drafter, history)
        assert held == history.token_ids and torch.allclose(
            keys, fresh_entries(drafter, held), atol=1e-5
        )
    # a second round, after each request committed some of its drafts: still each as alone
    for (history, _, _), drafts in zip(asks, batched):
        history.extend([*drafts[-1].token_ids[:1], 11])
    drafter.prepare(asks)
    for history, k, w in asks:
        alone = ModelDrafter(drafter.model, "draft_model").propose(
            TokenHistory(history.token_ids), k, w
        )
        assert [d.token_ids for d in drafter.propose(history, k, w)] == [d.token_ids for d in alone]


def test_a_finished_request_frees_its_row_and_memory_returns(drafter: ModelDrafter) -> None:
    one, two = TokenHistory(PROMPT), TokenHistory([3, 4, 5])
    drafter.prepare([(one, 2, 2), (two, 2, 2)])
    assert len(drafter.rows) == 2 and drafter.rows.cache.nbytes > 0
    drafts = drafter.propose(two, 2, 2)
    drafter.release(one)  # the other row moves into the freed slot and keeps its committed entries
    assert len(drafter.rows) == 1
    two.extend([*drafts[0].token_ids, 7])  # its drafts accepted: their entries did not move with it
    drafter.propose(two, 2, 2)
    held, keys = held_keys(drafter, two)
    assert held == two.token_ids and torch.allclose(keys, fresh_entries(drafter, held), atol=1e-5)
    drafter.release(two)
    assert len(drafter.rows) == 0 and drafter.rows.cache.nbytes == 0


@pytest.mark.parametrize(
    "prompt", [PROMPT, [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3]], ids=["mixed", "repetitive"]
)
def test_a_staged_chain_is_the_draft_models_greedy_chain(
    drafter: ModelDrafter, prompt: list[int]
) -> None:
    staged = ModelDrafter(drafter.model, "staged", lookahead=ContextNgram())
    history = TokenHistory(prompt)
    plain_drafts, staged_drafts = drafter.propose(history, K, 6), staged.propose(history, K, 6)
    assert staged_drafts[0].token_ids == plain_drafts[0].token_ids  # same chain, fewer draft passes
    assert [d.token_ids for d in staged_drafts[1:]] == [d.token_ids[:1] for d in plain_drafts[1:]]
    history.extend([*staged_drafts[0].token_ids[:4], 11])
    staged.propose(history, K, 6)
    held, keys = held_keys(staged, history)
    assert held == history.token_ids
    assert torch.allclose(keys, fresh_entries(drafter, history.token_ids), atol=1e-5)
