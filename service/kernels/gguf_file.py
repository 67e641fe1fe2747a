"""The tensors of a GGUF file, memory-mapped, found without parsing its metadata.

gguf-py's `GGUFReader` parses every metadata value into numpy views: seconds for a tokenizer of
49k tokens and merges, on every start. A start needs only the tensors' names, types, shapes and
offsets, and a few numbers, so this walks past the metadata (keeping its scalar numbers, the
alignment and the architecture) and maps the data.
The layout is GGUF v2/v3's (ggml's docs/gguf.md): header, key-value pairs, tensor infos, then
the tensor data at an aligned offset. Little-endian files only, as llama.cpp writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# metadata value types: the struct format of each fixed-size one; 8 is a string, 9 an array
SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
SCALAR_BYTES = {kind: struct.calcsize(fmt) for kind, fmt in SCALAR_FORMATS.items()}
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """A file that is not a GGUF this reader can map."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `raw` is a read-only view of its bytes in the file, shaped
    [*shape[:-1], bytes a row]; `shape` is numpy's order (rows first; GGUF lists dimensions
    innermost first)."""

    name: str
    kind: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray

    def dequantized(self) -> np.ndarray:
        """The float32 weights, as gguf-py dequantizes them."""
        return gguf.dequantize(self.raw, self.kind).reshape(self.shape)


@dataclass(frozen=True)
class GGUFContents:
    """What a start needs of a GGUF: its architecture (`general.architecture`, llama.cpp's name:
    "llama", "qwen2", "gemma3"...), its tensors by name, in file order, and its scalar
    numbers by key ("llama.context_length": 8192)."""

    path: Path
    architecture: str
    tensors: dict[str, GGUFTensor]
    numbers: dict[str, int | float]

    def number(self, key: str) -> int | float | None:
        """The architecture's number `key` ("context_length" for "llama.context_length")."""
        return self.numbers.get(f"{self.architecture}.{key}")


class _Cursor:
    """Reads little-endian fields from a byte buffer at a moving offset."""

    def __init__(self, data: np.ndarray, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path

    def read(self, fmt: str) -> int:
        return int(self._unpack(fmt))

    def scalar(self, kind: int) -> int | float:
        """A metadata number of value type `kind` (`SCALAR_FORMATS`)."""
        return self._unpack(SCALAR_FORMATS[kind])

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise GGUFFormatError(f"{self.path}: the file ends inside its header")
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.read("<Q")
        start = self.offset
        self.offset += length
        return bytes(self.data[start : self.offset]).decode("utf-8", "replace")

    def skip_value(self, kind: int) -> None:
        if kind == STRING:
            length = self.read("<Q")
            self.offset += length
        elif kind == ARRAY:
            element, count = self.read("<I"), self.read("<Q")
            if element in SCALAR_BYTES:
                self.offset += count * SCALAR_BYTES[element]
            else:
                for _ in range(count):
                    self.skip_value(element)
        elif kind in SCALAR_BYTES:
            self.offset += SCALAR_BYTES[kind]
        else:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind}")


def read_gguf(path: Path) -> GGUFContents:
    """The architecture and tensors of the GGUF at `path`; raises `GGUFFormatError` for a file
    that is not one (or is cut short)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(data, path)
    if bytes(data[:4]) != MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file")
    cursor.offset = 4
    version = cursor.read("<I")
    if version not in VERSIONS:
        raise GGUFFormatError(f"{path}: GGUF version {version} (this reader maps v2 and v3)")
    n_tensors, n_values = cursor.read("<Q"), cursor.read("<Q")
    architecture, numbers = "", dict[str, int | float]()
    for _ in range(n_values):
        key, kind = cursor.string(), cursor.read("<I")
        if kind in SCALAR_FORMATS:
            numbers[key] = cursor.scalar(kind)
        elif key == "general.architecture" and kind == STRING:
            architecture = cursor.string()
        else:
            cursor.skip_value(kind)
    alignment = int(numbers.get("general.alignment", DEFAULT_ALIGNMENT))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.read("<Q") for _ in range(cursor.read("<I"))]
        infos.append((name, gguf.GGMLQuantizationType(cursor.read("<I")), dims, cursor.read("<Q")))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, kind, dims, offset in infos:
        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        row_bytes = shape[-1] // block_weights * block_bytes
        first = start + offset
        last = first + int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        if shape[-1] % block_weights or last > len(data):
            raise GGUFFormatError(f"{path}: tensor {name} does not fit the file")
        raw = data[first:last].reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, kind, shape, raw)
    return GGUFContents(path, architecture, tensors, numbers)
