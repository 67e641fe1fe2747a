"""`ngrammys prepare`, the image's bake step: it fills the cache `serve` would use with the same
NGRAMMYS_* settings, and says whether it read and computed or found them cached. (The slow
image test runs it for real on the embedded model.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from app import cli


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []

    def load_model(model, device, dtype, cache_dir, quantization="auto"):
        calls.append(("load", model, device, dtype, cache_dir, quantization))
        cached = (cache_dir / "gguf").exists()
        (cache_dir / "gguf").mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(
            model=SimpleNamespace(dtype="torch.float32"),
            tokenizer=None,
            name="M",
            from_cache=cached,
        )

    def load_or_compute_tables(model, cache_dir, prefix, show_progress=True):
        calls.append(("tables", cache_dir, prefix))
        (cache_dir / "tables").mkdir(parents=True, exist_ok=True)
        (cache_dir / "tables" / "key.npz").touch()

    monkeypatch.setattr("service.model.loader.load_model", load_model)
    monkeypatch.setattr("service.model.tables.load_or_compute_tables", load_or_compute_tables)
    monkeypatch.setattr("service.model.prompts.assistant_prefix_ids", lambda tokenizer: [7, 8])
    return calls


def test_prepare_reads_the_settings_serve_reads(
    fakes: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NGRAMMYS_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setenv("NGRAMMYS_DTYPE", "bfloat16")
    monkeypatch.setenv("NGRAMMYS_QUANTIZATION", "none")
    cli.main(["prepare"])
    assert fakes[0] == ("load", None, None, "bfloat16", tmp_path / "env-cache", "none")
    assert fakes[1] == ("tables", tmp_path / "env-cache", [7, 8])  # the prefix serve's warm-up uses
    assert "model read, tables computed" in capsys.readouterr().out

    cli.main(
        [
            "prepare",
            "--cache-dir",
            str(tmp_path / "flag-cache"),
            "--dtype",
            "float32",
            "--quantization",
            "gguf",
        ]
    )
    assert fakes[2] == ("load", None, None, "float32", tmp_path / "flag-cache", "gguf")  # flags win


def test_prepare_says_when_everything_was_cached(
    fakes: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main(["prepare", "--cache-dir", str(tmp_path)])
    cli.main(["prepare", "--cache-dir", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[-1].endswith("model cached, tables cached")
