"""Recycled, logit-hint and suffix drafts through the engine: lossless alone and in the mix,
their shared tables fed by every pass, bounded, and updated by requests batched together."""

from __future__ import annotations

import pytest

from drafting import TableSlot, default_mixer
from drafting.recycled import GROWTH
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.request import Status
from service.model.runner import ModelRunner
from tests.helpers.engines import NEW_TOKENS, PROMPTS, reference_greedy
from tests.helpers.models import TINY_VOCAB

NEW_STRATEGIES = ["recycled", "logit", "suffix", "token_recycling", "mixed"]
SPEC = SpeculationParams(4, 4)


@pytest.mark.parametrize("strategy", NEW_STRATEGIES)
@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["mixed", "repetitive"])
def test_seeded_samples_equal_plain_samples(tiny_engine: Engine, prompt, strategy) -> None:
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    plain = tiny_engine.complete(prompt, GenerationParams(NEW_TOKENS, sampling=sampling))
    for _ in range(2):  # the second run drafts from tables the first one filled
        params = GenerationParams(
            NEW_TOKENS, speculation=SPEC, strategy=strategy, sampling=sampling
        )
        assert tiny_engine.complete(prompt, params).token_ids == plain.token_ids


@pytest.mark.parametrize("strategy", ["recycled", "logit", "mixed", "token_recycling"])
def test_every_pass_of_a_speculating_request_refreshes_the_table_it_drafts_from(
    tiny_engine: Engine, strategy
) -> None:
    params = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(1, 1), strategy=strategy)
    out = tiny_engine.complete(PROMPTS[0], params).token_ids
    recycled, baseline = tiny_engine.mixer.successors
    fed, untouched = (baseline, recycled) if strategy == "token_recycling" else (recycled, baseline)
    # the last pass: the node holding the second-to-last token (the root, or the accepted
    # draft) chose the last one, after the token before it (the context's, or the root's)
    assert fed.row(out[-2])[0] == out[-1]
    assert fed.pair_row(out[-3], out[-2]) == (
        [] if strategy == "token_recycling" else fed.row(out[-2])
    )
    assert untouched.passes == 0  # the other table learns only from its own requests' passes
    # allocated at the start, whatever the traffic
    pair_bytes = (1 << fed.pair_bits) * (8 + fed.top_k * 4)
    assert fed.nbytes <= (TINY_VOCAB + GROWTH) * fed.top_k * 4 + pair_bytes


def test_a_request_drafting_from_no_successor_table_hands_over_no_top_tokens(
    tiny_engine: Engine,
) -> None:
    tiny_engine.complete(
        PROMPTS[0], GenerationParams(NEW_TOKENS, speculation=SPEC, strategy="context")
    )
    assert all(table.passes == 0 for table in tiny_engine.mixer.successors)


@pytest.mark.parametrize(
    "speculation", [SpeculationParams(), SpeculationParams(4, 4, "off")], ids=["k=0", "off"]
)
def test_plain_decoding_pays_for_no_table_updates(tiny_engine: Engine, speculation) -> None:
    tiny_engine.complete(PROMPTS[0], GenerationParams(NEW_TOKENS, speculation=speculation))
    assert all(table.passes == 0 for table in tiny_engine.mixer.successors)


def test_recycled_drafts_get_accepted_once_the_table_has_seen_the_text(tiny_engine: Engine) -> None:
    tiny_engine.complete(
        PROMPTS[0], GenerationParams(NEW_TOKENS, speculation=SPEC, strategy="logit")
    )  # reads it too
    again = tiny_engine.complete(
        PROMPTS[0], GenerationParams(NEW_TOKENS, speculation=SPEC, strategy="recycled")
    )
    assert again.accepted_by_strategy["recycled"] > NEW_TOKENS // 4


def test_the_logit_hints_are_the_choosing_nodes_distribution(tiny_engine: Engine) -> None:
    request = tiny_engine.add_request(
        PROMPTS[0], GenerationParams(12, speculation=SPEC, strategy="logit")
    )
    while request.status is not Status.FINISHED:
        tiny_engine.step()
        history = request.drafts.history
        assert history.hints[0] == history.last_token  # greedy: the bonus token is the top one


def test_a_later_request_drafts_from_an_earlier_ones_output(tiny_engine: Engine) -> None:
    first = tiny_engine.complete(PROMPTS[0], GenerationParams(NEW_TOKENS))
    params = GenerationParams(NEW_TOKENS, speculation=SPEC, strategy="suffix")
    repeat = tiny_engine.complete(PROMPTS[0], params)
    assert repeat.token_ids == first.token_ids
    assert repeat.accepted_by_strategy["suffix"] >= NEW_TOKENS // 2  # the first output, replayed


def test_requests_batched_together_update_the_shared_tables(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    engine = Engine(
        tiny_runner,
        default_mixer(tiny_tables, suffix_cache_tokens=64),
        eos_token_ids=[],
        max_context=512,
    )
    index = engine.mixer.suffix
    size = index.nbytes
    requests = [
        (prompt, GenerationParams(NEW_TOKENS, speculation=SPEC, strategy=strategy))
        for prompt in PROMPTS[:3]
        for strategy in ("mixed", "recycled", "suffix", "token_recycling", "logit")
    ]
    for _ in range(2):  # the second batch drafts from what the first one left
        completions = engine.complete_many(requests)
        for (prompt, _), completion in zip(requests, completions):
            assert completion.token_ids == reference_greedy(tiny_model, prompt, NEW_TOKENS)
    assert (
        index.written > 2 * len(requests) * NEW_TOKENS > index.capacity
    )  # every output went in...
    assert index.nbytes == size  # ...within the cap
    assert sum(c.accepted_by_strategy["suffix"] for c in completions) > 0


def test_the_suffix_strategy_is_absent_without_a_cache(
    tiny_runner: ModelRunner, tiny_tables: TableSlot
) -> None:
    mixer = default_mixer(tiny_tables, suffix_cache_tokens=0)
    assert mixer.suffix is None and "suffix" not in mixer.names
