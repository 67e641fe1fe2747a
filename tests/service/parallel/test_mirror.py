"""The other ranks' caches follow rank 0's by its ops alone: an engine (prefix cache, chunked
prompts, speculation, rows leaving) runs on a runner whose every pass a replica runs too, over
caches it rebuilt from the ops only, on the same weights, so the two must agree bit for bit."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

from service.engine.params import GenerationParams, SpeculationParams
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner, RowInput
from service.parallel.mirror import MirroredCache, Op, Replica
from tests.helpers.engines import make_engine

SYSTEM = list(range(2, 42))  # two and a half prefix-cache blocks
PROMPTS = [
    SYSTEM + [5, 9],
    SYSTEM + [7],
    [3, 4, 5, 6, 3, 4, 5, 6, 3, 4],
    SYSTEM[:20] + [50, 51],
    [11],
]


class ShadowedRunner(ModelRunner):
    """Rank 0's runner with another rank in the same process: before each pass it hands the ops
    logged since the last to a `Replica` and runs the pass there as well."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, static_passes=False)
        self.ops: list[Op] = []
        self.other = ModelRunner(model, static_passes=False)
        self.replica = Replica(self.other.new_cache)
        self.passes = 0
        self._ids = itertools.count()

    def new_cache(self, rows: int = 0) -> TreeKVCache:
        cache_id = next(self._ids)
        self.ops.append((cache_id, "new_cache", rows))
        return MirroredCache(
            cache_id, self.ops.append, self.model.config.num_hidden_layers, rows, self.kv_dtype
        )

    def forward_flat(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert isinstance(cache, MirroredCache)
        self.replica.replay(self.ops)
        self.ops.clear()
        other = self.replica.caches[cache.cache_id]
        assert other.lengths == cache.lengths
        assert_same_entries(cache, other)
        theirs = self.other.forward_flat(other, rows)
        ours = super().forward_flat(cache, rows)
        assert torch.equal(ours, theirs)
        self.passes += 1
        return ours


def assert_same_entries(cache: TreeKVCache, other: TreeKVCache) -> None:
    for row, length in enumerate(cache.lengths):
        if length:
            for ours, theirs in zip(
                TreeKVCache.entries(cache, row, 0, length), other.entries(row, 0, length)
            ):
                assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "speculation",
    [SpeculationParams(0, 0), SpeculationParams(4, 4), SpeculationParams(4, 4, "auto")],
)
def test_a_replica_kept_by_the_ops_alone_runs_every_pass_as_rank_zero(
    tiny_model, tiny_tables, speculation: SpeculationParams
) -> None:
    runner = ShadowedRunner(tiny_model)
    engine = make_engine(runner, tiny_tables, max_tokens_per_pass=16, prefix_cache=True)
    for wave in (
        PROMPTS[:3],
        PROMPTS[3:],
        PROMPTS[:2],
    ):  # the last wave reads the blocks the first stored
        lengths = itertools.cycle([6, 14, 9])
        requests = [
            engine.add_request(prompt, GenerationParams(next(lengths), speculation=speculation))
            for prompt in wave
        ]
        while engine.has_work:
            results, _ = engine.step()
            assert not any(isinstance(out, Exception) for _, out in results)
        assert all(request.num_generated for request in requests)
    prefix = engine.scheduler.prefix
    assert prefix is not None and prefix.stats.hit_tokens > 0  # blocks were stored and read back
    assert runner.passes > 20
    engine.scheduler.prefix.clear()  # rank 0 lets its blocks go: the replica's follow
    runner.replica.replay(runner.ops)
    assert not runner.replica.blocks
