"""A GGUF built straight into the served modules (service/model/gguf_model.py): the weights
transformers' own GGUF loading gives, bit for bit, for a mixed-type file and a tied one; packed
linears and the token embedding from the blocks alone; and a model whose float32 copy would not
fit in memory loads."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from service.bench.random_gguf import ModelShape, write_random_gguf
from service.kernels.gguf_file import GGUFFormatError, read_gguf
from service.kernels.packed_embedding import PackedEmbedding
from service.kernels.packed_linear import PackedLinear, load_kernels
from service.model.loader import load_model
from tests.helpers.kernels import needs_int8
from tests.helpers.models import make_tiny_model
from tests.helpers.packed import (
    MIXED_HIDDEN,
    Q6_K,
    assert_speculation_equals_plain_decoding,
    mixed_type,
    write_tiny_gguf,
)

load_kernels()  # from the source tree's cache, not each test's own cache directory
TIED = ModelShape(256, 512, 3, 4, 2, 300, tied=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """A mixed-type file as llama.cpp's Q4_K_M writes one (q/k permuted, a Q2_K linear the
    kernels do not serve), and a random-weight tied one (no output tensor)."""
    directory = tmp_path_factory.mktemp("gguf")
    mixed = directory / "mixed.gguf"
    model = make_tiny_model(seed=3, hidden_size=MIXED_HIDDEN)
    write_tiny_gguf(model, mixed, loadable=True, linear_type=mixed_type, head_type=Q6_K)
    tied = directory / "tied.gguf"
    write_random_gguf(tied, TIED, "Q4_K_M")
    return {"mixed": mixed, "tied": tied}


def transformers_weights(path) -> dict[str, torch.Tensor]:
    """The state of the model transformers' own GGUF loading makes of `path` (in float32)."""
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.state_dict()


@pytest.mark.parametrize("name", ["mixed", "tied"])
def test_a_gguf_is_built_with_the_weights_transformers_loads(files, tmp_path, name) -> None:
    model = load_model(files[name], cache_dir=tmp_path, quantization="none", dtype="float32").model
    want = transformers_weights(files[name])
    got = model.state_dict()
    assert set(got) == set(want)
    for key, weight in want.items():
        assert torch.equal(got[key], weight), key
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "tied")


@pytest.mark.parametrize("name", ["mixed", "tied"])
def test_packed_linears_come_from_the_blocks_and_the_rest_from_its_tensor(
    files, tmp_path, name
) -> None:
    """No parameter is left unloaded, and every weight served, packed or not, is the one
    transformers dequantizes."""
    model = load_model(files[name], cache_dir=tmp_path).model
    want = transformers_weights(files[name])
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert "lm_head" in packed and len(packed) >= 7 * model.config.num_hidden_layers - 1
    for module_name, module in packed.items():
        assert torch.equal(module.dequantized(), want[f"{module_name}.weight"]), module_name
    for key, weight in model.state_dict().items():
        if key in want:
            assert torch.equal(weight, want[key]), key
    embedding = model.get_input_embeddings()
    table = embedding.dequantized() if name == "tied" else embedding.weight
    assert torch.equal(table, want["model.embed_tokens.weight"])


@pytest.mark.parametrize("quantization", ["gguf", pytest.param("gguf-int8", marks=needs_int8)])
def test_the_token_embedding_stays_the_files_blocks(files, tmp_path, quantization) -> None:
    """No float32 table, and no copy: a tied embedding (Q6_K here, as llama.cpp's Q4_K_M writes
    it) and an untied one are rows of the file's own blocks, dequantized as transformers does,
    on either activation path; an F32 one stays a table."""
    tied = load_model(files["tied"], cache_dir=tmp_path, quantization=quantization).model
    untied = tmp_path / "untied.Q4_0.gguf"
    write_random_gguf(untied, ModelShape(256, 512, 2, 4, 2, 300, tied=False), "Q4_0")
    model = load_model(untied, cache_dir=tmp_path, quantization=quantization).model
    for served, path, kind in ((tied, files["tied"], "Q6_K"), (model, untied, "Q4_0")):
        embedding = served.get_input_embeddings()
        assert isinstance(embedding, PackedEmbedding) and embedding.kind == kind
        held = sum(b.numel() * b.element_size() for b in embedding.buffers())
        assert held * embedding.num_embeddings <= path.stat().st_size  # one row's bytes
        want = transformers_weights(path)["model.embed_tokens.weight"]
        assert torch.equal(embedding.dequantized(), want)
        ids = torch.tensor([[3, 0, 255], [7, 7, 1]])
        assert torch.equal(embedding(ids), want[ids])
    mixed = load_model(files["mixed"], cache_dir=tmp_path).model
    assert type(mixed.get_input_embeddings()) is torch.nn.Embedding


def test_speculation_with_a_packed_embedding_equals_plain_decoding(files, tmp_path) -> None:
    assert_speculation_equals_plain_decoding(load_model(files["tied"], cache_dir=tmp_path).model)


def test_a_synthetic_file_serves_chat_prompts(files, tmp_path) -> None:
    """`ngrammys synth` files carry a chat template, so the benchmarks' chat prompts (`speed`,
    `bench`) can be built for them (the stand-in tokenizer keeps lowercase letters alone)."""
    from service.model.prompts import chat_prompt_ids

    loaded = load_model(files["tied"], cache_dir=tmp_path)
    ids = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": "Say hi"}])
    text = loaded.tokenizer.decode(ids)
    assert text == "userayhiassistant"


def test_the_tensor_reader_refuses_what_is_not_a_whole_gguf(files, tmp_path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        read_gguf(text)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["mixed"].read_bytes()[:-1000])
    with pytest.raises(GGUFFormatError, match="does not fit the file"):
        read_gguf(cut)


def test_the_tensor_reader_keeps_the_headers_numbers_as_gguf_py_reads_them(files) -> None:
    import gguf

    contents = read_gguf(files["mixed"])
    reader = gguf.GGUFReader(files["mixed"])
    want = {
        key: field.contents()
        for key, field in reader.fields.items()
        if len(field.types) == 1
        and field.types[0] != gguf.GGUFValueType.STRING
        and not key.startswith("GGUF.")  # the header's own counts, not metadata
    }
    assert contents.numbers == want and len(want) >= 6
    assert contents.number("context_length") == 512 and contents.architecture == "llama"


# the float32 model of this shape (280M weights, 1.1 GB) does not fit the limit; its packed one
# does (~0.75 bytes a weight, with the kernels' scratch buffers ~350 MB)
LARGE = ModelShape(1024, 4096, 16, 8, 8, 4096, tied=False)
LIMIT_MB = 700
LOAD_UNDER_A_LIMIT = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from service.kernels.packed_linear import load_kernels
    from service.model.loader import load_model

    load_kernels()  # compiled kernels from the source tree's cache, as the tests load them
    status = Path("/proc/self/status").read_text().split("\\n")
    data = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    limit = data + int(sys.argv[3]) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:
        # float32 on every path (none would take bfloat16 on a CPU with native bf16)
        load_model(
            Path(sys.argv[1]), dtype="float32", cache_dir=Path(sys.argv[2]),
            quantization=sys.argv[4],
        )
    except (MemoryError, RuntimeError) as error:
        print("failed:", type(error).__name__, str(error)[:200])
    else:
        print("loaded")
    """
)


@pytest.mark.slow
def test_a_model_whose_float32_copy_would_not_fit_in_memory_loads(tmp_path) -> None:
    """Under a memory limit below its float32 size, the packed model loads; the float32 one
    (`--quantization none`) does not, so the limit is one that binds."""
    path = tmp_path / "large.Q4_0.gguf"
    write_random_gguf(path, LARGE, "Q4_0")

    def load(quantization: str) -> str:
        """ "loaded", or how the load failed: an allocation error it caught, or a crash (an
        extension may die by a signal when an allocation fails)."""
        run = subprocess.run(
            [sys.executable, "-c", LOAD_UNDER_A_LIMIT, str(path), str(tmp_path / "cache")]
            + [str(LIMIT_MB), quantization],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if run.returncode != 0:
            return f"failed: exit {run.returncode}: {run.stderr[-2000:]}"
        return run.stdout.strip().splitlines()[-1]

    assert load("gguf") == "loaded"
    assert load("none") != "loaded"
