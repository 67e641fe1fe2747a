"""Fixtures of the service tests beyond the tiny model's (tests/conftest.py)."""

from __future__ import annotations

import pytest

from service.kernels.packed_linear import pack_gguf_linears
from tests.helpers.packed import tiny_gguf_twins


@pytest.fixture(scope="module")
def tiny_packed(tmp_path_factory):
    """The tiny Llama with Q4_1 weights, as float32 and with its linears packed."""
    plain, packed, path = tiny_gguf_twins(tmp_path_factory.mktemp("gguf"))
    tiles_file = path.with_suffix(".npz")
    assert (
        pack_gguf_linears(packed, path, tiles_file=tiles_file) == 15
    )  # 2 layers x 7, and the LM head
    return plain, packed, path, tiles_file


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory):
    """The tiny Llama with Q4_1 weights, as float32 and packed with 8-bit activations
    (`gguf-int8`)."""
    plain, packed, path = tiny_gguf_twins(tmp_path_factory.mktemp("gguf"))
    assert pack_gguf_linears(packed, path, int8_activations=True) == 15
    return plain, packed, path
