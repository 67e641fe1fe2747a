"""Measure what a forward pass costs on this device: T(tree size n, context length L).

Each context length gets a real cache (a random prompt prefilled); then passes of n tokens
are timed on top of it and rolled back (committing nothing), so L stays fixed. The logits are
read back so GPU timings include the work. The profile is saved per (device, model, dtype) and
reused on later starts.

The controller trades tokens against the *ratio* T(n)/T(1), so the ratio must survive a busy
machine: each repeat times every tree size in turn (a slow spell hits all sizes alike, not one),
medians are taken per size, and a larger tree is never recorded as cheaper than a smaller one
(a dip is noise or a kernel quirk the controller should not bet on).
"""

from __future__ import annotations

import itertools
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from service.model_runner import ModelRunner
from service.model_tables import model_fingerprint
from service.regime import CostProfile
from service.kv_cache import TreeKVCache
from service.tree import TokenTree, chain_tree

log = logging.getLogger(__name__)

TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_LENGTHS = (32, 256, 1024)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def measure_profile(
    runner: ModelRunner,
    tree_sizes: Sequence[int] = TREE_SIZES,
    context_lengths: Sequence[int] = CONTEXT_LENGTHS,
    repeats: int = 7,
) -> CostProfile:
    """Time passes over the grid; returns the medians, non-decreasing in n."""
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for length in context_lengths:
        cache = runner.new_cache()
        prompt = torch.randint(runner.vocab_size, (length,), generator=generator).tolist()
        runner.forward(cache, [chain_tree(prompt)], logits=False)
        cache.commit(0, range(length))
        trees = [chain_tree(torch.randint(runner.vocab_size, (n,), generator=generator).tolist()) for n in tree_sizes]
        for tree in trees:  # warm-up
            _timed_pass(runner, cache, tree)
        samples: list[list[float]] = [[] for _ in trees]
        for _ in range(repeats):
            for index, tree in enumerate(trees):
                samples[index].append(_timed_pass(runner, cache, tree))
        row = list(itertools.accumulate((statistics.median(s) for s in samples), max))
        seconds.append(row)
        log.info("profiled L=%d: %s", length, " ".join(f"n{n}={s * 1e3:.1f}ms" for n, s in zip(tree_sizes, row)))
    return CostProfile(
        list(tree_sizes), list(context_lengths), seconds,
        device=device_name(runner.device), model=model_fingerprint(runner.model), dtype=str(runner.dtype),
    )


def _timed_pass(runner: ModelRunner, cache: TreeKVCache, tree: TokenTree) -> float:
    started = time.perf_counter()
    logits = runner.forward(cache, [tree])
    assert logits is not None
    float(logits[0, -1, 0])  # wait for the device
    elapsed = time.perf_counter() - started
    cache.commit(0, [])  # roll back: the context length stays fixed
    return elapsed


def profile_path(cache_dir: Path, runner: ModelRunner) -> Path:
    name = f"{device_name(runner.device)}-{model_fingerprint(runner.model)}-{runner.dtype}"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return cache_dir / "profiles" / f"{safe}.json"


def load_or_measure(
    runner: ModelRunner,
    cache_dir: Path,
    remeasure: bool = False,
    tree_sizes: Sequence[int] = TREE_SIZES,
    context_lengths: Sequence[int] = CONTEXT_LENGTHS,
) -> CostProfile:
    """The saved profile for this device/model/dtype, measuring (and saving) it if absent."""
    path = profile_path(cache_dir, runner)
    if path.exists() and not remeasure:
        return CostProfile.load(path)
    log.info("measuring forward-pass costs (saved to %s)", path)
    profile = measure_profile(runner, tree_sizes, context_lengths)
    profile.save(path)
    return profile
