"""Freed host memory handed back to the system, so a server's resident memory stays near its
model and KV cache (glibc's malloc; elsewhere nothing changes).

glibc serves an allocation above its mmap threshold with a mapping of its own, unmapped on
free, and smaller ones from its heaps, which keep what is freed. The threshold starts at
128 KiB but rises to the size of each mapped block freed (up to 32 MiB), and the heap's trim
threshold with it: so once a prompt chunk's activations (8 MiB at a 2,048-wide model and 256
tokens) have been freed, later ones are carved from the heap and stay resident after the pass,
a quarter of a gigabyte for a 1B model (docs/benchmarks.md, "Loading a GGUF, and its memory").
A fixed threshold keeps them mapped and unmapped with each pass, at the cost of faulting their
pages in again: a few milliseconds a chunk against a pass of a second.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 4 << 20  # blocks this large or larger are mapped of their own
# what an operator sets instead (glibc reads these at start); then their choice stands
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def hand_back_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at `THRESHOLD_BYTES` for this process (once);
    whether they were set (False: not glibc, or set by the environment)."""
    if any(name in os.environ for name in ENVIRONMENT):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc (musl, macOS)
        return False
    done = all(mallopt(option, THRESHOLD_BYTES) for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    log.debug("glibc's mmap and trim thresholds fixed at %d bytes: %s", THRESHOLD_BYTES, done)
    return done
