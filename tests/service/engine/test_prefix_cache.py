"""The prefix cache (`service/model/prefix_cache.py`) and its use by the scheduler: what is found
and what is not, eviction within the KV budget, and engine output identical with and without it
(greedy and seeded, speculating or not, shared prefixes concurrent, evicted mid-burst)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from drafting import default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.scheduler import SchedulerConfig
from service.model.kv_cache import TreeKVCache
from service.model.prefix_cache import BLOCK_TOKENS, PrefixCache
from service.model.runner import ModelRunner
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.engines import make_engine, reference_greedy

LAYERS, HEADS, DIM = 2, 1, 4
ENTRY_BYTES = 2 * LAYERS * HEADS * DIM * 4  # keys and values, float32
BLOCK_BYTES = BLOCK_TOKENS * ENTRY_BYTES
SHARED = list(range(3, 3 + 2 * BLOCK_TOKENS + 5))  # two whole blocks and a part


def computed_row(cache: TreeKVCache, tokens: int, seed: int = 0) -> int:
    """A new row holding `tokens` entries of random keys and values (as a pass would leave it)."""
    generator = torch.Generator().manual_seed(seed)
    row = cache.add_row()
    keys, values = (torch.randn(LAYERS, HEADS, tokens, DIM, generator=generator) for _ in range(2))
    cache.append_entries(row, [(keys, values)])
    return row


def unbounded() -> int:
    return 2**40


def test_a_prompt_finds_the_whole_blocks_it_starts_with_and_gets_their_entries() -> None:
    cache, prefix = TreeKVCache(LAYERS, rows=0), PrefixCache(unbounded)
    source = computed_row(cache, len(SHARED))
    prefix.store(cache, source, SHARED)
    assert prefix.num_blocks == 2 and prefix.nbytes == 2 * BLOCK_BYTES
    row = cache.add_row()
    assert prefix.load(cache, row, SHARED + [99]) == 2 * BLOCK_TOKENS
    assert cache.lengths[row] == 2 * BLOCK_TOKENS
    for mine, theirs in zip(cache.entries(row, 0, 32), cache.entries(source, 0, 32)):
        assert torch.equal(mine, theirs)
    assert (prefix.stats.queried_tokens, prefix.stats.hit_tokens) == (
        len(SHARED) + 1,
        2 * BLOCK_TOKENS,
    )


@pytest.mark.parametrize(
    "prompt, hit",
    [
        (
            SHARED[: BLOCK_TOKENS + 1],
            BLOCK_TOKENS,
        ),  # ends one token past a block: the block, the last token to compute
        (
            SHARED[:BLOCK_TOKENS],
            0,
        ),  # ends on a block's edge: its last token must be computed, so the block is not whole
        (SHARED[: BLOCK_TOKENS + 7], BLOCK_TOKENS),  # ends inside the second block
        (SHARED, 2 * BLOCK_TOKENS),  # the very prompt that was cached
        (SHARED[:5] + [1] + SHARED[6:], 0),  # differs inside the first block
        (
            [1] * BLOCK_TOKENS + SHARED[BLOCK_TOKENS:],
            0,
        ),  # the second block's tokens after another first block
    ],
)
def test_only_the_same_tokens_at_the_same_positions_hit(prompt: list[int], hit: int) -> None:
    cache, prefix = TreeKVCache(LAYERS, rows=0), PrefixCache(unbounded)
    prefix.store(cache, computed_row(cache, len(SHARED)), SHARED)
    assert prefix.load(cache, cache.add_row(), prompt) == hit


def test_blocks_are_stored_only_as_far_as_the_row_is_committed() -> None:
    cache, prefix = TreeKVCache(LAYERS, rows=0), PrefixCache(unbounded)
    # a prompt in the middle of its prefill
    prefix.store(cache, computed_row(cache, BLOCK_TOKENS + 3), SHARED)
    assert prefix.num_blocks == 1


def test_eviction_keeps_to_the_room_and_drops_the_least_recently_used_end_first() -> None:
    room = [3 * BLOCK_BYTES]
    cache, prefix = TreeKVCache(LAYERS, rows=0), PrefixCache(lambda: room[0])
    first = list(range(100, 100 + 4 * BLOCK_TOKENS))
    prefix.store(cache, computed_row(cache, len(first)), first)
    assert (
        prefix.num_blocks == 3 and prefix.nbytes <= room[0]
    )  # no room for the fourth: its chain is kept
    second = list(range(500, 500 + BLOCK_TOKENS))
    prefix.store(cache, computed_row(cache, len(second), seed=1), second)
    assert prefix.nbytes <= room[0] and prefix.peek(second) == BLOCK_TOKENS
    assert prefix.peek(first) == 2 * BLOCK_TOKENS  # the first chain lost its end, not its start
    room[0] = BLOCK_BYTES
    prefix.evict_until(room[0])
    assert (
        prefix.num_blocks == 1 and prefix.peek(second) == BLOCK_TOKENS
    )  # the most recently used stays
    assert prefix.stats.evicted_blocks == 3


def test_evicting_a_block_drops_the_blocks_after_it_and_frees_their_memory() -> None:
    cache, prefix = TreeKVCache(LAYERS, rows=0), PrefixCache(unbounded)
    prefix.store(cache, computed_row(cache, len(SHARED)), SHARED)
    alive = [weakref.ref(block.keys) for block in prefix.match(SHARED)]
    # the first block is now the most recent: the second goes first
    prefix.match(SHARED[:BLOCK_TOKENS])
    prefix.evict_until(BLOCK_BYTES)
    assert prefix.peek(SHARED) == BLOCK_TOKENS
    prefix.clear()
    gc.collect()
    assert prefix.nbytes == 0 and prefix.num_blocks == 0 and not any(ref() for ref in alive)


# --- the engine ----------------------------------------------------------------------------

SYSTEM = [(7 * i) % 60 + 2 for i in range(40)]  # a shared "system prompt" of two and a half blocks
PROMPTS = [
    SYSTEM + [5, 9, 13],
    SYSTEM + [21, 4, 4, 8, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42],
    SYSTEM[: BLOCK_TOKENS + 1],  # ends one token past a block
    SYSTEM + [5, 9, 13],  # the very same prompt again
    SYSTEM[:33] + [50, 51],  # ends inside a block, after two shared blocks
]
LOGPROB_TOLERANCE = 1e-5
SPECULATION = {
    "off": SpeculationParams(0, 0),
    "fixed": SpeculationParams(4, 4),
    "auto": SpeculationParams(4, 4, "auto"),
}


def engine_with(tiny_runner, tiny_tables, prefix_cache: bool, **limits: int) -> Engine:
    return make_engine(tiny_runner, tiny_tables, prefix_cache=prefix_cache, **limits)


def run_in_waves(
    engine: Engine, params: GenerationParams, budget: int | None = None
) -> list[tuple[list[int], list[float]]]:
    """Every prompt, in two waves: the first two together (sharing the system prompt while it
    is prefilled), then the rest together (finding it cached); each request's tokens and their
    logprobs (which any change of a KV entry would move). Checks the KV budget each step."""
    outputs = []
    params = dataclasses.replace(params, logprobs=0)
    for wave in (PROMPTS[:2], PROMPTS[2:]):
        requests = [engine.add_request(prompt, params) for prompt in wave]
        logprobs: dict[int, list[float]] = {id(r): [] for r in requests}
        while engine.has_work:
            results, _ = engine.step()
            for request, out in results:
                assert not isinstance(out, Exception)
                logprobs[id(request)] += [lp.logprob for lp in out.logprobs or []]
            scheduler = engine.scheduler
            if budget is not None:
                cached = scheduler.prefix.nbytes if scheduler.prefix else 0
                assert scheduler.memory_bound(scheduler.running) + cached <= budget
        outputs += [(r.output_ids, logprobs[id(r)][: r.num_generated]) for r in requests]
    return outputs


def assert_same(
    outputs: list[tuple[list[int], list[float]]], expected: list[tuple[list[int], list[float]]]
) -> None:
    """The same tokens, and logprobs equal but for float rounding: a prompt prefilled in other
    chunks, or a cached block's entries where a pass computed them, may round its last bits
    differently on this (torch) path; a wrong entry moves them by far more."""
    assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, reference) in zip(outputs, expected):
        assert logprobs == pytest.approx(reference, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("mode", list(SPECULATION))
@pytest.mark.parametrize("seed", [None, 11])
def test_output_is_the_same_with_and_without_the_cache(
    tiny_runner, tiny_tables, mode: str, seed: int | None
) -> None:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.9, seed=seed)
    params = GenerationParams(24, speculation=SPECULATION[mode], sampling=sampling)
    cached = engine_with(tiny_runner, tiny_tables, True)
    assert_same(
        run_in_waves(cached, params),
        run_in_waves(engine_with(tiny_runner, tiny_tables, False), params),
    )
    stats = cached.scheduler.prefix.stats
    # the second wave found the system prompt: all but its last part-block, in 3 of its 3 prompts
    assert stats.hit_tokens >= 2 * BLOCK_TOKENS * 2 + BLOCK_TOKENS


def test_greedy_output_with_the_cache_is_plain_decoding(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    outputs = run_in_waves(engine_with(tiny_runner, tiny_tables, True), GenerationParams(24))
    assert [tokens for tokens, _ in outputs] == [
        reference_greedy(tiny_model, prompt, 24) for prompt in PROMPTS
    ]


def test_a_prompt_being_prefilled_is_computed_once(tiny_runner, tiny_tables) -> None:
    """Requests that arrive together with the same long prompt (the samples of `n`): the first
    prefills it, the others wait for it and find it cached."""
    engine = engine_with(tiny_runner, tiny_tables, True, max_tokens_per_pass=16)
    requests = [engine.add_request(PROMPTS[0], GenerationParams(8)) for _ in range(3)]
    prefilled = 0
    while engine.has_work:
        _, stats = engine.step()
        prefilled += stats.prefill_tokens if stats else 0
    whole_blocks = (len(PROMPTS[0]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert prefilled == (len(PROMPTS[0]) - 1) + 2 * (len(PROMPTS[0]) - 1 - whole_blocks)
    assert requests[1].output_ids == requests[2].output_ids == requests[0].output_ids


def test_blocks_are_evicted_within_the_budget_mid_burst(tiny_runner, tiny_tables) -> None:
    """A budget of a few rows: cached blocks give way to admissions, outputs stay the same."""
    bytes_per_token = tiny_runner.kv_bytes_per_token
    budget = 3 * 512 * bytes_per_token  # three rows of the capacity these requests reach
    params = GenerationParams(300)  # rows of up to 343 entries: capacity 512
    cached = engine_with(tiny_runner, tiny_tables, True, kv_cache_bytes=budget)
    with_cache = run_in_waves(cached, params, budget)
    assert_same(
        with_cache,
        run_in_waves(engine_with(tiny_runner, tiny_tables, False, kv_cache_bytes=budget), params),
    )
    assert (
        cached.scheduler.prefix.stats.evicted_blocks > 0
        and cached.scheduler.prefix.stats.hit_tokens > 0
    )
    assert cached.cache.nbytes == 0  # every row left: the rows' buffers are gone


def test_the_suffix_strategy_still_drafts_a_repeated_prompts_earlier_output(
    tiny_runner, tiny_tables
) -> None:
    """A prompt sent again is read from the cache, but its drafts see the whole prompt as
    before: the suffix index proposes the first answer, as without the cache."""
    params = GenerationParams(32, speculation=SpeculationParams(1, 8), strategy="suffix")
    accepted = {}
    for prefix_cache in (True, False):
        engine = Engine(
            tiny_runner,
            default_mixer(tiny_tables),
            eos_token_ids=[],
            max_context=512,
            scheduler_config=SchedulerConfig(prefix_cache=prefix_cache),
        )
        engine.profile = MEMORY_BOUND
        first = engine.complete(PROMPTS[0], params)
        again = engine.complete(PROMPTS[0], params)
        assert again.token_ids == first.token_ids
        accepted[prefix_cache] = again.num_accepted_tokens
    assert accepted[True] == accepted[False] > 16


@pytest.mark.parametrize("path", ["gguf", "gguf-int8"])
def test_a_second_turn_reads_the_first_turns_prompt_and_answer_on_the_packed_path(
    path, request
) -> None:
    """A second turn that starts with the first turn's prompt and answer reads both from the
    cache and decodes the same. On `gguf-int8` (float16 KV) every token's entries have the
    same bits in any chunk and any pass, a prompt's or a decoded token's: logprobs are
    bit-identical. On `gguf` a decoded token's entries come from the one-row kernels and a
    prompt's from the many-row ones, which round differently: equal to the last bits."""
    from service.kernels.int8_kernel import int8_supported

    if path == "gguf-int8" and not int8_supported():
        pytest.skip("the CPU has neither AVX2 nor AVX-512 VNNI")
    model = request.getfixturevalue("tiny_packed" if path == "gguf" else "tiny_int8")[1]
    runner = ModelRunner(model)
    params = GenerationParams(40, speculation=SpeculationParams(4, 4, "auto"), logprobs=0)
    turns = {}
    for prefix_cache in (True, False):
        engine = Engine(
            runner,
            default_mixer(),
            eos_token_ids=[],
            max_context=512,
            scheduler_config=SchedulerConfig(prefix_cache=prefix_cache),
        )
        engine.profile = MEMORY_BOUND
        first = engine.complete(PROMPTS[1], params)
        second = engine.complete(PROMPTS[1] + first.token_ids + [7, 8, 9], params)
        turns[prefix_cache] = [
            (c.token_ids, [lp.logprob for lp in c.logprobs]) for c in (first, second)
        ]
        if prefix_cache:  # the second turn read the first's prompt and answer
            assert (
                engine.scheduler.prefix.stats.hit_tokens
                == (len(PROMPTS[1]) + 40 + 2) // BLOCK_TOKENS * BLOCK_TOKENS
            )
    if path == "gguf-int8":
        assert turns[True] == turns[False]
    assert_same(turns[True], turns[False])
