"""Continuous batching: requests share every pass, and none notices the others."""

from __future__ import annotations

import pytest

from drafting import Acceptance
from service.controller.calibration import HostCost
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.request import Status
from service.engine.scheduler import (
    CPU_MAX_RUNNING_REQUESTS,
    CPU_PREFILL_TOKENS_WHILE_DECODING,
    GPU_MAX_RUNNING_REQUESTS,
    DoesNotFit,
    Scheduler,
    SchedulerConfig,
)
from tests.helpers.batch import LENGTHS, MODES, PROMPTS
from tests.helpers.costs import gpu_like, linear_profile
from tests.helpers.engines import make_engine, reference_greedy


def test_greedy_outputs_in_a_batch_equal_each_request_alone(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    engine = make_engine(tiny_runner, tiny_tables)
    requests = [(p, GenerationParams(n, speculation=s)) for p, n, s in zip(PROMPTS, LENGTHS, MODES)]
    completions = engine.complete_many(requests)
    for (prompt, params), completion in zip(requests, completions):
        assert completion.token_ids == reference_greedy(tiny_model, prompt, params.max_new_tokens)
        assert completion.finish_reason == "length"
    assert engine.cache.nbytes == 0 and engine.cache.num_rows == 0  # memory back to idle


def test_seeded_samples_in_a_batch_equal_each_request_alone(tiny_runner, tiny_tables) -> None:
    engine = make_engine(tiny_runner, tiny_tables)
    sampling = [
        SamplingParams(temperature=t, top_p=0.9, seed=s) for t, s in [(1.0, 1), (0.7, 2), (1.3, 3)]
    ]
    requests = [
        (p, GenerationParams(16, speculation=m, sampling=s))
        for p, m, s in zip(PROMPTS, MODES[1:], sampling)
    ]
    together = engine.complete_many(requests)
    for request, completion in zip(requests, together):
        alone = engine.complete(*request)
        plain = engine.complete(request[0], GenerationParams(16, sampling=request[1].sampling))
        assert completion.token_ids == alone.token_ids == plain.token_ids


def test_requests_join_and_leave_mid_stream(tiny_model, tiny_runner, tiny_tables) -> None:
    engine = make_engine(tiny_runner, tiny_tables)
    first = engine.add_request(PROMPTS[0], GenerationParams(30, speculation=MODES[1]))
    for _ in range(3):
        engine.step()
    second = engine.add_request(PROMPTS[3], GenerationParams(20, speculation=MODES[2]))
    leaver = engine.add_request(PROMPTS[1], GenerationParams(30, speculation=MODES[0]))
    for _ in range(2):
        engine.step()
    engine.abort(leaver)
    while engine.has_work:
        engine.step()
    assert first.output_ids == reference_greedy(tiny_model, PROMPTS[0], 30)
    assert second.output_ids == reference_greedy(tiny_model, PROMPTS[3], 20)
    assert leaver.finish_reason == "abort" and 0 < len(leaver.output_ids) < 30
    assert (
        leaver.output_ids == reference_greedy(tiny_model, PROMPTS[1], 30)[: len(leaver.output_ids)]
    )


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    engine = make_engine(tiny_runner, tiny_tables, max_tokens_per_pass=12)
    streaming = engine.add_request(PROMPTS[0], GenerationParams(30))
    engine.step()  # prefill and first token
    long = engine.add_request(list(range(2, 60)) * 3, GenerationParams(8))
    steps_while_prefilling = 0
    while long.num_generated == 0:
        results, stats = engine.step()
        assert streaming in [r for r, _ in results]  # the stream got its round this pass too
        assert stats is not None and stats.tokens <= 12
        steps_while_prefilling += 1
    assert long.prefill_remaining == 0  # the last chunk carried its first round
    assert steps_while_prefilling >= (3 * 58 - 1) // 11  # chunks of at most 11 prompt tokens
    while engine.has_work:
        engine.step()
    assert long.output_ids == reference_greedy(tiny_model, list(range(2, 60)) * 3, 8)
    assert streaming.output_ids == reference_greedy(tiny_model, PROMPTS[0], 30)


def test_prompt_chunks_are_capped_while_others_decode(tiny_model, tiny_runner, tiny_tables) -> None:
    engine = make_engine(
        tiny_runner,
        tiny_tables,
        max_tokens_per_pass=24,
        max_prefill_tokens_while_decoding=5,
        prefix_cache=False,
    )  # the joining prompt starts as the first: it would be cached
    prompt = list(range(2, 60))
    first = engine.add_request(prompt[:20], GenerationParams(40))
    _, stats = engine.step()
    assert stats is not None and stats.prefill_tokens == 19  # nothing decodes: the whole prompt
    # (a prompt's last token is not cached by its prefill: it is the root of the first tree)
    decoding = [first, *(engine.add_request(p, GenerationParams(40)) for p in PROMPTS[:3])]
    while any(r.prefill_remaining for r in decoding):
        engine.step()
    joining = engine.add_request(prompt, GenerationParams(4))
    chunks = []
    while joining.num_generated == 0:  # 4 rows decode, 1 prefills: its share (4) is under the cap
        _, stats = engine.step()
        assert stats is not None
        chunks.append(stats.prefill_tokens)
    assert max(chunks) == 5 and sum(chunks) == len(prompt) - 1
    while engine.has_work:
        engine.step()
    assert joining.output_ids == reference_greedy(tiny_model, prompt, 4)
    for request in decoding:
        assert request.output_ids == reference_greedy(tiny_model, request.prompt_ids, 40)


def test_prompt_chunks_beside_decoding_streams_are_priced_by_the_engines_profile(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    """The profile the engine is given prices the chunks: 10 ms + 1 ms a token keeps a pass of
    2 streams within 30.5 ms at 20 tokens, 18 of them the joining prompt's."""
    engine = make_engine(tiny_runner, tiny_tables, prefill_pass_ms=30.5, prefix_cache=False)
    engine.profile = linear_profile(0.010, 0.001)
    streams = [engine.add_request(p, GenerationParams(40)) for p in PROMPTS[:2]]
    while any(r.prefill_remaining for r in streams):
        engine.step()
    prompt = list(range(2, 60))
    joining = engine.add_request(prompt, GenerationParams(4))
    chunks = []
    while joining.num_generated == 0:
        _, stats = engine.step()
        assert stats is not None
        chunks.append(stats.prefill_tokens)
    assert chunks == [18, 18, 18, 3]  # 57 prompt tokens to cache
    while engine.has_work:
        engine.step()
    assert joining.output_ids == reference_greedy(tiny_model, prompt, 4)
    for request in streams:
        assert request.output_ids == reference_greedy(tiny_model, request.prompt_ids, 40)


def test_a_burst_of_prompts_gets_its_share_of_the_pass(tiny_runner, tiny_tables) -> None:
    engine = make_engine(
        tiny_runner,
        tiny_tables,
        max_tokens_per_pass=41,
        max_prefill_tokens_while_decoding=5,
        prefix_cache=False,
    )  # (with it, the three same prompts would be prefilled once)
    engine.add_request(PROMPTS[0], GenerationParams(40))
    engine.step()
    for _ in range(3):
        engine.add_request(list(range(2, 60)), GenerationParams(4))
    _, stats = engine.step()
    # 1 row decodes, 3 wait for their first token: prompts get 3/4 of the 40 tokens left, the
    # oldest all 30; the two others still bring one token each (every running row takes part)
    assert stats is not None and stats.prefill_tokens == 30 + 1 + 1


def test_a_few_prompts_joining_many_decoding_streams_keep_to_the_cap(
    tiny_model, tiny_runner, tiny_tables
) -> None:
    """Not a burst (fewer requests wait for a first token than decode): the prompts take the
    cap, not their share of the pass, so the decoding streams' next tokens are not held up."""
    engine = make_engine(
        tiny_runner,
        tiny_tables,
        max_tokens_per_pass=41,
        max_prefill_tokens_while_decoding=5,
        prefix_cache=False,
    )  # (with it, the two same prompts would be prefilled once)
    decoding = [engine.add_request(p, GenerationParams(40)) for p in PROMPTS[:3]]
    while any(r.prefill_remaining for r in decoding):
        engine.step()
    joining = [engine.add_request(list(range(2, 60)), GenerationParams(4)) for _ in range(2)]
    _, stats = engine.step()
    # 3 rows decode, 2 wait: their share would be 2/5 of the 38 tokens left (15); the cap is 5
    assert stats is not None and stats.prefill_tokens == 5 + 1
    while engine.has_work:
        engine.step()
    assert all(r.output_ids == reference_greedy(tiny_model, r.prompt_ids, 4) for r in joining)


def test_the_batch_size_and_the_prefill_cap_default_by_device() -> None:
    config = SchedulerConfig(max_tokens_per_pass=300)
    assert config.for_device("cpu").unpriced_prefill_tokens == CPU_PREFILL_TOKENS_WHILE_DECODING
    assert config.for_device("cuda").unpriced_prefill_tokens == 300
    assert config.for_device("cpu").max_running_requests == CPU_MAX_RUNNING_REQUESTS
    assert config.for_device("cuda").max_running_requests == GPU_MAX_RUNNING_REQUESTS
    chosen = SchedulerConfig(max_running_requests=5, max_prefill_tokens_while_decoding=7)
    assert (
        chosen.for_device("cpu").max_running_requests
        == chosen.for_device("cuda").max_running_requests
        == 5
    )


def test_a_scheduler_takes_only_a_config_resolved_for_its_device(tiny_runner) -> None:
    with pytest.raises(ValueError, match="for_device"):
        Scheduler(SchedulerConfig(), tiny_runner.new_cache(), 1)


def test_the_kv_budget_is_never_exceeded_and_admission_is_first_come_first_served(
    tiny_runner, tiny_tables
) -> None:
    per_request = make_engine(tiny_runner, tiny_tables).scheduler.memory_bound
    probe = make_engine(tiny_runner, tiny_tables)
    one = probe.add_request(PROMPTS[0], GenerationParams(16))
    budget = 2 * per_request([one])  # room for two such requests at a time
    engine = make_engine(tiny_runner, tiny_tables, kv_cache_bytes=budget)
    requests = [engine.add_request(PROMPTS[0], GenerationParams(16)) for _ in range(5)]
    started_order, peak_rows = [], 0
    while engine.has_work:
        engine.step()
        peak_rows = max(peak_rows, engine.cache.num_rows)
        assert engine.cache.nbytes <= budget
        started_order += [
            r for r in requests if r.started_at is not None and r not in started_order
        ]
    assert peak_rows == 2
    assert started_order == requests  # FCFS
    assert all(r.status is Status.FINISHED and len(r.output_ids) == 16 for r in requests)
    assert engine.cache.nbytes == 0
    with pytest.raises(DoesNotFit, match="KV budget"):
        engine.add_request(list(range(2, 60)) * 4, GenerationParams(280))  # 513 KV tokens


def test_max_running_requests_caps_the_batch(tiny_runner, tiny_tables) -> None:
    engine = make_engine(tiny_runner, tiny_tables, max_running_requests=3)
    for prompt in PROMPTS:
        engine.add_request(prompt, GenerationParams(6))
    sizes = []
    while engine.has_work:
        _, stats = engine.step()
        sizes.append(stats.batch_size if stats else 0)
    assert max(sizes) == 3 and sizes[0] == 3


def test_a_failing_request_ends_alone(tiny_model, tiny_runner, tiny_tables, monkeypatch) -> None:
    engine = make_engine(tiny_runner, tiny_tables)
    good = engine.add_request(PROMPTS[0], GenerationParams(12))
    bad = engine.add_request(PROMPTS[1], GenerationParams(12, stop_token_ids=frozenset({3})))
    original = bad.drafts.observe

    def broken(committed):
        raise RuntimeError("drafting state broke")

    bad.drafts.observe = broken
    errors = []
    while engine.has_work:
        results, _ = engine.step()
        errors += [out for r, out in results if isinstance(out, Exception)]
    assert len(errors) == 1 and bad.finish_reason == "error"
    assert good.output_ids == reference_greedy(tiny_model, PROMPTS[0], 12)
    bad.drafts.observe = original


def drafted_once_prompts_are_in(tiny_model, engine: Engine, monkeypatch) -> bool:
    """Four auto requests to the end: whether any row was drafted after the first step (which
    takes every prompt in, with its first tree); their answers must be plain's either way.
    The host's drafting seconds, which auto mode measures live, count as none: on a busy
    machine one slow step priced drafts out, and these tests are about the passes' prices."""
    monkeypatch.setattr(HostCost, "observe", lambda self, seconds, rows: None)
    params = GenerationParams(12, speculation=SpeculationParams(6, 5, "auto"))
    requests = [engine.add_request(prompt, params) for prompt in PROMPTS[:4]]
    asked: list[int] = []
    for request in requests:
        candidates = request.drafts.candidates
        request.drafts.candidates = lambda k, w, c=candidates: asked.append(k) or c(k, w)  # type: ignore[method-assign]
    engine.step()
    assert all(request.prefill_remaining == 0 for request in requests)
    asked.clear()
    while engine.has_work:
        engine.step()
    for request in requests:
        assert request.output_ids == reference_greedy(tiny_model, request.prompt_ids, 12)
    return bool(asked)


@pytest.mark.parametrize("wide_row_seconds, drafted", [(1.0, False), (0.0, True)])
def test_auto_rows_are_not_drafted_where_not_even_a_sure_draft_would_pay(
    tiny_model, tiny_runner, tiny_tables, wide_row_seconds: float, drafted: bool, monkeypatch
) -> None:
    """A batch where one more wide row costs a second (70 passes): once the prompts are in (a
    row whose last chunk is in the pass is wide already, so its first tree is nearly free), no
    draft could pay, so no auto row is drafted (the host work saved)."""
    engine = make_engine(tiny_runner, tiny_tables)
    engine.profile = gpu_like(4, wide_row_seconds)
    assert drafted_once_prompts_are_in(tiny_model, engine, monkeypatch) == drafted


@pytest.mark.parametrize(
    "best, drafted", [(Acceptance(1.0, 1.0), True), (Acceptance(0.2, 0.2), False)]
)
def test_auto_rows_are_not_drafted_where_not_even_the_best_draft_known_would_pay(
    tiny_model, tiny_runner, tiny_tables, best: Acceptance, drafted: bool, monkeypatch
) -> None:
    """Each token costs as much again as the pass's first (four rows: 0.05 s, a sure draft of
    five tokens 0.10 s for 9 tokens, which pays): where the best draft the mixer knows is
    accepted a fifth of the time, its tokens cost more than they bring, and no row drafts."""
    engine = make_engine(tiny_runner, tiny_tables)
    engine.profile = linear_profile(0.01, 0.01)
    engine.mixer.best_acceptance = lambda w: best  # type: ignore[method-assign]
    assert drafted_once_prompts_are_in(tiny_model, engine, monkeypatch) == drafted
