"""A token embedding kept as the GGUF's own blocks, memory-mapped, each looked-up row dequantized
on the way.

A 128k-token vocabulary at 4,096 wide is 2 GB as a float32 table and a fraction of that as the
file stores it; a pass reads only its own tokens' rows, and the pages of rows never looked up
are never read. The rows are gguf-py's dequantization itself (any type it reads: the K-quants,
Q2_K and the IQ types included), so the model computes exactly as with the float32 table, and
nothing is re-laid at start. A scaled embedding (Gemma's: rows times √hidden) keeps its
scale, applied in float32 as the module it replaces applies it.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn


class PackedEmbedding(nn.Module):
    """Drop-in for `nn.Embedding` (no padding index, no max norm) over a GGUF tensor's bytes
    `raw` [num_embeddings, bytes a row] of type `kind`; `scale`: every row times it (float32),
    as a scaled embedding's forward does."""

    def __init__(
        self, raw: np.ndarray, kind: gguf.GGMLQuantizationType, scale: float | None = None
    ) -> None:
        super().__init__()
        self._raw, self._type = raw, kind
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        self.kind = kind.name
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = self._rows(np.zeros(1, np.int64)).shape[1]
        # a copy of the first row's bytes, so that the model fingerprint sees the table
        self.register_buffer("first_row", torch.from_numpy(np.array(raw[:1])), persistent=True)

    def extra_repr(self) -> str:
        scaled = "" if self.scale is None else f", times {float(self.scale):g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} (GGUF blocks){scaled}"

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(np.asarray(self._raw[ids]), self._type)

    def dequantized(self) -> torch.Tensor:
        """The whole float32 table (tests; never on the serving path)."""
        return torch.from_numpy(self._rows(np.arange(self.num_embeddings)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.reshape(-1).long().cpu().numpy()
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        out = torch.from_numpy(self._rows(rows))
        if self.scale is not None:
            out = out * self.scale
        return out.reshape(*input_ids.shape, self.embedding_dim).to(input_ids.device)
