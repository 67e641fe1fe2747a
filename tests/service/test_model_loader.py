"""Loading the embedded GGUF: converted once, then served from the cache."""

from __future__ import annotations

import pytest
import torch

from service.model_loader import load_model, resolve_dtype


@pytest.mark.slow
def test_gguf_conversion_is_cached_and_reused(tmp_path, embedded) -> None:
    cold = load_model(cache_dir=tmp_path)
    warm = load_model(cache_dir=tmp_path)
    assert (cold.from_cache, warm.from_cache) == (False, True)
    assert warm.load_seconds < cold.load_seconds
    ids = torch.tensor([cold.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        torch.testing.assert_close(cold.model(ids).logits, warm.model(ids).logits)
        # the cache holds the same weights the shared fixture got
        torch.testing.assert_close(warm.model(ids).logits, embedded.model(ids).logits)
    assert warm.tokenizer.encode("hello world") == embedded.tokenizer.encode("hello world")


@pytest.mark.slow
def test_a_local_model_directory_loads_as_is(tmp_path, embedded) -> None:
    directory = tmp_path / "my-model"
    embedded.model.save_pretrained(directory)
    embedded.tokenizer.save_pretrained(directory)
    loaded = load_model(directory)
    assert loaded.name == "my-model" and not loaded.from_cache
    assert loaded.model.config.num_hidden_layers == embedded.model.config.num_hidden_layers


def test_missing_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_model(tmp_path / "absent")


def test_dtype_defaults_follow_the_device() -> None:
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float7", torch.device("cpu"))
