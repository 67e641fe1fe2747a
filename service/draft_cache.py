"""One request's KV cache for a draft model, kept in step with the tokens the target committed.

Layout after a round of drafting: the committed tokens' entries at [0, c), then the drafted
tree depth by depth — branch b's token at depth d (1-based) at c + (d - 1)·width + b, all
branches holding entries for the same number of tokens (the deepest drafted token of each is
never fed, so it has none; a staged draft holds one branch). The next round's `sync`
compares that with the request's history: a drafted branch whose tokens were committed keeps
its entries (gathered right after the committed ones, so an accepted draft is never
recomputed); the rest is cropped (rollback after partial acceptance or rejection). What is
left to feed is at least the newest token, whose logits the next draft starts from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

from drafting import common_prefix


class DraftCache:
    """A `DynamicCache` and the token ids its entries hold (see the module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.kv = DynamicCache(config=config)
        self.token_ids: list[int] = []  # committed tokens with entries at [0, len)
        self.branches: list[list[int]] = []  # the drafted tree after them (equal lengths)

    @property
    def length(self) -> int:
        """Entries held: committed tokens plus the drafted tree."""
        return self.kv.get_seq_length()

    def sync(self, history: Sequence[int]) -> list[int]:
        """Keep the longest prefix of `history` the cache holds (a committed draft branch
        included), drop the rest, and return the tokens still to feed (never empty)."""
        committed = common_prefix(self.token_ids, history)
        kept_branch: list[int] = []
        if committed == len(self.token_ids) and self.branches:
            new = history[committed:]
            best = max(range(len(self.branches)), key=lambda b: common_prefix(self.branches[b], new))
            accepted = min(common_prefix(self.branches[best], new), len(new) - 1)
            kept_branch = [committed + depth * len(self.branches) + best for depth in range(accepted)]
        keep = min(committed, len(history) - 1)
        self._keep(keep, kept_branch if keep == committed else [])
        self.token_ids = list(history[: self.length])
        self.branches = []
        return list(history[self.length :])

    def record_tree(self, branches: list[list[int]]) -> None:
        """The tree the drafter just appended (its entries follow the committed ones)."""
        assert len({len(b) for b in branches}) <= 1, "branches are drafted depth by depth"
        self.branches = branches

    def tree_mask(self, width: int, depth: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[1, 1, width, c + depth·width] additive mask for drafting depth `depth` (1-based) of
        `width` branches: each query sees the committed prefix and its own branch only."""
        committed = len(self.token_ids)
        total = committed + depth * width
        mask = torch.full((1, 1, width, total), torch.finfo(dtype).min, dtype=dtype, device=device)
        mask[..., :committed] = 0
        for branch in range(width):
            mask[0, 0, branch, committed + branch :: width] = 0
        return mask

    def truncate(self, length: int) -> None:
        """Drop the entries past `length` (draft tokens the draft model itself rejected)."""
        self._keep(length, [])

    @torch.inference_mode()
    def _keep(self, prefix: int, extra: list[int]) -> None:
        """Keep entries [0, prefix) followed by the entries at `extra`; drop every other."""
        for layer in self.kv.layers:
            if not layer.is_initialized:
                continue
            if extra:
                index = torch.tensor([*range(prefix), *extra], dtype=torch.long, device=layer.keys.device)
                layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
            else:
                layer.keys, layer.values = layer.keys[:, :, :prefix], layer.values[:, :, :prefix]
