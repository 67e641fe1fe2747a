"""The one place that runs the transformer: one flat pass over every running row.

Every pass — prompt prefill chunks, plain decode steps, speculation rounds, for all running
requests at once — is the same call: each KV row brings a token tree; its nodes get position
ids `length + depth` and see the row's committed cache plus their own ancestors, nothing else
(`service/model/attention.py`). All rows' tokens go through the model as one flat sequence, so the
linear layers compute exactly the tokens brought, and the LM head runs only on the nodes whose
next-token distribution is asked for (tree nodes, not prompt chunks). The logits of each node
then equal those of decoding its path token by token (a unit test holds the project to that).
Llama-family models run the decoder stack through `service/model/decoder_pass.py` (same arithmetic,
far fewer operator calls); other models through transformers' own modules. On a GPU, a pass
whose rows each bring a whole tree of at most 128 nodes is padded to a fixed shape and replayed
as a CUDA graph (`service/model/static_pass.py`): the launches of a small model's pass cost more
than its arithmetic there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from service.kernels.attention_kernel import warm_up as warm_up_attention
from service.kernels.chunk_attention_kernel import chunk_kernel_fits
from service.kernels.chunk_attention_kernel import warm_up as warm_up_chunk_attention
from service.model.attention import (
    build_layout,
    layer_windows,
    prompt_prefix,
    use_ragged_attention,
)
from service.model.decoder_pass import (
    attention_kernel_width,
    kv_cache_dtype,
    lean_hidden,
    packed_pass_kernels,
    supports_lean_pass,
)
from service.model.kv_cache import TreeKVCache
from service.model.packed_pass import packed_hidden
from service.model.static_pass import FixedShape, StaticPasses
from service.model.tree import TokenTree

# Attention backends a pass may use: all but cuDNN's, which builds a plan for every new shape
# (far dearer than the call itself), and a pass's rows end at new lengths every step
# (docs/benchmarks.md, "Attention on the GPU").
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class RowInput:
    """What one KV row brings to a pass: a tree (or the part of it past `cached`), and from
    which node on it needs logits."""

    tree: TokenTree
    logits_from: int = 0  # nodes [logits_from, num_nodes) get logits; num_nodes for none
    # nodes [0, cached) were written by an earlier pass, uncommitted (kept as they are)
    cached: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cached <= self.logits_from <= self.tree.num_nodes:
            raise ValueError(
                f"need 0 <= cached ({self.cached}) <= logits_from ({self.logits_from}) "
                f"<= nodes ({self.tree.num_nodes})"
            )


class ModelRunner:
    """Holds a causal LM in eval mode and runs flat passes over the rows of a `TreeKVCache`."""

    tensor_parallel_size = 1  # ranks each pass runs on (`service/parallel/runner.py`)

    def __init__(self, model: PreTrainedModel, static_passes: bool | None = None) -> None:
        """`static_passes`: bring small passes to fixed shapes (`service/model/static_pass.py`),
        recorded as CUDA graphs on a GPU. Default: on a GPU for models of the lean pass; True
        elsewhere runs those shapes eagerly (tests); False: every pass eager."""
        self.model = model.eval()
        use_ragged_attention(self.model)
        # Llama-family layers run through a lean pass of our own; others through transformers'
        self.lean = supports_lean_pass(self.model)
        # the sliding windows of the model's layers: each gets masks of its own every pass
        self.windows = sorted({w for w in layer_windows(model.config) if w is not None})
        on_gpu = model.device.type == "cuda"
        wanted = on_gpu if static_passes is None else static_passes
        self.static = (
            StaticPasses.for_model(self.model, capture=on_gpu)
            if wanted and self.lean and not self.windows  # fixed shapes have no windows
            else None
        )
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size: int = model.config.vocab_size
        config = model.config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.kv_dtype = kv_cache_dtype(self.model)
        # keys + values of one token over all layers
        self.kv_bytes_per_token = (
            2
            * config.num_hidden_layers
            * config.num_key_value_heads
            * head_dim
            * self.kv_dtype.itemsize
        )
        self.query_groups: int = config.num_attention_heads // config.num_key_value_heads
        # Gemma 2's caps of its attention scores and of its output logits (0: none)
        self.attention_cap: float = getattr(config, "attn_logit_softcapping", None) or 0.0
        self.logit_cap: float = getattr(config, "final_logit_softcapping", None) or 0.0
        # the packed CPU path's pass and its kernels (None: the lean pass in torch operators)
        self.packed_kernels = packed_pass_kernels(self.model) if self.lean else None
        # rows of up to this many tokens attend through the attention kernel (0: none)
        self.attention_width = attention_kernel_width(self.model) if self.lean else 0
        # on the packed CPU path, prompt tokens attend through the chunk kernel (their own bits)
        self.chunk_kernel = bool(self.attention_width and chunk_kernel_fits(head_dim))
        if self.attention_width:  # compile them now, not in the first request's pass
            half = self.kv_dtype == torch.float16
            warm_up_attention(head_dim, self.query_groups, half, self.attention_cap)
            if self.chunk_kernel:
                warm_up_chunk_attention(
                    head_dim, self.query_groups, half, self.attention_cap, self.windows
                )

    @property
    def capture_seconds(self) -> float:
        """Time spent so far recording passes as CUDA graphs (0 where none are)."""
        return 0.0 if self.static is None else self.static.capture_seconds

    def new_cache(self, rows: int = 0) -> TreeKVCache:
        return TreeKVCache(
            num_layers=self.model.config.num_hidden_layers,
            rows=rows,
            dtype=self.kv_dtype,
            spare=None if self.static is None else self.static.spare,
        )

    def forward(self, cache: TreeKVCache, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """Append row r's tree (its nodes past `cached`) to cache row r, for every row, and
        return, per row, the logits [num_nodes - logits_from, vocab] of its nodes from
        `logits_from` on.

        The caller must `cache.commit()` each row afterwards.
        """
        logits = self.forward_flat(cache, rows)
        return list(logits.split([row.tree.num_nodes - row.logits_from for row in rows]))

    @torch.inference_mode()
    def forward_flat(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`forward`'s logits as one tensor [nodes asked for, vocab], rows in order.
        `token_ids` [flat tokens] on the model's device, when the tokens were drafted there
        (`service/device_round/`): the trees then give only the pass's shape, and the host
        never reads a token."""
        if all(row.logits_from == 0 and row.cached == 0 for row in rows):  # no gather
            return self.logits(self.every_node_hidden(cache, rows, token_ids))
        hidden, offsets = self._hidden(cache, rows, token_ids)
        wanted = [
            offset + node - row.cached
            for offset, row in zip(offsets, rows)
            for node in range(row.logits_from, row.tree.num_nodes)
        ]
        if not wanted:
            return hidden.new_empty(0, self.vocab_size)
        return self.logits(hidden[wanted])  # [num_wanted, vocab]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits [n, vocab] of final-norm hidden states [n, hidden]: its LM head's,
        capped as the model caps them (Gemma 2's `final_logit_softcapping`: cap * tanh(logit /
        cap), in transformers' order). Every pass's logits leave the model here, so sampling,
        greedy choices, log-probabilities and verification all see the capped ones."""
        logits = self.model.get_output_embeddings()(hidden)
        if not self.logit_cap:
            return logits
        return torch.tanh(logits / self.logit_cap) * self.logit_cap

    @torch.inference_mode()
    def every_node_hidden(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final-norm hidden states of every node of `rows` [nodes, hidden] (rows in order;
        none cached): what a device round takes the LM head of among its recorded operators."""
        hidden, _ = self._hidden(cache, rows, token_ids)
        return hidden[: sum(row.tree.num_nodes for row in rows)]

    def _hidden(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int]]:
        """The pass's hidden states (flat, padding after the last row's where it has a fixed
        shape), with each row's first flat token."""
        if len(rows) != cache.num_rows:
            raise ValueError(f"{len(rows)} row inputs for {cache.num_rows} cache rows")
        with sdpa_kernel(ATTENTION_BACKENDS):
            return self._static_hidden(cache, rows, token_ids) or self._eager_hidden(
                cache, rows, token_ids
            )

    def _static_hidden(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The pass at a fixed shape, with each row's first flat token; None where it has none."""
        if self.static is None or any(row.cached for row in rows):
            return None
        sizes = [row.tree.num_nodes for row in rows]
        shape = FixedShape.of(sizes)
        hidden = (
            None
            if shape is None
            else self.static.hidden(cache, [row.tree for row in rows], shape, token_ids)
        )
        return (
            None if hidden is None else (hidden, list(itertools.accumulate(sizes[:-1], initial=0)))
        )

    def _eager_hidden(
        self, cache: TreeKVCache, rows: Sequence[RowInput], token_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int]]:
        """The pass as it comes (every row's new nodes, nothing padded), with each row's first
        flat token."""
        trees = [row.tree for row in rows]
        prompts = (
            [prompt_prefix(row.tree, row.logits_from) for row in rows]
            if self.chunk_kernel
            else None
        )
        layout = build_layout(
            trees,
            cache.lengths,
            self.device,
            [row.cached for row in rows],
            self.dtype,
            self.attention_width,
            self.query_groups,
            prompts,
            self.windows,
        )
        cache.begin_pass(layout)
        input_ids = (
            token_ids[None]
            if token_ids is not None
            # [1, T]
            else torch.tensor(
                [[t for row in rows for t in row.tree.token_ids[row.cached :]]], device=self.device
            )
        )
        if self.lean:
            hidden = (  # [T, hidden]
                lean_hidden(self.model, input_ids, layout, cache)
                if self.packed_kernels is None
                else packed_hidden(self.model, input_ids, layout, cache, self.packed_kernels)
            )
        else:
            hidden = self.model.base_model(
                input_ids=input_ids,
                position_ids=layout.position_ids,
                past_key_values=cache,
                use_cache=True,
                pass_layout=layout,
            ).last_hidden_state[0]  # [T, hidden]
        return hidden, layout.offsets
