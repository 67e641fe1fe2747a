"""Waiting queue → running batch: admission, chunked prefill, and every status transition.

- Admission: first come, first served, while a running slot is free and the KV budget holds
  with the request (rows × the longest row any of them can reach × bytes per token bounds the
  KV memory); nothing behind a request that does not fit jumps the queue.
- Priority classes (`GenerationParams.priority`), each first come, first served: interactive
  requests go first; a batch request is admitted only while no interactive request waits, and
  beside running interactive ones only where the cost profile says the pass, its row added,
  costs at most `BATCH_SLOWDOWN` more than the interactive rows' alone (without a profile,
  never). Batch rows give way when interactive load arrives: an interactive request that finds
  no slot or no memory preempts the newest batch rows, and batch rows beyond that price beside
  running interactive ones are preempted too (`preempt`: the row's whole blocks stay in the
  prefix cache, and the request waits at the head of the batch queue to recompute the rest).
  Their prompt chunks beside interactive rows are held to the same price.
- Chunked prefill: decoding rows bring their pending token (and tree); prefilling rows share
  what is left of `max_tokens_per_pass`, oldest first. While others decode, prompt chunks take
  as many tokens as keep the pass within `prefill_pass_ms`, priced by the cost profile
  (`prefill_cap`), since every prompt token in the pass delays every stream's next token; in a
  burst (more requests waiting for a first token than decoding) prompts take their share of
  the pass instead, so the burst is not starved.
- Prefix cache (`service/model/prefix_cache.py`): a new row starts with the cached blocks of
  its prompt; the blocks of committed chunks and finished rows fill the room the running rows
  leave, least recently used evicted first; a request whose prompt a running request is still
  prefilling waits for it and reads it from the cache.

docs/architecture.md, "Batching and the scheduler", says why each rule is so.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass

from drafting import common_prefix
from service.controller.cost_profile import CostProfile, PassShape
from service.engine.params import Priority
from service.engine.request import Request, Status
from service.model.kv_cache import INITIAL_CAPACITY, TreeKVCache
from service.model.prefix_cache import BLOCK_TOKENS, PrefixCache


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the running batch."""

    max_running_requests: int | None = None  # None: by device (`for_device`)
    max_tokens_per_pass: int = 512  # prefill chunks + decode tokens + tree nodes in one pass
    kv_cache_bytes: int | None = None  # budget of the KV buffers; None = unbounded
    # a fixed cap; None: priced by `prefill_pass_ms`
    max_prefill_tokens_while_decoding: int | None = None
    # while others decode, a pass that carries prompt chunks is sized to cost about this much
    prefill_pass_ms: float = 100.0
    prefix_cache: bool = True  # keep computed KV blocks for later requests with the same prefix
    # the cap until a cost profile prices one: `for_device`
    unpriced_prefill_tokens: int | None = None
    # with no interactive request running, batch requests start only once none has run or
    # waited for this long (a pass in flight cannot be preempted: see `_batch_may_start`)
    batch_idle_seconds: float = 1.0

    def __post_init__(self) -> None:
        if (
            self.max_running_requests is not None and self.max_running_requests < 1
        ) or self.max_tokens_per_pass < 1:
            raise ValueError("max_running_requests and max_tokens_per_pass must be >= 1")
        if (
            self.max_prefill_tokens_while_decoding is not None
            and self.max_prefill_tokens_while_decoding < 1
        ):
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1")
        if self.prefill_pass_ms <= 0:
            raise ValueError("prefill_pass_ms must be > 0")
        if self.batch_idle_seconds < 0:
            raise ValueError("batch_idle_seconds must be >= 0")

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with the batch size and the unpriced prefill cap resolved for a device
        ("cpu", "cuda", ...)."""
        cpu = device_type == "cpu"
        running = self.max_running_requests or (
            CPU_MAX_RUNNING_REQUESTS if cpu else GPU_MAX_RUNNING_REQUESTS
        )
        unpriced = CPU_PREFILL_TOKENS_WHILE_DECODING if cpu else self.max_tokens_per_pass
        return dataclasses.replace(
            self, max_running_requests=running, unpriced_prefill_tokens=unpriced
        )


CPU_PREFILL_TOKENS_WHILE_DECODING = 64  # until a cost profile is in use
# The least a priced cap gives prompts while others decode (one prefix-cache block), so that a
# prompt still loads where the decoding rows alone already cost `prefill_pass_ms`.
LEAST_PRICED_PREFILL_TOKENS = BLOCK_TOKENS
# Requests in one batch. On a CPU a 16-row pass already costs several one-row passes
# (compute-bound), so more rows add latency, not throughput; on a GPU a pass is host-bound and
# 64 rows run at about twice the tokens/s of 16 (docs/benchmarks.md).
CPU_MAX_RUNNING_REQUESTS = 16
GPU_MAX_RUNNING_REQUESTS = 64
# what cached prefix blocks may hold when the KV budget is unbounded
UNBOUNDED_BUDGET_PREFIX_CACHE_BYTES = 2**30
# Beside running interactive requests, batch rows may make their pass cost at most this much more
# than the interactive rows' alone: on a GPU, where a 64-row pass costs about a one-row one,
# that admits many; on a CPU, where every row adds its compute, next to none. Batch work uses
# the room interactive requests leave, and never costs them more than a few percent of speed.
BATCH_SLOWDOWN = 0.05


class DoesNotFit(ValueError):
    """The request alone would exceed the KV memory budget: it could never run."""


@dataclass(frozen=True)
class Schedule:
    """What each running request brings to this step's pass."""

    prefill_tokens: dict[Request, int]  # prompt tokens each prefilling request puts in the cache
    tree_budget: int  # tree nodes (beyond one root per decoding row) the pass can still take


def kv_capacity_bound(max_tokens: int) -> int:
    """The capacity the cache reaches for rows of at most `max_tokens` (power-of-two growth)."""
    capacity = INITIAL_CAPACITY
    while capacity < max_tokens:
        capacity *= 2
    return capacity


class Scheduler:
    """Owns the waiting queue and the running batch; `running[i]` holds KV row i."""

    def __init__(
        self, config: SchedulerConfig, cache: TreeKVCache, kv_bytes_per_token: int
    ) -> None:
        if config.max_running_requests is None or config.unpriced_prefill_tokens is None:
            raise ValueError(
                "the scheduler takes a config resolved for its device (SchedulerConfig.for_device)"
            )
        self.config = config
        self.max_running: int = config.max_running_requests
        self.unpriced_prefill_tokens: int = config.unpriced_prefill_tokens
        self.cache = cache
        self.kv_bytes_per_token = kv_bytes_per_token
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix = PrefixCache(self._prefix_room) if config.prefix_cache else None
        self.profile: CostProfile | None = None  # prices the prompt chunks while others decode
        self.preemptions = 0  # rows given up for interactive load since start (metrics)
        self._interactive_at = -math.inf  # when an interactive request last ran or waited

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def memory_bound(self, requests: list[Request]) -> int:
        """Upper bound of the KV bytes while `requests` run together. The buffers' rows and
        capacity (columns, one for all rows) only grow while they are held; buffers that pass
        on for CUDA graphs hold a power of two of rows, and may come larger than asked."""
        if not requests:
            return 0
        held = self.cache.held_rows
        capacity = max(
            kv_capacity_bound(max(r.max_kv_tokens for r in requests)),
            self.cache.capacity if held else 0,
        )
        return max(self.cache.buffer_rows(len(requests)), held) * capacity * self.kv_bytes_per_token

    def _row_bytes(self, kv_tokens: int) -> int:
        return kv_capacity_bound(kv_tokens) * self.kv_bytes_per_token

    def check_fits(self, kv_tokens: int) -> None:
        """Raise `DoesNotFit` if a request needing `kv_tokens` KV entries exceeds the budget
        alone."""
        budget = self.config.kv_cache_bytes
        if budget is not None and self._row_bytes(kv_tokens) > budget:
            raise DoesNotFit(
                f"the request needs up to {kv_tokens} KV tokens "
                f"({self._row_bytes(kv_tokens) / 2**20:.0f} MiB), "
                f"over the server's KV budget of {budget / 2**20:.0f} MiB; "
                f"ask for fewer max_tokens or a "
                f"shorter prompt"
            )

    def add(self, request: Request) -> None:
        self.check_fits(request.max_kv_tokens)
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch while a slot is free and they fit: the oldest
        interactive request first, preempting the newest batch rows for a slot or memory if it
        has none; with none waiting, the oldest batch request if it may run beside the running
        interactive rows (`_batch_rows_fit`). Within a class nothing overtakes a request that
        must wait (for memory, or for a running prefill of its prompt), and no batch request
        overtakes a waiting interactive one. Then batch rows the running interactive ones
        leave no room for are preempted, newest first."""
        self.drop_aborted_waiting()
        if any(not _is_batch(r) for r in (*self.running, *self.waiting)):
            self._interactive_at = time.monotonic()
        admitted = []
        while (candidate := self._next_candidate()) is not None:
            bound = self.memory_bound([*self.running, candidate])
            budget = self.config.kv_cache_bytes
            if len(self.running) >= self.max_running or (budget is not None and bound > budget):
                if not _is_batch(candidate) and self._preempt_newest_batch_row():
                    continue
                break  # FCFS: it waits for a slot or memory, and nothing behind it overtakes
            if self._joins_running_prefill(candidate):
                # FCFS as well: it waits a few passes at most, for entries it then need not compute
                break
            self.waiting.remove(candidate)
            self._start(candidate, None if budget is None else budget - bound)
            admitted.append(candidate)
        while not self._batch_rows_fit(self.running) and self._preempt_newest_batch_row():
            pass
        return admitted

    def _next_candidate(self) -> Request | None:
        """The request admission tries next: the oldest interactive one waiting; with none, the
        oldest batch one if a batch row fits beside the running ones; else None."""
        interactive = self._oldest_waiting("interactive")
        if interactive is not None:
            return interactive
        batch = self._oldest_waiting("batch")
        if batch is not None and self._batch_may_start(batch):
            return batch
        return None

    def _batch_may_start(self, batch: Request) -> bool:
        """Beside running interactive rows, where the price allows (`_batch_rows_fit`); with
        none running, once no interactive request has run or waited for `batch_idle_seconds`.
        A pass cannot be preempted once it runs, so a batch pass started in the moment between
        one interactive answer and the next request would delay that request by its whole
        length: batch work waits for the interactive load to pause, not for a gap in it."""
        if any(not _is_batch(r) for r in self.running):
            return self._batch_rows_fit([*self.running, batch])
        return time.monotonic() - self._interactive_at >= self.config.batch_idle_seconds

    def _oldest_waiting(self, priority: Priority) -> Request | None:
        """The oldest waiting request of `priority` not asked to stop."""
        return next(
            (r for r in self.waiting if r.params.priority == priority and not r.aborted), None
        )

    def _batch_rows_fit(self, rows: list[Request]) -> bool:
        """Whether `rows` may run together as far as priority goes: always without interactive
        rows or without batch rows; with both, only where the cost profile prices their pass
        (one token each) at most `1 + BATCH_SLOWDOWN` times the interactive rows' pass alone.
        Against the interactive rows alone, not the running ones: each batch row looks cheap
        beside many, and their slowdowns would compound. No profile, no price: no batch row
        runs beside an interactive one."""
        interactive = [r for r in rows if not _is_batch(r)]
        if not interactive or len(interactive) == len(rows):
            return True
        if self.profile is None:
            return False
        alone = self.profile.cost(len(interactive), _mean_context(interactive), len(interactive))
        return (
            self.profile.cost(len(rows), _mean_context(rows), len(rows))
            <= (1 + BATCH_SLOWDOWN) * alone
        )

    def _preempt_newest_batch_row(self) -> bool:
        """Preempt the running batch request that arrived last; False if none runs."""
        batch = [r for r in self.running if _is_batch(r)]
        if not batch:
            return False
        self.preempt(max(batch, key=lambda r: r.arrival))
        return True

    def preempt(self, request: Request) -> None:
        """Give up a running request's KV row (for interactive load): the whole blocks of its
        committed entries stay in the prefix cache (while there is room), and it waits at the
        head of the queue; readmitted, it loads them and recomputes the rest of its prompt and
        output as prompt chunks. What it generates does not change."""
        self._free_row(request)
        request.status, request.num_cached = Status.WAITING, 0
        request.prefill_target = request.context_length - 1
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _start(self, request: Request, prefix_room: int | None) -> None:
        """Give an admitted request its KV row, with the cached blocks its committed tokens
        start with (its prompt's; a preempted request's output too); cached blocks beyond
        `prefix_room` bytes (None: unbounded) are evicted first."""
        first = request.started_at is None
        request.status = Status.RUNNING
        if first:
            request.started_at = time.monotonic()
        request.kv_row = self.cache.add_row()
        if self.prefix is not None:
            if prefix_room is not None:
                self.prefix.evict_until(prefix_room)
            request.num_cached = self.prefix.load(
                self.cache, request.kv_row, request.token_ids, counted=first
            )
            if first:
                request.num_prefix_cached = request.num_cached
        self.running.append(request)

    def _prefix_room(self) -> int:
        """Bytes the cached prefix blocks may hold now: the KV budget less what the running
        rows may reach."""
        budget = self.config.kv_cache_bytes
        if budget is None:
            return UNBOUNDED_BUDGET_PREFIX_CACHE_BYTES
        return budget - self.memory_bound(self.running)

    def _joins_running_prefill(self, candidate: Request) -> bool:
        """Whether a running request is still prefilling a prefix of `candidate`'s prompt that
        the cache does not hold yet, a block or more and at least half of what `candidate`
        would prefill (a shared template of a few tokens is not worth a wait)."""
        if self.prefix is None:
            return False
        prompt = candidate.prompt_ids[: candidate.num_prompt_tokens - 1]
        cached = self.prefix.peek(prompt)
        for request in self.running:
            if request.prefill_remaining > 0:
                ahead = (
                    common_prefix(prompt, request.prompt_ids[: request.num_prompt_tokens - 1])
                    - cached
                )
                if ahead >= BLOCK_TOKENS and 2 * ahead >= len(prompt) - cached:
                    return True
        return False

    def keep_prefix(self, request: Request) -> None:
        """Cache the whole blocks of a running request's committed entries (after a pass)."""
        if self.prefix is not None and request.kv_row is not None:
            self.prefix.store(self.cache, request.kv_row, request.token_ids)

    @property
    def kv_usage(self) -> float | None:
        """The share of the KV budget the running rows may reach (cached prefix blocks count
        as free: they give way to any admission); None with no budget."""
        budget = self.config.kv_cache_bytes
        return None if budget is None else self.memory_bound(self.running) / budget

    def drop_aborted_waiting(self) -> list[Request]:
        """Take aborted requests out of the queue at once (their slot frees now)."""
        gone = [r for r in self.waiting if r.aborted]
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        for request in gone:
            request.status = Status.FINISHED
        return gone

    def schedule(self) -> Schedule:
        """Split this pass's token budget: one token per decoding row first, then prefill
        chunks, interactive before batch and oldest first within each (each prefilling row
        brings at least one token). While others decode, prompts get `prefill_cap`; in a burst
        (more requests waiting for their first token than decoding) their share of the pass if
        larger, in proportion to their number. Beside interactive rows, batch chunks together
        get `_batch_prefill_cap`."""
        prefilling = sorted(
            (r for r in self.running if r.prefill_remaining > 0), key=_is_batch
        )  # stable: oldest first within a class
        decoding = len(self.running) - len(prefilling)
        left = self.config.max_tokens_per_pass - decoding
        prefill_left = left
        if decoding and prefilling:
            cap = self.prefill_cap(decoding, len(prefilling))
            burst = len(prefilling) > decoding
            prefill_left = min(
                left, max(cap, left * len(prefilling) // len(self.running)) if burst else cap
            )
        batch_left = self._batch_prefill_cap(sum(map(_is_batch, prefilling)))
        prefill: dict[Request, int] = {}
        for request in prefilling:
            share = prefill_left
            if _is_batch(request) and batch_left is not None:
                share = min(share, batch_left)
                batch_left -= min(request.prefill_remaining, share)
            chunk = max(1, min(request.prefill_remaining, share))
            prefill[request] = chunk
            left -= chunk
            prefill_left -= chunk
        return Schedule(prefill, max(left, 0))

    def _batch_prefill_cap(self, batch_prefilling: int) -> int | None:
        """Prompt tokens the chunks of `batch_prefilling` batch rows may take together beside
        running interactive rows: as many as keep the pass (every other row one token) within
        `1 + BATCH_SLOWDOWN` times the interactive rows' pass alone, by the cost profile (the
        admission's price, `_batch_rows_fit`, with the chunks in it); None: no interactive row
        runs, or no batch row prefills."""
        interactive = [r for r in self.running if not _is_batch(r)]
        if not interactive or not batch_prefilling:
            return None
        if self.profile is None:  # unpriced, no batch row runs beside interactive ones
            return 0
        alone = self.profile.cost(len(interactive), _mean_context(interactive), len(interactive))
        rows = len(self.running)
        fits = self.profile.at(_mean_context(self.running), rows).tokens_within(
            (1 + BATCH_SLOWDOWN) * alone,
            PassShape(rows, batch_prefilling),
            self.config.max_tokens_per_pass,
        )
        return fits - (rows - batch_prefilling)  # each other row brings one token

    def prefill_cap(self, decoding: int, prefilling: int) -> int:
        """Prompt tokens a pass may carry beside `decoding` one-token rows: the configured
        number if one is fixed; else, priced by the cost profile, as many as keep the pass
        (`prefilling` wide rows among the running rows, at their mean context) within
        `prefill_pass_ms`, and at least `LEAST_PRICED_PREFILL_TOKENS`; without a profile, the
        device's default (`SchedulerConfig.for_device`)."""
        config = self.config
        if config.max_prefill_tokens_while_decoding is not None:
            return config.max_prefill_tokens_while_decoding
        if self.profile is None:
            return self.unpriced_prefill_tokens
        cost = self.profile.at(_mean_context(self.running), len(self.running))
        fits = cost.tokens_within(
            config.prefill_pass_ms / 1e3,
            PassShape(decoding + prefilling, prefilling),
            config.max_tokens_per_pass,
        )
        return max(fits - decoding, LEAST_PRICED_PREFILL_TOKENS)

    def finish(self, request: Request) -> None:
        """Take a request out of the batch and free its KV row."""
        request.status = Status.FINISHED
        if not _is_batch(request):
            self._interactive_at = time.monotonic()
        self._free_row(request)

    def _free_row(self, request: Request) -> None:
        """Free a request's KV row (if it holds one), keeping its whole blocks in the prefix
        cache unless its pass failed (which may have left its entries half written); the last
        row moves into the freed slot."""
        if request.kv_row is None:
            return
        if request.finish_reason != "error":
            self.keep_prefix(request)
        row, request.kv_row = request.kv_row, None
        moved = self.cache.remove_row(row)
        last = self.running.pop()
        if moved is not None:
            self.running[row] = last
            last.kv_row = row


def _is_batch(request: Request) -> bool:
    return request.params.priority == "batch"


def _mean_context(requests: list[Request]) -> float:
    """The mean context length of `requests` (not empty): what a pass over them attends to."""
    return sum(r.context_length for r in requests) / len(requests)
