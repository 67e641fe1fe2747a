"""Freed host memory goes back to the system: a block that glibc's default (its threshold raised
by an earlier free) would keep in its heap is unmapped when freed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# In a fresh process: a 16 MiB block allocated and freed twice (the first free raises glibc's
# default thresholds, so the second block comes from the heap), then how much of it stayed.
SCRIPT = """
import sys
import numpy as np
from service.model.freed_memory import hand_back_freed_memory

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])

if sys.argv[1] == "fixed":
    assert hand_back_freed_memory()
before = anon_kib()
for _ in range(2):
    block = np.ones(16 << 20, np.uint8)
    del block
print(anon_kib() - before)
"""


def kept_kib(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])  # the repository
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, check=True
    )
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's /proc/self/status")
def test_a_freed_block_leaves_the_resident_memory() -> None:
    assert kept_kib("default") > 8 << 10  # glibc's own: the second block stays in the heap
    assert kept_kib("fixed") < 2 << 10


def test_an_operators_malloc_settings_stand(monkeypatch) -> None:
    from service.model import freed_memory

    freed_memory.hand_back_freed_memory.cache_clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    try:
        assert not freed_memory.hand_back_freed_memory()
    finally:
        freed_memory.hand_back_freed_memory.cache_clear()
