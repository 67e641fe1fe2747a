"""GGUF files of real models' shapes with random weights (`ngrammys synth`).

What a model costs to load, to hold and to run does not depend on its weights' values, so a
1B- or 7B-shaped file with random blocks measures start time, memory and pass cost without a
download. The blocks are random bytes (every byte pattern of these types is a valid block) with
float16 scales small enough that activations stay finite; the file is written tensor by tensor
as it is made, so a 4 GB file needs no 4 GB in memory. A stand-in tokenizer (one made-up token
an id) completes what a server needs to start. Outputs mean nothing: never serve one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from service.kernels.packed_linear import LLAMA_LINEARS

log = logging.getLogger(__name__)

Kind = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture model's hyperparameters."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool  # no output tensor: the LM head is the token embedding
    context: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    bos: int = 1
    eos: int = 2


SHAPES = {
    "llama-3.2-1b": ModelShape(2048, 8192, 16, 32, 8, 128256, tied=True, rope_theta=500000.0),
    "llama-2-7b": ModelShape(4096, 11008, 32, 32, 32, 32000, tied=False),
}

# the byte offsets of each block type's float16 scales, and a size for them that keeps a random
# block's weights about as large as a trained layer's
SCALE_FIELDS: dict[Kind, tuple[tuple[int, ...], float]] = {
    Kind.Q4_0: ((0,), 5e-3),
    Kind.Q4_1: ((0, 2), 5e-3),
    Kind.Q5_0: ((0,), 2.5e-3),
    Kind.Q5_1: ((0, 2), 2.5e-3),
    Kind.Q8_0: ((0,), 3e-4),
    Kind.IQ4_NL: ((0,), 5e-4),
    Kind.Q2_K: ((80, 82), 1e-3),
    Kind.Q3_K: ((108,), 5e-4),
    Kind.Q4_K: ((0, 2), 1e-4),
    Kind.Q5_K: ((0, 2), 5e-5),
    Kind.Q6_K: ((208,), 1e-4),
}


def random_blocks(rows: int, cols: int, kind: Kind, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes [rows, bytes a row] of a random weight of block type `kind`."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // block_weights, block_bytes), dtype=np.uint8)
    offsets, scale = SCALE_FIELDS[kind]
    for offset in offsets:
        halves = rng.uniform(0.5, 1.0, blocks.shape[:2]) * scale
        blocks[..., offset : offset + 2] = halves.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp's K-quant presets give more bits (its `use_more_bits`): the first
    and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# llama.cpp's "_M" K-quant presets: their base type
K_M_PRESETS = {"Q4_K_M": Kind.Q4_K, "Q5_K_M": Kind.Q5_K}


def preset(name: str) -> Callable[[str, int, int], Kind]:
    """The type of each tensor ("token_embd", "output" or a linear's llama.cpp name; its layer;
    the layer count) in a preset: "Q4_K_M" and "Q5_K_M" mix as llama.cpp's do (Q6_K for the
    output, and for attn_v and ffn_down where `more_bits`; the base type elsewhere); a block
    type's name puts every tensor in that type."""
    if name in K_M_PRESETS:  # (llama.cpp's llama_tensor_get_type, for a dense Llama)
        base = K_M_PRESETS[name]

        def k_m(tensor: str, layer: int, layers: int) -> Kind:
            if tensor == "output" or (
                tensor in ("attn_v", "ffn_down") and more_bits(layer, layers)
            ):
                return Kind.Q6_K
            return base

        return k_m
    kind = Kind[name]
    if kind not in SCALE_FIELDS:
        choices = ", ".join([*K_M_PRESETS, *(kind.name for kind in SCALE_FIELDS)])
        raise ValueError(f"no random blocks for {name}: one of {choices}")
    return lambda tensor, layer, layers: kind


def token_names(vocab: int) -> list[str]:
    """`vocab` distinct made-up tokens: the letters' bijective base-26 numerals a, b, ..., z,
    aa, ab, ... (so the stand-in merge "a a" has its result, "aa")."""
    names = []
    for number in range(1, vocab + 1):
        letters = ""
        while number:
            number, digit = divmod(number - 1, 26)
            letters = chr(ord("a") + digit) + letters
        names.append(letters)
    return names


# a plain chat template, so that the benchmarks' chat prompts can be built for a random model
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def add_llama_metadata(writer: gguf.GGUFWriter, shape: ModelShape) -> None:
    """The hyperparameters, a stand-in byte-level tokenizer and a chat template: what
    transformers needs beside the tensors to make a model and tokenizer of a GGUF, and what the
    benchmarks need to make chat prompts."""
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(token_names(shape.vocab))
    writer.add_token_types([1] * shape.vocab)
    writer.add_token_scores([0.0] * shape.vocab)
    writer.add_token_merges(["a a"])
    writer.add_bos_token_id(shape.bos)
    writer.add_eos_token_id(shape.eos)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_random_gguf(path: Path, shape: ModelShape, types: str = "Q4_K_M", seed: int = 0) -> None:
    """Write a GGUF of `shape` with random weights in the `types` preset (`preset`) to `path`,
    norms all ones."""
    kind_of = preset(types)
    # as llama.cpp's quantizer: a tied embedding is the output, in the output's type
    embedding = kind_of("output" if shape.tied else "token_embd", 0, 1)
    tensors: list[tuple[str, tuple[int, ...], Kind | None]] = [
        ("token_embd.weight", (shape.vocab, shape.hidden), embedding)
    ]
    head_dim = shape.hidden // shape.heads
    rows = {
        "attn_q": (shape.hidden, shape.hidden),
        "attn_k": (shape.kv_heads * head_dim, shape.hidden),
        "attn_v": (shape.kv_heads * head_dim, shape.hidden),
        "attn_output": (shape.hidden, shape.hidden),
        "ffn_gate": (shape.intermediate, shape.hidden),
        "ffn_up": (shape.intermediate, shape.hidden),
        "ffn_down": (shape.hidden, shape.intermediate),
    }
    for layer in range(shape.layers):
        tensors.append((f"blk.{layer}.attn_norm.weight", (shape.hidden,), None))
        tensors += [
            (f"blk.{layer}.{name}.weight", rows[name], kind_of(name, layer, shape.layers))
            for name in LLAMA_LINEARS
        ]
        tensors.append((f"blk.{layer}.ffn_norm.weight", (shape.hidden,), None))
    tensors.append(("output_norm.weight", (shape.hidden,), None))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, shape.hidden), kind_of("output", 0, 1)))

    writer = gguf.GGUFWriter(path, "llama")
    add_llama_metadata(writer, shape)
    for name, dims, kind in tensors:
        if kind is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            nbytes = dims[0] * dims[1] // block_weights * block_bytes
            byte_shape = (dims[0], nbytes // dims[0])
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in tensors:
        if kind is None:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(*dims, kind, rng))
    writer.close()
    log.info("wrote %s (%.2f GB)", path, path.stat().st_size / 1e9)
