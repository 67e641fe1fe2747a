"""Model-running drafts (self-draft, draft model): lossless alone and mixed, greedy and
sampled, in a batch; a draft that is the target itself is always accepted; unfit drafts are
refused at start with errors that say why."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from drafting import ContextNgram, Mixer, TokenHistory, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.model.loader import LoadedModel
from service.model_drafts.draft_checks import IncompatibleDraft, check_draft, check_tokenizers
from service.model_drafts.draft_model import ModelDrafter, model_drafters
from service.model_drafts.self_draft import first_layers
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.engines import NEW_TOKENS, PROMPTS, reference_greedy
from tests.helpers.models import make_tiny_model

MIXES = [
    "self_draft",
    "draft_model",
    "self_draft_staged",
    "draft_model_staged",
    "context+self_draft",
    "context+bigram+draft_model",
    "self_draft+draft_model",
    "context+self_draft_staged",
    "mixed",
]


@pytest.mark.parametrize("strategy", MIXES)
@pytest.mark.parametrize("mode", ["fixed", "auto"])
def test_greedy_is_lossless_alone_and_mixed(
    tiny_model, tiny_engine: Engine, strategy: str, mode: str
) -> None:
    tiny_engine.profile = MEMORY_BOUND
    for prompt in PROMPTS[:2]:
        params = GenerationParams(
            NEW_TOKENS, speculation=SpeculationParams(4, 4, mode), strategy=strategy
        )
        completion = tiny_engine.complete(prompt, params)
        assert completion.token_ids == reference_greedy(tiny_model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("strategy", MIXES)
def test_seeded_sampling_is_lossless_alone_and_mixed(tiny_engine: Engine, strategy: str) -> None:
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    for seed in range(4):
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        plain = tiny_engine.complete(prompt, GenerationParams(24, sampling=sampling))
        spec = tiny_engine.complete(
            prompt,
            GenerationParams(
                24, speculation=SpeculationParams(3, 4), strategy=strategy, sampling=sampling
            ),
        )
        assert spec.token_ids == plain.token_ids


def test_requests_drafted_together_equal_each_alone(tiny_model, tiny_engine: Engine) -> None:
    requests = [
        (p, GenerationParams(20, speculation=SpeculationParams(3, 3), strategy=s))
        for p, s in zip(PROMPTS, ["self_draft", "draft_model", "mixed", "context+self_draft"])
    ]
    for (prompt, params), completion in zip(requests, tiny_engine.complete_many(requests)):
        assert completion.token_ids == reference_greedy(tiny_model, prompt, params.max_new_tokens)


def test_one_draft_pass_a_depth_serves_every_request_and_rows_are_freed(
    tiny_model, tiny_runner
) -> None:
    drafter = ModelDrafter(make_tiny_model(seed=5), "draft_model")
    engine = Engine(tiny_runner, Mixer([drafter]), [], max_context=512)
    assert (
        engine.scheduler.kv_bytes_per_token
        == tiny_runner.kv_bytes_per_token + drafter.kv_bytes_per_token
    )
    passes = []
    forward = drafter.rows.runner.forward
    drafter.rows.runner.forward = lambda cache, rows: passes.append(rows) or forward(cache, rows)  # type: ignore[method-assign]
    params = GenerationParams(12, speculation=SpeculationParams(2, 3), strategy="draft_model")
    requests = [engine.add_request(prompt, params) for prompt in PROMPTS[:3]]
    while not all(r.prefill_remaining == 0 for r in requests):
        engine.step()
    passes.clear()
    engine.step()
    assert len(passes) == 3  # w passes for all three requests: the feed, then two depths
    assert all(sum(row.tree.num_nodes > row.cached for row in rows) == 3 for rows in passes)
    while engine.has_work:
        engine.step()
    assert len(drafter.rows) == 0 and drafter.rows.cache.nbytes == 0


@pytest.mark.parametrize("staged", [False, True], ids=["tree", "staged"])
def test_a_self_draft_in_the_targets_rows_drafts_what_one_with_rows_of_its_own_does(
    tiny_model, tiny_runner, staged: bool
) -> None:
    """The target's entries of its first m layers are the self-draft's: drafting in them needs
    no cache, catch-up or memory of its own, and gives the same drafts."""
    view, lookahead = first_layers(tiny_model, 1), ContextNgram() if staged else None
    shared = ModelDrafter(view, "self_draft", lookahead=lookahead, shares_target_cache=True)
    engine = Engine(tiny_runner, Mixer([shared]), [], max_context=512)
    assert (
        engine.scheduler.kv_bytes_per_token == tiny_runner.kv_bytes_per_token
    )  # nothing of its own
    seen = []
    prepare = shared.prepare

    def recording(asks):
        prepare(asks)
        seen.extend((list(h.token_ids), k, w, shared._prepared[id(h)][2]) for h, k, w in asks)

    shared.prepare = recording  # type: ignore[method-assign]
    params = GenerationParams(16, speculation=SpeculationParams(3, 3), strategy="self_draft")
    requests = [(prompt, params) for prompt in PROMPTS[:3]]
    for (prompt, _), completion in zip(requests, engine.complete_many(requests)):
        assert completion.token_ids == reference_greedy(tiny_model, prompt, 16)
    assert len(seen) >= 9
    own = ModelDrafter(view, "self_draft", lookahead=lookahead)
    for token_ids, k, w, drafts in seen:
        assert own.propose(TokenHistory(token_ids), k, w) == drafts


@pytest.mark.parametrize("w", [1, 3, 6])
def test_the_target_drafting_for_itself_is_always_accepted(tiny_model, tiny_runner, w: int) -> None:
    engine = Engine(
        tiny_runner, Mixer([ModelDrafter(make_tiny_model(), "draft_model")]), [], max_context=512
    )
    params = GenerationParams(
        NEW_TOKENS, speculation=SpeculationParams(2, w), strategy="draft_model"
    )
    completion = engine.complete(PROMPTS[0], params)
    assert completion.token_ids == reference_greedy(tiny_model, PROMPTS[0], NEW_TOKENS)
    assert completion.num_passes == -(-NEW_TOKENS // (w + 1))  # every round: w drafted + the bonus


def test_self_draft_shares_the_targets_weights_and_leaves_it_whole(tiny_model) -> None:
    view = first_layers(tiny_model, 1)
    assert len(view.model.layers) == 1 and view.config.num_hidden_layers == 1
    assert len(tiny_model.model.layers) == 2 and tiny_model.config.num_hidden_layers == 2
    assert view.lm_head is tiny_model.lm_head and view.model.layers[0] is tiny_model.model.layers[0]
    assert view.model.norm is tiny_model.model.norm
    with pytest.raises(ValueError, match=r"in \[1, 1\] for this 2-layer model, got 2"):
        first_layers(tiny_model, 2)


def test_several_self_draft_depths_are_named_by_depth(tiny_model) -> None:
    loaded = LoadedModel(make_tiny_model(num_layers=4), word_tokenizer(64), "tiny", 0.0, False)
    assert [d.name for d in model_drafters(loaded, (2,))] == ["self_draft"]
    assert [d.name for d in model_drafters(loaded, (1, 3))] == ["self_draft_1", "self_draft_3"]
    assert [d.model.config.num_hidden_layers for d in model_drafters(loaded, (None,))] == [
        3
    ]  # 4/5 of 4
    staged = model_drafters(loaded, (2,), staged=True)
    assert [(d.name, d.lookahead is not None) for d in staged] == [
        ("self_draft", False),
        ("self_draft_staged", True),
    ]


def word_tokenizer(size: int, renamed: dict[int, str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `size` tokens t0, t1, ... (some renamed)."""
    vocab = {(renamed or {}).get(i, f"t{i}"): i for i in range(size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))


def test_a_tokenizer_mismatch_names_the_differing_tokens() -> None:
    check_tokenizers(word_tokenizer(64), word_tokenizer(64))
    with pytest.raises(
        IncompatibleDraft,
        match=r"in 2 tokens: 'five' \(target id None, draft id 5\), "
        r"'t5' \(target id 5, draft id None\)",
    ):
        check_tokenizers(word_tokenizer(64), word_tokenizer(64, {5: "five"}))
    with pytest.raises(IncompatibleDraft, match=r"'t64' \(target id 64, draft id None\)"):
        check_tokenizers(word_tokenizer(65), word_tokenizer(64))


def test_a_draft_on_another_dtype_device_or_shorter_context_is_refused(tiny_model) -> None:
    tokenizer = word_tokenizer(64)
    check_draft(tiny_model, make_tiny_model(seed=1), tokenizer, tokenizer)
    with pytest.raises(
        IncompatibleDraft, match="computes in torch.bfloat16, the target in torch.float32"
    ):
        check_draft(tiny_model, make_tiny_model(seed=1).to(torch.bfloat16), tokenizer, tokenizer)
    with pytest.raises(IncompatibleDraft, match=f"is on meta, the target on {tiny_model.device}"):
        check_draft(tiny_model, make_tiny_model(seed=1).to("meta"), tokenizer, tokenizer)
    short = make_tiny_model(seed=1)
    short.config.max_position_embeddings = 128
    with pytest.raises(
        IncompatibleDraft, match=r"context \(128 tokens\) is shorter than the target's \(512\)"
    ):
        check_draft(tiny_model, short, tokenizer, tokenizer)


def test_an_unknown_or_disabled_draft_strategy_is_refused(tiny_tables) -> None:
    with pytest.raises(ValueError, match="unknown strategy 'context\\+self_draft'"):
        default_mixer(tiny_tables).for_request([1, 2], "context+self_draft")
