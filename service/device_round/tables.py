"""A successor table on the model's device: drafts grown by gathers, refreshed by a scatter.

It holds what `drafting.SuccessorTable` holds (a [vocab, K] row of the model's likeliest next
tokens after each token, and hashed rows keyed by (previous, token)), as tensors on the device
that runs the model, so that a round's drafting and its refresh never wait for the host. It
starts as a copy of a host table (the one the host-drafted rounds of the same engine keep) and
follows the same rules, so the same passes give the same tables and the same walks the same
drafts (tested against the host table):
- a walk takes each node's `rank`-th successor from the pair row of its parent's and
  grandparent's tokens where a pass saw that pair, else from its parent's token row, else from
  the model bigram table (the fallback) where the token row was never observed; a node whose
  parent is invalid, or whose row holds no such rank, is invalid;
- a refresh writes every node's top-K into its token's row and into its (parent token, token)
  pair bucket; where several nodes of a pass write one row (or bucket), the last one wins.
Both are fixed-size tensor operations: nothing here reads a tensor's value on the host.
"""

from __future__ import annotations

import torch

from drafting import SuccessorTable, TableSlot
from drafting.recycled import pair_bucket


class DeviceTable:
    """One successor table's rows on a device (plus one scratch row and one scratch bucket,
    where the writes that a later node overrides go, so that a refresh is one scatter)."""

    def __init__(self, host: SuccessorTable, vocab_size: int, device: torch.device) -> None:
        self.host = host
        self.top_k = host.top_k
        self.pair_bits = host.pair_bits
        self.fallback_slot = host.fallback
        self.vocab_size = vocab_size
        self.device = device
        self.successors = torch.full(
            (vocab_size + 1, host.top_k), -1, dtype=torch.long, device=device
        )
        buckets = len(host.pair_keys)
        self.pair_keys = torch.full((buckets + 1,), -1, dtype=torch.long, device=device)
        self.pair_successors = torch.full(
            (buckets + 1, host.top_k), -1, dtype=torch.long, device=device
        )
        self.push()
        # none until the slot fills
        self.fallback = torch.full((vocab_size, 1), -1, dtype=torch.long, device=device)
        self._fallback_from: object = None

    def push(self) -> None:
        """Take the host table's rows (after rounds drafted on the host refreshed it): a copy
        to the device, which the host does not wait for."""
        host = self.host
        rows = min(len(host.successors), self.vocab_size)
        self.successors[:rows].copy_(torch.from_numpy(host.successors[:rows]), non_blocking=True)
        self.pair_keys[:-1].copy_(torch.from_numpy(host.pair_keys), non_blocking=True)
        self.pair_successors[:-1].copy_(torch.from_numpy(host.pair_successors), non_blocking=True)

    def pull(self) -> None:
        """Give the host table these rows (before a round drafted on the host): one copy back."""
        host = self.host
        host.successors = self.successors[:-1].to(torch.int32).cpu().numpy()
        host.pair_keys[:] = self.pair_keys[:-1].cpu().numpy()
        host.pair_successors[:] = self.pair_successors[:-1].cpu().numpy()

    def sync_fallback(self) -> None:
        """Take the model bigram table once it exists (the tables are computed in the
        background after the server starts): a host check a round, a copy once."""
        tables = self.fallback_slot.tables if isinstance(self.fallback_slot, TableSlot) else None
        if tables is not None and tables is not self._fallback_from:
            bigram = torch.from_numpy(tables.bigram[: self.vocab_size].astype("int64"))
            self.fallback = torch.full(
                (self.vocab_size, bigram.shape[1]), -1, dtype=torch.long, device=self.device
            )
            self.fallback[: len(bigram)] = bigram.to(self.device)
            self._fallback_from = tables

    # -- drafting ----------------------------------------------------------------------------

    def single_rows(self) -> torch.Tensor:
        """[vocab, W] the row a walk steps from after a token alone: its observed successors
        where a pass saw it, else the model bigram's (each padded with -1 to W, the wider of
        the two). Made once a step, so a level of the walk reads one row, not both and a choice."""
        width = max(self.top_k, self.fallback.shape[1])
        observed = self.successors[:-1, :1] >= 0
        return torch.where(
            observed, _widened(self.successors[:-1], width), _widened(self.fallback, width)
        )

    def step(
        self, previous: torch.Tensor, token: torch.Tensor, rank: torch.Tensor, single: torch.Tensor
    ) -> torch.Tensor:
        """The `rank`-th successor after (`previous`, `token`), elementwise (same shapes; a
        negative previous: none known; `single`: this step's `single_rows`); -1 where the
        rows hold none. Inputs must be valid token ids (the caller masks invalid nodes)."""
        width = single.shape[1]
        following = torch.where(rank < width, single[token, rank.clamp(max=width - 1)], -1)
        if not self.pair_bits:
            return following
        bucket = pair_bucket(previous.clamp(min=0), token, self.pair_bits)
        paired = (previous >= 0) & (self.pair_keys[bucket] == (previous << 32 | token))
        from_pair = torch.where(
            rank < self.top_k, self.pair_successors[bucket, rank.clamp(max=self.top_k - 1)], -1
        )
        return torch.where(paired, from_pair, following)

    # -- learning ----------------------------------------------------------------------------

    def refresh(
        self, tokens: torch.Tensor, parents: torch.Tensor, top_ids: torch.Tensor, keep: torch.Tensor
    ) -> None:
        """A pass's refresh: node i (of the flat [M] `tokens`, where `keep`) writes its
        [M, K'] `top_ids` into its token's row and, where `parents[i]` ≥ 0, into the
        (parent token, token) bucket (the rest of the bucket's row set to -1), the later
        node winning a row or bucket several write."""
        width = min(top_ids.shape[1], self.top_k)
        top = top_ids[:, :width]
        # the rest: scratch
        rows = torch.where(last_writers(tokens, keep, self.vocab_size + 1), tokens, self.vocab_size)
        self.successors[rows, :width] = top
        if not self.pair_bits:
            return
        buckets = pair_bucket(parents.clamp(min=0), tokens, self.pair_bits)
        scratch = len(self.pair_keys) - 1
        buckets = torch.where(
            last_writers(buckets, keep & (parents >= 0), scratch + 1), buckets, scratch
        )
        self.pair_keys[buckets] = parents << 32 | tokens
        row = torch.full((len(tokens), self.top_k), -1, dtype=torch.long, device=tokens.device)
        row[:, :width] = top
        self.pair_successors[buckets] = row

    def host_view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(successors, pair keys, pair successors) without the scratch row and bucket (tests)."""
        return self.successors[:-1], self.pair_keys[:-1], self.pair_successors[:-1]


def _widened(rows: torch.Tensor, width: int) -> torch.Tensor:
    """`rows` [n, w] padded with -1 to [n, width]."""
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=-1)


def last_writers(slots: torch.Tensor, writing: torch.Tensor, size: int) -> torch.Tensor:
    """Which of the writes to `slots` (values below `size`; where `writing`) is its slot's last:
    the greatest index writing to each slot, found by one scatter of maxima (deterministic, and
    linear in the writes, where comparing every pair grows with their square)."""
    index = torch.arange(len(slots), device=slots.device)
    last = torch.full((size,), -1, dtype=torch.long, device=slots.device)
    last.scatter_reduce_(0, slots, torch.where(writing, index, -1), "amax")
    return writing & (last[slots] == index)
