"""A served model built straight from a GGUF file, with no float32 copy of the model.

The model is made from its config with every parameter on the meta device (no memory). The
caller packs the linears the kernels serve first (service/kernels/packed_linear.py), and the
token embedding (`pack_embedding`); `fill_from_gguf` fills each parameter left from its own
tensor: dequantized as gguf-py does, turned from llama.cpp's
layout into transformers' by transformers' own per-architecture processor (Llama's q/k row
order, Gemma's norm offset), cast and moved, one tensor at a time. Memory at its peak is the
served model plus one tensor in float32, where loading through transformers holds every tensor
in float32 at once (28 GB for a 7B model).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

from service.kernels.gguf_file import GGUFContents
from service.kernels.packed_embedding import PackedEmbedding
from service.kernels.packed_linear import PackedLinear

log = logging.getLogger(__name__)


def empty_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The model of `config` with its parameters on the meta device, nothing allocated for
    them, and its buffers (rotary frequencies) on the CPU, computed by the model's own
    initialization, as transformers' loading does."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, buffer in list(model.named_buffers()):
        parent, _, attr = name.rpartition(".")
        model.get_submodule(parent)._buffers[attr] = torch.empty_like(buffer, device="cpu")
    model.init_weights()  # the buffers' values; free on the meta parameters
    return model


def pack_embedding(model: PreTrainedModel, contents: GGUFContents) -> str | None:
    """Replace the token embedding by a `PackedEmbedding` over the file's `token_embd` blocks
    (any type gguf-py dequantizes but float32), unless an LM head left in float32 is tied to
    it; a scaled embedding (Gemma's) keeps its scale. Returns the GGUF type kept packed, or
    None (the embedding is then filled in float32)."""
    embedding = model.get_input_embeddings()
    name = next(n for n, module in model.named_modules() if module is embedding)
    parent, _, attr = name.rpartition(".")
    tensor = contents.tensors.get("token_embd.weight")
    if (
        tensor is None
        or not isinstance(embedding, nn.Embedding)
        or tensor.kind == gguf.GGMLQuantizationType.F32
    ):
        return None
    if model.config.tie_word_embeddings and (
        not isinstance(model.get_output_embeddings(), PackedLinear)
        or "output.weight" in contents.tensors
    ):
        return None  # a float32 table (which an unpacked head is tied to)
    try:
        packed = PackedEmbedding(
            tensor.raw, tensor.kind, getattr(embedding, "scalar_embed_scale", None)
        )
    except NotImplementedError:  # a type gguf-py cannot dequantize: fill_from_gguf says so
        return None
    if (packed.num_embeddings, packed.embedding_dim) != tuple(embedding.weight.shape):
        raise ValueError(
            f"{contents.path.name}: tensor token_embd.weight has shape "
            f"{(packed.num_embeddings, packed.embedding_dim)}, the model's embedding "
            f"{tuple(embedding.weight.shape)}"
        )
    setattr(model.get_submodule(parent), attr, packed)
    return tensor.kind.name


def fill_from_gguf(model: PreTrainedModel, contents: GGUFContents, device: torch.device) -> None:
    """Give every parameter of `model` still on the meta device its weights from the GGUF
    `contents`, in the parameter's dtype, on `device` (buffers too); a tied output embedding
    without a tensor of its own is tied to the input one. Raises `ValueError` naming any
    parameter the file has no tensor for."""
    path = contents.path
    processor = TENSOR_PROCESSORS.get(contents.architecture, TensorProcessor)(
        config=model.config.to_dict()
    )
    targets = _parameter_names(model, contents)
    for tensor in contents.tensors.values():
        if tensor.name not in targets:  # packed already: neither dequantized nor read
            continue
        result = processor.process(
            weights=tensor.dequantized(),
            name=tensor.name,
            tensor_key_mapping=targets,
            parsed_parameters={"tensors": {}},
        )
        name = targets.get(result.name)
        if name is None:
            continue
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)
        old = getattr(module, attr)
        if tuple(old.shape) != result.weights.shape:
            raise ValueError(
                f"{path.name}: tensor {tensor.name} has shape {result.weights.shape}, "
                f"the model's {name} {tuple(old.shape)}"
            )
        weights = torch.from_numpy(np.require(result.weights, requirements=["C", "W"]))
        setattr(module, attr, nn.Parameter(weights.to(old.dtype).to(device), requires_grad=False))
    _tie_output_embeddings(model)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{path.name} has no tensor for {', '.join(missing[:5])}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}"
        )
    model.to(device)


def _parameter_names(model: PreTrainedModel, contents: GGUFContents) -> dict[str, str]:
    """GGUF tensor name -> the name of the parameter still on the meta device it fills
    ("blk.3.attn_norm.weight" -> "model.layers.3.input_layernorm.weight"), by gguf-py's map of
    the architecture's names."""
    arch = next(
        (key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == contents.architecture),
        None,
    )
    if arch is None:
        raise ValueError(f"gguf-py does not know the architecture {contents.architecture!r}")
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    targets = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        module, _, suffix = name.rpartition(".")
        tensor = names.get_name(module)
        if parameter.is_meta and tensor is not None:
            targets[f"{tensor}.{suffix}"] = name
    return targets


def _tie_output_embeddings(model: PreTrainedModel) -> None:
    """Tie an output embedding the file has no tensor for to the input embedding, where the
    config says they are tied (a packed LM head is a module of its own and stays)."""
    output = model.get_output_embeddings()
    weight = getattr(output, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.is_meta and model.config.tie_word_embeddings:
        output.weight = model.get_input_embeddings().weight
