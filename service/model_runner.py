"""The one place that runs the transformer: a tree pass over the KV cache.

Every pass — prompt prefill, plain decode step, speculation round — is the same call: each
row brings a token tree; its nodes get position ids `length + depth` and a 4D additive mask
that lets a node see the row's committed cache plus itself and its ancestors, nothing else.
The logits of each node then equal those of decoding its path token by token (a unit test
holds the project to that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from service.kv_cache import TreeKVCache
from service.tree import TokenTree


class ModelRunner:
    """Holds a causal LM in eval mode and runs tree passes for one or more rows."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size: int = model.config.vocab_size

    def new_cache(self, rows: int = 1) -> TreeKVCache:
        return TreeKVCache(num_layers=self.model.config.num_hidden_layers, rows=rows)

    @torch.inference_mode()
    def forward(
        self, cache: TreeKVCache, trees: Sequence[TokenTree], logits: bool = True
    ) -> torch.Tensor | None:
        """Append each row's tree to `cache` and return logits [rows, width, vocab].

        With `logits=False` (prefill) the LM head is skipped and None is returned. The caller
        must `cache.commit()` each row afterwards.
        """
        widths = [tree.num_nodes for tree in trees]
        width = max(widths)
        starts = list(cache.lengths)
        cache.begin_pass(widths)
        input_ids = torch.zeros(len(trees), width, dtype=torch.long)  # [rows, width]
        position_ids = torch.zeros(len(trees), width, dtype=torch.long)  # [rows, width]
        allowed = torch.zeros(len(trees), 1, width, cache.pass_end, dtype=torch.bool)
        for row, (tree, start) in enumerate(zip(trees, starts)):
            n = tree.num_nodes
            input_ids[row, :n] = torch.tensor(tree.token_ids)
            position_ids[row, :n] = start + torch.tensor(tree.depths)
            allowed[row, 0, :n, :start] = True
            allowed[row, 0, :n, start : start + n] = tree.ancestor_mask()
            allowed[row, 0, n:, 0] = True  # padding rows attend somewhere, then are ignored
        mask = torch.zeros(allowed.shape, dtype=self.dtype)  # [rows, 1, width, pass_end]
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        inputs = dict(
            input_ids=input_ids.to(self.device),
            position_ids=position_ids.to(self.device),
            attention_mask=mask.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        if not logits:
            self.model.base_model(**inputs)
            return None
        return self.model(**inputs).logits  # [rows, width, vocab]
