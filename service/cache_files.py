"""Write cached artefacts atomically and read them back checked, so that a cache heals.

Everything the server keeps under its cache directory (a GGUF's config and tokenizer, model
tables, packed tiles, the cost profile, kernel limits) can be rebuilt from the model, so a file
that is truncated, altered or half-written by a process that died is never worth a crash, and
never worth a wrong answer either: `read_cached` turns any failure to read one into a warning naming
the file and what was wrong, and the caller builds the artefact again.

Writers go through `write_atomically`: the bytes go to a temporary file in the same directory,
which `os.replace` then puts in place, so a reader sees the old file or the new one, never half
of one, and two servers starting on one cache directory at once both come up (the last rename
wins; each wrote a whole file). A directory (a GGUF's config and tokenizer) is built aside and
renamed the same way (`cached_directory`). JSON artefacts carry a sha256 of their content
(`write_checked_json`), directories a manifest of every file's size and sha256; npz files need
neither, since zip keeps a CRC-32 of every array that reading it checks, but their readers check
the arrays' keys and shapes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKSUM_KEY = "sha256"
MANIFEST_FILE = "cache-manifest.json"


class CorruptCacheFile(ValueError):
    """A cached artefact that is truncated, altered, or not what its reader expects."""


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write` with a temporary file beside `path`, then put that file at `path` in one
    rename; on any failure the temporary file is removed and the error raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(path, "partial")
    try:
        with os.fdopen(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def read_cached(path: Path, read: Callable[[Path], T], what: str) -> T | None:
    """`read(path)`, or None when there is no file at `path` or it cannot be read: then a
    warning names the file and the error, and the caller rebuilds the artefact."""
    if not path.exists():
        return None
    try:
        return read(path)
    except FileNotFoundError:  # removed since: as if never there
        return None
    except Exception as error:  # noqa: BLE001 - whatever broke the file, the remedy is a rebuild
        log.warning(
            "the cached %s %s is unreadable (%s: %s); building it again",
            what,
            path,
            type(error).__name__,
            error,
        )
        return None


def write_checked_json(path: Path, data: dict[str, Any]) -> None:
    """Save `data` as JSON at `path` (atomically) with a sha256 of its content beside it."""
    document = {**data, CHECKSUM_KEY: _json_digest(data)}
    write_atomically(path, lambda file: file.write(json.dumps(document, indent=2).encode()))


def read_checked_json(path: Path) -> dict[str, Any]:
    """The data `write_checked_json` saved at `path`; `CorruptCacheFile` (naming the file) if it
    is no JSON object, has no checksum, or its content no longer matches it."""
    try:
        document = json.loads(path.read_bytes())
    except ValueError as error:  # undecodable bytes or truncated JSON
        raise CorruptCacheFile(f"{path} is not valid JSON ({error})") from error
    if not isinstance(document, dict) or CHECKSUM_KEY not in document:
        raise CorruptCacheFile(f"{path} has no {CHECKSUM_KEY} of its content")
    expected = document.pop(CHECKSUM_KEY)
    if _json_digest(document) != expected:
        raise CorruptCacheFile(f"{path}: its content does not match its {CHECKSUM_KEY}")
    return document


def cached_directory(directory: Path, build: Callable[[Path], None], what: str) -> bool:
    """Make sure `directory` holds a whole, unaltered build: True if it already did; else
    (absent, or failing its manifest: a warning) `build` fills a fresh temporary sibling, which
    gets a manifest and is renamed to `directory`, and the result is False. Another process
    that renamed its own build first wins; this one's is discarded."""
    if directory.is_dir():
        try:
            _check_manifest(directory)
            return True
        except Exception as error:  # noqa: BLE001 - whatever broke it, the remedy is a rebuild
            log.warning(
                "the cached %s %s is damaged (%s); building it again", what, directory, error
            )
            _discard(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(directory, "partial")
    staging.mkdir()
    try:
        build(staging)
        _write_manifest(staging)
        try:
            staging.rename(directory)
        except OSError:
            if not directory.is_dir():
                raise  # another process finished first otherwise: its build is as good
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone if renamed; else not needed
    return False


def file_sha256(path: Path) -> str:
    """The sha256 of the file at `path`, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _json_digest(data: dict[str, Any]) -> str:
    """The sha256 of `data` in a canonical JSON form (floats round-trip exactly through JSON,
    so the form read back hashes as the one written)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _write_manifest(directory: Path) -> None:
    """Record every file under `directory` with its size and sha256."""
    files = {
        str(path.relative_to(directory)): {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    write_checked_json(directory / MANIFEST_FILE, {"files": files})


def _check_manifest(directory: Path) -> None:
    """`CorruptCacheFile` unless every file the manifest lists is there, of its size and
    sha256 (files added later, beside it, are not the manifest's business)."""
    manifest = directory / MANIFEST_FILE
    if not manifest.exists():
        raise CorruptCacheFile(f"{manifest} is missing (an interrupted or older build)")
    for name, expected in read_checked_json(manifest)["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != expected["size"]:
            raise CorruptCacheFile(f"{path} is missing or not of its recorded size")
        if file_sha256(path) != expected["sha256"]:
            raise CorruptCacheFile(f"{path} does not match its recorded sha256")


def _discard(directory: Path) -> None:
    """Move `directory` out of the way at once (one rename), then delete it; another process
    that moved it first has done the same."""
    aside = _sibling(directory, "damaged")
    try:
        directory.rename(aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _sibling(path: Path, kind: str) -> Path:
    """A hidden name beside `path` that no other writer picks (this process's id and a random
    part). Created by the caller with the default permissions (the umask's), as the artefact
    itself would be: a cache another user serves from must stay readable to it."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
