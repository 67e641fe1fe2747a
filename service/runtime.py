"""A loaded model and its engine, driven from an asyncio server without blocking it.

Forward passes run on one dedicated worker thread, so the event loop keeps answering health
probes and new requests while a generation runs; requests queue on that thread in arrival
order. (The scheduler with a bounded queue and continuous batching replaces this later.)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from drafting import TableSlot, default_mixer
from service.config import GenerationParams
from service.engine import Completion, Engine
from service.model_loader import LoadedModel
from service.model_runner import ModelRunner
from service.model_tables import fill_in_background, load_or_compute_tables
from service.prompts import assistant_prefix_ids, stop_token_ids


def build_engine(loaded: LoadedModel, tables: TableSlot) -> Engine:
    """The engine for `loaded`, drafting with every strategy over `tables`."""
    config = loaded.model.config
    return Engine(
        ModelRunner(loaded.model),
        default_mixer(tables),
        eos_token_ids=stop_token_ids(loaded.tokenizer, config.eos_token_id),
        max_context=config.max_position_embeddings,
    )


def build_engine_with_tables(loaded: LoadedModel, cache_dir: Path) -> Engine:
    """An engine whose model tables are ready before it returns (benchmarks, tools)."""
    prefix = assistant_prefix_ids(loaded.tokenizer)
    return build_engine(loaded, TableSlot(load_or_compute_tables(loaded.model, cache_dir, prefix)))


@dataclass
class Runtime:
    """What a server needs to answer requests: tokenizer, engine and its worker thread."""

    loaded: LoadedModel
    engine: Engine
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngrammys-engine")
    )

    @classmethod
    def start(cls, loaded: LoadedModel, cache_dir: Path, model_tables: bool = True) -> Runtime:
        """Serve at once; the model tables are computed (or loaded) in the background."""
        slot = TableSlot()
        if model_tables:
            fill_in_background(loaded.model, cache_dir, assistant_prefix_ids(loaded.tokenizer), slot)
        return cls(loaded, build_engine(loaded, slot))

    async def complete(self, prompt_ids: list[int], params: GenerationParams) -> Completion:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.engine.complete, prompt_ids, params)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
