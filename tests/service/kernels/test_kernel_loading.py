"""The numba kernels load where numba is installed, and a failure to load them is loud."""

from __future__ import annotations

import logging
import sys

import pytest

import service.kernels
from service.kernels import packed_linear
from service.kernels.packed_linear import kernels_error, load_kernels
from tests.helpers.kernels import needs_numba


@needs_numba
def test_the_kernels_load_where_numba_is_installed() -> None:
    assert load_kernels() is not None, (
        f"numba is installed but its kernels failed to load: {kernels_error()}"
    )
    assert kernels_error() is None


def test_a_kernel_module_that_fails_to_import_is_logged_as_an_error_and_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("_kernels", "_layer_kernels", "_kernels_error"):  # as before any load
        monkeypatch.setattr(packed_linear, name, None)
    monkeypatch.delattr(service.kernels, "packed_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "service.kernels.packed_kernels", None)  # importing it raises
    with caplog.at_level(logging.ERROR, logger=packed_linear.__name__):
        assert load_kernels() is None
    assert kernels_error() is not None and kernels_error().startswith(
        ("ImportError", "ModuleNotFoundError")
    )
    assert any(r.levelno == logging.ERROR and "fallback" in r.getMessage() for r in caplog.records)
    assert load_kernels() is None  # not tried again: the server reports the first failure
