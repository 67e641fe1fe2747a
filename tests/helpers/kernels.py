"""The numba kernels in tests: a test skips only where numba is not installed. Where it is, the
kernels failing to load fails the tests, since the server would then run the slow fallback."""

from __future__ import annotations

import importlib.util

import pytest

NUMBA_INSTALLED = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not NUMBA_INSTALLED, reason="numba is not installed")
