"""GGUF weights for the packed-linear tests: random quantized blocks and their reference
product, the tiny Llama written to a GGUF file as llama.cpp writes one, and the check that
speculation on a packed model equals its plain decoding."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from drafting import TableSlot, default_mixer
from service.bench import random_gguf
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.kernels.packed_linear import (
    PackedLinear,
    gguf_linears,
    tiles_from_blocks,
    unpermute_rows,
)
from service.model.runner import ModelRunner
from service.model.tables import compute_tables
from tests.helpers.models import make_tiny_model

IQ4_NL = gguf.GGMLQuantizationType.IQ4_NL
Q2_K = gguf.GGMLQuantizationType.Q2_K
Q3_K = gguf.GGMLQuantizationType.Q3_K
Q4_0 = gguf.GGMLQuantizationType.Q4_0
Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q4_K = gguf.GGMLQuantizationType.Q4_K
Q5_0 = gguf.GGMLQuantizationType.Q5_0
Q5_1 = gguf.GGMLQuantizationType.Q5_1
Q5_K = gguf.GGMLQuantizationType.Q5_K
Q6_K = gguf.GGMLQuantizationType.Q6_K
Q8_0 = gguf.GGMLQuantizationType.Q8_0
K_TYPES = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)  # K-quants
RANDOM_TYPES = (*K_TYPES, IQ4_NL)  # types gguf-py cannot write: random blocks


def random_blocks(out_features: int, in_features: int, seed: int = 0, kind=Q4_1) -> np.ndarray:
    """GGUF bytes of a random weight, as gguf's own quantizer writes them; for the K-quants it
    cannot write, random blocks (`service/bench/random_gguf.py`)."""
    rng = np.random.default_rng(seed)
    if kind not in RANDOM_TYPES:
        weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(weight, kind)
    return random_gguf.random_blocks(out_features, in_features, kind, rng)


def reference(blocks: np.ndarray, x: torch.Tensor, kind=Q4_1) -> torch.Tensor:
    """gguf's dequantization, then a float64 matmul."""
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    return (x.double() @ weight.double().T).float()


def assert_linear_matches_reference(
    kind: gguf.GGMLQuantizationType, out_features: int, in_features: int, rows: int, kernels: Any
) -> None:
    """A `PackedLinear` of random `kind` blocks (on `kernels`, or the torch fallback for None)
    gives float32 outputs of its shape, within float32 rounding of the float64 reference."""
    blocks = random_blocks(out_features, in_features, seed=rows, kind=kind)
    layer = PackedLinear(tiles_from_blocks(blocks, out_features, in_features, kind.name), kernels)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(out_features))
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(blocks, x, kind), rtol=1e-5, atol=2e-5)


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf), the inverse of `unpermute_rows`."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# llama.cpp's architecture names where they differ from transformers' model types
GGUF_ARCHITECTURES = {"gemma3_text": "gemma3"}


def write_tiny_gguf(
    model,
    path: Path,
    loadable: bool = False,
    linear_type: Callable[[int, str], gguf.GGMLQuantizationType] = lambda index, kind: Q4_1,
    head_type: gguf.GGMLQuantizationType = Q8_0,
) -> None:
    """Quantize a tiny model's linears (`linear_type(layer index, llama.cpp's name)`, Q4_1 by
    default) and its LM head (Q8_0 by default) into a GGUF of its architecture (llama.cpp's
    names, for a Llama its q/k permutation, Phi-3's fused modules as they are), and set the
    model's weights to exactly what that file holds (random blocks for the K-quants gguf-py
    cannot write). `loadable`: with the rest a served model needs (`_add_model_rest`), so that
    `load_model` converts and serves the file; a model with tied embeddings then gets no output
    tensor: its token embedding, in `head_type`, is the head, as llama.cpp writes such a
    model."""
    config = model.config
    architecture = GGUF_ARCHITECTURES.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(path, architecture)
    linears = gguf_linears(architecture)
    tied_table = loadable and config.tie_word_embeddings
    if loadable:
        _add_model_rest(writer, model, head_type if tied_table else None)
    for index, layer in enumerate(model.model.layers):
        for kind, name in linears.items():
            linear = layer.get_submodule(name)
            weight = linear.weight.detach().numpy()
            heads = (
                {
                    "attn_q": config.num_attention_heads,
                    "attn_k": config.num_key_value_heads,
                }.get(kind)
                if config.model_type == "llama"
                else None
            )
            stored = permute_rows(weight, heads) if heads else weight
            dtype = linear_type(index, kind)
            blocks = _quantize(stored, dtype, seed=index * 100 + list(linears).index(kind))
            served = gguf.quants.dequantize(blocks, dtype)
            if heads:
                served = served[unpermute_rows(served.shape[0], heads)]
            linear.weight.data = torch.from_numpy(np.ascontiguousarray(served))
            writer.add_tensor(f"blk.{index}.{kind}.weight", blocks, raw_dtype=dtype)
    if not tied_table:
        head = _quantize(model.lm_head.weight.detach().numpy(), head_type, seed=99)
        model.lm_head.weight.data = torch.from_numpy(gguf.quants.dequantize(head, head_type))
        writer.add_tensor("output.weight", head, raw_dtype=head_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantize(weight: np.ndarray, kind: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """`weight` quantized to `kind`, or random blocks of its shape for a type gguf-py cannot
    write."""
    if kind in RANDOM_TYPES:
        return random_blocks(*weight.shape, seed=seed, kind=kind)
    return gguf.quants.quantize(weight, kind)


def _add_model_rest(
    writer: gguf.GGUFWriter, model, embedding_type: gguf.GGMLQuantizationType | None = None
) -> None:
    """The hyperparameters, a stand-in tokenizer, the embeddings and the norms of `model`: what
    transformers needs beside the linears to load a GGUF as a model and tokenizer. The token
    embedding in float32, or quantized to `embedding_type` (the model's set to the file's).
    Gemma's norms as llama.cpp stores them (1 + weight: its norms scale by that), its sandwich
    norms under their llama.cpp names, its window and Gemma 2's caps. The padding token, the
    dimensions of each head the rotary embedding turns (Phi-4-mini's are a part of it), and
    Phi-3's window and rope scaling (`_add_phi3_rope`), as llama.cpp writes them."""
    config = model.config
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3's: per layer type
    head_dim = model.model.layers[0].self_attn.head_dim
    shape = random_gguf.ModelShape(
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        tied=False,
        context=config.max_position_embeddings,
        rope_theta=rope["rope_theta"],
        norm_eps=config.rms_norm_eps,
        bos=config.bos_token_id,
        eos=config.eos_token_id,
    )
    random_gguf.add_llama_metadata(writer, shape)
    if config.pad_token_id is not None:  # (Phi-3's default is past a tiny vocabulary)
        writer.add_pad_token_id(config.pad_token_id)
    writer.add_key_length(head_dim)  # Qwen3's is no quotient
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    gemma = hasattr(model.model.layers[0], "post_feedforward_layernorm")
    if gemma:
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "phi3":
        _add_phi3_rope(writer, config)
    if getattr(config, "attn_logit_softcapping", None):  # Gemma 2's caps
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    embedding = model.model.embed_tokens.weight.detach().numpy()
    if embedding_type is None:
        writer.add_tensor("token_embd.weight", embedding)
    else:
        table = _quantize(embedding, embedding_type, seed=98)
        model.model.embed_tokens.weight.data = torch.from_numpy(
            gguf.quants.dequantize(table, embedding_type)
        )
        writer.add_tensor("token_embd.weight", table, raw_dtype=embedding_type)

    def add_norm(name: str, norm: torch.nn.Module) -> None:
        weight = norm.weight.detach().numpy()
        writer.add_tensor(name, weight + 1 if gemma else weight)

    add_norm("output_norm.weight", model.model.norm)
    for index, layer in enumerate(model.model.layers):
        norms = {"attn_norm": layer.input_layernorm, "ffn_norm": layer.post_attention_layernorm}
        if gemma:
            norms = {
                "attn_norm": layer.input_layernorm,
                "post_attention_norm": layer.post_attention_layernorm,
                "ffn_norm": layer.pre_feedforward_layernorm,
                "post_ffw_norm": layer.post_feedforward_layernorm,
            }
        for kind, name in gguf_linears(writer.arch).items():  # Qwen2's q/k/v biases
            bias = layer.get_submodule(name).bias
            if bias is not None:
                writer.add_tensor(f"blk.{index}.{kind}.bias", bias.detach().numpy())
        if hasattr(layer.self_attn, "q_norm"):  # Qwen3's
            norms |= {"attn_q_norm": layer.self_attn.q_norm, "attn_k_norm": layer.self_attn.k_norm}
        for kind, norm in norms.items():
            add_norm(f"blk.{index}.{kind}.weight", norm)


def _add_phi3_rope(writer: gguf.GGUFWriter, config) -> None:
    """Phi-3's window (0: none), original context and, for its long-context rope scaling
    (LongRoPE), the attention factor and the per-frequency factors as tensors, as llama.cpp's
    converter writes them."""
    writer.add_sliding_window(config.sliding_window or 0)
    original = config.original_max_position_embeddings
    writer.add_rope_scaling_orig_ctx_len(original)
    rope = config.rope_parameters
    if rope.get("rope_type") != "longrope":
        return
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    for kind in ("long", "short"):
        writer.add_tensor(
            f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], np.float32)
        )


def tiny_gguf_twins(directory: Path):
    """The tiny Llama with Q4_1 weights written to a GGUF in `directory`: the float32 model, a
    second copy of it to pack, and the file."""
    path = directory / "tiny.Q4_1.gguf"
    plain = make_tiny_model(seed=3)
    write_tiny_gguf(plain, path)
    twin = make_tiny_model(seed=3)
    twin.load_state_dict(plain.state_dict())
    return plain, twin, path


def mixed_type(index: int, kind: str) -> gguf.GGMLQuantizationType:
    """A mix like llama.cpp's Q4_K_M, Q5_K_M and Q2_K presets: mostly Q4_K, some Q5_0 and
    Q8_0, Q4_0, a Q6_K attn_v (layer 0), a Q5_K ffn_gate, a Q5_1 attn_output and a Q2_K ffn_up
    (layer 1), and an IQ4_NL ffn_down (layer 1): `UNSERVED`, a type the kernels do not
    serve."""
    special = {
        ("attn_v", 0): Q6_K,
        ("ffn_gate", 1): Q5_K,
        ("attn_output", 1): Q5_1,
        ("ffn_up", 1): Q2_K,
    }
    if (kind, index) == ("ffn_down", 1):
        return UNSERVED
    if (kind, index) in special:
        return special[kind, index]
    return {"attn_k": Q4_0, "attn_output": Q5_0, "ffn_up": Q8_0}.get(kind, Q4_K)


UNSERVED = IQ4_NL  # (a lookup table of 16 values: no layout of the kernels holds it)
MIXED_HIDDEN = 256  # a K-quant's 256-weight blocks fit the rows of every linear


def tiny_mixed_twins(directory: Path):
    """`tiny_gguf_twins` for a wider tiny Llama whose GGUF mixes types as `mixed_type` says
    (the LM head Q5_0)."""
    path = directory / "tiny.Q4_K_M.gguf"
    plain = make_tiny_model(seed=3, hidden_size=MIXED_HIDDEN)
    write_tiny_gguf(plain, path, linear_type=mixed_type, head_type=Q5_0)
    twin = make_tiny_model(seed=3, hidden_size=MIXED_HIDDEN)
    twin.load_state_dict(plain.state_dict())
    return plain, twin, path


def assert_speculation_equals_plain_decoding(model) -> None:
    """Speculative greedy output of `model`'s engine equals its plain decoding, for a few shapes."""
    engine = Engine(
        ModelRunner(model),
        default_mixer(TableSlot(compute_tables(model, batch_size=16, show_progress=False))),
        eos_token_ids=[],
        max_context=512,
    )
    prompt = [5, 9, 5, 9, 5, 9, 12, 30, 5, 9, 5]
    plain = engine.complete(prompt, GenerationParams(max_new_tokens=40)).token_ids
    for k, w in ((1, 1), (2, 3), (4, 4)):
        params = GenerationParams(max_new_tokens=40, speculation=SpeculationParams(k, w))
        assert engine.complete(prompt, params).token_ids == plain, (k, w)
