"""Automatic prefix caching: the KV of token blocks outlives the request that computed it.

Real traffic repeats prompt prefixes (system prompts, few-shot examples, a chat's whole
history every turn, agents re-sending their transcript), and on a CPU prefill is the dearest
part of such a request. So every full block of `BLOCK_TOKENS` committed tokens a
request computed is kept — keys and values of all layers, a copy — keyed by its tokens and
the block before it, and a later request whose prompt starts with the same blocks gets
their entries copied into its KV row instead of prefilling them.

Copied, not shared: the KV cache keeps one contiguous row per request (`kv_cache.py`), which
the attention kernels, the per-row compaction after verification and CUDA graphs all rely
on. A copy costs a memory move of ~46 KB a token (embedded model, float32 KV), far less than
prefilling the token (docs/benchmarks.md, "Prefix caching"); and a row never writes into a
cached block, so speculation and compaction need no copy-on-write.

Exact: a block's key is (its parent block's id, its tokens), compared as is — no hash that
could collide — so a block is found only after the very same tokens at the very same
positions. The entries a cached block brings are those the same tokens got when computed,
so a request's output is the same with and without the cache as far as the model's passes
are row- and chunk-independent (the packed CPU kernels are, bit for bit; elsewhere to the
last bits of float arithmetic, as chunked prefill already is).

Memory: the blocks share the KV budget with the running rows (`Scheduler`): they fill what
the rows leave, and the least recently used block (with the blocks after it, unreachable
without it) goes first when a request needs the room. Nothing a running request needs lives
only here, so any block can go at any time.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from service.model.kv_cache import TreeKVCache

BLOCK_TOKENS = 16  # vLLM's default block size: a hit loses at most 15 tokens to the block edge

# (parent block's id, or -1 at the start; the block's tokens)
BlockKey = tuple[int, tuple[int, ...]]


@dataclass(eq=False)
class _Block:
    key: BlockKey
    id: int
    parent: _Block | None
    keys: torch.Tensor  # [layers, kv_heads, BLOCK_TOKENS, head_dim]
    values: torch.Tensor
    children: list[_Block] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up and found (vLLM's prefix_cache_queries / _hits), and blocks
    evicted; cumulative."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    """Cached blocks in LRU order. `room()` says how many bytes the blocks may hold now (the
    KV budget less what the running rows may reach); `store` evicts to stay within it."""

    def __init__(self, room: Callable[[], int]) -> None:
        self.room = room
        self.stats = PrefixCacheStats()
        self.nbytes = 0
        self._blocks: OrderedDict[BlockKey, _Block] = OrderedDict()  # least recently used first
        self._ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def match(self, token_ids: Sequence[int], touch: bool = True) -> list[_Block]:
        """The cached blocks that `token_ids` starts with (whole blocks only), marked as just
        used unless `touch` is False."""
        blocks: list[_Block] = []
        parent = -1
        for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            block = self._blocks.get((parent, tuple(token_ids[start : start + BLOCK_TOKENS])))
            if block is None:
                break
            blocks.append(block)
            parent = block.id
        if touch:
            self._touch(blocks)
        return blocks

    def peek(self, token_ids: Sequence[int]) -> int:
        """How many tokens `match` would find, nothing marked or counted."""
        return len(self.match(token_ids, touch=False)) * BLOCK_TOKENS

    def load(
        self, cache: TreeKVCache, row: int, token_ids: Sequence[int], counted: bool = True
    ) -> int:
        """Fill an empty KV row with the cached blocks its committed tokens start with (a
        prompt's, or a preempted request's prompt and output), all but the newest token (whose
        pass gives the next logits); returns the tokens loaded. `counted`: the lookup counts in
        the prompt statistics (not a preempted request's return)."""
        blocks = self.match(token_ids[: len(token_ids) - 1])
        if counted:
            self.stats.queried_tokens += len(token_ids)
            self.stats.hit_tokens += len(blocks) * BLOCK_TOKENS
        if blocks:
            cache.append_entries(row, [(block.keys, block.values) for block in blocks])
        return len(blocks) * BLOCK_TOKENS

    def store(self, cache: TreeKVCache, row: int, token_ids: Sequence[int]) -> None:
        """Keep the whole blocks of a row's committed entries (`token_ids`: the tokens they
        hold, from the row's start) that are not cached yet, as far as there is room."""
        parent, chain = None, []
        end = min(len(token_ids), cache.lengths[row])
        for start in range(0, end - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = (
                -1 if parent is None else parent.id,
                tuple(token_ids[start : start + BLOCK_TOKENS]),
            )
            block = self._blocks.get(key)
            if block is None:
                if not self._make_room(BLOCK_TOKENS * cache.entry_nbytes, keep=parent):
                    break
                keys, values = cache.entries(row, start, start + BLOCK_TOKENS)
                block = _Block(key, next(self._ids), parent, keys, values)
                self._blocks[key] = block
                self.nbytes += block.nbytes
                if parent is not None:
                    parent.children.append(block)
            chain.append(block)
            parent = block
        self._touch(chain)

    def _touch(self, chain: list[_Block]) -> None:
        """Mark a chain of blocks as just used, its first block last: of a chain, eviction then
        takes the end first, and a prefix many prompts share (a system prompt) stays longest."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def evict_until(self, nbytes: int) -> None:
        """Evict least recently used blocks until the blocks hold at most `nbytes`."""
        while self._blocks and self.nbytes > nbytes:
            self._evict(next(iter(self._blocks.values())))

    def clear(self) -> None:
        self.evict_until(0)

    def _make_room(self, nbytes: int, keep: _Block | None) -> bool:
        """Evict least recently used blocks, but never `keep` or the blocks before it (the
        chain being stored), until `nbytes` more fit in `room()`; whether they do."""
        room = self.room()
        if self.nbytes + nbytes <= room:
            return True
        protected = set()
        while keep is not None:
            protected.add(keep.id)
            keep = keep.parent
        for block in list(self._blocks.values()):
            if self.nbytes + nbytes <= room:
                break
            if block.id not in protected and block.key in self._blocks:
                self._evict(block)
        return self.nbytes + nbytes <= room

    def _evict(self, block: _Block) -> None:
        """Drop `block` and every block after it (no prompt can reach them without it)."""
        if block.parent is not None:
            block.parent.children.remove(block)
        pending = [block]
        while pending:
            gone = pending.pop()
            if self._blocks.pop(gone.key, None) is not None:
                self.nbytes -= gone.nbytes
                self.stats.evicted_blocks += 1
                pending += gone.children
