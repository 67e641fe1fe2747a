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
    blocks a row), heads 16 wide; `config`: more of the family config's fields. Its attention
    is transformers' default kind for it: SDPA, but eager for Gemma 2 (SDPA cannot cap). A
    Gemma scales its scores by 1/sqrt(head size), as every released size but 27B does (and as
    llama.cpp reads a GGUF of it)."""
    torch.manual_seed(seed)
    if config_name.startswith("Gemma"):
        config = {"query_pre_attn_scalar": 16} | config
    made = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        **config,
    )
    return transformers.AutoModelForCausalLM.from_config(made).eval()


def make_successor_model(
    successors: dict[int, int], default: int, vocab_size: int = TINY_VOCAB, seed: int = 0
) -> LlamaForCausalLM:
    """A 1-layer Llama whose greedy next token depends on the current token only: `successors[t]`
    after t, `default` after any other, so a test can make it write a script. Its layer adds
    nothing (zero output projections), so the logits are the head's of the token's own
    embedding: token t (the i-th key) is the unit vector i, any other the last one, and the head
    scores each successor on the directions of the tokens it follows."""
    hidden = 64
    if len(successors) >= hidden:
        raise ValueError(f"at most {hidden - 1} tokens have successors of their own")
    model = make_tiny_model(seed=seed, vocab_size=vocab_size, num_layers=1, hidden_size=hidden)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        embedding = torch.zeros(vocab_size, hidden)
        embedding[:, hidden - 1] = 1.0
        head = torch.zeros(vocab_size, hidden)
        head[default, hidden - 1] = 10.0
        for i, (token, successor) in enumerate(successors.items()):
            embedding[token] = 0.0
            embedding[token, i] = 1.0
            head[successor, i] = 10.0
        model.model.embed_tokens.weight.copy_(embedding)
        model.lm_head.weight.copy_(head)
    return model


# Gemma 2's caps for the tiny models, low enough to bite: attention scores past 5 and logits
# past 3 are soft-capped (`make_tiny_gemma2` scales its weights so that many are)
GEMMA2_CAPS = {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}


def make_tiny_gemma2(
    seed: int = 5, window: int = 4, **config: object
) -> transformers.PreTrainedModel:
    """A tiny random Gemma 2 (`make_tiny_family_model`) whose caps bite: its local layers see
    `window` positions, its q and k projections (×30) and its untied LM head (×15) are scaled
    up, so that many of its attention scores and logits pass `GEMMA2_CAPS`."""
    model = make_tiny_family_model(
        "Gemma2Config",
        seed=seed,
        sliding_window=window,
        tie_word_embeddings=False,
        **(GEMMA2_CAPS | config),
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
        model.lm_head.weight.mul_(15.0)
    return model
