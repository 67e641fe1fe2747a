"""Shared fixtures: a tiny random Llama (fast, no download) and the embedded model (slow)."""

from __future__ import annotations

import os

import pytest
from transformers import LlamaForCausalLM

from drafting import ContextNgram, TableSlot, default_mixer
from service.engine.engine import Engine
from service.model.runner import ModelRunner
from service.model.tables import compute_tables
from service.model_drafts.draft_model import ModelDrafter
from service.model_drafts.self_draft import first_layers
from tests.helpers.models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return make_tiny_model()


@pytest.fixture(scope="session")
def tiny_runner(tiny_model: LlamaForCausalLM) -> ModelRunner:
    return ModelRunner(tiny_model)


@pytest.fixture(scope="session")
def tiny_tables(tiny_model: LlamaForCausalLM) -> TableSlot:
    return TableSlot(compute_tables(tiny_model, batch_size=16, show_progress=False))


@pytest.fixture(scope="session")
def tiny_drafters(tiny_model: LlamaForCausalLM) -> list[ModelDrafter]:
    """Model-running drafts: the tiny model's first layer (drafting in the target's KV rows),
    and another random (1-layer) model with the same vocabulary as a separate draft model
    (rows of its own); each also staged."""
    shallow, other = first_layers(tiny_model, 1), make_tiny_model(seed=1, num_layers=1)
    return [
        ModelDrafter(shallow, "self_draft", shares_target_cache=True),
        ModelDrafter(other, "draft_model"),
        ModelDrafter(
            shallow, "self_draft_staged", lookahead=ContextNgram(), shares_target_cache=True
        ),
        ModelDrafter(other, "draft_model_staged", lookahead=ContextNgram()),
    ]


@pytest.fixture
def tiny_engine(
    tiny_runner: ModelRunner, tiny_tables: TableSlot, tiny_drafters: list[ModelDrafter]
) -> Engine:
    # EOS is not a stop here, so runs go the full length and compare more tokens.
    return Engine(
        tiny_runner, default_mixer(tiny_tables, tiny_drafters), eos_token_ids=[], max_context=512
    )


@pytest.fixture(scope="session")
def embedded():
    """The real embedded SmolLM2 with float32 weights (converted once into the user cache, then
    reused), whatever the CPU: a CPU with native bf16 would otherwise get bf16 by capability,
    whose rounding makes the exact comparisons of these tests part at near-ties.
    tests/service/kernels/test_packed_linear.py loads the packed (`--quantization gguf`) one and
    tests/service/engine/test_embedded_lossless.py the bf16 one."""
    from service.model.loader import load_model

    return load_model(quantization="none", dtype="float32")


@pytest.fixture(scope="session")
def tiny_served(embedded):
    """The tiny random Llama behind the embedded model's tokenizer (and vocabulary size): a
    model an HTTP server can load in milliseconds and generate with at hundreds of tokens per
    second, for tests of the edge rather than of the text."""
    from service.model.loader import LoadedModel

    model = make_tiny_model(vocab_size=embedded.model.config.vocab_size)
    return LoadedModel(model, embedded.tokenizer, "tiny-random-llama", 0.0, False)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true", help="tests/stress at full size (as NGRAMMYS_STRESS_FULL=1)"
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--full"):
        os.environ["NGRAMMYS_STRESS_FULL"] = "1"


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session (tests/helpers/postgres.py); each test that needs a
    store takes a database of its own (`postgres.new_database()`)."""
    from tests.helpers.postgres import postgres_server

    with postgres_server() as server:
        yield server
