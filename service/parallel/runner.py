"""Rank 0's model runner, which has the other ranks run every pass with it, and their loop.

Rank 0 runs the whole engine (scheduler, drafts, controller, verification, sampling) as with one
device; only its `ModelRunner` differs. Each pass is sent to the other ranks with the cache ops
before it (`service/parallel/mirror.py`) and run by all at once on their shards, their partial
sums exchanged inside (`service/parallel/shard.py`). Every rank ends the pass with the same
logits; only rank 0's are used, so the ranks never need to agree on anything else.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Generator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from drafting import ModelTables
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner, RowInput
from service.model.tables import compute_tables_steps, save_tables
from service.parallel.group import Control, receive
from service.parallel.mirror import MirroredCache, Replica

log = logging.getLogger(__name__)


class ParallelRunner(ModelRunner):
    """A `ModelRunner` over rank 0's shard whose passes every rank runs. Passes run eagerly
    (no fixed-shape graphs) and take their tokens from the host (no device round)."""

    def __init__(self, model: PreTrainedModel, control: Control, world: int) -> None:
        super().__init__(model, static_passes=False)
        self.control = control
        self.tensor_parallel_size = world
        self._cache_ids = itertools.count()

    def new_cache(self, rows: int = 0) -> TreeKVCache:
        cache_id = next(self._cache_ids)
        self.control.log((cache_id, "new_cache", rows))
        cache = MirroredCache(
            cache_id, self.control.log, self.model.config.num_hidden_layers, rows, self.kv_dtype
        )
        weakref.finalize(cache, self.control.log, (cache_id, "drop_cache"))
        return cache

    def forward_flat(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if token_ids is not None or not isinstance(cache, MirroredCache):
            raise NotImplementedError(
                "a tensor-parallel pass takes host tokens and a cache of its runner"
            )
        with self.control.turn("forward", cache.cache_id, list(rows)):
            return super().forward_flat(cache, rows)

    def table_steps(
        self, prefix_ids: Sequence[int], path: Path, batch_size: int
    ) -> Generator[ModelTables | None, None, ModelTables]:
        """The model tables computed over the ranks, one batch a step in turn with the passes
        (`compute_tables_steps` runs the model's own forward, which every rank must run with
        it; its partial tables are yielded as it yields them), then saved at `path` (the whole
        model's)."""
        steps = compute_tables_steps(self.model, prefix_ids, batch_size, show_progress=False)
        while True:
            with self.control.turn("tables", list(prefix_ids), batch_size):
                try:
                    partial = next(steps)
                except StopIteration as done:
                    tables = done.value
                    break
            yield partial
        save_tables(path, tables)
        return tables

    def close(self) -> None:
        self.control.close()


def serve_rank(runner: ModelRunner, control_group: dist.ProcessGroup) -> None:
    """Another rank's life: run what rank 0 sends, until it says stop (or is lost: the
    collective's error is raised)."""
    replica = Replica(runner.new_cache)
    tables: Generator[ModelTables | None, None, ModelTables] | None = None
    while True:
        ops, message = receive(control_group)
        replica.replay(ops)
        if message[0] == "forward":
            _, cache_id, rows = message
            runner.forward_flat(replica.caches[cache_id], rows)
        elif message[0] == "tables":
            _, prefix_ids, batch_size = message
            tables = tables or compute_tables_steps(
                runner.model, prefix_ids, batch_size, show_progress=False
            )
            try:
                next(tables)
            except StopIteration:
                tables = None
        elif message[0] == "ping":
            dist.all_reduce(torch.zeros(1), group=control_group)
        elif message[0] == "stop":
            log.info("rank %d: stopped by rank 0", dist.get_rank())
            return
