"""Model-derived tables: what a single-token forward says, cached by weight fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.model.tables import compute_tables, load_or_compute_tables, model_fingerprint
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
