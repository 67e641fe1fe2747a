"""The synthetic files' type mixes (`ngrammys synth --types`): llama.cpp's "_M" presets."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Kind

from service.bench.random_gguf import K_M_PRESETS, preset


@pytest.mark.parametrize("name", K_M_PRESETS)
def test_a_k_m_preset_gives_more_bits_where_llama_cpp_does(name) -> None:
    kind_of, base = preset(name), K_M_PRESETS[name]
    layers = 16  # more bits: layers 0-1 and 14-15, and every third from 2 on (4, 7, 10, 13)
    assert kind_of("output", 0, layers) == Kind.Q6_K
    more = [layer for layer in range(layers) if kind_of("ffn_down", layer, layers) == Kind.Q6_K]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [kind_of("attn_v", layer, layers) for layer in range(layers)] == [
        Kind.Q6_K if layer in more else base for layer in range(layers)
    ]
    assert {kind_of(tensor, 3, layers) for tensor in ("attn_q", "ffn_up", "token_embd")} == {base}


def test_an_unknown_type_names_the_choices() -> None:
    with pytest.raises(ValueError, match="Q4_K_M, Q5_K_M, Q4_0"):
        preset("IQ2_XS")
