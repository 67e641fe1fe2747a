"""Cut a Llama-family model into one rank's shard (Megatron's layout).

Each rank keeps a slice of every decoder layer: its share of the attention heads (q, k and v
projections cut by output rows, whole heads each) and of the MLP's intermediate columns (gate
and up cut by rows), with the o and down projections cut by input columns to match. Their
partial outputs are summed over the ranks, one all-reduce after attention and one after the
MLP of every layer. The LM head is cut by vocabulary rows and its logits gathered, so every
rank ends a pass holding the whole distribution. Embeddings and norms stay whole on every rank.

The lean pass (`service/model/decoder_pass.py`) then runs unchanged on a shard: it takes the head
counts from the config (divided here) and calls the projections it finds, so the all-reduces
ride in `RowParallelLinear`. Packed CPU linears are not cut (their tiles are laid out per whole
matrix), so a sharded model computes with plain weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from service.kernels.packed_linear import LLAMA_MODULE_TYPES, PackedLinear


class NotShardable(ValueError):
    """A model, or a rank count, this server cannot split."""


class RowParallelLinear(nn.Module):
    """A linear layer cut by input columns: each rank's partial product, summed over `group`;
    the bias (if any) added once, after the sum."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Module):
    """The LM head cut by vocabulary rows (padded to equal parts): each rank's logits, gathered
    over `group` into the whole [..., vocab] on every rank."""

    def __init__(
        self, weight: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.vocab_size = weight.shape[0]
        part = -(-self.vocab_size // world)
        rows = weight[rank * part : (rank + 1) * part]
        padded = rows.new_zeros(part, weight.shape[1])
        padded[: rows.shape[0]] = rows
        self.weight = nn.Parameter(padded, requires_grad=False)
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # [..., part]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def check_shardable(model: PreTrainedModel, world: int) -> None:
    """Raise `NotShardable`, saying why, unless `model` splits evenly over `world` ranks."""
    config = model.config
    if getattr(config, "model_type", None) not in LLAMA_MODULE_TYPES:
        raise NotShardable(
            f"tensor parallelism supports {', '.join(LLAMA_MODULE_TYPES)} models, "
            f"not {getattr(config, 'model_type', None)!r}"
        )
    if any(isinstance(module, PackedLinear) for module in model.modules()):
        raise NotShardable(
            "packed GGUF linears cannot be split over ranks: use --quantization none"
        )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % world:
            raise NotShardable(
                f"{name} ({getattr(config, name)}) does not divide over {world} ranks"
            )


@torch.no_grad()
def shard_model(
    model: PreTrainedModel, rank: int, world: int, group: dist.ProcessGroup | None = None
) -> None:
    """Keep rank `rank`'s shard of `model` (of `world`), in place; `group`: the ranks the
    partial sums and logits are exchanged with (None: the default group)."""
    check_shardable(model, world)
    config = model.config
    for layer in model.base_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _rows(getattr(attn, name), rank, world))
        attn.o_proj = _columns(attn.o_proj, rank, world, group)
        mlp.gate_proj, mlp.up_proj = (
            _rows(mlp.gate_proj, rank, world),
            _rows(mlp.up_proj, rank, world),
        )
        mlp.down_proj = _columns(mlp.down_proj, rank, world, group)
        for attribute in (
            "num_heads",
            "num_key_value_heads",
        ):  # older transformers keep counts here
            if hasattr(attn, attribute):
                setattr(attn, attribute, getattr(attn, attribute) // world)
    model.lm_head = VocabParallelHead(
        model.get_output_embeddings().weight.detach(), rank, world, group
    )
    config.tie_word_embeddings = False  # the head is a slice of its own now
    config.num_attention_heads //= world
    config.num_key_value_heads //= world
    config.intermediate_size //= world


def _rows(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    """This rank's output rows of `linear` (whole heads, since heads divide over the ranks)."""
    part = linear.out_features // world
    kept = nn.Linear(
        linear.in_features,
        part,
        bias=linear.bias is not None,
        device=linear.weight.device,
        dtype=linear.weight.dtype,
    )
    kept.weight.copy_(linear.weight[rank * part : (rank + 1) * part])
    if linear.bias is not None:
        kept.bias.copy_(linear.bias[rank * part : (rank + 1) * part])
    return kept.requires_grad_(False)


def _columns(
    linear: nn.Linear, rank: int, world: int, group: dist.ProcessGroup | None
) -> RowParallelLinear:
    """This rank's input columns of `linear`, its output summed over the ranks."""
    part = linear.in_features // world
    weight = linear.weight[:, rank * part : (rank + 1) * part].clone()
    return RowParallelLinear(
        weight, None if linear.bias is None else linear.bias.detach().clone(), group
    )
