"""GGUF weights for the packed-linear tests: random quantized blocks and their reference
product, the tiny Llama written to a GGUF file as llama.cpp writes one, and the check that
speculation on a packed model equals its plain decoding."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from drafting import TableSlot, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams
from service.kernels.packed_linear import LLAMA_LINEARS, unpermute_rows
from service.model.runner import ModelRunner
from service.model.tables import compute_tables
from tests.helpers.models import make_tiny_model

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def random_blocks(out_features: int, in_features: int, seed: int = 0, kind=Q4_1) -> np.ndarray:
    """GGUF bytes of a random weight, as gguf's own quantizer writes them."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    return gguf.quants.quantize(weight, kind)


def reference(blocks: np.ndarray, x: torch.Tensor, kind=Q4_1) -> torch.Tensor:
    """gguf's dequantization, then a float64 matmul."""
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    return (x.double() @ weight.double().T).float()


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf), the inverse of `unpermute_rows`."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(model, path: Path, loadable: bool = False) -> None:
    """Quantize the tiny Llama's linears to Q4_1 and its LM head to Q8_0 into a GGUF (llama.cpp's
    names and q/k permutation), and set the model's weights to exactly what that file holds.
    `loadable`: with the rest a served model needs (`_add_model_rest`), so that `load_model`
    converts and serves the file."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    if loadable:
        _add_model_rest(writer, model)
    for index, layer in enumerate(model.model.layers):
        for kind, name in LLAMA_LINEARS.items():
            linear = layer.get_submodule(name)
            weight = linear.weight.detach().numpy()
            heads = {
                "attn_q": config.num_attention_heads,
                "attn_k": config.num_key_value_heads,
            }.get(kind)
            stored = permute_rows(weight, heads) if heads else weight
            blocks = gguf.quants.quantize(stored, Q4_1)
            served = gguf.quants.dequantize(blocks, Q4_1)
            if heads:
                served = served[unpermute_rows(served.shape[0], heads)]
            linear.weight.data = torch.from_numpy(np.ascontiguousarray(served))
            writer.add_tensor(f"blk.{index}.{kind}.weight", blocks, raw_dtype=Q4_1)
    head = gguf.quants.quantize(model.lm_head.weight.detach().numpy(), Q8_0)
    model.lm_head.weight.data = torch.from_numpy(gguf.quants.dequantize(head, Q8_0))
    writer.add_tensor("output.weight", head, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_model_rest(writer: gguf.GGUFWriter, model) -> None:
    """The hyperparameters, a stand-in byte-level tokenizer (a made-up token per id), the
    embeddings and the norms of `model`: what transformers needs beside the linears to load a
    GGUF as a model and tokenizer."""
    config = model.config
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    vocab = config.vocab_size
    writer.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges(["a a"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().numpy())
    writer.add_tensor("output_norm.weight", model.model.norm.weight.detach().numpy())
    for index, layer in enumerate(model.model.layers):
        norms = {"attn_norm": layer.input_layernorm, "ffn_norm": layer.post_attention_layernorm}
        for kind, norm in norms.items():
            writer.add_tensor(f"blk.{index}.{kind}.weight", norm.weight.detach().numpy())


def tiny_gguf_twins(directory: Path):
    """The tiny Llama with Q4_1 weights written to a GGUF in `directory`: the float32 model, a
    second copy of it to pack, and the file."""
    path = directory / "tiny.Q4_1.gguf"
    plain = make_tiny_model(seed=3)
    write_tiny_gguf(plain, path)
    twin = make_tiny_model(seed=3)
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
