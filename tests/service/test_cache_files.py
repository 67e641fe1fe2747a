"""Caches that heal: every artefact under the cache directory, written through its real code
path, then truncated or altered in the middle, is built again on the next load, with a warning
naming the file, and the result is what it was before; two processes filling one empty cache
directory at once both come up with the same results."""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

import service.controller.profiler as profiler
from service.cache_files import (
    MANIFEST_FILE,
    CorruptCacheFile,
    read_checked_json,
    write_atomically,
    write_checked_json,
)
from service.controller.cost_profile import CostProfile
from service.kernels import packed_linear
from service.kernels.packed_linear import (
    kernel_max_rows_for,
    pack_gguf_linears,
    tiles_file_name,
    tiles_from_blocks,
)
from service.model.loader import load_model
from service.model.runner import ModelRunner
from service.model.tables import load_or_compute_tables, tables_path
from tests.helpers.models import make_tiny_model
from tests.helpers.packed import random_blocks, tiny_gguf_twins, write_tiny_gguf


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def overwrite_middle(path: Path) -> None:
    """Invert 16 bytes in the middle of the file: its size stays, its content does not."""
    with path.open("r+b") as file:
        file.seek(path.stat().st_size // 2)
        original = file.read(16)
        file.seek(path.stat().st_size // 2)
        file.write(bytes(b ^ 0xFF for b in original))


DAMAGES = [truncate, overwrite_middle]


def warned_about(caplog: pytest.LogCaptureFixture, path: Path) -> bool:
    return any(
        record.levelno == logging.WARNING and str(path) in record.getMessage()
        for record in caplog.records
    )


def greedy(model, steps: int = 8) -> list[int]:
    """Plain greedy decoding of a fixed prompt."""
    ids = [0, 5, 9, 5]
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny Llama as a GGUF that `load_model` serves."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    write_tiny_gguf(make_tiny_model(seed=3), path, loadable=True)
    return path


def test_checked_json_round_trips_and_refuses_any_altered_value(tmp_path) -> None:
    path = tmp_path / "limit.json"
    write_checked_json(path, {"rows": 128, "seconds": [0.1, 1e-7]})
    assert read_checked_json(path) == {"rows": 128, "seconds": [0.1, 1e-7]}
    path.write_text(path.read_text().replace("128", "512"))  # still JSON, another value
    with pytest.raises(CorruptCacheFile, match="does not match"):
        read_checked_json(path)
    assert [p.name for p in tmp_path.iterdir()] == ["limit.json"]  # no temporary file left


def test_atomic_writes_keep_the_default_permissions(tmp_path) -> None:
    """A cache built by one user and served by another stays readable (a temporary file's own
    owner-only mode would not)."""
    umask = os.umask(0o022)
    try:
        write_checked_json(tmp_path / "limit.json", {"rows": 64})
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "limit.json").stat().st_mode) == 0o644


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path) -> None:
    path = tmp_path / "tables.npz"
    path.write_bytes(b"old")

    def fail(file) -> None:
        file.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, fail)
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_gguf_config_is_read_from_the_file_again(
    tiny_gguf, tmp_path, caplog, damage
) -> None:
    before = greedy(
        load_model(tiny_gguf, cache_dir=tmp_path, quantization="none", dtype="float32").model
    )
    (directory,) = (tmp_path / "gguf").iterdir()
    config = directory / "config.json"
    damage(config)
    with caplog.at_level(logging.WARNING):
        again = load_model(tiny_gguf, cache_dir=tmp_path, quantization="none", dtype="float32")
    assert not again.from_cache and warned_about(caplog, config)
    assert greedy(again.model) == before
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [directory.name]  # no leftovers
    warm = load_model(tiny_gguf, cache_dir=tmp_path, quantization="none", dtype="float32")
    assert warm.from_cache and greedy(warm.model) == before


def test_a_gguf_header_cache_without_a_manifest_is_written_again(
    tiny_gguf, tmp_path, caplog
) -> None:
    """A directory an older version wrote, or one a copy left unfinished, is not trusted."""
    load_model(tiny_gguf, cache_dir=tmp_path, quantization="none", dtype="float32")
    (directory,) = (tmp_path / "gguf").iterdir()
    (directory / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        again = load_model(tiny_gguf, cache_dir=tmp_path, quantization="none", dtype="float32")
    assert not again.from_cache and warned_about(caplog, directory / MANIFEST_FILE)
    assert (directory / MANIFEST_FILE).exists()


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_model_tables_are_computed_again(tiny_model, tmp_path, caplog, damage) -> None:
    first = load_or_compute_tables(tiny_model, tmp_path, [0], show_progress=False)
    path = tables_path(tiny_model, tmp_path, [0])
    damage(path)
    with caplog.at_level(logging.WARNING):
        again = load_or_compute_tables(tiny_model, tmp_path, [0], show_progress=False)
    assert warned_about(caplog, path)
    assert np.array_equal(again.unigram, first.unigram)
    assert np.array_equal(again.bigram, first.bigram)
    caplog.clear()
    saved = load_or_compute_tables(tiny_model, tmp_path, [0], show_progress=False)
    assert np.array_equal(saved.bigram, first.bigram) and not caplog.records  # healed on disk


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_packed_tiles_are_read_from_the_gguf_again(tmp_path, caplog, damage) -> None:
    plain, packed, path = tiny_gguf_twins(tmp_path)
    tiles_file = tmp_path / tiles_file_name()
    pack_gguf_linears(packed, path, tiles_file=tiles_file, use_kernels=False)
    ids = torch.randint(64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = packed(ids).logits
    damage(tiles_file)
    again = make_tiny_model(seed=3)
    again.load_state_dict(plain.state_dict())
    with caplog.at_level(logging.WARNING):
        assert pack_gguf_linears(again, path, tiles_file=tiles_file, use_kernels=False) == 15
    assert warned_about(caplog, tiles_file)
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, expected)
    caplog.clear()
    third = make_tiny_model(seed=3)
    third.load_state_dict(plain.state_dict())
    pack_gguf_linears(third, path, tiles_file=tiles_file, use_kernels=False)
    assert not caplog.records  # the file was written anew


def test_tiles_of_another_model_are_read_from_the_gguf_again(tmp_path, caplog) -> None:
    """Whole and unaltered, but not tiles of this model's weights (shapes differ)."""
    plain, packed, path = tiny_gguf_twins(tmp_path)
    tiles_file = tmp_path / tiles_file_name()
    pack_gguf_linears(packed, path, tiles_file=tiles_file, use_kernels=False)
    wider = make_tiny_model(seed=3, vocab_size=96)  # another LM head shape
    other_gguf = tmp_path / "other" / "wider.gguf"
    other_gguf.parent.mkdir()
    write_tiny_gguf(wider, other_gguf)
    with caplog.at_level(logging.WARNING):
        pack_gguf_linears(wider, other_gguf, tiles_file=tiles_file, use_kernels=False)
    assert warned_about(caplog, tiles_file)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_kernel_limit_is_measured_again(tmp_path, caplog, monkeypatch, damage) -> None:
    tunings = []

    def tune(*args) -> int:  # the timing itself is another test's; this one is the file's
        tunings.append(args)
        return 128

    monkeypatch.setattr(packed_linear, "tune_kernel_max_rows", tune)
    tiles = [tiles_from_blocks(random_blocks(32, 64), 32, 64)]
    assert kernel_max_rows_for(tiles, None, 2, tmp_path) == 128
    (path,) = (tmp_path / "tuning").iterdir()
    damage(path)
    with caplog.at_level(logging.WARNING):
        assert kernel_max_rows_for(tiles, None, 2, tmp_path) == 128
    assert warned_about(caplog, path) and len(tunings) == 2
    assert kernel_max_rows_for(tiles, None, 2, tmp_path) == 128 and len(tunings) == 2


PROFILE = CostProfile(
    [1], [32, 1024], [[1, 2, 4]], [[[0.010, 0.011, 0.013], [0.012, 0.013, 0.015]]]
)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cost_profile_is_measured_again(
    tiny_runner: ModelRunner, tmp_path, caplog, monkeypatch, damage
) -> None:
    measured = []

    def measure(*args, **kwargs):  # the timing itself is another test's; this one is the file's
        measured.append(args)
        return PROFILE, []

    monkeypatch.setattr(profiler, "measure_profile", measure)
    assert profiler.load_or_measure(tiny_runner, tmp_path) == PROFILE
    path = profiler.profile_path(tmp_path, tiny_runner)
    written = path.read_bytes()
    damage(path)
    with caplog.at_level(logging.WARNING):
        assert profiler.load_saved(tiny_runner, tmp_path) is None
        assert profiler.load_or_measure(tiny_runner, tmp_path) == PROFILE
    assert warned_about(caplog, path) and len(measured) == 2
    assert path.read_bytes() == written


def test_a_numba_cache_that_breaks_the_warm_up_is_cleared_and_compiled_again(
    tmp_path, caplog, monkeypatch
) -> None:
    """numba unpickles its cache unchecked: a damaged index raises at the first call. The
    compiling is not this test's (it takes minutes): the warm-ups are stand-ins."""
    numba = pytest.importorskip("numba")
    from service.kernels import layer_kernels

    for name in ("_kernels", "_layer_kernels", "_kernels_error"):  # as before any load
        monkeypatch.setattr(packed_linear, name, None)
    ours = [tmp_path / "kernels_x" / "packed_kernels.q4_1_matmul-10.py311.nbi"]
    ours.append(tmp_path / "kernels_x" / "layer_kernels.rms_norm-28.py311.1.nbc")
    other = tmp_path / "elsewhere.f-3.py311.nbi"
    for path in (*ours, other):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"\x80\x04")
    calls = []

    def warm_up(kernels) -> None:
        calls.append(kernels)
        if len(calls) == 1:
            raise EOFError("Ran out of input")

    monkeypatch.setattr(packed_linear, "_warm_up", warm_up)
    monkeypatch.setattr(layer_kernels, "warm_up", lambda: None)
    monkeypatch.setattr(numba, "threading_layer", lambda: "omp")  # no parallel kernel ran
    monkeypatch.setattr(packed_linear, "_numba_cache", lambda kernels: tmp_path)
    with caplog.at_level(logging.WARNING):
        assert packed_linear.load_kernels() is not None
    assert warned_about(caplog, tmp_path) and len(calls) == 2
    assert not any(path.exists() for path in ours) and other.exists()


def _start_server_parts(gguf: Path, cache_dir: Path, barrier) -> tuple[list[int], bytes]:
    """What a server start puts in the cache, from one process: the GGUF's config and
    tokenizer, its packed tiles and the model tables; its greedy output and the tables' bytes."""
    barrier.wait()
    loaded = load_model(gguf, cache_dir=cache_dir, quantization="none", dtype="float32")
    tables = load_or_compute_tables(loaded.model, cache_dir, show_progress=False)
    output = greedy(loaded.model)
    (directory,) = (cache_dir / "gguf").iterdir()
    pack_gguf_linears(
        loaded.model, gguf, tiles_file=directory / tiles_file_name(), use_kernels=False
    )
    return output, tables.bigram.tobytes() + tables.unigram.tobytes()


@pytest.mark.slow
def test_two_processes_filling_one_empty_cache_at_once_both_come_up(tiny_gguf, tmp_path) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(2)
        with context.Pool(2) as pool:
            results = pool.starmap(_start_server_parts, [(tiny_gguf, tmp_path, barrier)] * 2)
    assert results[0] == results[1]
    (directory,) = (tmp_path / "gguf").iterdir()  # one whole directory, no leftovers
    assert (directory / MANIFEST_FILE).exists() and (directory / tiles_file_name()).exists()
    assert not [p for p in tmp_path.rglob("*") if ".partial" in p.name]
    loaded = load_model(tiny_gguf, cache_dir=tmp_path, quantization="none", dtype="float32")
    assert loaded.from_cache and greedy(loaded.model) == results[0][0]
