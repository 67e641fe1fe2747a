"""Linear layers that keep a GGUF's blocks packed and compute with them (CPU fast path).

`--quantization gguf` serves the embedded model (or a GGUF of any family the lean pass takes,
`PACKED_MODEL_TYPES`) with its linear layers' weights as the file stores them, re-laid exactly
into one of four kernel layouts (`service/kernels/gguf_blocks.py`: Q4_0, Q4_1 and Q4_K take the
4-bit one, 32 weights with a scale d and min m, w = d*q + m; Q3_K, Q5_0, Q6_K and Q8_0 the 8-bit
one, w = d*q; Q5_1 and Q5_K the 8-bit one with a min, w = d*q + m; Q2_K the 8-bit one with a
scale and min a half). On the embedded Q4_1 file a pass then reads ~0.6 bytes per weight instead
of float32's 4, and the numba kernel (service/kernels/packed_kernels.py) dequantizes each block
once per pass and applies it to every row of the pass (up to a pass size measured once on each
kind of CPU, `kernel_max_rows_for`; larger passes dequantize the layer and call `F.linear`).
Without numba the same modules dequantize and call `F.linear` (slower, same weights). Up to a
pass size measured on the CPU at load (`tune_fused_max_rows`) the weights are dequantized in
registers, four rows at a time; above it, once per tile into a buffer that every row then reads.

The served weights are bit-for-bit those of the float32 path (`--quantization none`, which
dequantizes the same blocks); what differs is only the order of the float32 sums inside a matmul,
so the two paths' greedy outputs part only where the top two logits nearly tie. Within the
kernels a row's result does not depend on the pass size, so speculation reproduces plain
decoding bit for bit in the linears (trees stay within the kernels on every CPU; where the
kernels won at every size, prompt chunks and the rows beside them do too).

The LM head is packed too when its type is one of those (the embedded file's is tied to the
Q8_0 token embedding: the head gets its own packed copy, 8.5 bits a weight instead of 32, the
same values). The token embedding stays the file's memory-mapped blocks
(service/kernels/packed_embedding.py). Norms and linears of other GGUF types (the IQ types)
stay as loaded, in float32. With 8-bit activations a layer keeps only its 8-bit
re-laying (`Int8Tiles`), which holds the same weights.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from service.cache_files import (
    CorruptCacheFile,
    read_cached,
    read_checked_json,
    write_atomically,
    write_checked_json,
)
from service.kernels.gguf_blocks import BLOCK_TYPES, unpack
from service.kernels.gguf_file import GGUFTensor, read_gguf
from service.kernels.int8_chunk_kernel import CHUNK_MIN_ROWS, GROUP, chunk_matmul_of
from service.kernels.int8_chunk_kernel import warm_up as warm_up_chunks
from service.kernels.int8_kernel import (
    REQUIRED_FEATURES,
    Int8Tiles,
    best_isa,
    int8_supported,
    int8_tiles,
    matmul_of,
)
from service.kernels.int8_kernel import warm_up as warm_up_int8
from service.kernels.packed_kernels_gen import TILE

log = logging.getLogger(__name__)

QUANTIZATIONS: tuple[str, ...] = ("none", "gguf", "gguf-int8")
LAYOUTS = ("Q4_1", "Q8_0", "Q8_1", "Q8_1_16")  # the kernels' (every `BLOCK_TYPES` type's)
WITH_MINS = ("Q4_1", "Q8_1", "Q8_1_16")  # the layouts whose weights are d*q + m
# the layouts the 8-bit-activation kernels take; a layer of another (Q2_K's) keeps float32 ones
INT8_LAYOUTS = ("Q4_1", "Q8_0", "Q8_1")
PACKED = ("gguf", "gguf-int8")  # the quantizations that keep the GGUF's blocks packed
# Passes above this many rows may dequantize the layer and call F.linear (prefill-sized passes,
# where a BLAS GEMM can be faster than the register-tiled kernel), if the CPU says so at load
# (`tune_kernel_max_rows`: the kernel is timed against that path at these sizes; on some CPUs
# it wins at every size: docs/benchmarks.md, "Large passes in the kernels"). Trees stay below
# the least of them.
KERNEL_MAX_ROWS = 64
LARGE_PASS_CANDIDATES = (128, 512)
UNBOUNDED_ROWS = 1 << 30  # the kernel won at every candidate: it takes every pass
LARGE_PASS_TUNING_REPEATS = 3
# A pass whose rows x packed bytes are below this runs on one thread (see forward): below it a
# parallel launch measured slower than the serial call (docs/benchmarks.md).
PARALLEL_MIN_BYTES = 1 << 14
# Pass sizes at which the in-register Q4_1 kernel is timed against the buffer path at load. Which
# wins depends on the CPU, its vector registers above all (docs/benchmarks.md, "The float path's
# kernels").
FUSED_ROW_CANDIDATES = (3, 4, 6, 8, 12, 16, 24, 32)
TUNING_REPEATS = 9
TUNING_LAYERS = 4  # the first few decoder layers' Q4_1 weights are timed (briefly, at load)

# GGUF tensor name (per block) -> Hugging Face Llama module name.
LLAMA_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ... Phi-3's: llama.cpp writes its fused modules as they are (rows q, k, v; gate, then up:
# the halves Phi-3's MLP and llama.cpp's both split), without permuting q/k rows
PHI3_LINEARS = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_linears(architecture: str) -> dict[str, str]:
    """The packed linears of a GGUF of llama.cpp's `architecture`: per-block tensor name ->
    the module it fills (`PHI3_LINEARS` for "phi3", `LLAMA_LINEARS` for the rest)."""
    return PHI3_LINEARS if architecture == "phi3" else LLAMA_LINEARS


_kernels: Any = None
_layer_kernels: Any = None
_kernels_error: str | None = None


def load_kernels(cache_dir: Path | None = None) -> Any:
    """The compiled numba kernels module, or None when numba is not installed (or fails).
    The per-layer kernels (`service/kernels/layer_kernels.py`) load with it
    (`loaded_layer_kernels`).

    The first call per machine compiles them (slow; logged) into numba's cache,
    `<cache_dir>/numba` (next to the source without a `cache_dir`; `NUMBA_CACHE_DIR` overrides
    both); later starts load them from there, much faster. The cache dir, not
    the package, so that `ngrammys prepare` bakes them where an image's server finds them: numba
    only uses a cache directory it can write, and an installed package is read-only to a
    non-root server. (numba compiles again, once, on a CPU other than the one that compiled.)
    """
    global _kernels, _layer_kernels, _kernels_error
    if _kernels is not None or _kernels_error is not None:
        return _kernels
    # Must be set before numba is first imported: the kernels rely on the SLP vectorizer.
    os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
    if cache_dir is not None:
        os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir / "numba"))
    try:
        import numba

        numba.config.SLP_VECTORIZE = 1
        if os.environ.get(
            "NUMBA_CACHE_DIR"
        ):  # numba may have been imported (and configured) before
            numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
        from service.kernels import layer_kernels, packed_kernels
    except Exception as error:  # noqa: BLE001 - any import failure means: use the fallback
        _kernels_error = f"{type(error).__name__}: {error}"
        log.error(
            "the numba kernels failed to load (%s): the packed linears run on their torch "
            "fallback, several times slower; /health reports it",
            _kernels_error,
        )
        return None
    started = time.perf_counter()
    try:
        _warm_up(packed_kernels)
        layer_kernels.warm_up()
    except Exception as error:  # noqa: BLE001 - numba unpickles its cache unchecked
        cache = _numba_cache(packed_kernels)
        log.warning(
            "numba's cache of the kernels under %s is unreadable (%s: %s); compiling them again",
            cache,
            type(error).__name__,
            error,
        )
        _clear_numba_cache(cache)
        _warm_up(packed_kernels)
        layer_kernels.warm_up()
    layer = numba.threading_layer()
    log.info(
        "numba packed-linear kernels ready in %.1f s (threading layer %s, %d threads)",
        time.perf_counter() - started,
        layer,
        numba.get_num_threads(),
    )
    if layer == "workqueue":
        log.warning(
            "numba runs the packed kernels on its workqueue threading layer, on which passes "
            "took 1.3-2.7x as long as on OpenMP: install the system's libgomp (Debian: libgomp1)"
        )
    _kernels, _layer_kernels = packed_kernels, layer_kernels
    return _kernels


def loaded_kernels() -> Any:
    """The kernels module if `load_kernels` already loaded it (the CPU fast path is on), else
    None: for callers that use a kernel where it is ready but should not compile them."""
    return _kernels


def kernels_error() -> str | None:
    """Why `load_kernels` found no kernels (numba missing or failing to import or compile), or
    None if they loaded or were never asked for."""
    return _kernels_error


def loaded_layer_kernels() -> Any:
    """The per-layer kernels module (RMSNorm, rotary embedding with the cache write) if
    `load_kernels` loaded the kernels, else None."""
    return _layer_kernels


def _numba_cache(kernels: Any) -> Path:
    """Where numba keeps the compiled kernels: its cache directory, else beside the source."""
    import numba

    return Path(numba.config.CACHE_DIR or Path(kernels.__file__).parent / "__pycache__")


def _clear_numba_cache(cache: Path) -> None:
    """Delete numba's index and data files of the kernels `load_kernels` warms up, so that
    numba compiles them again (a damaged entry makes it raise, not recompile)."""
    for module in ("packed_kernels", "layer_kernels"):
        for path in cache.rglob(f"{module}.*.nb[ic]"):
            path.unlink(missing_ok=True)


def _warm_up(kernels: Any) -> None:
    qs = np.zeros((1, 1, 16, TILE), np.uint8)
    scales = np.zeros((1, 1, TILE), np.float32)
    x, out = np.zeros((3, 32), np.float32), np.empty((3, TILE), np.float32)
    kernels.q4_1_matmul(x, qs, scales, scales, out, 1, 4)
    kernels.q4_1_dequantize(qs, scales, scales, np.empty((32, TILE), np.float32))
    kernels.top_k_ids(np.zeros((1, 2 * kernels.TOP_K_BLOCK), np.float32), 1)
    kernels.q4_1_matmul_serial(x, qs, scales, scales, out, 0, 4)
    _warm_up_8bit(kernels, np.int8)


def _warm_up_8bit(kernels: Any, dtype: type, layout: str = "Q8_0") -> None:
    """An 8-bit layout's kernels for q of `dtype`: Q8_0's int8 ones at every start; int16 (Q6_K),
    Q8_1 (Q5_1, Q5_K) and Q8_1_16 (Q2_K) on the first model that has such a linear (about a
    minute on two cores, then in numba's cache)."""
    q = np.zeros((1, 1, 32, TILE), dtype)
    scales = np.zeros((1, 1, 2, TILE) if layout == "Q8_1_16" else (1, 1, TILE), np.float32)
    weights = (q, scales, scales) if layout in WITH_MINS else (q, scales)
    x, out = np.zeros((3, 32), np.float32), np.empty((3, TILE), np.float32)
    name = layout.lower()
    getattr(kernels, f"{name}_matmul")(x, *weights, out, 1)
    getattr(kernels, f"{name}_matmul_serial")(x, *weights, out, 0)
    getattr(kernels, f"{name}_dequantize")(*weights, np.empty((32, TILE), np.float32))


_scratch = threading.local()
# Layers up to this many weights dequantize for a large pass into a reusable buffer (the
# embedded model's largest, gate and up fused, has 1.77M); the LM head (28M) gets its own.
SCRATCH_MAX_WEIGHTS = 4 << 20


def _scratch_weights(shape: tuple[int, int]) -> np.ndarray:
    """A float32 array of `shape` in this thread's scratch buffer. A fresh array of megabytes
    is a fresh memory mapping each call, and its page faults cost more than dequantizing into
    it (docs/benchmarks.md, "Chunks on the packed path")."""
    size = shape[0] * shape[1]
    if size > SCRATCH_MAX_WEIGHTS:
        return np.empty(shape, np.float32)
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = np.empty(SCRATCH_MAX_WEIGHTS, np.float32)
    return buffer[:size].reshape(shape)


def _threads() -> int:
    return max(1, torch.get_num_threads())


@dataclass(frozen=True)
class PackedTiles:
    """GGUF blocks of one weight [out_features, in_features], re-laid into tiles of TILE rows."""

    kind: str  # the kernel layout, one of `LAYOUTS` (`gguf_blocks`: each type's)
    # Q4_1: [T, K/32, 16, TILE] uint8 (two weights a byte); Q8_0: [T, K/32, 32, TILE] int8, or
    # int16 for a wide type (Q6_K); Q8_1, Q8_1_16: as Q8_0's int8
    qs: np.ndarray
    d: np.ndarray  # [T, K/32, TILE] float32 scales (Q8_1_16: [T, K/32, 2, TILE], a half each)
    m: np.ndarray  # float32 mins, as d (`WITH_MINS`; empty for Q8_0)
    out_features: int
    in_features: int

    def rows(self, first: int, count: int) -> PackedTiles:
        """Output rows first..first+count-1 (`first` a whole number of tiles in), as views."""
        assert first % TILE == 0
        tiles = slice(first // TILE, -(-(first + count) // TILE))
        m = self.m[tiles] if self.m.size else self.m
        return replace(self, qs=self.qs[tiles], d=self.d[tiles], m=m, out_features=count)


def tiles_from_blocks(
    raw: np.ndarray, out_features: int, in_features: int, kind: str = "Q4_1"
) -> PackedTiles:
    """`raw`: the GGUF bytes of a `kind` weight [out_features, blocks * block bytes] (row-major
    blocks, as `gguf.GGUFReader` gives them), in its kernel layout (`gguf_blocks`). Rows are
    padded to a whole tile with zero groups (zero weights)."""
    groups = unpack(kind, raw, out_features, in_features)
    tiles = -(-out_features // TILE)

    def tiled(a: np.ndarray) -> np.ndarray:  # [rows, groups, ...] -> [T, groups, ..., TILE]
        padded = np.zeros((tiles * TILE, *a.shape[1:]), a.dtype)
        padded[:out_features] = a
        padded = padded.reshape(tiles, TILE, *a.shape[1:])
        return np.ascontiguousarray(np.moveaxis(padded, 1, -1))

    if groups.layout == "Q4_1":
        q = groups.q
        nibbles = q[..., :16] | (q[..., 16:] << 4)  # byte j: weights j (low) and j + 16
        return PackedTiles(
            "Q4_1", tiled(nibbles), tiled(groups.d), tiled(groups.m), out_features, in_features
        )
    m = tiled(groups.m) if groups.layout in WITH_MINS else np.zeros((0, 0, 0), np.float32)
    return PackedTiles(
        groups.layout, tiled(groups.q), tiled(groups.d), m, out_features, in_features
    )


def dequantize_tiles(tiles: PackedTiles) -> torch.Tensor:
    """The float32 weight [out_features, in_features], in plain torch (the reference)."""
    return dequantize_rows(tiles, torch.arange(tiles.out_features))


def dequantize_rows(tiles: PackedTiles, rows: torch.Tensor) -> torch.Tensor:
    """The float32 weights of `rows` (int64 [n]) [n, in_features], in plain torch: d*q is exact,
    so d*q + m rounds once, as gguf-py's dequantization does."""
    tile, lane = rows // TILE, rows % TILE
    qs = torch.from_numpy(tiles.qs)[tile, :, :, lane]  # [n, B, 16 or 32]

    def per_weight(scales: np.ndarray) -> torch.Tensor:  # [n, B, 1], or [n, B, 32] for halves
        a = torch.from_numpy(scales)[tile, ..., lane]  # [n, B] or [n, B, 2]
        return a[..., None] if a.dim() == 2 else a.repeat_interleave(16, dim=-1)

    q = torch.cat([qs & 15, qs >> 4], dim=-1) if tiles.kind == "Q4_1" else qs  # [n, B, 32]
    w = per_weight(tiles.d) * q.float()
    if tiles.kind in WITH_MINS:
        w = w + per_weight(tiles.m)
    return w.reshape(len(rows), tiles.in_features)


class PackedLinear(nn.Module):
    """Drop-in for a bias-free `nn.Linear` whose weight is a GGUF tensor kept packed in one of
    the kernels' layouts (`LAYOUTS`)."""

    def __init__(
        self,
        tiles: PackedTiles | Int8Tiles,
        kernels: Any = None,
        fused_max_rows: int = 2,
        int8_activations: bool = False,
        kernel_max_rows: int = KERNEL_MAX_ROWS,
    ) -> None:
        """`tiles`: the weight in its kernel layout, or (8-bit activations) re-laid already."""
        super().__init__()
        self.kind = tiles.kind
        self.in_features = tiles.in_features
        self.out_features = tiles.out_features
        self.kernels = kernels
        # Q4_1 passes up to this many rows dequantize in registers
        self.fused_max_rows = fused_max_rows
        self.kernel_max_rows = kernel_max_rows  # larger passes dequantize the layer for F.linear
        # 8-bit activations (service/kernels/int8_kernel.py), for passes of every size
        self.int8_activations = isinstance(tiles, Int8Tiles) or (
            int8_activations and tiles.kind in INT8_LAYOUTS
        )
        self._set_tiles(tiles)

    def _set_tiles(self, tiles: PackedTiles | Int8Tiles) -> None:
        """The weight the layer computes with. For 8-bit activations only the re-laid tiles
        are kept (made here from `PackedTiles`): they hold the same weights."""
        if self.int8_activations and isinstance(tiles, PackedTiles):
            tiles = int8_tiles(tiles.kind, tiles.qs, tiles.d, tiles.m, tiles.out_features)
        names = ("packed", "d", "m") if isinstance(tiles, Int8Tiles) else ("qs", "d", "m")
        # Buffers, so state_dict (and the model fingerprint keying the caches) shows them.
        for name in names:
            self.register_buffer(name, torch.from_numpy(getattr(tiles, name)), persistent=True)
        self._tiles = tiles if isinstance(tiles, PackedTiles) else None  # numpy views
        self._int8 = tiles if isinstance(tiles, Int8Tiles) else None
        if self._int8 is not None:  # what every call needs, looked up once
            # the kernels of the tiles' own layout
            self._int8_kernel = matmul_of(self._int8)
            self._chunk_kernel = chunk_matmul_of(self._int8)
            self._int8_columns = self._int8.padded_features

    def extra_repr(self) -> str:
        path = (
            f"int8 activations, {self._int8.isa.name}"
            if self._int8 is not None
            else "numba"
            if self.kernels is not None
            else "torch fallback"
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.kind} ({path})"
        )

    def tiles(self) -> PackedTiles:
        """The weight in its kernel layout (float32 activations: 8-bit ones keep only their
        re-laying)."""
        if self._tiles is None:
            raise ValueError("a layer with 8-bit activations keeps only its re-laid tiles")
        return self._tiles

    def dequantized(self, reuse: bool = False) -> torch.Tensor:
        """The served float32 weights [out_features, in_features]. `reuse`: in the calling
        thread's scratch buffer (valid until its next such call), for a large pass's F.linear."""
        if self._int8 is not None:
            return torch.from_numpy(self._int8.dequantized())
        if self.kernels is None:
            return dequantize_tiles(self.tiles())
        t = self._tiles
        shape = (self.in_features, t.qs.shape[0] * TILE)  # transposed: the kernels' layout
        out = _scratch_weights(shape) if reuse else np.empty(shape, np.float32)
        if self.kind == "Q8_0":
            self.kernels.q8_0_dequantize(t.qs, t.d, out)
        else:
            getattr(self.kernels, f"{self.kind.lower()}_dequantize")(t.qs, t.d, t.m, out)
        return torch.from_numpy(out).t()[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs of {self.in_features} features, got {x.shape[-1]}")
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self._int8 is None and (
            self.kernels is None or rows.shape[0] > self.kernel_max_rows or x.device.type != "cpu"
        ):
            return F.linear(x, self.dequantized(reuse=x.device.type == "cpu").to(x.device, x.dtype))
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return self._shaped(self.apply(rows.numpy()), x)

    def apply(self, xs: np.ndarray) -> np.ndarray:
        """The layer's output for float32 rows xs [R, in_features] (C-contiguous), as the
        kernels leave it: [R, at least out_features] (8-bit kernels pad to whole tiles). The
        packed CPU pass (`service/model/packed_pass.py`) calls this directly, without torch."""
        if self._int8 is not None:
            return self._int8_apply(xs)
        if self.kernels is None or xs.shape[0] > self.kernel_max_rows:
            return F.linear(torch.from_numpy(xs), self.dequantized(reuse=True)).numpy()
        t = self._tiles
        out = np.empty((xs.shape[0], t.qs.shape[0] * TILE), np.float32)
        # Tiny layers run on the calling thread: a parallel launch costs more than it saves.
        threads = _threads() if xs.shape[0] * t.qs.size >= PARALLEL_MIN_BYTES else 1
        threads = threads if threads > 1 else 0
        if self.kind == "Q4_1":
            (self.kernels.q4_1_matmul if threads else self.kernels.q4_1_matmul_serial)(
                xs, t.qs, t.d, t.m, out, threads, self.fused_max_rows
            )
        else:
            name = self.kind.lower()
            weights = (t.qs, t.d, t.m) if self.kind in WITH_MINS else (t.qs, t.d)
            matmul = getattr(self.kernels, f"{name}_matmul{'' if threads else '_serial'}")
            matmul(xs, *weights, out, threads)
        return out

    def _int8_apply(self, xs: np.ndarray) -> np.ndarray:
        """The 8-bit kernels, whatever the pass size (from CHUNK_MIN_ROWS rows on, a Q4_1 layer's
        many-row kernel, with the same bits): a prompt chunk's rows then compute as they would
        in a pass of their own. Lean: a one-token pass makes over a hundred of these calls, so
        what every call needs is looked up once (`_set_tiles`) and no no-op conversion runs
        (docs/benchmarks.md, "Figures behind design choices")."""
        assert self._int8 is not None
        t = self._int8
        threads = _threads() if xs.shape[0] * t.packed.size >= PARALLEL_MIN_BYTES else 0
        threads = threads if threads > 1 else 0
        if (
            self._chunk_kernel is not None and xs.shape[0] >= CHUNK_MIN_ROWS
        ):  # the same bits, faster
            padded = np.empty((-(-xs.shape[0] // GROUP) * GROUP, self._int8_columns), np.float32)
            self._chunk_kernel(xs, t.packed, t.d, t.m, padded, threads)
            return padded[: xs.shape[0]]
        out = np.empty((xs.shape[0], self._int8_columns), np.float32)
        self._int8_kernel(xs, t.packed, t.d, t.m, out, threads)
        return out

    def _shaped(self, out: np.ndarray, x: torch.Tensor) -> torch.Tensor:
        """A kernel's output [rows, whole tiles] as the layer's: its columns, x's dtype and
        leading dimensions."""
        y = torch.from_numpy(out)
        if out.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)


def fuse_packed(modules: Sequence[PackedLinear]) -> PackedLinear | None:
    """One layer computing `modules`' outputs side by side (their tiles, or 8-bit re-layings,
    concatenated), so a pass makes one kernel call instead of several; each module then holds
    a view of the fused tiles (no copy stays behind). None when the modules differ in layout,
    q's width or input width, or a module's rows do not fill whole tiles."""
    tiles = [module._int8 or module.tiles() for module in modules]
    if len({_fusable_as(t) for t in tiles}) != 1 or any(t.out_features % TILE for t in tiles):
        return None
    first = tiles[0]
    arrays = {
        name: np.concatenate([getattr(t, name) for t in tiles])
        for name in (("packed", "d", "m") if isinstance(first, Int8Tiles) else ("qs", "d", "m"))
    }
    whole = replace(first, **arrays, out_features=sum(t.out_features for t in tiles))
    fused = PackedLinear(
        whole,
        modules[0].kernels,
        modules[0].fused_max_rows,
        modules[0].int8_activations,
        modules[0].kernel_max_rows,
    )
    start = 0
    for module, t in zip(modules, tiles):
        module._set_tiles(whole.rows(start, t.out_features))
        start += t.out_features
    return fused


def _fusable_as(t: PackedTiles | Int8Tiles) -> tuple[Any, ...]:
    """What tiles concatenated into one weight must share."""
    width = t.isa if isinstance(t, Int8Tiles) else t.qs.dtype
    return type(t), t.kind, width, t.in_features


def tune_fused_max_rows(layers: Sequence[PackedTiles], kernels: Any) -> int:
    """The largest of `FUSED_ROW_CANDIDATES` up to which the in-register Q4_1 kernel beat the
    buffer path at every candidate, timed on `layers` (the served model's own weights); 2 (the
    buffer path from three rows) if it lost at three. Both paths give the same bits, so the
    choice changes speed only; each size's fastest of `TUNING_REPEATS` rounds counts (other work
    on the machine only adds time), the two paths alternating within a round."""
    threads = _threads() if _threads() > 1 else 0
    matmul = kernels.q4_1_matmul if threads else kernels.q4_1_matmul_serial
    rng = np.random.default_rng(0)
    best = 2
    for rows in FUSED_ROW_CANDIDATES:
        inputs = [
            (
                rng.standard_normal((rows, t.in_features), np.float32),
                np.empty((rows, t.qs.shape[0] * TILE), np.float32),
                t,
            )
            for t in layers
        ]

        def seconds(fused_max_rows: int) -> float:
            started = time.perf_counter()
            for x, out, t in inputs:
                matmul(x, t.qs, t.d, t.m, out, threads, fused_max_rows)
            return time.perf_counter() - started

        fused, buffered = [], []
        for _ in range(TUNING_REPEATS):
            fused.append(seconds(rows))
            buffered.append(seconds(2))
        log.debug(
            "Q4_1 kernel at %d rows: in registers %.2f ms, buffer %.2f ms",
            rows,
            min(fused) * 1e3,
            min(buffered) * 1e3,
        )
        if min(fused) >= min(buffered):
            break
        best = rows
    return best


def tune_kernel_max_rows(layers: Sequence[PackedTiles], kernels: Any, fused_max_rows: int) -> int:
    """The pass size up to which the packed kernel beat dequantizing the layer for `F.linear` at
    every one of `LARGE_PASS_CANDIDATES` (`UNBOUNDED_ROWS` if at all of them, `KERNEL_MAX_ROWS`
    if at none), timed on `layers` as the served modules run them, each size's fastest of
    `LARGE_PASS_TUNING_REPEATS` rounds, the two paths alternating within a round. The paths
    round differently (float32 sums in another order), so the choice decides which bits a large
    pass gets; within the kernel's range every row's result is the same whatever the pass."""
    kernel = [
        PackedLinear(t, kernels, fused_max_rows, kernel_max_rows=UNBOUNDED_ROWS) for t in layers
    ]
    gemm = [PackedLinear(t, kernels, fused_max_rows, kernel_max_rows=0) for t in layers]
    generator = torch.Generator().manual_seed(0)
    best = KERNEL_MAX_ROWS
    for rows in LARGE_PASS_CANDIDATES:
        inputs = [torch.randn(rows, t.in_features, generator=generator) for t in layers]

        def seconds(modules: list[PackedLinear]) -> float:
            started = time.perf_counter()
            for module, x in zip(modules, inputs):
                module(x)
            return time.perf_counter() - started

        in_kernel, in_gemm = [], []
        for _ in range(LARGE_PASS_TUNING_REPEATS):
            in_kernel.append(seconds(kernel))
            in_gemm.append(seconds(gemm))
        log.debug(
            "packed linears at %d rows: kernel %.1f ms, dequantized + F.linear %.1f ms",
            rows,
            min(in_kernel) * 1e3,
            min(in_gemm) * 1e3,
        )
        if min(in_kernel) >= min(in_gemm):
            return best
        best = rows
    return UNBOUNDED_ROWS


def kernel_max_rows_for(
    layers: Sequence[PackedTiles], kernels: Any, fused_max_rows: int, cache_dir: Path | None
) -> int:
    """`tune_kernel_max_rows`, measured once per kind of CPU (LLVM's name for it) and thread
    count and kept in `cache_dir`: the limit decides which bits a large pass gets, so a timing
    that came out otherwise on a busy start would change a server's answers at near ties."""
    if cache_dir is None:
        return tune_kernel_max_rows(layers, kernels, fused_max_rows)
    import llvmlite.binding as llvm

    path = cache_dir / "tuning" / f"kernel-max-rows-{llvm.get_host_cpu_name()}-x{_threads()}.json"
    saved = read_cached(path, _read_kernel_max_rows, "kernel limit")
    if saved is not None:
        return saved
    rows = tune_kernel_max_rows(layers, kernels, fused_max_rows)
    write_checked_json(path, {"kernel_max_rows": rows})
    return rows


def _read_kernel_max_rows(path: Path) -> int:
    """The limit saved at `path`, checked against its checksum and the values tuning gives."""
    rows = read_checked_json(path)["kernel_max_rows"]
    if rows not in (KERNEL_MAX_ROWS, *LARGE_PASS_CANDIDATES, UNBOUNDED_ROWS):
        raise CorruptCacheFile(f"{path}: {rows!r} is no limit that tuning gives")
    return int(rows)


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (as transformers' GGUF loader does):
    `weight_hf = weight_gguf[index]`, a permutation of whole rows, so of whole Q4_1 blocks."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(-1)


def read_packed_linears(
    model: nn.Module, gguf_path: Path
) -> tuple[dict[str, PackedTiles], Counter[str], Counter[str]]:
    """The linear weights of `gguf_path` whose GGUF type the kernels serve (`BLOCK_TYPES`; the
    LM head too: the output tensor, or the token embedding it is tied to) as tiles keyed by the
    model's module names ("model.layers.3.mlp.up_proj", "lm_head"; `gguf_linears`), a Llama's
    q/k rows un-permuted (llama.cpp permutes that architecture's alone, and transformers undoes
    it for it alone); and how many linears of each GGUF type were packed, and of each type left
    as loaded."""
    config = model.config
    contents = read_gguf(gguf_path)
    by_name, permuted = contents.tensors, contents.architecture == "llama"
    linears = gguf_linears(contents.architecture)
    tiles: dict[str, PackedTiles] = {}
    packed: Counter[str] = Counter()
    kept: Counter[str] = Counter()

    def add(
        name: str, tensor: GGUFTensor, linear: nn.Module, rows: np.ndarray | None = None
    ) -> None:
        kind = tensor.kind.name
        block = BLOCK_TYPES.get(kind)
        if block is None or getattr(linear, "bias", None) is not None:
            kept[kind] += 1
            return
        out_features, in_features = linear.weight.shape
        raw = tensor.raw.reshape(out_features, -1)
        tiles[name] = tiles_from_blocks(
            raw if rows is None else raw[rows], out_features, in_features, kind
        )
        packed[kind] += 1

    for tensor in by_name.values():
        parts = tensor.name.split(".")  # blk.{i}.{kind}.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in linears:
            continue
        name = f"model.layers.{int(parts[1])}.{linears[parts[2]]}"
        linear = model.get_submodule(name)
        heads = {
            "attn_q": config.num_attention_heads,
            "attn_k": config.num_key_value_heads,
        }.get(parts[2])
        rows = unpermute_rows(linear.weight.shape[0], heads) if heads and permuted else None
        add(name, tensor, linear, rows)
    head = by_name.get("output.weight") or (
        by_name.get("token_embd.weight") if config.tie_word_embeddings else None
    )
    lm_head = getattr(model, "lm_head", None)
    if head is not None and isinstance(lm_head, nn.Linear):
        add("lm_head", head, lm_head)
    return tiles, packed, kept


# The architectures whose projections are Llama's modules, under Llama's names
LLAMA_MODULE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# The architectures whose linears are packed: the lean pass's (`service/model/decoder_pass.py`),
# Phi-3's fused projections under its own names (`PHI3_LINEARS`)
PACKED_MODEL_TYPES = (*LLAMA_MODULE_TYPES, "phi3")
# Bumped whenever what saved tiles hold changes (so that older files are not read)
TILES_FORMAT = 2


def tiles_file_name() -> str:
    """The packed tiles' cache file (beside a GGUF's cached config), for float and 8-bit
    activations alike. Its name changes with the types the kernels serve (`BLOCK_TYPES`), so
    tiles saved before a type was served are not read for a model that has it, nor tiles of an
    older `TILES_FORMAT`."""
    served = ",".join(f"{name}:{t.layout}:{t.wide}" for name, t in BLOCK_TYPES.items())
    served += f";{TILES_FORMAT}"
    digest = hashlib.sha256(served.encode()).hexdigest()[:12]
    return f"packed_tiles_{digest}.npz"


def _save_tiles(tiles: dict[str, PackedTiles], path: Path) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name, t in tiles.items():
        arrays |= {
            f"{name}:qs": t.qs,
            f"{name}:d": t.d,
            f"{name}:m": t.m,
            f"{name}:shape": np.array([t.out_features, t.in_features]),
            f"{name}:kind": np.array(t.kind),
        }
    try:
        write_atomically(path, lambda file: np.savez(file, **arrays))
    except OSError as error:  # a read-only cache: serve anyway, read the GGUF again next start
        log.warning("could not save the packed tiles to %s (%s)", path, error)


def _load_tiles(path: Path, model: nn.Module) -> dict[str, PackedTiles]:
    """The tiles `_save_tiles` wrote (zip checks every array's CRC-32 as it is read), each
    checked against `model`'s linear of its name: `CorruptCacheFile` where one is not tiles of
    that weight's shape."""
    with np.load(path) as arrays:
        names = [key[: -len(":shape")] for key in arrays.files if key.endswith(":shape")]
        tiles = {
            name: PackedTiles(
                str(arrays[f"{name}:kind"]),
                arrays[f"{name}:qs"],
                arrays[f"{name}:d"],
                arrays[f"{name}:m"],
                *(int(v) for v in arrays[f"{name}:shape"]),
            )
            for name in names
        }
    for name, t in tiles.items():
        weight = model.get_submodule(name).weight
        if (t.out_features, t.in_features) != tuple(weight.shape) or not _well_formed(t):
            raise CorruptCacheFile(f"{path}: the tiles of {name} do not fit its weight")
    return tiles


def _well_formed(t: PackedTiles) -> bool:
    """Whether `t`'s arrays have the kind, dtypes and shapes `tiles_from_blocks` gives."""
    if t.kind not in LAYOUTS or t.in_features % 32:
        return False
    grid = (-(-t.out_features // TILE), t.in_features // 32)
    q4_1 = t.kind == "Q4_1"
    q_types = {"Q4_1": (np.uint8,), "Q8_0": (np.int8, np.int16)}.get(t.kind, (np.int8,))
    scales = (*grid, 2, TILE) if t.kind == "Q8_1_16" else (*grid, TILE)
    return (
        t.qs.dtype in q_types
        and t.qs.shape == (*grid, 16 if q4_1 else 32, TILE)
        and t.d.dtype == np.float32
        and t.d.shape == scales
        and t.m.dtype == np.float32
        and t.m.shape == (scales if t.kind in WITH_MINS else (0, 0, 0))
    )


def pack_gguf_linears(
    model: nn.Module,
    gguf_path: Path,
    cache_dir: Path | None = None,
    tiles_file: Path | None = None,
    use_kernels: bool = True,
    int8_activations: bool = False,
) -> int:
    """Replace every decoder linear (`gguf_linears`), and the LM head, whose GGUF type the
    kernels serve (`gguf_blocks.BLOCK_TYPES`) by a `PackedLinear`; returns how many. `model`'s
    weights may be loaded or still on the meta device (service/model/gguf_model.py fills the
    rest after).
    Other linears are left as they are (logged by type); so are the embeddings (a tied LM head
    gets its own packed copy of the blocks).
    `int8_activations`: the packed linears compute with 8-bit activations
    (service/kernels/int8_kernel.py).

    Re-laying a large model's blocks takes seconds, so the tiles are saved to `tiles_file` (if
    given) and read from there on later starts (from the GGUF again, with a warning, when the
    file cannot be read back whole or its tiles do not fit the model). When they are read from
    the GGUF into a loaded model, each packed weight is checked against the loaded one: they
    must be equal, bit for bit (same file, same dequantization), so a wrong name mapping or
    permutation fails loudly.
    """
    config = model.config
    if getattr(config, "model_type", None) not in PACKED_MODEL_TYPES:
        raise ValueError(
            f"--quantization gguf supports {', '.join(PACKED_MODEL_TYPES)} models, "
            f"not {config.model_type!r}"
        )
    if int8_activations and not int8_supported():
        raise ValueError(
            f"--quantization gguf-int8 needs a CPU with {REQUIRED_FEATURES}; "
            "use --quantization gguf"
        )
    kernels = load_kernels(cache_dir) if use_kernels else None
    saved = (
        None
        if tiles_file is None
        else read_cached(tiles_file, lambda path: _load_tiles(path, model), "packed tiles")
    )
    from_file = saved is not None
    if saved is not None:
        tiles = saved
    else:
        tiles, packed_types, kept = read_packed_linears(model, gguf_path)
        log.info(
            "%s: packing %s linears; %s",
            gguf_path.name,
            _counts(packed_types),
            f"left as loaded (float32): {_counts(kept)}" if kept else "none left as loaded",
        )
    if not tiles:
        raise ValueError(
            f"{gguf_path.name} has no linear weights of a packed type "
            f"({', '.join(BLOCK_TYPES)}); serve it with --quantization none"
        )
    if tiles_file is not None and not from_file:
        _save_tiles(tiles, tiles_file)
    fused_max_rows, kernel_max_rows = 2, KERNEL_MAX_ROWS
    # the layers the float32-activation kernels compute: all, or with 8-bit activations Q2_K's
    floats = [t for t in tiles.values() if not int8_activations or t.kind not in INT8_LAYOUTS]
    if kernels is not None and any(t.qs.dtype == np.int16 for t in floats):
        _warm_up_8bit(kernels, np.int16)
    for layout in ("Q8_1", "Q8_1_16"):
        if kernels is not None and any(t.kind == layout for t in floats):
            _warm_up_8bit(kernels, np.int8, layout)
    first_layers = tuple(f"model.layers.{i}." for i in range(TUNING_LAYERS))
    tuned = [t for name, t in tiles.items() if t.kind == "Q4_1" and name.startswith(first_layers)]
    if kernels is not None and tuned and not int8_activations:  # (defaults: no 4-bit early)
        fused_max_rows = tune_fused_max_rows(tuned, kernels)
        kernel_max_rows = kernel_max_rows_for(tuned, kernels, fused_max_rows, cache_dir)
    layouts = Counter(t.kind for t in tiles.values())
    count = len(tiles)
    for name in list(tiles):  # each weight's float tiles go once 8-bit ones are made of them
        t = tiles.pop(name)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        packed = PackedLinear(t, kernels, fused_max_rows, int8_activations, kernel_max_rows)
        loaded = getattr(parent, attr).weight
        if (
            not from_file
            and not loaded.is_meta
            and not torch.equal(packed.dequantized(), loaded.detach().float().cpu())
        ):
            raise ValueError(
                f"{name}: packed blocks differ from the loaded weight "
                f"(is {gguf_path.name} the file this model was loaded from?)"
            )
        setattr(parent, attr, packed)
    if int8_activations:
        served = [m._int8 for m in model.modules() if isinstance(m, PackedLinear) and m._int8]
        warm_up_int8(served)
        warm_up_chunks(served)
    large_passes = (
        "every pass"
        if kernel_max_rows == UNBOUNDED_ROWS
        else f"passes of up to {kernel_max_rows} rows"
    )
    log.info(
        "packed %s linears in the kernels' layouts (%s)",
        _counts(layouts),
        f"8-bit activations ({isa.name})"
        if int8_activations and (isa := best_isa()) is not None
        else "numba kernels; 4-bit weights dequantized in registers for passes of up to "
        f"{fused_max_rows} rows, "
        f"the kernels for {large_passes}"
        if kernels is not None
        else "torch fallback: numba not installed",
    )
    return count


def _counts(counts: Counter[str]) -> str:
    return " + ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
