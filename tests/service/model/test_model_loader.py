"""Loading a model: the embedded GGUF (its header cached once), a directory, random weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig

import service.model.loader as model_loader
from service.kernels.gguf_file import GGUFContents
from service.model.loader import (
    UnsupportedModel,
    check_supported,
    cpu_has_native_bf16,
    load_model,
    random_model,
    resolve_dtype,
    resolve_quantization,
)


@pytest.mark.slow
def test_the_gguf_header_is_cached_and_reused(tmp_path, embedded) -> None:
    cold = load_model(cache_dir=tmp_path, quantization="none", dtype="float32")
    warm = load_model(cache_dir=tmp_path, quantization="none", dtype="float32")
    assert (cold.from_cache, warm.from_cache) == (False, True)
    assert warm.load_seconds < cold.load_seconds
    ids = torch.tensor([cold.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        torch.testing.assert_close(cold.model(ids).logits, warm.model(ids).logits)
        # the same weights the shared fixture got
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


def test_random_weights_build_the_configured_architecture(tmp_path) -> None:
    LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json"):
        model = random_model(source, device="cpu", dtype="bfloat16")
        assert (model.config.num_hidden_layers, model.config.vocab_size) == (3, 96)
        assert model.dtype == torch.bfloat16 and model.device.type == "cpu" and not model.training
        assert model.get_output_embeddings().weight.std() > 0  # initialised, not left empty
    with pytest.raises(OSError):
        random_model(tmp_path / "absent")


def test_dtype_defaults_follow_the_device(monkeypatch) -> None:
    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype(None, torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float7", torch.device("cpu"))


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert not cpu_has_native_bf16(cpuinfo)
    for flag in ("avx512_bf16", "amx_bf16"):
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu avx2 avx512f {flag}\n")
        assert cpu_has_native_bf16(cpuinfo)
    assert not cpu_has_native_bf16(tmp_path / "absent")


def test_quantization_auto_picks_the_packed_path_only_where_it_pays(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_quantization("none", True, cpu, None) == "none"
    assert resolve_quantization("gguf", True, cpu, None) == "gguf"
    expected = "gguf" if importlib.util.find_spec("numba") else "none"
    assert resolve_quantization("auto", True, cpu, None) == expected
    assert resolve_quantization("auto", True, cpu, "float32") == expected
    assert resolve_quantization("auto", True, cpu, "bfloat16") == "none"
    assert resolve_quantization("auto", False, cpu, None) == "none"  # a model directory
    assert resolve_quantization("auto", True, cuda, None) == "none"
    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_quantization("auto", True, cpu, None) == expected  # faster than bf16 there too
    assert resolve_quantization("auto", True, cpu, "bfloat16") == "none"
    assert (
        resolve_quantization("auto", False, cpu, None) == "none"
    )  # a model directory: bf16 by capability
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quantization("int3", True, cpu, None)


def test_quantization_auto_serves_a_gguf_of_an_unpacked_family_unpacked(
    tmp_path, monkeypatch
) -> None:
    """A GGUF of an architecture the packed path does not take (a Llama one here, with the
    Llama family taken off the list) serves with --quantization none, not a refusal."""
    from service.bench.random_gguf import ModelShape, write_random_gguf
    from service.kernels.packed_linear import PackedLinear

    path = tmp_path / "tiny.gguf"
    write_random_gguf(path, ModelShape(64, 128, 2, 4, 2, 300, tied=False), "Q4_0")
    monkeypatch.setattr(model_loader, "PACKED_MODEL_TYPES", ("qwen2",))
    loaded = load_model(path, cache_dir=tmp_path, dtype="float32")
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    assert loaded.quantization == "none"  # what the benchmarks label it with
    monkeypatch.setattr(model_loader, "PACKED_MODEL_TYPES", ("llama",))
    assert load_model(path, cache_dir=tmp_path).quantization == "gguf"


def test_quantization_gguf_needs_a_gguf_model(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(tmp_path, quantization="gguf")


def _tiny(config_class, **fields):
    return config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **fields,
    )


def test_a_sliding_window_model_is_refused_at_load(tmp_path) -> None:
    """Starcoder2's windows (transformers' own layers, every one windowed): not applied."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    directory = tmp_path / "windowed"
    config = _tiny(Starcoder2Config, sliding_window=16, bos_token_id=0, eos_token_id=1)
    Starcoder2ForCausalLM(config).save_pretrained(directory)
    with pytest.raises(UnsupportedModel, match=r"sliding-window.*\(16 tokens\).*\(512\)"):
        load_model(directory)


def _header_only_gguf(path, architecture: str, numbers: dict[str, float]) -> None:
    """A GGUF of `architecture` with a header only: a 32,768 context and `numbers` (llama.cpp's
    keys after the architecture's name, as float32)."""
    import gguf

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(32768)
    for key, value in numbers.items():
        writer.add_float32(f"{architecture}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_windowed_gguf_is_refused_before_any_conversion(tmp_path) -> None:
    """Its header says so (a Starcoder2 window of 512 in a context of 32,768, which its layers
    do not apply): refused before the config and tokenizer are read (here there are none to
    read)."""
    path = tmp_path / "windowed.gguf"
    _header_only_gguf(path, "starcoder2", {"attention.sliding_window": 512})
    with pytest.raises(UnsupportedModel, match=r"starcoder2 .*sliding-window.*\(512 tokens\)"):
        load_model(path, cache_dir=tmp_path)
    assert not (tmp_path / "gguf").exists()


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capped_logits_are_refused_but_gemma_2s(field: str, tmp_path) -> None:
    """The passes cap Gemma 2's attention scores and output logits (its layers, its config's
    caps); a cap on another model (here a Gemma 3 given one) is refused, from its config or
    from its GGUF header before any conversion."""
    from transformers import Gemma2Config, Gemma3TextConfig

    check_supported(_tiny(Gemma2Config, sliding_window=16, **{field: 30.0}))
    with pytest.raises(UnsupportedModel, match=f"gemma3_text .*{field}.*gemma2"):
        check_supported(_tiny(Gemma3TextConfig, sliding_window=16, **{field: 30.0}))
    path = tmp_path / "capped.gguf"
    _header_only_gguf(path, "gemma3", {field: 30.0})
    with pytest.raises(UnsupportedModel, match=f"gemma3 .*{field}"):
        load_model(path, cache_dir=tmp_path)
    assert not (tmp_path / "gguf").exists()


@pytest.mark.parametrize(
    "config_name,fields,refused",
    [
        ("MistralConfig", {"sliding_window": 16}, False),  # a window inside the context: applied
        ("MistralConfig", {"sliding_window": 512}, False),  # a window as long as the context: none
        ("MistralConfig", {"sliding_window": None}, False),  # no window
        ("Qwen2Config", {"sliding_window": 16, "use_sliding_window": False}, False),  # switched off
        (
            "Qwen2Config",
            {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0},
            False,  # applied
        ),
        ("Gemma3TextConfig", {"sliding_window": 16}, False),  # local layers: applied
        ("Gemma2Config", {"sliding_window": 16}, False),  # every other layer, capped: applied
        ("Starcoder2Config", {"sliding_window": 16}, True),  # every layer, not applied
        ("LlamaConfig", {}, False),  # dense attention only
    ],
)
def test_only_windows_the_context_can_outgrow_are_refused(
    config_name: str, fields, refused: bool
) -> None:
    import transformers

    config = _tiny(getattr(transformers, config_name), **fields)
    if refused:
        with pytest.raises(UnsupportedModel):
            check_supported(config)
    else:
        check_supported(config)


@pytest.mark.parametrize(
    "architecture,layers,scalar",
    [
        ("gemma2", 46, 4608 // 32),
        ("gemma2", 42, 128),
        ("gemma3", 62, 4608 // 32),
        ("gemma3", 26, 128),
    ],
)
def test_a_gemma_ggufs_attention_scale_is_llama_cpps(architecture, layers, scalar) -> None:
    """A Gemma GGUF has no key for its attention scale: a 27B model (46 layers for Gemma 2, 62
    for Gemma 3) scales by 1/sqrt(hidden / heads), every other size by 1/sqrt(head size), as
    llama.cpp derives it; transformers' mapping would leave the class's 256."""
    numbers = {"block_count": layers, "embedding_length": 4608, "attention.head_count": 32}
    numbers |= {"attention.key_length": 128}
    contents = GGUFContents(
        Path("model.gguf"), architecture, {}, {f"{architecture}.{k}": v for k, v in numbers.items()}
    )
    config = Gemma2Config()
    assert config.query_pre_attn_scalar == 256
    model_loader._take_attention_scale(config, contents)
    assert config.query_pre_attn_scalar == scalar
    llama = LlamaConfig()
    model_loader._take_attention_scale(llama, GGUFContents(Path("m.gguf"), "llama", {}, {}))
    assert not hasattr(llama, "query_pre_attn_scalar")
