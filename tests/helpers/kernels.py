"""The numba kernels in tests: a test skips only where numba is not installed. Where it is, the
kernels failing to load fails the tests, since the server would then run the slow fallback.
The 8-bit kernels' tests skip only on a CPU with neither of their instruction sets."""

from __future__ import annotations

import importlib.util

import pytest

NUMBA_INSTALLED = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not NUMBA_INSTALLED, reason="numba is not installed")


def _int8_supported() -> bool:
    if not NUMBA_INSTALLED:  # (the kernels' module imports numba)
        return False
    from service.kernels.int8_kernel import int8_supported

    return int8_supported()


INT8_MISSING = "the CPU has neither AVX2 nor AVX-512 VNNI"
needs_int8 = pytest.mark.skipif(not _int8_supported(), reason=INT8_MISSING)
