"""A token embedding kept as the GGUF's blocks, each looked-up row dequantized on the way.

A 128k-token vocabulary at 4,096 wide is 2 GB as a float32 table and a quarter of that packed; a
pass reads only its own tokens' rows. The rows are gguf-py's dequantization bit for bit (the
same layouts as the packed linears, `dequantize_rows`), so the model computes exactly as with
the float32 table. A tied LM head and the embedding share one set of tiles.
"""

from __future__ import annotations

import torch
from torch import nn

from service.kernels.packed_linear import PackedTiles, dequantize_rows, dequantize_tiles


class PackedEmbedding(nn.Module):
    """Drop-in for `nn.Embedding` (no padding index, no max norm) over packed tiles."""

    def __init__(self, tiles: PackedTiles) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = tiles.out_features, tiles.in_features
        self.kind = tiles.kind
        self._tiles = tiles
        for name in ("qs", "d", "m"):  # buffers, so the model fingerprint sees them
            self.register_buffer(name, torch.from_numpy(getattr(tiles, name)), persistent=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} (packed)"

    def tiles(self) -> PackedTiles:
        return self._tiles

    def dequantized(self) -> torch.Tensor:
        """The whole float32 table (tests; never on the serving path)."""
        return dequantize_tiles(self._tiles)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.reshape(-1).long().cpu()
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        out = dequantize_rows(self._tiles, rows)
        return out.reshape(*input_ids.shape, self.embedding_dim).to(input_ids.device)
