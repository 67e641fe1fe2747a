"""A loaded model and its engine, driven from an asyncio server without blocking it.

Forward passes run on one dedicated worker thread, so the event loop keeps answering health
probes and new requests while a generation runs; requests queue on that thread in arrival
order. (The scheduler with a bounded queue and continuous batching replaces this later.)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from drafting import ContextNgramDrafter
from service.config import GenerationParams
from service.engine import Completion, Engine
from service.model_loader import LoadedModel
from service.model_runner import ModelRunner
from service.prompts import stop_token_ids


@dataclass
class Runtime:
    """What a server needs to answer requests: tokenizer, engine and its worker thread."""

    loaded: LoadedModel
    engine: Engine
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngrammys-engine")
    )

    @classmethod
    def build(cls, loaded: LoadedModel) -> Runtime:
        config = loaded.model.config
        engine = Engine(
            ModelRunner(loaded.model),
            ContextNgramDrafter(),
            eos_token_ids=stop_token_ids(loaded.tokenizer, config.eos_token_id),
            max_context=config.max_position_embeddings,
        )
        return cls(loaded, engine)

    async def complete(self, prompt_ids: list[int], params: GenerationParams) -> Completion:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.engine.complete, prompt_ids, params)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
