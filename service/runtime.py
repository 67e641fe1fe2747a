"""What a server runs: the loaded model, its engine behind the async worker, and the warm-up
(cost profile, model tables) that the worker runs in increments while idle."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

from drafting import Strategy, TableSlot, compile_table_kernels, default_mixer
from drafting.suffix import DEFAULT_CAPACITY
from service.engine.async_engine import AsyncEngine
from service.engine.engine import Engine, StepStats
from service.model.loader import LoadedModel
from service.model.runner import ModelRunner
from service.model.tables import load_or_compute_tables, load_or_compute_tables_steps
from service.controller.profiler import load_or_measure, load_saved, measure_and_save_steps
from service.model.prompts import assistant_prefix_ids, stop_token_ids
from service.engine.scheduler import SchedulerConfig

log = logging.getLogger(__name__)
TABLE_BATCH = 128  # vocabulary tokens per warm-up increment (a fraction of a second on a CPU)


def build_engine(loaded: LoadedModel, tables: TableSlot, scheduler: SchedulerConfig = SchedulerConfig(),
                 drafters: Sequence[Strategy] = (), suffix_cache_tokens: int = DEFAULT_CAPACITY,
                 enforce_eager: bool = False) -> Engine:
    """The engine for `loaded`, drafting with every strategy over `tables` and `drafters`
    (the model-running ones, `service/model_drafts/draft_model.py`); `enforce_eager`: no CUDA graphs."""
    config = loaded.model.config
    return Engine(
        ModelRunner(loaded.model, static_passes=False if enforce_eager else None),
        default_mixer(tables, drafters, suffix_cache_tokens),
        eos_token_ids=stop_token_ids(loaded.tokenizer, config.eos_token_id),
        max_context=config.max_position_embeddings,
        scheduler_config=scheduler,
    )


def build_engine_with_tables(loaded: LoadedModel, cache_dir: Path, profile: bool = False,
                             drafters: Sequence[Strategy] = (), suffix_cache_tokens: int = DEFAULT_CAPACITY,
                             enforce_eager: bool = False) -> Engine:
    """An engine whose model tables (and cost profile, if asked) are ready before it returns."""
    prefix = assistant_prefix_ids(loaded.tokenizer)
    tables = TableSlot(load_or_compute_tables(loaded.model, cache_dir, prefix))
    engine = build_engine(loaded, tables, drafters=drafters, suffix_cache_tokens=suffix_cache_tokens,
                          enforce_eager=enforce_eager)
    if profile:
        engine.profile = load_or_measure(engine.runner, cache_dir)
    return engine


def warm_up(
    engine: Engine, loaded: LoadedModel, cache_dir: Path, model_tables: bool, profile: bool
) -> Generator[bool | None, None, None]:
    """The warm-up as increments: the cost profile, then the model tables;
    then, for as long as the server runs, a new profile whenever live pass times drift from
    it (yields False while there is nothing to do). First the successor tables' compiled
    refresh and walk, which every round of a request drafting from them runs."""
    compile_table_kernels()
    yield None
    if profile:
        engine.profile = load_saved(engine.runner, cache_dir)
        if engine.profile is None:
            engine.profile = yield from measure_and_save_steps(engine.runner, cache_dir)
        log.info("cost profile ready: auto mode enabled")
    if model_tables:
        prefix = assistant_prefix_ids(loaded.tokenizer)
        steps = load_or_compute_tables_steps(loaded.model, cache_dir, prefix, TABLE_BATCH, show_progress=False)
        engine.mixer.tables.tables = yield from steps
        log.info("model tables ready: unigram/bigram strategies enabled")
    while profile:
        if engine.calibration.drifted():
            log.warning("live pass times drifted from the cost profile: measuring it again")
            engine.profile = yield from measure_and_save_steps(engine.runner, cache_dir)
            engine.calibration.reset_costs()
        else:
            yield False


@dataclass
class Runtime:
    """What a server needs to answer requests: tokenizer, engine, and the engine's worker."""

    loaded: LoadedModel
    engine: Engine
    async_engine: AsyncEngine

    @classmethod
    def start(
        cls,
        loaded: LoadedModel,
        cache_dir: Path,
        model_tables: bool = True,
        profile: bool = True,
        max_waiting: int = 64,
        request_timeout: float | None = None,
        scheduler: SchedulerConfig = SchedulerConfig(),
        on_step: Callable[[StepStats], None] | None = None,
        drafters: Sequence[Strategy] = (),
        suffix_cache_tokens: int = DEFAULT_CAPACITY,
        enforce_eager: bool = False,
    ) -> Runtime:
        """Serve at once; the worker measures (or loads) the cost profile, then the model
        tables, while idle. Until then auto mode decodes plainly and the table strategies
        propose nothing."""
        engine = build_engine(loaded, TableSlot(), scheduler, drafters, suffix_cache_tokens, enforce_eager)
        steps = warm_up(engine, loaded, cache_dir, model_tables, profile)
        return cls(loaded, engine, AsyncEngine(engine, max_waiting, request_timeout, steps, on_step))

    def close(self) -> None:
        self.async_engine.shutdown()
