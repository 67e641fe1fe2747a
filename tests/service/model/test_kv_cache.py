"""The KV cache alone (`service/model/kv_cache.py`): rows come and go, each pass writes every
row at its own committed length, a commit keeps exactly the listed entries in order, and the
buffers grow, count and pass on as their docstrings say. Entries are written through a layer's
`update`, as the model's attention layers write them, with values that name their token."""

from __future__ import annotations

import torch

from service.model.attention import build_layout
from service.model.kv_cache import INITIAL_CAPACITY, SpareBuffers, TreeKVCache
from service.model.tree import chain_tree

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
CPU = torch.device("cpu")


def write_pass(
    cache: TreeKVCache, widths: list[int], first_value: float = 1.0
) -> list[list[float]]:
    """One pass in which row r brings `widths[r]` tokens on top of its committed entries; the
    pass's flat token i is written as the value first_value + i (keys) and its negative
    (values) in every layer. Returns each row's written values."""
    layout = build_layout([chain_tree(list(range(w))) for w in widths], cache.lengths, CPU)
    cache.begin_pass(layout)
    total = sum(widths)
    names = first_value + torch.arange(total, dtype=torch.float32)
    keys = (
        names[None, None, :, None]
        .expand(1, HEADS, total, HEAD_DIM)
        .to(cache.dtype or torch.float32)
    )
    for layer in cache.layers:
        layer.update(keys, -keys)
    offsets = [sum(widths[:r]) for r in range(len(widths))]
    return [names[o : o + w].tolist() for o, w in zip(offsets, widths)]


def row_entries(cache: TreeKVCache, row: int, layer: int = 0) -> list[float]:
    """The committed keys of a row, one value per entry (the names `write_pass` gave them)."""
    keys = cache.layers[layer].keys[row, 0, : cache.lengths[row], 0]
    assert torch.equal(cache.layers[layer].values[row, 0, : cache.lengths[row], 0], -keys)
    return keys.tolist()


def test_rows_are_added_at_the_end_and_a_freed_row_takes_the_last_one() -> None:
    cache = TreeKVCache(LAYERS, rows=0)
    assert [cache.add_row() for _ in range(3)] == [0, 1, 2]
    write_pass(cache, [2, 3, 1])
    cache.commit_rows({0: [0, 1], 1: [0, 1, 2], 2: [0]})
    assert cache.remove_row(0) == 2  # the last row moved into the freed slot
    assert (
        cache.lengths == [1, 3]
        and row_entries(cache, 0) == [6.0]
        and row_entries(cache, 1) == [3.0, 4.0, 5.0]
    )
    assert cache.remove_row(1) is None  # the last row leaves: nothing moves
    assert cache.num_rows == 1 and row_entries(cache, 0) == [6.0]


def test_each_row_is_written_at_its_own_committed_length() -> None:
    cache = TreeKVCache(LAYERS, rows=2)
    write_pass(cache, [3, 1])
    cache.commit_rows({0: [0, 1, 2], 1: [0]})
    second = write_pass(cache, [2, 2], first_value=10.0)  # row 0 from column 3, row 1 from column 1
    cache.commit_rows({0: [0, 1], 1: [0, 1]})
    assert row_entries(cache, 0) == [1.0, 2.0, 3.0, *second[0]]
    assert row_entries(cache, 1) == [4.0, *second[1]]
    assert all(
        row_entries(cache, r, layer=1) == row_entries(cache, r) for r in range(2)
    )  # every layer alike


def test_a_layers_update_returns_every_rows_entries_up_to_the_passs_end() -> None:
    cache = TreeKVCache(LAYERS, rows=2)
    write_pass(cache, [3, 1])
    cache.commit_rows({0: [0, 1, 2], 1: [0]})
    layout = build_layout([chain_tree([0]), chain_tree([0, 1, 2])], cache.lengths, CPU)
    cache.begin_pass(layout)
    new = torch.full((1, HEADS, 4, HEAD_DIM), 9.0)
    keys, values = cache.layers[0].update(new, -new)
    assert keys.shape == values.shape == (2, HEADS, 4, HEAD_DIM)  # row 1 ends at 1 + 3 columns
    assert keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 9.0] and keys[1, 0, :, 0].tolist() == [
        4.0,
        9.0,
        9.0,
        9.0,
    ]


def test_commit_keeps_only_the_listed_entries_in_order() -> None:
    # row 0 keeps its root and a branch (offsets 0, 2, 3); row 1 only its root; row 2 a deep
    # node's path (0, 3); row 3 is left out of the commit and keeps its length
    cache = TreeKVCache(LAYERS, rows=4)
    write_pass(cache, [1, 1, 1, 1])
    cache.commit_rows({r: [0] for r in range(4)})
    written = write_pass(cache, [5, 2, 4, 3], first_value=10.0)
    cache.commit_rows({0: [0, 2, 3], 1: [0], 2: [0, 3]})
    assert cache.lengths == [4, 2, 3, 1]
    assert row_entries(cache, 0) == [1.0, written[0][0], written[0][2], written[0][3]]
    assert row_entries(cache, 1) == [2.0, written[1][0]]
    assert row_entries(cache, 2) == [3.0, written[2][0], written[2][3]]
    assert row_entries(cache, 3) == [4.0]


def test_the_capacity_doubles_to_hold_a_pass_and_keeps_what_was_committed() -> None:
    cache = TreeKVCache(LAYERS, rows=1)
    write_pass(cache, [200])
    cache.commit(0, range(200))
    assert cache.capacity == INITIAL_CAPACITY and cache.layers[0].keys.shape[2] == INITIAL_CAPACITY
    write_pass(cache, [100], first_value=1000.0)  # 300 columns: one doubling
    cache.commit(0, range(100))
    assert (
        cache.capacity == 2 * INITIAL_CAPACITY
        and cache.layers[1].keys.shape[2] == 2 * INITIAL_CAPACITY
    )
    assert row_entries(cache, 0) == [float(v) for v in range(1, 201)] + [
        float(v) for v in range(1000, 1100)
    ]


def test_memory_counts_every_layers_keys_and_values_and_returns_to_zero() -> None:
    cache = TreeKVCache(LAYERS, rows=0, dtype=torch.float16)
    assert cache.nbytes == 0 and cache.held_rows == 0  # no buffers before the first write
    for _ in range(3):
        cache.add_row()
    write_pass(cache, [1, 1, 1])
    per_row = 2 * LAYERS * HEADS * INITIAL_CAPACITY * HEAD_DIM * 2  # keys and values, 2 bytes each
    assert cache.layers[0].keys.dtype == torch.float16
    assert cache.nbytes == 3 * per_row and cache.held_rows == 3
    cache.reserve(INITIAL_CAPACITY + 1)
    write_pass(cache, [1, 1, 1])
    assert cache.nbytes == 3 * 2 * per_row  # the capacity doubled
    for row in (2, 1, 0):
        cache.remove_row(row)
    assert cache.nbytes == 0 and cache.capacity == INITIAL_CAPACITY  # idle: nothing held


def test_buffers_that_pass_on_grow_by_powers_of_two_of_rows_and_are_taken_up_again() -> None:
    spare = SpareBuffers()
    cache = TreeKVCache(LAYERS, rows=3, spare=spare)
    assert cache.buffer_rows() == 4
    write_pass(cache, [1, 1, 1])
    assert cache.held_rows == 4
    identity = cache.buffer_identity()
    for row in (2, 1, 0):
        cache.remove_row(row)
    assert (
        cache.nbytes == 0 and spare.nbytes > 0
    )  # the last row left: the buffers went to the spare
    again = TreeKVCache(LAYERS, rows=2, spare=spare)
    assert again.buffer_identity() == identity and spare.nbytes == 0  # the same memory, taken up
    for row in (1, 0):
        again.remove_row(row)
    larger = TreeKVCache(LAYERS, rows=8, spare=spare)
    assert (
        larger.buffer_identity() == ()
    )  # the spare buffers hold too few rows: not taken, and freed
    assert spare.nbytes == 0
