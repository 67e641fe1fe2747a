"""What a server runs: the loaded model, its engine behind the async queue, and the
background warm-up (cost profile, model tables) that enables auto mode and the table drafts."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from drafting import TableSlot, default_mixer
from service.async_engine import AsyncEngine
from service.engine import Engine
from service.model_loader import LoadedModel
from service.model_runner import ModelRunner
from service.model_tables import load_or_compute_tables
from service.profiler import load_or_measure
from service.prompts import assistant_prefix_ids, stop_token_ids

log = logging.getLogger(__name__)


def build_engine(loaded: LoadedModel, tables: TableSlot) -> Engine:
    """The engine for `loaded`, drafting with every strategy over `tables`."""
    config = loaded.model.config
    return Engine(
        ModelRunner(loaded.model),
        default_mixer(tables),
        eos_token_ids=stop_token_ids(loaded.tokenizer, config.eos_token_id),
        max_context=config.max_position_embeddings,
    )


def build_engine_with_tables(loaded: LoadedModel, cache_dir: Path, profile: bool = False) -> Engine:
    """An engine whose model tables (and cost profile, if asked) are ready before it returns."""
    prefix = assistant_prefix_ids(loaded.tokenizer)
    engine = build_engine(loaded, TableSlot(load_or_compute_tables(loaded.model, cache_dir, prefix)))
    if profile:
        engine.profile = load_or_measure(engine.runner, cache_dir)
    return engine


def _warm_up(engine: Engine, loaded: LoadedModel, cache_dir: Path, model_tables: bool, profile: bool) -> None:
    try:
        if profile:
            engine.profile = load_or_measure(engine.runner, cache_dir)
            log.info("cost profile ready: auto mode enabled")
        if model_tables:
            prefix = assistant_prefix_ids(loaded.tokenizer)
            engine.mixer.tables.tables = load_or_compute_tables(loaded.model, cache_dir, prefix)
            log.info("model tables ready: unigram/bigram strategies enabled")
    except Exception:  # serving goes on with what is ready
        log.exception("warm-up failed")


@dataclass
class Runtime:
    """What a server needs to answer requests: tokenizer, engine, and the engine's queue."""

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
    ) -> Runtime:
        """Serve at once; the cost profile, then the model tables, are measured (or loaded
        from the cache) on a background thread. Until then auto mode runs as fixed, and the
        table strategies propose nothing."""
        engine = build_engine(loaded, TableSlot())
        threading.Thread(
            target=_warm_up, args=(engine, loaded, cache_dir, model_tables, profile),
            name="ngrammys-warm-up", daemon=True,
        ).start()
        return cls(loaded, engine, AsyncEngine(engine, max_waiting, request_timeout))

    def close(self) -> None:
        self.async_engine.shutdown()
