"""Model-derived tables: what a single-token forward says, cached by weight fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.model import tables as model_tables
from service.model.tables import (
    compute_tables,
    compute_tables_steps,
    load_or_compute_tables,
    model_fingerprint,
)
from tests.helpers.models import TINY_VOCAB, make_tiny_model


@pytest.mark.parametrize("prefix", [[], [0], [0, 7, 3]])
def test_bigram_rows_are_the_top_successors_of_each_token_alone(tiny_model, prefix) -> None:
    tables = compute_tables(tiny_model, prefix, batch_size=7, show_progress=False)  # uneven batches
    assert tables.bigram.shape == (TINY_VOCAB, 8) and tables.bigram.dtype == np.uint32
    with torch.inference_mode():
        for token in (0, 13, TINY_VOCAB - 1):
            logits = tiny_model(torch.tensor([prefix + [token]])).logits[0, -1]
            assert tables.bigram[token].tolist() == logits.topk(8).indices.tolist()


def test_unigram_is_the_mean_next_token_distribution(tiny_model) -> None:
    tables = compute_tables(tiny_model, show_progress=False)
    with torch.inference_mode():
        every_token = torch.arange(TINY_VOCAB)[:, None]
        mean = tiny_model(every_token).logits[:, -1].softmax(-1).mean(0)
    assert tables.unigram[:5].tolist() == mean.topk(5).indices.tolist()


def test_tables_are_cached_per_model(tmp_path, tiny_model) -> None:
    first = load_or_compute_tables(tiny_model, tmp_path, [0], show_progress=False)
    assert len(list((tmp_path / "tables").iterdir())) == 1
    again = load_or_compute_tables(tiny_model, tmp_path, [0], show_progress=False)
    assert np.array_equal(first.bigram, again.bigram) and np.array_equal(
        first.unigram, again.unigram
    )
    load_or_compute_tables(tiny_model, tmp_path, [0, 5], show_progress=False)  # another prefix
    assert len(list((tmp_path / "tables").iterdir())) == 2
    other = make_tiny_model(seed=9)
    assert model_fingerprint(other) != model_fingerprint(tiny_model)


def test_the_rows_done_are_yielded_as_their_count_doubles(tiny_model, monkeypatch) -> None:
    """A large vocabulary's tables take many minutes: the strategies get the rows done so far,
    each a prefix of the final table, at 8, 16, 32 rows (of 64, 5 a batch), then the whole."""
    monkeypatch.setattr(model_tables, "FIRST_PUBLISHED_ROWS", 8)
    steps = compute_tables_steps(tiny_model, [0], batch_size=5, show_progress=False)
    yielded = []
    while True:
        try:
            partial = next(steps)
        except StopIteration as done:
            final = done.value
            break
        if partial is not None:
            yielded.append(partial)
    assert [len(p.bigram) for p in yielded] == [10, 20, 40]
    for partial in yielded:
        assert np.array_equal(partial.bigram, final.bigram[: len(partial.bigram)])
    assert final.bigram.shape == (TINY_VOCAB, 8)


def test_a_batch_is_bounded_by_its_logits(tiny_model, monkeypatch) -> None:
    monkeypatch.setattr(model_tables, "LOGITS_PER_BATCH", 3 * TINY_VOCAB)
    steps = compute_tables_steps(tiny_model, batch_size=512, show_progress=False)
    increments = 0
    try:
        while True:
            next(steps)
            increments += 1
    except StopIteration as done:
        tables = done.value
    assert increments == -(-TINY_VOCAB // 3)  # 3 tokens a batch
    assert np.array_equal(tables.bigram, compute_tables(tiny_model, show_progress=False).bigram)
