"""Tiny random Llamas: real attention code, milliseconds per pass, no download."""

from __future__ import annotations

import os

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

TINY_VOCAB = 64
# The device of the tiny models (and so of their engines): `NGRAMMYS_TEST_DEVICE=cuda pytest
# tests/service/engine/test_engine_lossless.py ...` runs the engine tests on a GPU; CPU by default.
TEST_DEVICE = torch.device(os.environ.get("NGRAMMYS_TEST_DEVICE", "cpu"))


def make_tiny_model(
    seed: int = 0,
    attn_implementation: str = "sdpa",
    vocab_size: int = TINY_VOCAB,
    num_layers: int = 2,
    context: int = 512,
    hidden_size: int = 64,
) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: real attention code, milliseconds per pass."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).to(TEST_DEVICE).eval()


def make_tiny_family_model(
    config_name: str, seed: int = 2, vocab_size: int = TINY_VOCAB, **config: object
) -> transformers.PreTrainedModel:
    """A 2-layer random model of a family (`config_name`: "Qwen3Config"...), 64 wide (two Q4_1
    blocks a row), heads 16 wide; `config`: more of the family config's fields."""
    torch.manual_seed(seed)
    made = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        attn_implementation="sdpa",
        **config,
    )
    return transformers.AutoModelForCausalLM.from_config(made).eval()
