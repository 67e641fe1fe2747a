"""The KV cache of rank 0, with every change to its shape told to the other ranks.

Rank 0 alone schedules: it adds and removes rows, commits the entries verification keeps, and
copies prompt blocks into and out of the prefix cache. Every other rank holds the same rows over
its own heads, so each such call is logged here as an `Op` (name and arguments, never tensors)
and replayed, in order, by `replay` on the other ranks before the next pass they run. A prefix
block's keys and values are each rank's own: rank 0's copy gets a block id, the other ranks keep
theirs under that id until rank 0's copy is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from service.model.kv_cache import TreeKVCache

Op = tuple[Any, ...]  # (cache id, method name, *arguments)


class MirroredCache(TreeKVCache):
    """A `TreeKVCache` whose every change is handed to `log` as an `Op`."""

    def __init__(
        self,
        cache_id: int,
        log: Callable[[Op], None],
        num_layers: int,
        rows: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_layers=num_layers, rows=rows, dtype=dtype)
        self.cache_id, self._log = cache_id, log
        self._block_ids: dict[int, int] = {}  # id() of a block's keys -> its block id
        self._next_block = 0

    def add_row(self) -> int:
        self._log((self.cache_id, "add_row"))
        return super().add_row()

    def remove_row(self, row: int) -> int | None:
        self._log((self.cache_id, "remove_row", row))
        return super().remove_row(row)

    def commit_rows(self, kept_by_row: Mapping[int, Sequence[int]]) -> None:
        self._log(
            (self.cache_id, "commit_rows", {row: list(kept) for row, kept in kept_by_row.items()})
        )
        super().commit_rows(kept_by_row)

    def advance(self, row: int, entries: int) -> None:
        self._log((self.cache_id, "advance", row, entries))
        super().advance(row, entries)

    def keep_paths(self, starts: torch.Tensor, paths: torch.Tensor, counts: torch.Tensor) -> None:
        raise NotImplementedError("the device round does not run under tensor parallelism")

    def entries(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().entries(row, start, end)
        block = self._next_block
        self._next_block += 1
        self._block_ids[id(keys)] = block
        self._log((self.cache_id, "entries", row, start, end, block))
        weakref.finalize(keys, self._forget, id(keys), block)
        return keys, values

    def append_entries(self, row: int, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._log(
            (
                self.cache_id,
                "append_entries",
                row,
                [self._block_ids[id(keys)] for keys, _ in blocks],
            )
        )
        super().append_entries(row, blocks)

    def _forget(self, keys_id: int, block: int) -> None:
        """Rank 0's copy of `block` is gone: the other ranks drop theirs."""
        self._block_ids.pop(keys_id, None)
        self._log((self.cache_id, "drop_block", block))


class Replica:
    """The other ranks' side: their caches and prefix blocks, kept as rank 0's are by its ops."""

    def __init__(self, new_cache: Callable[[int], TreeKVCache]) -> None:
        self.new_cache = new_cache
        self.caches: dict[int, TreeKVCache] = {}
        self.blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def replay(self, ops: Sequence[Op]) -> None:
        for cache_id, name, *args in ops:
            if name == "new_cache":
                self.caches[cache_id] = self.new_cache(*args)
            elif name == "drop_cache":
                self.caches.pop(cache_id)
                self.blocks = {
                    key: block for key, block in self.blocks.items() if key[0] != cache_id
                }
            elif name == "entries":
                row, start, end, block = args
                self.blocks[cache_id, block] = self.caches[cache_id].entries(row, start, end)
            elif name == "append_entries":
                row, blocks = args
                self.caches[cache_id].append_entries(
                    row, [self.blocks[cache_id, block] for block in blocks]
                )
            elif name == "drop_block":
                self.blocks.pop((cache_id, args[0]), None)
            else:
                getattr(self.caches[cache_id], name)(*args)
