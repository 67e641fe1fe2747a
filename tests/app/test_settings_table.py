"""The README's settings table is the one `Settings` generates, and it names every setting."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from app.settings_table import COMMAND, block, settings_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_settings_table_is_generated_from_settings() -> None:
    assert block(README.read_text(encoding="utf-8")) == settings_table(), (
        f"README.md's settings table is out of date: run `{COMMAND}`"
    )


def test_every_setting_has_a_row() -> None:
    rows = settings_table().splitlines()[2:]
    assert len(rows) == len(Settings.model_fields)
    for name, row in zip(Settings.model_fields, rows):
        assert row.startswith(f"| `--{name.replace('_', '-')}")
        assert f"`NGRAMMYS_{name.upper()}`" in row
