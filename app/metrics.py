"""Prometheus metrics: the only importer of prometheus_client.

Names follow vLLM's speculative-decoding schema (llama.cpp's server copied it too) with the
`ngrammys_` prefix and no colons, so existing dashboards and habits carry over. Labels take
small fixed value sets only (strategy, position, status, tree-size bucket). Each app owns its
registry (one worker process per server), so tests can build many apps side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import metrics_identity
from app.batches.store import STATUSES as BATCH_STATUSES
from app.batches.store import StoreError
from app.live import LiveStats
from service.controller.profile_keeper import OUTCOMES, ProfileState
from service.engine.outputs import RoundOutput, StepStats
from service.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from app.batches.runner import BatchRunner
    from drafting.suffix import SuffixIndex

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PASS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TREE_SIZE_BUCKETS = ((1, "1"), (4, "2-4"), (8, "5-8"), (16, "9-16"), (32, "17-32"), (64, "33-64"))
MAX_POSITION_LABEL = 16  # accepted positions beyond this share the last label


disable_created_metrics()  # `*_created` series only double the scrape size here


def tree_size_bucket(nodes: int) -> str:
    return next((label for limit, label in TREE_SIZE_BUCKETS if nodes <= limit), "65+")


class Metrics:
    """Every exported metric, and the recording calls the edge makes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.live = LiveStats()  # the same figures as plain numbers, for the status route
        r = self.registry
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds: the standard series
        ProcessCollector(registry=r)
        self.num_drafts = Counter(
            "ngrammys_spec_decode_num_drafts", "Rounds that verified drafts", registry=r
        )
        self.num_draft_tokens = Counter(
            "ngrammys_spec_decode_num_draft_tokens",
            "Drafted tokens verified",
            ["strategy"],
            registry=r,
        )
        self.num_accepted_tokens = Counter(
            "ngrammys_spec_decode_num_accepted_tokens",
            "Drafted tokens accepted",
            ["strategy"],
            registry=r,
        )
        self.accepted_per_pos = Counter(
            "ngrammys_spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by depth (0 = first)",
            ["position"],
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            "ngrammys_spec_decode_tokens_per_pass",
            "Tokens committed per forward pass (bonus included)",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32),
            registry=r,
        )
        self.k = Gauge("ngrammys_spec_decode_k", "Speculations in the last round", registry=r)
        self.w = Gauge(
            "ngrammys_spec_decode_w", "Tokens per speculation in the last round", registry=r
        )
        self.predicted = Gauge(
            "ngrammys_spec_decode_predicted_tokens_per_second",
            "Controller's forecast for the last auto round",
            registry=r,
        )
        self.realized = Gauge(
            "ngrammys_spec_decode_realized_tokens_per_second",
            "Tokens per second the last round achieved (drafting + pass)",
            registry=r,
        )
        self.ttft = Histogram(
            "ngrammys_time_to_first_token_seconds",
            "Arrival to first text",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ngrammys_inter_token_latency_seconds",
            "Time per token between outputs",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ngrammys_e2e_request_latency_seconds",
            "Arrival to completion",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "ngrammys_request_queue_time_seconds",
            "Arrival to engine start",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward = Histogram(
            "ngrammys_forward_pass_seconds",
            "One forward pass over the batch (not its "
            "planning, drafting or verification), by its tokens",
            ["tree_size"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "ngrammys_batch_size", "Requests in one pass", buckets=BATCH_BUCKETS, registry=r
        )
        self.pass_tokens = Histogram(
            "ngrammys_pass_tokens",
            "Tokens one pass computed (prompt chunks, roots, tree nodes), summed over the batch",
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.pass_committed = Histogram(
            "ngrammys_pass_committed_tokens",
            "Tokens one pass committed, summed over the batch",
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.graph_capture = Counter(
            "ngrammys_cuda_graph_capture_seconds",
            "Time passes spent recording CUDA graphs of new pass shapes",
            registry=r,
        )
        self.waiting = Gauge("ngrammys_num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge(
            "ngrammys_num_requests_running", "Requests the engine is decoding", registry=r
        )
        self.prompt_tokens = Counter(
            "ngrammys_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "ngrammys_generation_tokens", "Generated tokens", registry=r
        )
        self.requests = Counter(
            "ngrammys_requests", "Finished requests by outcome", ["status"], registry=r
        )
        self.disconnects = Counter(
            "ngrammys_client_disconnects", "Clients gone before the end", registry=r
        )
        self.http_requests = Counter(
            "ngrammys_http_requests",
            "HTTP requests answered, by route (its path template), method and status",
            ["route", "method", "status"],
            registry=r,
        )

    def watch_queue(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the queue gauges from the engine at scrape time."""
        self.waiting.set_function(waiting)
        self.running.set_function(running)

    def watch_profile(self, state: Callable[[], ProfileState | None]) -> None:
        """Read the cost profile's state (None: the server measures none) at scrape time."""
        self.registry.register(_ProfileCollector(state))

    def watch_kv_cache(self, scheduler: Scheduler) -> None:
        """Read the KV usage and the prefix cache's counters from the scheduler at scrape time."""
        self.registry.register(_KVCacheCollector(scheduler))

    def watch_suffix_index(self, index: SuffixIndex) -> None:
        """Export the cross-request suffix index's size (fixed at its capacity)."""
        Gauge(
            "ngrammys_suffix_index_bytes",
            "Bytes held by the cross-request suffix index (fixed by --suffix-cache-tokens)",
            registry=self.registry,
        ).set_function(lambda: index.nbytes)

    def watch_batches(self, runner: BatchRunner) -> None:
        """Batches by status (read from the store at scrape time), and the lines and tokens
        the batch runner has answered."""
        self.registry.register(_BatchCollector(runner))

    def record_step(self, stats: StepStats) -> None:
        """One pass of the engine (called on the engine's thread; the client is thread-safe)."""
        self.live.record_step(stats)
        self.forward.labels(tree_size_bucket(stats.tokens)).observe(stats.pass_seconds)
        self.batch_size.observe(stats.batch_size)
        self.pass_tokens.observe(stats.tokens)
        self.pass_committed.observe(stats.committed_tokens)
        self.graph_capture.inc(stats.capture_seconds)

    def record_round(self, output: RoundOutput) -> None:
        """One request's round: its tokens and speculation."""
        self.live.record_round(output)
        self.generation_tokens.inc(len(output.token_ids))
        self.tokens_per_pass.observe(len(output.token_ids))
        self.k.set(output.k)
        self.w.set(output.w)
        self.realized.set(output.realized_tokens_per_second)
        if output.predicted_tokens_per_second is not None:
            self.predicted.set(output.predicted_tokens_per_second)
        if output.num_draft_tokens == 0:
            return
        self.num_drafts.inc()
        for strategy, count in output.drafted_by_strategy.items():
            self.num_draft_tokens.labels(strategy).inc(count)
        for position, strategy in enumerate(output.accepted_strategies):
            self.num_accepted_tokens.labels(strategy).inc()
            self.accepted_per_pos.labels(str(min(position, MAX_POSITION_LABEL))).inc()


class _ProfileCollector:
    """The cost profile's validity and its measurements, as the keeper counts them."""

    def __init__(self, state: Callable[[], ProfileState | None]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state()
        yield GaugeMetricFamily(
            "ngrammys_cost_profile_valid",
            "1 while a valid cost profile is in use (auto mode speculates)",
            value=float(state is not None and state.valid),
        )
        remeasures = CounterMetricFamily(
            "ngrammys_cost_profile_remeasures",
            "Cost profile measurements by outcome: "
            "adopted, failed (validation), abandoned (machine busy or budget spent)",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            remeasures.add_metric([outcome], 0 if state is None else state.remeasures[outcome])
        yield remeasures


class _BatchCollector:
    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Metric]:
        batches = GaugeMetricFamily("ngrammys_batches", "Batch jobs by status", labels=["status"])
        try:
            counts = self.runner.store.status_counts()
        except StoreError:  # the store's own error is the batches' to report; the scrape goes on
            counts = {}
        for status in BATCH_STATUSES:
            batches.add_metric([status], counts.get(status, 0))
        yield batches
        lines = CounterMetricFamily(
            "ngrammys_batch_lines",
            "Batch lines answered since start: completed (200) or failed (an error answer)",
            labels=["outcome"],
        )
        for outcome, count in self.runner.lines_answered.items():
            lines.add_metric([outcome], count)
        yield lines
        yield CounterMetricFamily(
            "ngrammys_batch_generation_tokens",
            "Tokens generated for batch lines since start (rate: batch tokens/s)",
            value=self.runner.tokens,
        )


class _KVCacheCollector:
    """vLLM's KV cache series: the share of the KV budget the running requests may reach (the
    Gateway API Inference Extension's KVCacheUtilization; cached prefix blocks count as free,
    as they give way to any request), the preemptions, and the prompt tokens looked up in and
    found in the prefix cache (hit rate = hits / queries)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        usage = self.scheduler.kv_usage
        if usage is not None:  # no budget: no share of it to report
            yield GaugeMetricFamily(
                "ngrammys_kv_cache_usage_perc",
                "Share of the KV cache budget the running requests may reach (1 = full)",
                value=usage,
            )
        yield GaugeMetricFamily(
            "ngrammys_kv_cache_bytes",
            "Bytes held by the running requests' KV buffers (0 while idle)",
            value=self.scheduler.cache.nbytes,
        )
        yield CounterMetricFamily(
            "ngrammys_num_preemptions",
            "Running batch requests that gave their KV row up for interactive load",
            value=self.scheduler.preemptions,
        )
        prefix = self.scheduler.prefix
        if prefix is None:
            return
        yield CounterMetricFamily(
            "ngrammys_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=prefix.stats.queried_tokens,
        )
        yield CounterMetricFamily(
            "ngrammys_prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            value=prefix.stats.hit_tokens,
        )
        yield GaugeMetricFamily(
            "ngrammys_prefix_cache_bytes", "Bytes held by cached prefix blocks", value=prefix.nbytes
        )


router = APIRouter(dependencies=[Depends(metrics_identity)])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


class RouteCounter:
    """ASGI middleware: every HTTP request answered, counted in `metrics.http_requests` by the
    route it matched (its path template, so the labels stay few; `unmatched` for none), its
    method and the status sent (500 where none was: the error left past this middleware)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_requests.labels(route, scope["method"], str(status)).inc()
