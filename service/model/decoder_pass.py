"""A lean pass through a Llama-family decoder stack: the same arithmetic as transformers'
modules, in a fraction of the operator calls.

On a CPU a one-token pass of a small model is mostly fixed costs: each torch operator call
costs microseconds whatever its size, and transformers' decoder layer makes ~90 of them per
layer (RMSNorm as eight ops, rotary embedding as fourteen, decorators and keyword plumbing on
every call). This module, with the masks of `service/model/attention.py` built once a pass,
makes a one-token pass markedly cheaper, with bitwise equal logits (docs/benchmarks.md, "The
float path's kernels").

What it does differently, nothing else:
- one RMSNorm operator (`F.rms_norm`) instead of eight;
- the q, k and v projections as ONE linear layer, gate and up as another
  (`fuse_projections`): 4 matmul calls a layer instead of 7, and the fused layers are wide
  enough to run on every thread;
- rotary embedding once over the queries and keys together;
- no per-layer decorators, keyword plumbing or output records.
The packed CPU path runs the same layers in numpy and numba instead
(`service/model/packed_pass.py`); its projections and rotary tables come from here.

Phi-3's fused modules are used as they are, and a partial rotary embedding (Phi-4-mini's
`partial_rotary_factor`) turns the first dimensions of each head, as its model does.

Weights, cache writes and attention (`service/model/attention.py`) are the model's own.
Qwen3's and Gemma 3's RMSNorm of each query and key head before the rotary embedding
is one norm call each; Gemma's norms (2 and 3) scale by 1 + weight, in float32 (`_rms_norm`),
wrap the attention and the MLP on both sides, and Gemma 3's local and global layers take rotary
tables of their own. Gemma 2's attention scores are soft-capped (cap * tanh(score / cap),
`attn_logit_softcapping`) by every attention path, its final logits by the runner
(`service/model/runner.py`). Models whose layers differ otherwise take transformers' own forward:
`supports_lean_pass` decides.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from service.kernels.packed_linear import (
    PACKED_MODEL_TYPES,
    PackedLinear,
    fuse_packed,
    loaded_layer_kernels,
)
from service.model.attention import (
    PassLayout,
    layer_windows,
    ragged_attention,
)
from service.model.kv_cache import TreeKVCache

# Model types whose decoder layer is exactly: RMSNorm (weight * normed) → q/k/v (optional
# bias) → (Qwen3: RMSNorm of each q and k head) → rotary → attention → o_proj → residual →
# RMSNorm → down(act(gate) * up) → residual; and Gemma 2's and 3's (the module docstring); and
# Phi-3's, whose q/k/v and gate/up are one module each already and whose rotary embedding may
# cover a part of each head: the packed path's families
LEAN_MODEL_TYPES = PACKED_MODEL_TYPES

# Rows of up to this many tokens attend through the packed path's attention kernel. It reads a
# row's keys once per query, so it beats SDPA on one-token rows (no padding to the longest row)
# and on the small trees auto mode builds on a CPU, but loses to a call of their own on wide
# trees (docs/benchmarks.md: "One-token rows without padding", and the default path by
# category). Tree nodes answered here also get the bits of the same token decoded alone.
ATTENTION_KERNEL_WIDTH = 4
# With 8-bit activations (`--quantization gguf-int8`) every row attends through the kernel
# (prompt tokens needing no logits through the chunk kernel, whose bits do not depend on the
# chunking either): a call of its own rounds a token's attention otherwise than that token
# decoded alone (or in a chunk of another width: the last chunk of a prompt carries the first
# tree), and where float activations carry such a last-bit difference into a near-tie at most,
# rounding to 8 bits can turn it into a whole step of an activation. With tree rows alone on the
# kernel, speculation still parted from plain decoding at non-ties on most Spec-Bench prompts
# (docs/benchmarks.md).
INT8_ATTENTION_KERNEL_WIDTH = 1 << 30
# ... and its KV cache holds float16, as llama.cpp's does by default: a pass of sixteen
# one-token rows reads every row's keys and values once a layer, in float32 more bytes than
# the weights; float16 halves them (docs/benchmarks.md, "The attention kernel and a float16
# cache").
INT8_KV_DTYPE = torch.float16


@dataclass(frozen=True)
class FusedProjections:
    """One decoder layer's projections. q/k/v and gate/up are each one module where their parts
    fuse (`fuse_projections`), else their modules, whose outputs go side by side."""

    qkv: tuple[nn.Module, ...]  # [T, hidden] -> [T, (heads + 2 * kv_heads) * head_dim]
    gate_up: tuple[nn.Module, ...]  # [T, hidden] -> [T, 2 * intermediate]
    o: nn.Module  # [T, heads * head_dim] -> [T, hidden]
    down: nn.Module  # [T, intermediate] -> [T, hidden]
    # the MLP's activation of the gate (a module's `forward`, as `project` calls projections)
    act: Callable[[torch.Tensor], torch.Tensor]


# Per decoder layer, made once: a self-draft view shares the target's layers and their fusion.
_FUSED: weakref.WeakKeyDictionary[nn.Module, FusedProjections] = weakref.WeakKeyDictionary()


def supports_lean_pass(model: PreTrainedModel) -> bool:
    """Whether `model`'s layers are the ones `lean_hidden` computes. (Sliding windows need no
    check: the loader refuses models with a window shorter than the context.)"""
    return getattr(model.config, "model_type", None) in LEAN_MODEL_TYPES


@torch.inference_mode()
def lean_hidden(
    model: PreTrainedModel, input_ids: torch.Tensor, layout: PassLayout, cache: TreeKVCache
) -> torch.Tensor:
    """The final-norm hidden states [T, hidden] of a flat pass (`input_ids`: [1, T]), in torch
    operators (the packed CPU path's pass: `service/model/packed_pass.py`)."""
    base = model.base_model
    x = base.embed_tokens(input_ids)  # [1, T, hidden]
    rotary = rotary_tables(model, x, layout)  # per layer
    x = x[0]  # [T, hidden]
    tokens = x.shape[0]
    heads = model.config.num_attention_heads
    windows = layer_windows(model.config)
    sandwich = has_sandwich_norms(model)
    softcap = getattr(model.config, "attn_logit_softcapping", None)  # Gemma 2's
    for index, layer in enumerate(base.layers):
        cos, sin = rotary[index]
        attn, projections = layer.self_attn, fused_projections(layer)
        qkv = project(projections.qkv, _rms_norm(x, layer.input_layernorm)).view(
            tokens, -1, attn.head_dim
        )
        if hasattr(attn, "q_norm"):
            _norm_heads(qkv, (attn.q_norm, attn.k_norm), heads)
        queries, keys, values = _queries_and_cache(qkv, cos, sin, heads, cache.layers[index])
        out, _ = ragged_attention(
            attn,
            queries,
            keys,
            values,
            None,
            scaling=attn.scaling,
            pass_layout=layout.for_window(windows[index]),
            softcap=softcap,
        )
        attended = projections.o.forward(out.reshape(tokens, -1))
        if sandwich:
            x = x + _rms_norm(attended, layer.post_attention_layernorm)
            gate, up = project(
                projections.gate_up, _rms_norm(x, layer.pre_feedforward_layernorm)
            ).chunk(2, dim=-1)
            x = x + _rms_norm(
                projections.down.forward(projections.act(gate) * up),
                layer.post_feedforward_layernorm,
            )
            continue
        x = x + attended
        gate, up = project(projections.gate_up, _rms_norm(x, layer.post_attention_layernorm)).chunk(
            2, dim=-1
        )
        x = x + projections.down.forward(projections.act(gate) * up)
    return _rms_norm(x, base.norm)


def has_sandwich_norms(model: PreTrainedModel) -> bool:
    """Whether `model`'s layers norm the attention's and the MLP's outputs too (Gemma's)."""
    return hasattr(model.base_model.layers[0], "post_feedforward_layernorm")


@dataclass(frozen=True)
class RotaryTables:
    """A pass's rotary tables: each distinct pair cos, sin [T, rotary dims] once (one for all
    layers, or Gemma 3's per layer type: its local layers' base differs from its global ones'),
    and which pair each layer takes."""

    pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    of_layer: tuple[int, ...]  # layer -> its index in `pairs`

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pairs[self.of_layer[layer]]


def rotary_tables(model: PreTrainedModel, x: torch.Tensor, layout: PassLayout) -> RotaryTables:
    """The pass's rotary tables for `model`'s layers (`x`: the embedded pass, for its dtype)."""
    rotary = model.base_model.rotary_emb
    layers = model.config.num_hidden_layers
    if not hasattr(rotary, "layer_types"):
        cos, sin = rotary(x, position_ids=layout.position_ids)  # [1, T, head_dim] each
        return RotaryTables(((cos[0].contiguous(), sin[0].contiguous()),), (0,) * layers)
    kinds = list(dict.fromkeys(rotary.layer_types))
    pairs = []
    for kind in kinds:
        cos, sin = rotary(x, position_ids=layout.position_ids, layer_type=kind)
        pairs.append((cos[0].contiguous(), sin[0].contiguous()))
    return RotaryTables(
        tuple(pairs), tuple(kinds.index(kind) for kind in model.config.layer_types[:layers])
    )


def attention_kernel_width(model: PreTrainedModel) -> int:
    """Rows of up to this many tokens attend through the attention kernel in `model`'s passes
    (0: none, off the packed CPU path)."""
    if not supports_lean_pass(model) or packed_pass_kernels(model) is None:
        return 0
    int8 = model.base_model.layers[0].mlp.down_proj.int8_activations
    return INT8_ATTENTION_KERNEL_WIDTH if int8 else ATTENTION_KERNEL_WIDTH


def kv_cache_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype of `model`'s KV cache: the model's, float16 on the 8-bit path (where the
    attention kernel reads every row)."""
    return (
        INT8_KV_DTYPE
        if attention_kernel_width(model) == INT8_ATTENTION_KERNEL_WIDTH
        else model.dtype
    )


def packed_pass_kernels(model: PreTrainedModel) -> Any:
    """The per-layer kernels (`service/kernels/layer_kernels.py`) when `model`'s passes run the
    packed CPU path (its linears packed, with the numba kernels; float32 on a CPU; the pass of
    `service/model/packed_pass.py`), else None."""
    down = model.base_model.layers[0].mlp.down_proj
    if not isinstance(down, PackedLinear) or down.kernels is None:
        return None
    return (
        loaded_layer_kernels()
        if model.dtype == torch.float32 and model.device.type == "cpu"
        else None
    )


def _queries_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    cache_layer: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pass's rotated queries [1, heads, T, head_dim], and the cache rows' keys and values
    [rows, kv_heads, pass_end, head_dim] with the pass's rotated keys and its values written in.
    `qkv`: [T, heads + 2 * kv_heads, head_dim]; `cos`, `sin`: [T, rotary dims]."""
    kv_heads = (qkv.shape[1] - heads) // 2
    new_values = qkv[None, :, heads + kv_heads :].transpose(1, 2)  # [1, kv_heads, T, head_dim]
    # [T, heads + kv_heads, head_dim]
    qk = _rotate(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
    keys, values = cache_layer.update(qk[None, :, heads:].transpose(1, 2), new_values)
    return qk[None, :, :heads].transpose(1, 2), keys, values


def fused_projections(layer: nn.Module) -> FusedProjections:
    """The layer's q/k/v and gate/up projections, fused where they can be, and its o and down
    projections (made on first use)."""
    fused = _FUSED.get(layer)
    if fused is None:
        attn, mlp = layer.self_attn, layer.mlp
        fused = FusedProjections(
            (attn.qkv_proj,)  # Phi-3's, fused in the model
            if hasattr(attn, "qkv_proj")
            else fuse_projections([attn.q_proj, attn.k_proj, attn.v_proj]),
            (mlp.gate_up_proj,)
            if hasattr(mlp, "gate_up_proj")
            else fuse_projections([mlp.gate_proj, mlp.up_proj]),
            attn.o_proj,
            mlp.down_proj,
            _called_directly(mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn),
        )
        _FUSED[layer] = fused
    return fused


def _called_directly(
    act: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An activation module's `forward` itself (a function as it is)."""
    return act.forward if isinstance(act, nn.Module) else act


def project(modules: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    """The outputs of `modules` (a `FusedProjections` entry) side by side. Each is called
    through `forward`: `nn.Module.__call__`'s hook machinery costs time on every call, a visible
    share of a one-token pass's many small matmuls (a served model's layers have no hooks)."""
    if len(modules) == 1:
        return modules[0].forward(x)
    return torch.cat([module.forward(x) for module in modules], dim=-1)


def fuse_projections(modules: Sequence[nn.Module]) -> tuple[nn.Module, ...]:
    """One linear layer computing `modules`' outputs side by side, where they fuse. The modules'
    own weights become views of the fused weight, so memory is not doubled and they keep
    working alone. Packed modules of mixed kinds fuse in runs of one kind (a Q4_K_M file's q
    and k beside a v of another type); others stay as they are."""
    if all(isinstance(m, PackedLinear) for m in modules):
        return _fuse_packed_runs(modules)  # type: ignore[arg-type]
    if all(type(m) is nn.Linear for m in modules) and len({m.bias is None for m in modules}) == 1:
        return (_fuse_linears(modules),)  # type: ignore[arg-type]
    return tuple(modules)


def _fuse_packed_runs(modules: Sequence[PackedLinear]) -> tuple[PackedLinear, ...]:
    """`modules` as the fewest layers, each the longest run of consecutive ones that fuse."""
    layers: list[PackedLinear] = []
    start = 0
    while start < len(modules):
        end, layer = start + 1, modules[start]
        for last in range(len(modules), start + 1, -1):
            fused = fuse_packed(modules[start:last])
            if fused is not None:
                end, layer = last, fused
                break
        layers.append(layer)
        start = end
    return tuple(layers)


@torch.no_grad()
def _fuse_linears(modules: Sequence[nn.Linear]) -> nn.Linear:
    weight = torch.cat([m.weight for m in modules])  # [sum of out_features, in_features]
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    offset = 0
    for module in modules:
        rows = module.out_features
        module.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias[offset : offset + rows], requires_grad=False)
        offset += rows
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalize in float32, round to the input's dtype, then
    scale (one fused call when that rounding is a no-op). Gemma's (no `variance_epsilon`):
    scale by 1 + weight in float32, then round."""
    if is_gemma_norm(norm):
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, norm.eps)
        return (normed * (1.0 + norm.weight.float())).type_as(x)
    eps = norm.variance_epsilon
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def is_gemma_norm(norm: nn.Module) -> bool:
    """Whether `norm` is Gemma's RMSNorm (scaling by 1 + weight; no `variance_epsilon`)."""
    return not hasattr(norm, "variance_epsilon")


def _norm_heads(qkv: torch.Tensor, norms: tuple[nn.Module, nn.Module], heads: int) -> None:
    """Qwen3's RMSNorm of each query head and each key head over head_dim (`norms`: the
    queries', the keys'), in place in `qkv` [T, heads + 2 * kv_heads, head_dim]."""
    kv_heads = (qkv.shape[1] - heads) // 2
    for norm, part in zip(norms, (slice(0, heads), slice(heads, heads + kv_heads))):
        x = qkv[:, part]
        qkv[:, part] = _rms_norm(x.reshape(-1, x.shape[-1]), norm).view(x.shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' `rotate_half` convention: x * cos + [-x2, x1] * sin, on
    the first cos.shape[-1] dimensions (all but for a partial rotary embedding), the rest as
    they are."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat((_rotate(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
