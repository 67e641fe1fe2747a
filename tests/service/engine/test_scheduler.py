"""The scheduler alone (`service/engine/scheduler.py`): who is admitted and when, what each
running request brings to a pass, and what leaving the batch frees. No model runs: requests
are moved by hand through the states the engine would move them through."""

from __future__ import annotations

import pytest
import torch

from drafting import default_mixer
from service.controller.calibration import Calibration
from service.controller.cost_profile import CostProfile
from service.engine.params import GenerationParams, Priority
from service.engine.request import Request, Status
from service.engine.scheduler import (
    BATCH_SLOWDOWN,
    CPU_PREFILL_TOKENS_WHILE_DECODING,
    LEAST_PRICED_PREFILL_TOKENS,
    DoesNotFit,
    Scheduler,
    SchedulerConfig,
    kv_capacity_bound,
)
from service.model.kv_cache import INITIAL_CAPACITY, TreeKVCache
from tests.helpers.costs import COMPUTE_BOUND, linear_profile

MIXER = default_mixer(None)
# One byte per KV token: a row's bound is then its capacity in bytes (256 for a short request).
BYTES_PER_TOKEN = 1


def make_request(
    prompt_tokens: int = 8, new_tokens: int = 8, name: str = "r", priority: Priority = "interactive"
) -> Request:
    prompt = list(range(2, 2 + prompt_tokens))
    return Request(
        name,
        prompt,
        GenerationParams(new_tokens, priority=priority),
        MIXER.for_request(prompt),
        Calibration().for_request(),
        None,
        frozenset(),
    )


def make_scheduler(
    max_running: int = 4,
    tokens_per_pass: int = 512,
    kv_bytes: int | None = None,
    prefill_cap: int | None = 512,
    cache: TreeKVCache | None = None,
    prefix_cache: bool = False,
    pass_ms: float = 100.0,
    batch_idle_seconds: float = 0.0,
) -> Scheduler:
    """A scheduler whose requests (prompts that all start alike) are admitted as if new:
    without a prefix cache, unless asked for (its own tests, test_prefix_cache.py), and batch
    requests without waiting for interactive load to pause (but in their own test)."""
    config = SchedulerConfig(
        max_running_requests=max_running,
        max_tokens_per_pass=tokens_per_pass,
        kv_cache_bytes=kv_bytes,
        max_prefill_tokens_while_decoding=prefill_cap,
        prefill_pass_ms=pass_ms,
        prefix_cache=prefix_cache,
        batch_idle_seconds=batch_idle_seconds,
    )
    return Scheduler(
        config.for_device("cpu"), cache or TreeKVCache(num_layers=1, rows=0), BYTES_PER_TOKEN
    )


def decoding(request: Request) -> Request:
    """The request as it stands once its whole prompt but the pending token is in the cache."""
    request.num_cached = request.num_prompt_tokens - 1
    return request


@pytest.mark.parametrize(
    "kv_tokens, capacity",
    [
        (1, INITIAL_CAPACITY),  # the smallest row still gets the initial capacity
        (INITIAL_CAPACITY, INITIAL_CAPACITY),  # exactly full: no growth
        (INITIAL_CAPACITY + 1, 2 * INITIAL_CAPACITY),  # one more: the capacity doubles
        (1000, 1024),  # powers of two from the initial capacity on
    ],
)
def test_the_capacity_bound_is_the_caches_power_of_two_growth(
    kv_tokens: int, capacity: int
) -> None:
    assert kv_capacity_bound(kv_tokens) == capacity


def test_admission_is_first_come_first_served_up_to_the_running_cap() -> None:
    scheduler = make_scheduler(max_running=2)
    requests = [make_request(name=f"r{i}") for i in range(3)]
    for request in requests:
        scheduler.add(request)
    assert scheduler.has_work and list(scheduler.waiting) == requests
    assert scheduler.admit() == requests[:2]
    assert [r.kv_row for r in requests] == [0, 1, None]
    assert [r.status for r in requests] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    assert requests[0].started_at is not None and requests[2].started_at is None
    assert scheduler.admit() == []  # the batch is full: the third waits
    scheduler.finish(requests[0])
    assert scheduler.admit() == [requests[2]] and scheduler.running == [requests[1], requests[2]]


@pytest.mark.parametrize(
    "kv_tokens, budget, fits",
    [
        (256, 256, True),  # a row of exactly the budget
        (257, 511, False),  # the row would grow to 512 columns
        (257, 512, True),
        (10**6, None, True),  # no budget: anything fits
    ],
)
def test_check_fits_refuses_a_request_that_alone_exceeds_the_budget(
    kv_tokens: int, budget: int | None, fits: bool
) -> None:
    scheduler = make_scheduler(kv_bytes=budget)
    if fits:
        scheduler.check_fits(kv_tokens)
    else:
        with pytest.raises(DoesNotFit, match=f"needs up to {kv_tokens} KV tokens"):
            scheduler.check_fits(kv_tokens)


def test_a_request_that_can_never_fit_is_refused_at_the_door() -> None:
    scheduler = make_scheduler(kv_bytes=300)
    with pytest.raises(DoesNotFit, match="KV budget"):
        scheduler.add(make_request(prompt_tokens=200, new_tokens=100))  # 301 KV tokens: 512 columns
    assert not scheduler.has_work


def test_the_kv_budget_holds_every_running_row_at_the_longest_rows_capacity() -> None:
    """The rows share one capacity, so a long request makes every row count at its length: with
    two short requests running (2 × 256 bytes), a long one (512 columns) needs 3 × 512."""
    scheduler = make_scheduler(kv_bytes=3 * 512 - 1)
    short, other, long = (
        make_request(name="short"),
        make_request(name="other"),
        make_request(300, 100, "long"),
    )
    for request in (short, other, long):
        scheduler.add(request)
    assert scheduler.memory_bound([short, other]) == 2 * 256
    assert scheduler.memory_bound([short, other, long]) == 3 * 512
    assert scheduler.admit() == [short, other]  # the long one does not fit beside them
    tail = make_request(name="tail")
    scheduler.add(tail)
    assert (
        scheduler.admit() == []
    )  # FCFS: the short request behind the long one does not overtake it
    scheduler.finish(other)
    assert scheduler.admit() == [long]  # 2 × 512 fits
    assert scheduler.memory_bound(scheduler.running) <= 3 * 512 - 1


def test_buffers_already_held_count_at_their_rows_and_capacity() -> None:
    """The buffers only grow while held: once they hold three rows of 512 columns, even one
    short request is bounded by them."""
    cache = TreeKVCache(num_layers=1, rows=0)
    for _ in range(3):
        cache.add_row()
    cache.reserve(2 * INITIAL_CAPACITY)
    cache.make_buffers(torch.zeros(1, 1, 1, 1))
    scheduler = make_scheduler(cache=cache)
    assert scheduler.memory_bound([make_request()]) == 3 * 512
    assert scheduler.memory_bound([]) == 0


def test_aborted_waiting_requests_are_dropped_and_never_get_a_row() -> None:
    scheduler = make_scheduler(max_running=1)
    first, second, third = (make_request(name=n) for n in ("first", "second", "third"))
    for request in (first, second, third):
        scheduler.add(request)
    second.aborted = True
    assert scheduler.drop_aborted_waiting() == [second]
    assert second.status is Status.FINISHED and list(scheduler.waiting) == [first, third]
    assert scheduler.drop_aborted_waiting() == []
    first.aborted = True  # aborted at the head of the queue: admission skips it
    assert scheduler.admit() == [third]
    assert first.kv_row is None and not scheduler.waiting


@pytest.mark.parametrize(
    "decoding_rows, prompts, per_pass, cap, chunks, tree_budget",
    [
        # nothing decodes: the oldest prompt takes the whole pass; the next still brings a token
        (0, [100, 30], 64, 5, [64, 1], 0),
        # one stream decodes: the prompt gets the cap
        (1, [100], 64, 5, [5], 58),
        # two streams, two prompts (no burst): the prompts share the cap, oldest first
        (2, [3, 100], 64, 5, [3, 2], 57),
        # a burst (3 prompts, 1 stream): prompts take their share of the pass, 3/4 of 40
        (1, [100, 100, 100], 41, 5, [30, 1, 1], 8),
        # a few prompts behind many streams: the cap, not their share
        (3, [100, 100], 41, 5, [5, 1], 32),
        # a prompt shorter than its share takes only what it needs
        (1, [4], 64, 32, [4], 59),
    ],
)
def test_prompt_chunks_share_the_pass_with_decoding_rows(
    decoding_rows: int,
    prompts: list[int],
    per_pass: int,
    cap: int,
    chunks: list[int],
    tree_budget: int,
) -> None:
    scheduler = make_scheduler(max_running=8, tokens_per_pass=per_pass, prefill_cap=cap)
    streams = [make_request(name=f"stream{i}") for i in range(decoding_rows)]
    waiting = [make_request(prompt_tokens=n + 1, name=f"prompt{i}") for i, n in enumerate(prompts)]
    for request in (*streams, *waiting):
        scheduler.add(request)
    scheduler.admit()
    for stream in streams:
        decoding(stream)
    plan = scheduler.schedule()
    assert [plan.prefill_tokens[r] for r in waiting] == chunks
    assert set(plan.prefill_tokens) == set(waiting)  # decoding rows bring no prompt tokens
    assert plan.tree_budget == tree_budget


CPU = linear_profile(0.010, 0.001)
GPU = linear_profile(0.003, 0.000002)  # 512 tokens: 4 ms


def _one_prompt_beside(streams: int, scheduler: Scheduler) -> Request:
    """A long prompt admitted beside `streams` decoding requests."""
    for stream in [make_request(name=f"stream{i}") for i in range(streams)]:
        scheduler.add(stream)
        scheduler.admit()
        decoding(stream)
    prompt = make_request(prompt_tokens=1000, name="prompt")
    scheduler.add(prompt)
    scheduler.admit()
    return prompt


@pytest.mark.parametrize(
    "pass_ms, profile, streams, chunk",
    [
        # 10 ms + 1 ms a token (a CPU): a pass of 4 streams and the prompt's tokens stays within
        # 50.5 ms up to 40 tokens in all, 36 of them the prompt's; 100.5 ms allows 90,
        # 86 the prompt's
        (50.5, CPU, 4, 36),
        (100.5, CPU, 4, 86),
        (100.5, CPU, 1, 89),
        # the decoding rows alone cost over the budget: the prompt still gets its least chunk
        (50.5, linear_profile(0.060, 0.001), 4, LEAST_PRICED_PREFILL_TOKENS),
        # a pass costs next to nothing more per token (a GPU below its knee): the whole pass
        (100.0, GPU, 4, 512 - 4),
    ],
)
def test_the_prefill_cap_is_priced_by_the_cost_profile(
    pass_ms: float, profile: CostProfile, streams: int, chunk: int
) -> None:
    scheduler = make_scheduler(max_running=8, prefill_cap=None, pass_ms=pass_ms)
    scheduler.profile = profile
    prompt = _one_prompt_beside(streams, scheduler)
    assert scheduler.schedule().prefill_tokens[prompt] == chunk
    if (
        chunk != LEAST_PRICED_PREFILL_TOKENS and profile is not GPU
    ):  # the most tokens within the budget
        assert profile.cost(streams + chunk, 100, streams + 1, 1) <= pass_ms / 1e3
        assert profile.cost(streams + chunk + 1, 100, streams + 1, 1) > pass_ms / 1e3


def test_a_fixed_prefill_cap_wins_over_the_price_and_the_device_default_holds_until_a_profile() -> (
    None
):
    priced = make_scheduler(max_running=8, prefill_cap=None)
    prompt = _one_prompt_beside(2, priced)
    assert (
        priced.schedule().prefill_tokens[prompt] == CPU_PREFILL_TOKENS_WHILE_DECODING
    )  # no profile yet
    priced.profile = GPU
    assert priced.schedule().prefill_tokens[prompt] == 512 - 2
    fixed = make_scheduler(max_running=8, prefill_cap=7)
    fixed.profile = GPU
    prompt = _one_prompt_beside(2, fixed)
    assert fixed.schedule().prefill_tokens[prompt] == 7


def test_finishing_frees_the_row_and_moves_the_last_row_into_it() -> None:
    scheduler = make_scheduler()
    a, b, c = (make_request(name=n) for n in "abc")
    for request in (a, b, c):
        scheduler.add(request)
    scheduler.admit()
    scheduler.finish(a)
    assert (a.status, a.kv_row) == (Status.FINISHED, None)
    assert scheduler.running == [c, b] and (c.kv_row, b.kv_row) == (
        0,
        1,
    )  # `running[i]` holds row i
    assert scheduler.cache.num_rows == 2
    scheduler.finish(b)  # the last row: nothing moves
    assert scheduler.running == [c] and c.kv_row == 0 and scheduler.cache.num_rows == 1
    waiting = make_request(name="waiting")
    scheduler.add(waiting)
    scheduler.finish(waiting)  # never admitted: no row to free
    assert waiting.status is Status.FINISHED and scheduler.cache.num_rows == 1


@pytest.mark.parametrize(
    "limits",
    [
        {"max_running_requests": 0},  # no request could ever run
        {"max_tokens_per_pass": 0},  # no pass could carry a token
        {"max_prefill_tokens_while_decoding": 0},  # a prompt would never load beside a stream
    ],
)
def test_limits_below_one_are_refused(limits: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        SchedulerConfig(**limits)
    with pytest.raises(ValueError, match="must be > 0"):
        SchedulerConfig(prefill_pass_ms=0)  # no prompt chunk would ever be priced in


def batch(name: str, prompt_tokens: int = 8) -> Request:
    return make_request(prompt_tokens, name=name, priority="batch")


def test_requests_are_interactive_unless_asked_and_a_class_must_be_known() -> None:
    assert GenerationParams().priority == "interactive"
    assert make_request().params.priority == "interactive"
    with pytest.raises(ValueError, match="priority must be interactive or batch"):
        GenerationParams(priority="urgent")  # type: ignore[arg-type]


def test_an_interactive_request_goes_before_batch_requests_queued_earlier() -> None:
    """Interactive first; then (here, with nothing interactive running) batch ones, in their
    order of arrival."""
    scheduler = make_scheduler(max_running=2)
    early, later = batch("early"), batch("later")
    interactive = make_request(name="interactive")
    for request in (early, later, interactive):
        scheduler.add(request)
    assert scheduler.admit() == [interactive]  # it runs: no batch row beside it, unpriced
    assert early.status is Status.WAITING and list(scheduler.waiting) == [early, later]
    scheduler.finish(interactive)
    assert scheduler.admit() == [early, later]


def test_a_batch_request_waits_while_an_interactive_one_waits_or_runs_unpriced() -> None:
    """A batch request that would fit does not pass an interactive request waiting for memory,
    nor join a running interactive one without a cost profile to say it is cheap; once the
    interactive ones are gone (aborted, finished), it runs."""
    scheduler = make_scheduler(max_running=4, kv_bytes=2 * 512 - 1)
    running = make_request(name="running")
    scheduler.add(running)
    assert scheduler.admit() == [running]
    long = make_request(300, 100, "long")  # 512 columns: 2 × 512 with `running`, over the budget
    waiting = batch("waiting")  # 2 × 256 beside `running`: it would fit
    for request in (long, waiting):
        scheduler.add(request)
    assert scheduler.admit() == []  # the interactive one waits for memory; the batch one for it
    long.aborted = True
    assert scheduler.admit() == []  # an interactive request runs, and nothing prices a batch row
    assert long.status is Status.FINISHED and list(scheduler.waiting) == [waiting]
    scheduler.finish(running)
    assert scheduler.admit() == [waiting]


def test_batch_requests_are_first_come_first_served_among_themselves() -> None:
    """A batch request waiting for memory holds back the batch requests behind it."""
    scheduler = make_scheduler(max_running=4, kv_bytes=2 * 512 - 1)
    first = batch("first")
    scheduler.add(first)
    assert scheduler.admit() == [first]
    long, short = batch("long", prompt_tokens=300), batch("short")
    for request in (long, short):
        scheduler.add(request)
    assert scheduler.admit() == []
    scheduler.finish(first)
    assert scheduler.admit() == [long]


def running_batch(scheduler: Scheduler, count: int) -> list[Request]:
    """`count` batch requests admitted and decoding, each with a few tokens generated."""
    rows = [batch(f"batch{i}") for i in range(count)]
    for request in rows:
        scheduler.add(request)
    assert scheduler.admit() == rows
    for request in rows:
        request.drafts.history.extend([50, 51, 52])
        request.num_generated = 3
        request.num_cached = request.context_length - 1
    return rows


FREE_ROWS = linear_profile(0.010, 0.0)  # a pass costs the same whatever its rows


def test_an_interactive_request_preempts_the_newest_batch_row_for_a_slot() -> None:
    """Where batch rows cost nothing beside it, the interactive request takes the newest batch
    row's slot alone; the preempted request waits at the head of the queue, with everything it
    committed (prompt and output) to recompute, and comes back first when a slot frees."""
    scheduler = make_scheduler(max_running=2)
    scheduler.profile = FREE_ROWS
    older, newer = running_batch(scheduler, 2)
    later = batch("later")
    interactive = make_request(name="interactive")
    for request in (later, interactive):
        scheduler.add(request)
    assert scheduler.admit() == [interactive]
    assert scheduler.running == [older, interactive] and interactive.kv_row == 1
    assert newer.status is Status.WAITING and list(scheduler.waiting) == [newer, later]
    assert newer.kv_row is None and newer.prefill_remaining == newer.num_prompt_tokens + 3 - 1
    assert (newer.preemptions, older.preemptions, scheduler.preemptions) == (1, 0, 1)
    scheduler.finish(interactive)
    assert scheduler.admit() == [newer]


def test_an_interactive_request_preempts_batch_rows_for_memory() -> None:
    """A budget for two short rows: the interactive one needs two rows' worth, and preempts
    both batch rows; nothing is preempted for a request of the same class."""
    scheduler = make_scheduler(max_running=4, kv_bytes=2 * 256)
    scheduler.profile = FREE_ROWS
    rows = running_batch(scheduler, 2)
    scheduler.add(batch("third"))
    assert scheduler.admit() == [] and scheduler.preemptions == 0
    long = make_request(300, 100, "long")  # 512 columns: the whole budget
    scheduler.add(long)
    assert scheduler.admit() == [long]
    assert scheduler.running == [long] and all(r.status is Status.WAITING for r in rows)
    assert [r.request_id for r in scheduler.waiting] == ["batch0", "batch1", "third"]


def test_without_a_profile_every_batch_row_gives_way_to_a_running_interactive_one() -> None:
    scheduler = make_scheduler(max_running=8)
    rows = running_batch(scheduler, 3)
    interactive = make_request(name="interactive")
    scheduler.add(interactive)
    assert scheduler.admit() == [interactive]
    assert scheduler.running == [interactive]
    assert list(scheduler.waiting) == rows  # in their order of arrival
    assert scheduler.admit() == []  # while it runs, they wait
    scheduler.finish(interactive)
    assert scheduler.admit() == rows


@pytest.mark.parametrize(
    "profile, admitted",
    [
        # a pass costs the same whatever its rows (a GPU far below its knee): every free slot
        (linear_profile(0.010, 0.0), 7),
        # every row adds a whole one-row pass (compute-bound): none
        (linear_profile(0.0, 0.001), 0),
        (COMPUTE_BOUND, 0),
        # each row adds 1%: the batch rows together may add 5% to the interactive row's 1.01 s
        (linear_profile(1.0, 0.01), 5),
    ],
)
def test_batch_rows_join_running_interactive_ones_where_the_profile_says_they_are_nearly_free(
    profile: CostProfile, admitted: int
) -> None:
    """Priced against the interactive rows' pass alone, not the running rows' (each batch row
    looks cheaper beside the last, and their slowdowns would add up)."""
    scheduler = make_scheduler(max_running=8)
    scheduler.profile = profile
    interactive = make_request(name="interactive")
    scheduler.add(interactive)
    assert scheduler.admit() == [interactive]
    decoding(interactive)
    waiting = [batch(f"batch{i}") for i in range(10)]
    for request in waiting:
        scheduler.add(request)
    assert scheduler.admit() == waiting[:admitted]
    rows = len(scheduler.running)
    assert profile.cost(rows, 8, rows) <= (1 + BATCH_SLOWDOWN) * profile.cost(1, 8, 1)
    scheduler.finish(interactive)  # batch rows alone: they fill the batch
    assert scheduler.admit() == waiting[admitted : admitted + 8 - rows + 1]
    # interactive load again: the newest batch rows give way until the price holds again
    scheduler.add(again := make_request(name="again"))
    assert scheduler.admit() == [again]
    assert {r.request_id for r in scheduler.running} == {
        r.request_id for r in [again, *waiting[:admitted]]
    }
    assert list(scheduler.waiting)[: 8 - admitted] == waiting[admitted:8]


def test_batch_prompt_chunks_beside_interactive_rows_are_held_to_the_price() -> None:
    """Each token adds 1% to a pass: beside one decoding interactive row, a batch prompt's
    chunk takes the tokens that keep the pass within 5% of the interactive row's alone; alone,
    its whole prompt."""
    profile = linear_profile(1.0, 0.01)
    scheduler = make_scheduler(max_running=4, prefill_cap=None, pass_ms=10_000)
    scheduler.profile = profile
    stream = make_request(name="stream")
    scheduler.add(stream)
    scheduler.admit()
    decoding(stream)
    prompt = batch("prompt", prompt_tokens=101)
    scheduler.add(prompt)
    assert scheduler.admit() == [prompt]
    chunk = scheduler.schedule().prefill_tokens[prompt]
    limit = (1 + BATCH_SLOWDOWN) * profile.cost(1, 8)
    assert profile.cost(1 + chunk, 8) <= limit < profile.cost(2 + chunk, 8) and chunk == 5
    scheduler.finish(stream)
    assert scheduler.schedule().prefill_tokens[prompt] == 100


def test_batch_requests_wait_for_interactive_load_to_pause(monkeypatch) -> None:
    """With no interactive request running, a batch request starts only once none has run or
    waited for `batch_idle_seconds`: not in the moment between one answer and the next."""
    now = [100.0]
    monkeypatch.setattr("service.engine.scheduler.time.monotonic", lambda: now[0])
    scheduler = make_scheduler(max_running=4, batch_idle_seconds=1.0)
    work = batch("work")
    scheduler.add(work)
    assert scheduler.admit() == [work]  # nothing interactive ever ran
    scheduler.finish(work)
    interactive = make_request(name="interactive")
    scheduler.add(interactive)
    assert scheduler.admit() == [interactive]
    later = batch("later")
    scheduler.add(later)
    now[0] += 5.0
    scheduler.finish(interactive)
    assert scheduler.admit() == []  # an interactive request ran a moment ago
    now[0] += 0.9
    assert scheduler.admit() == []
    now[0] += 0.2
    assert scheduler.admit() == [later]
