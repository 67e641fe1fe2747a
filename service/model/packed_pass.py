"""The decoder pass of the packed CPU path: the lean pass's layers (`decoder_pass.lean_hidden`)
on numpy arrays, each step one numba kernel or numpy call.

A one-token pass of a small model is mostly fixed costs on a CPU. Through torch, each layer
made some twenty operator calls around its kernels (new tensors, views, transposes, the
residual adds, slices of the kernels' padded outputs), each costing microseconds whatever its
size: SmolLM2-135M's thirty layers spent about as long on them as on reading their weights.
Here the hidden states stay numpy arrays from the embedding to the final norm: the packed
linears (`PackedLinear.apply`), the norms and the rotary embedding with the cache write
(`service/kernels/layer_kernels.py`) and attention (`attend_through_kernels`) are numba calls
on them, the residual adds numpy's. Torch computes the embedding lookup and the rotary tables
once a pass, the MLP's activation (the model's own function, so its bits), the rows too wide
for the attention kernels and projections the kernels do not serve (Qwen2's biased ones)
(docs/benchmarks.md, "The packed pass in numpy").

The arithmetic is the lean pass's on the packed path, step for step: a row's result does not
depend on the pass, so speculation still reproduces plain decoding bit for bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from service.kernels.packed_linear import PackedLinear
from service.model.attention import (
    PassLayout,
    attend_separate_rows,
    attend_through_kernels,
    kernel_array,
    layer_windows,
    ragged_attention,
)
from service.model.decoder_pass import (
    fused_projections,
    is_gemma_norm,
    rotary_tables,
)
from service.model.kv_cache import TreeKVCache

ArrayProjection = Callable[[np.ndarray], np.ndarray]  # rows [T, in] -> [T, out]


@dataclass(frozen=True)
class Norm:
    """An RMSNorm as the kernel takes it: what it multiplies the normalized rows by (the
    weight; Gemma's 1 + weight, made once), and its epsilon."""

    scale: np.ndarray
    eps: float

    @classmethod
    def of(cls, norm: nn.Module) -> Norm:
        gemma = is_gemma_norm(norm)
        weight = norm.weight.detach().float()
        return cls(
            (1.0 + weight if gemma else weight).numpy(),
            norm.eps if gemma else norm.variance_epsilon,
        )


_NORMS: weakref.WeakKeyDictionary[nn.Module, Norm] = weakref.WeakKeyDictionary()


def norm_of(module: nn.Module) -> Norm:
    """`Norm.of(module)`, made once a module."""
    made = _NORMS.get(module)
    if made is None:
        made = _NORMS[module] = Norm.of(module)
    return made


@dataclass(frozen=True)
class PackedLayer:
    """One decoder layer as the packed pass runs it (made once a layer)."""

    norms: tuple[Norm, ...]  # input, post-attention; Gemma's pre- and post-feedforward too
    head_norms: tuple[Norm, Norm] | None  # Qwen3's and Gemma 3's of each query and key head
    qkv: ArrayProjection
    o: ArrayProjection
    gate_up: ArrayProjection
    down: ArrayProjection
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation of the gate


_LAYERS: weakref.WeakKeyDictionary[nn.Module, PackedLayer] = weakref.WeakKeyDictionary()


def packed_layer(layer: nn.Module) -> PackedLayer:
    """`layer` as the packed pass runs it: its projections fused as the lean pass fuses them
    (`fused_projections`, shared with it), its norms' arrays."""
    made = _LAYERS.get(layer)
    if made is None:
        projections, attn = fused_projections(layer), layer.self_attn
        names = ["input_layernorm", "post_attention_layernorm"]
        if hasattr(layer, "post_feedforward_layernorm"):
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        made = _LAYERS[layer] = PackedLayer(
            tuple(norm_of(getattr(layer, name)) for name in names),
            (norm_of(attn.q_norm), norm_of(attn.k_norm)) if hasattr(attn, "q_norm") else None,
            _array_projection(projections.qkv),
            _array_projection((projections.o,)),
            _array_projection(projections.gate_up),
            _array_projection((projections.down,)),
            projections.act,
        )
    return made


def _array_projection(modules: tuple[nn.Module, ...]) -> ArrayProjection:
    """`modules`' outputs side by side, on arrays: a packed layer's kernels directly (their
    padding columns cut off), any other module through torch."""

    def one(module: nn.Module) -> ArrayProjection:
        if isinstance(module, PackedLinear):
            width = module.out_features
            return lambda xs: module.apply(xs)[:, :width]
        return lambda xs: module.forward(torch.from_numpy(xs)).numpy()

    parts = [one(module) for module in modules]
    if len(parts) == 1:
        return parts[0]
    return lambda xs: np.concatenate([part(xs) for part in parts], axis=1)


@torch.inference_mode()
def packed_hidden(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    layout: PassLayout,
    cache: TreeKVCache,
    kernels: Any,
) -> torch.Tensor:
    """The final-norm hidden states [T, hidden] of a flat pass (`input_ids`: [1, T]) on the
    packed CPU path (`kernels`: `decoder_pass.packed_pass_kernels(model)`)."""
    base, config = model.base_model, model.config
    embedded = base.embed_tokens(input_ids)  # [1, T, hidden]
    rotary = rotary_tables(model, embedded, layout)
    arrays = [(cos.numpy(), sin.numpy()) for cos, sin in rotary.pairs]
    x = embedded[0].numpy()  # [T, hidden]
    tokens, heads = x.shape[0], config.num_attention_heads
    head_dim = base.layers[0].self_attn.head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    buffers = cache.pass_buffers(torch.empty(1, kv_heads, tokens, head_dim))  # every layer's
    keys, values = (kernel_array(buffer) for buffer in buffers)
    rows, positions = layout.write_rows.numpy(), layout.write_positions.numpy()
    windows = layer_windows(config)
    softcap = getattr(config, "attn_logit_softcapping", None)  # Gemma 2's

    def norm(rows: np.ndarray, by: Norm) -> np.ndarray:
        out = np.empty(rows.shape, np.float32)
        kernels.rms_norm(rows, by.scale, by.eps, out)
        return out

    for index, layer in enumerate(base.layers):
        packed, attn = packed_layer(layer), layer.self_attn
        qkv = packed.qkv(norm(x, packed.norms[0])).reshape(tokens, -1, head_dim)
        if packed.head_norms is not None:
            for by, part in zip(
                packed.head_norms, (slice(0, heads), slice(heads, heads + kv_heads))
            ):
                qkv[:, part] = norm(qkv[:, part].reshape(-1, head_dim), by).reshape(
                    tokens, -1, head_dim
                )
        queries = np.empty((tokens, heads, head_dim), np.float32)
        cos, sin = arrays[rotary.of_layer[index]]
        kernels.rotate_and_store(
            qkv, cos, sin, heads, keys[index], values[index], rows, positions, queries
        )
        out = _attention(
            queries,
            (keys[index], values[index]),
            lambda: (buffers[0][index], buffers[1][index]),
            layout.for_window(windows[index]),
            attn,
            softcap,
        )
        attended = packed.o(out)
        sandwich = len(packed.norms) == 4
        if sandwich:
            x = x + norm(attended, packed.norms[1])
            gate_up = packed.gate_up(norm(x, packed.norms[2]))
        else:
            x = x + attended
            gate_up = packed.gate_up(norm(x, packed.norms[1]))
        gate, up = torch.from_numpy(gate_up).chunk(2, dim=-1)
        down = packed.down((packed.act(gate) * up).numpy())
        x = x + (norm(down, packed.norms[3]) if sandwich else down)
    return torch.from_numpy(norm(x, norm_of(base.norm)))


def _attention(
    queries: np.ndarray,
    arrays: tuple[np.ndarray, np.ndarray],
    buffers: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    layout: PassLayout,
    attn: nn.Module,
    softcap: float | None,
) -> np.ndarray:
    """The layer's attention [T, heads * head_dim] of `queries` [T, heads, head_dim] over its
    whole key and value buffers (as arrays for the kernels; `buffers()`: as tensors, for torch):
    the kernels' tokens through them, wide rows a call each; a pass the kernels take no part in
    (a float path's prompt) as the lean pass attends."""
    tokens = queries.shape[0]
    if layout.kernel_queries is None and layout.chunk_queries is None:
        query = torch.from_numpy(queries).transpose(0, 1)[None]  # [1, heads, T, head_dim]
        keys, values = (buffer[: layout.rows, :, : layout.pass_end] for buffer in buffers())
        out, _ = ragged_attention(
            attn,
            query,
            keys,
            values,
            None,
            scaling=attn.scaling,
            pass_layout=layout,
            softcap=softcap,
        )
        return np.ascontiguousarray(out.reshape(tokens, -1).numpy())
    out = np.empty_like(queries)
    attend_through_kernels(queries, *arrays, layout, attn.scaling, softcap, out)
    if layout.separate_rows:
        query = torch.from_numpy(queries).transpose(0, 1)[None]
        flat = torch.from_numpy(out)
        attend_separate_rows(query, *buffers(), layout, attn.scaling, flat, softcap)
    return out.reshape(tokens, -1)
