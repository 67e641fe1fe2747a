"""llama.cpp's greedy decoding as a bench reference (`ngrammys bench --llama-cpp`). The package
compiles llama.cpp when installed, so only the missing-package path runs without it."""

from __future__ import annotations

import sys

import pytest

from service.bench.llama_cpp_reference import INSTALL_HINT, LlamaCppGreedy
from service.engine.params import GenerationParams, SamplingParams
from service.model.loader import embedded_gguf_path


def test_without_the_package_the_reference_says_how_to_get_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when not installed
    with pytest.raises(RuntimeError, match="llama-cpp"):
        LlamaCppGreedy(embedded_gguf_path(), [2], threads=1)
    assert "ngrammys[llama-cpp]" in INSTALL_HINT


@pytest.mark.slow
def test_greedy_decoding_of_the_embedded_gguf_is_repeatable_and_keeps_the_budget(embedded) -> None:
    pytest.importorskip("llama_cpp")
    from service.model.prompts import chat_prompt_ids

    reference = LlamaCppGreedy(embedded_gguf_path(), embedded.tokenizer.all_special_ids, threads=2)
    prompt = chat_prompt_ids(
        embedded.tokenizer, [{"role": "user", "content": "Count from one to twenty."}]
    )
    first = reference.complete(prompt, GenerationParams(max_new_tokens=24))
    # no state kept between calls
    again = reference.complete(prompt, GenerationParams(max_new_tokens=24))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 24
    assert first.finish_reason == "length" and first.seconds > 0
    assert embedded.tokenizer.decode(first.token_ids).strip()  # text, not stray ids
    with pytest.raises(ValueError, match="greedily"):
        reference.complete(
            prompt, GenerationParams(max_new_tokens=4, sampling=SamplingParams(temperature=0.7))
        )
