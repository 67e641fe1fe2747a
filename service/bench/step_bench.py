"""In-process batch benchmark (`ngrammys steps`): `Engine.step()` loops over C concurrent
requests, speculation off against auto, and where a step's time goes.

The load test (`loadtest.py`) measures what clients see through HTTP; this measures the
engine alone — step time, split into planning and drafting, the forward pass, and
verification with the KV commit; output tokens per second — so the host's share of a step
shows (on a GPU, where a pass is cheap, that share decides whether speculation pays). Each
run starts a fresh engine over the same tables and cost profile, so nothing learnt in one run
helps the next; the modes alternate (off, auto, auto, off, ...) so a machine's drift hits
both alike.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from service.bench.command import load
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams

MODES = ("off", "auto")
REQUESTS_PER_SLOT = 4  # requests a run = C x this


@dataclass(frozen=True)
class StepRun:
    """One run: C requests decoded together to the end."""

    concurrency: int
    mode: str
    steps: int
    tokens: int  # output tokens of all requests
    seconds: float  # wall time of the run
    step_seconds: float  # Σ over steps of the step's time (plan, pass, verify)
    draft_seconds: float  # of which planning and drafting
    rows: int  # Σ over steps of the requests in the pass (their mean shows the batch C really ran)
    capture_seconds: float = 0.0  # of `pass_seconds`: recording CUDA graphs of new pass shapes
    # of `step_seconds`: the forward passes (the rest: verification and KV commits)
    pass_seconds: float = 0.0
    device_steps: int = 0  # steps taken by the device round (`service/device_round/`)
    # of their time: the host waiting for the device in their one copy back each
    wait_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def row(self) -> str:
        per_step = 1e3 / self.steps
        return (
            f"| {self.concurrency} | {self.mode} | {self.steps} | {self.rows / self.steps:.1f} "
            f"| {self.tokens} "
            f"| {self.step_seconds * per_step:.1f} "
            f"| {self.draft_seconds * per_step:.1f} | {self.pass_seconds * per_step:.1f} "
            f"| {self.capture_seconds * per_step:.1f} "
            f"| {(self.step_seconds - self.draft_seconds - self.pass_seconds) * per_step:.1f} "
            f"| {self.device_steps} | {self.wait_seconds * 1e3 / max(self.device_steps, 1):.2f} "
            f"| {self.tokens_per_second:.0f} |"
        )


HEADER = (
    "| C | mode | steps | rows/step | tokens | ms/step | plan+draft ms | pass ms "
    "| of which capture ms "
    "| verify+commit ms | device-round steps | their wait ms | tokens/s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def run_steps(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    mode: str,
    max_new_tokens: int,
    k: int,
    w: int,
    requests_per_slot: int = REQUESTS_PER_SLOT,
) -> StepRun:
    """C × `requests_per_slot` requests (the prompts cycled), C of them in flight at a time (a
    new one joins as one ends, as under a steady load), stepped until every one ends. The
    engine must run C requests at once: one that holds fewer would queue the rest and measure a
    smaller batch under C's name."""
    if engine.scheduler.max_running < concurrency:
        raise ValueError(
            f"C={concurrency} needs an engine that runs {concurrency} requests at once, "
            f"not {engine.scheduler.max_running}"
        )
    speculation = (
        SpeculationParams(k, w, mode="auto") if mode == "auto" else SpeculationParams(0, 0)
    )
    params = GenerationParams(max_new_tokens=max_new_tokens, speculation=speculation)
    queued = list(itertools.islice(itertools.cycle(prompts), concurrency * requests_per_slot))[::-1]
    in_flight = steps = tokens = rows = 0
    step_seconds = draft_seconds = capture_seconds = pass_seconds = wait_seconds = 0.0
    device_steps = 0
    started = time.perf_counter()
    while queued or in_flight:
        while queued and in_flight < concurrency:
            engine.add_request(queued.pop(), params)
            in_flight += 1
        results, stats = engine.step()
        in_flight -= sum(
            1 for _, out in results if isinstance(out, Exception) or out.finish_reason is not None
        )
        if stats is not None:
            steps, tokens, rows = (
                steps + 1,
                tokens + stats.committed_tokens,
                rows + stats.batch_size,
            )
            step_seconds, draft_seconds = (
                step_seconds + stats.seconds,
                draft_seconds + stats.draft_seconds,
            )
            capture_seconds, pass_seconds = (
                capture_seconds + stats.capture_seconds,
                pass_seconds + stats.pass_seconds,
            )
            device_steps, wait_seconds = (
                device_steps + stats.syncs,
                wait_seconds + stats.wait_seconds,
            )
    return StepRun(
        concurrency,
        mode,
        steps,
        tokens,
        time.perf_counter() - started,
        step_seconds,
        draft_seconds,
        rows,
        capture_seconds,
        pass_seconds,
        device_steps,
        wait_seconds,
    )


def run_step_bench(
    new_engine: Callable[[], Engine],
    prompts: Sequence[Sequence[int]],
    concurrency: Sequence[int],
    max_new_tokens: int,
    k: int,
    w: int,
    repeats: int = 2,
    requests_per_slot: int = REQUESTS_PER_SLOT,
    progress: Callable[[StepRun], None] | None = None,
) -> list[StepRun]:
    """Each C with each mode `repeats` times, the order alternating, after one warm-up run of
    each mode at the smallest C (the first passes of new shapes pay one-off costs)."""
    for mode in MODES:
        run_steps(
            new_engine(), prompts, min(concurrency), mode, max_new_tokens, k, w, requests_per_slot=1
        )
    runs = []
    for c in concurrency:
        for repeat in range(repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                runs.append(
                    run_steps(
                        new_engine(), prompts, c, mode, max_new_tokens, k, w, requests_per_slot
                    )
                )
                if progress is not None:
                    progress(runs[-1])
    return runs


def format_summary(runs: Sequence[StepRun]) -> str:
    """Per C: each mode's tokens/s summed over its runs, and auto over off."""
    lines = ["| C | off tokens/s | auto tokens/s | auto/off |", "|---|---|---|---|"]
    for c in dict.fromkeys(r.concurrency for r in runs):
        rate = {
            mode: sum(r.tokens for r in runs if (r.concurrency, r.mode) == (c, mode))
            / sum(r.seconds for r in runs if (r.concurrency, r.mode) == (c, mode))
            for mode in MODES
        }
        lines.append(
            f"| {c} | {rate['off']:.0f} | {rate['auto']:.0f} | {rate['auto'] / rate['off']:.2f}x |"
        )
    return "\n".join(lines)


def run_command(
    model: str | None,
    config: EngineConfig,
    dataset: Path,
    per_category: int,
    concurrency: list[int],
    max_new_tokens: int,
    k: int,
    w: int,
    requests_per_slot: int,
    repeats: int,
) -> None:
    """`ngrammys steps`: the engine's steps in process, speculation off against auto, a row a
    run as it ends, then the ratios."""
    from service.bench.specbench import load_specbench
    from service.engine.scheduler import SchedulerConfig
    from service.runtime import build_engine, build_engine_with_tables

    loaded = load(model, config)
    # no suffix index: the prompts cycle, and it would draft a repeated prompt's earlier answer
    # whole
    config = replace(config, cost_profile=True, suffix_cache_tokens=0)
    engine = build_engine_with_tables(loaded, config)
    prompts = [p.prompt_ids for p in load_specbench(dataset, loaded.tokenizer, per_category)]

    # C in flight means C in the pass
    batch = SchedulerConfig(max_running_requests=max(concurrency))

    def new_engine() -> Engine:
        fresh = build_engine(loaded, engine.mixer.tables, replace(config, scheduler=batch))
        fresh.profile = engine.profile
        return fresh

    print(
        f"{loaded.name} on {loaded.model.device}, {loaded.model.dtype}: "
        f"{len(prompts)} prompts cycled, "
        f"{max_new_tokens} tokens each, C x {requests_per_slot} requests a run, greedy, "
        f"auto up to k={k} w={w}\n\n{HEADER}",
        flush=True,
    )
    runs = run_step_bench(
        new_engine,
        prompts,
        concurrency,
        max_new_tokens,
        k,
        w,
        repeats,
        requests_per_slot,
        progress=lambda run: print(run.row(), flush=True),
    )
    print(f"\n{format_summary(runs)}")
