"""Derive the unigram and bigram tables from the model itself, and cache them on disk.

Bigram: for every vocabulary token x, the model's top-K next tokens given x alone, found by
running all V single-token inputs through the model in batches. "Alone" means after a fixed
neutral prefix (the tokens that open an assistant turn): a token at position 0 is an
attention sink and the model then predicts little but punctuation. The prefix's KV cache is
computed once and shared by every batch, so each input still costs one token. Unigram: the
tokens with the highest next-token probability averaged over those same V inputs — the
model's preference with no real context. One pass over the vocabulary yields both; on a CPU
that takes minutes (it grows with the square of the vocabulary: a 262k-token one's take many
times a 49k-token one's), so it runs in the background at start, in id order (a vocabulary's
ids run from its commonest tokens), and the table strategies draft from the rows done so far,
given to them each time their count doubles. A batch is bounded by its logits' size, so a large
vocabulary's batches are smaller. The result is a few MB ([V, K] uint32) saved under the cache
directory, keyed by a fingerprint of the weights; a saved file that cannot be read back whole,
or whose arrays are not tables, is computed again (service/cache_files.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from drafting import ModelTables
from service.cache_files import CorruptCacheFile, read_cached, write_atomically

log = logging.getLogger(__name__)
T = TypeVar("T")

BIGRAM_TOP_K = 8
UNIGRAM_SIZE = 64
LOGITS_PER_BATCH = 1 << 23  # a batch's [B, vocab] float32 logits: 32 MiB at most
FIRST_PUBLISHED_ROWS = 1024  # the partial tables given to the strategies first, then doubling
_computing = threading.Lock()  # one computation at a time; later callers then find the file


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hash of the weights: names, shapes and a sample of every tensor's values."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        sample = tensor.detach().flatten()[:256].float().cpu().numpy().tobytes()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample)
    return digest.hexdigest()[:16]


def compute_tables(
    model: PreTrainedModel,
    prefix_ids: Sequence[int] = (),
    batch_size: int = 512,
    show_progress: bool = True,
) -> ModelTables:
    """Run every token after `prefix_ids` through `model`; keep top-K next tokens and the mean."""
    return run_to_end(compute_tables_steps(model, prefix_ids, batch_size, show_progress))


def compute_tables_steps(
    model: PreTrainedModel,
    prefix_ids: Sequence[int] = (),
    batch_size: int = 512,
    show_progress: bool = True,
) -> Generator[ModelTables | None, None, ModelTables]:
    """`compute_tables` one batch (of at most `batch_size` tokens, fewer for a large
    vocabulary: `LOGITS_PER_BATCH`) per increment (the engine runs them between steps). An
    increment yields the tables of the rows done so far each time their count has doubled
    since the last it yielded (from `FIRST_PUBLISHED_ROWS`), else None."""
    vocab = model.config.vocab_size
    batch_size = max(1, min(batch_size, LOGITS_PER_BATCH // vocab))
    bigram = np.zeros((vocab, BIGRAM_TOP_K), dtype=np.uint32)  # [vocab, K]
    mean_probs = torch.zeros(vocab, dtype=torch.float64, device=model.device)  # [vocab]
    with torch.inference_mode():
        prefix = _prefix_cache(model, prefix_ids)
    batches = range(0, vocab, batch_size)
    publish_at = FIRST_PUBLISHED_ROWS
    for start in tqdm(batches, desc="bigram table", unit="batch", disable=not show_progress):
        with torch.inference_mode():
            # [B, 1]
            ids = torch.arange(start, min(start + batch_size, vocab), device=model.device)[:, None]
            logits = _next_token_logits(model, ids, prefix, len(prefix_ids))  # [B, vocab]
            bigram[start : start + len(ids)] = (
                logits.topk(BIGRAM_TOP_K, dim=-1).indices.cpu().numpy()
            )
            mean_probs += logits.softmax(dim=-1).sum(dim=0, dtype=torch.float64)
        done = start + len(ids)
        if publish_at <= done < vocab:
            publish_at = 2 * done
            yield ModelTables(unigram=_unigram(mean_probs), bigram=bigram[:done])
        else:
            yield None
    return ModelTables(unigram=_unigram(mean_probs), bigram=bigram)


def _unigram(mean_probs: torch.Tensor) -> np.ndarray:
    """The tokens of the highest summed probability, most likely first."""
    top = min(UNIGRAM_SIZE, len(mean_probs))
    return mean_probs.topk(top).indices.cpu().numpy().astype(np.uint32)


def run_to_end(steps: Generator[object, None, T]) -> T:
    """Run an incremental computation at once; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _prefix_cache(
    model: PreTrainedModel, prefix_ids: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [1, kv_heads, len(prefix), head_dim] of the prefix."""
    if not prefix_ids:
        return []
    cache = model(
        torch.tensor([list(prefix_ids)], device=model.device), use_cache=True
    ).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def _next_token_logits(
    model: PreTrainedModel,
    ids: torch.Tensor,
    prefix: list[tuple[torch.Tensor, torch.Tensor]],
    position: int,
) -> torch.Tensor:
    """Logits [B, vocab] after prefix + each id of `ids` [B, 1]."""
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(prefix):
        cache.update(keys.expand(len(ids), -1, -1, -1), values.expand(len(ids), -1, -1, -1), layer)
    positions = torch.full_like(ids, position)
    output = model(
        ids,
        position_ids=positions,
        past_key_values=cache if prefix else None,
        use_cache=bool(prefix),
    )
    return output.logits[:, -1].float()


def load_or_compute_tables(
    model: PreTrainedModel,
    cache_dir: Path,
    prefix_ids: Sequence[int] = (),
    show_progress: bool = True,
) -> ModelTables:
    """Tables from `cache_dir/tables/<fingerprint>.npz`, computing and saving them if absent."""
    with _computing:
        return run_to_end(
            load_or_compute_tables_steps(model, cache_dir, prefix_ids, show_progress=show_progress)
        )


def load_or_compute_tables_steps(
    model: PreTrainedModel,
    cache_dir: Path,
    prefix_ids: Sequence[int] = (),
    batch_size: int = 512,
    show_progress: bool = True,
) -> Generator[ModelTables | None, None, ModelTables]:
    """`load_or_compute_tables` in increments of one batch (yielding as `compute_tables_steps`
    does)."""
    path = tables_path(model, cache_dir, prefix_ids)
    cached = saved_tables(path)
    if cached is not None:
        return cached
    log.info("computing the model's unigram/bigram tables (cached at %s)", path)
    tables = yield from compute_tables_steps(model, prefix_ids, batch_size, show_progress)
    save_tables(path, tables)
    return tables


def tables_path(model: PreTrainedModel, cache_dir: Path, prefix_ids: Sequence[int] = ()) -> Path:
    """Where `model`'s tables (after `prefix_ids`) are saved: keyed by its weights' fingerprint."""
    key = hashlib.sha256(f"{model_fingerprint(model)}{list(prefix_ids)}".encode()).hexdigest()[:16]
    return cache_dir / "tables" / f"{key}.npz"


def saved_tables(path: Path) -> ModelTables | None:
    """The tables saved at `path` (`tables_path`), or None if none are or they cannot be read
    back whole (a warning; they are computed again)."""
    return read_cached(path, _read_tables, "model tables")


def save_tables(path: Path, tables: ModelTables) -> None:
    """Save `tables` at `path`, written aside and renamed: a crash never leaves half a file."""
    write_atomically(
        path, lambda file: np.savez(file, unigram=tables.unigram, bigram=tables.bigram)
    )


def _read_tables(path: Path) -> ModelTables:
    """The tables in the npz at `path` (zip checks every array's CRC-32 as it is read), or
    `CorruptCacheFile` if its arrays are not tables: uint32 token ids below the vocabulary
    size, a [V, BIGRAM_TOP_K] bigram and a unigram of min(UNIGRAM_SIZE, V)."""
    with np.load(path) as saved:
        unigram, bigram = saved["unigram"], saved["bigram"]
    vocab = bigram.shape[0] if bigram.ndim == 2 else 0
    if (
        vocab == 0
        or unigram.dtype != np.uint32
        or bigram.dtype != np.uint32
        or bigram.shape != (vocab, BIGRAM_TOP_K)
        or unigram.shape != (min(UNIGRAM_SIZE, vocab),)
        or max(int(unigram.max()), int(bigram.max())) >= vocab
    ):
        raise CorruptCacheFile(
            f"{path} holds no tables: unigram {unigram.dtype}{list(unigram.shape)}, "
            f"bigram {bigram.dtype}{list(bigram.shape)}"
        )
    return ModelTables(unigram=unigram, bigram=bigram)
