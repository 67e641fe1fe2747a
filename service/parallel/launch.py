"""Bring one rank up: its model shard on its device, met with the other ranks.

Every rank reads the whole checkpoint into host memory, keeps its shard and moves only that to
its device, so a model larger than one GPU loads; the ranks of a pod load one after another, so
its host holds one whole copy at a time (and the shards kept). Rank 0 also looks the model
tables up while it holds the whole model: they are kept under the whole weights' fingerprint,
where one rank's server finds them too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from drafting import ModelTables
from service.kernels.packed_linear import PACKED
from service.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from service.model.prompts import assistant_prefix_ids
from service.model.tables import saved_tables, tables_path
from service.parallel.group import join_ranks
from service.parallel.ranks import RankPlace
from service.parallel.shard import NotShardable, check_shardable, shard_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankShard:
    """A rank ready to run passes: its shard, its place, and the groups it meets the others in."""

    loaded: LoadedModel  # the shard (model), and the tokenizer and name as loaded
    place: RankPlace
    data_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    tables: ModelTables | None  # rank 0: the model tables found in the cache
    tables_path: Path  # where the whole model's tables are kept
    timeout: timedelta  # the longest a collective waits


def rank_device(device: str | None, local_rank: int) -> torch.device:
    """A rank's device: the GPU of its local rank (whatever index `device` names), else the CPU."""
    resolved = resolve_device(device)
    return torch.device("cuda", local_rank) if resolved.type == "cuda" else resolved


def load_shard(
    place: RankPlace,
    source: str | None,
    device: str | None,
    dtype: str | None,
    cache_dir: os.PathLike[str],
    quantization: str,
    timeout: timedelta,
) -> RankShard:
    """Meet the other ranks (each collective then bound by `timeout`), then, in turn with the
    other ranks of this pod (`in_turn`), load the model whole on the host and keep this rank's
    shard on its device. Raises `NotShardable` for what tensor parallelism cannot split."""
    if quantization in PACKED:
        raise NotShardable(
            f"--quantization {quantization} cannot be split over ranks: use --quantization none"
        )
    target = rank_device(device, place.local_rank)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    else:  # the pod's cores shared among its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.per_pod))
    dtype_name = str(resolve_dtype(dtype, target)).removeprefix("torch.")
    started = time.perf_counter()
    store, data_group, control_group = join_ranks(place, target, timeout)
    log.info(
        "rank %d of %d met the others in %.1f s",
        place.rank,
        place.world,
        time.perf_counter() - started,
    )
    with in_turn(store, place):
        loaded = load_model(source, "cpu", dtype_name, cache_dir, "none")
        check_shardable(loaded.model, place.world)
        path = tables_path(loaded.model, Path(cache_dir), assistant_prefix_ids(loaded.tokenizer))
        tables = saved_tables(path) if place.rank == 0 else None
        shard_model(loaded.model, place.rank, place.world, data_group)
        loaded.model.to(target)
    return RankShard(loaded, place, data_group, control_group, tables, path, timeout)


@contextmanager
def in_turn(store: dist.Store, place: RankPlace) -> Iterator[None]:
    """Run the body after the pod's previous rank ran it (it holds the whole model on the host
    only until it has cut its shard), so a pod holds one whole copy at a time, not one a rank.
    Ranks of other pods (hosts) go at once. The wait is the store's (the meeting's)."""
    if place.local_rank > 0:
        store.wait([f"loaded/{place.rank - 1}"])
    yield
    store.set(f"loaded/{place.rank}", "1")
