"""The README's settings table, generated from `Settings` so that it cannot drift from the code.

`python -m app.settings_table README.md` rewrites the block between the two markers below;
a test fails when the README's block differs from `settings_table()`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from app.settings import Settings

START = "<!-- settings-table:start -->"
END = "<!-- settings-table:end -->"
COMMAND = "python -m app.settings_table README.md"


def _flag(name: str, info: FieldInfo) -> str:
    """Booleans are switches (`--x / --no-x`); every other setting takes a value."""
    flag = "--" + name.replace("_", "-")
    if info.annotation is bool:
        return f"`{flag}` / `--no-{flag[2:]}`"
    return f"`{flag} VALUE`"


def _default(value: Any) -> str:
    """A default as a user reads it: none shown where the description says what is derived, a
    boolean as its variable takes it, and a path under the home directory as `~/...`, so the
    table is the same on every machine."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        value = str(value).lower()
    if isinstance(value, Path) and value.is_relative_to(Path.home()):
        value = "~/" + value.relative_to(Path.home()).as_posix()
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    """A markdown table of every server setting: flag, environment variable, default,
    description."""
    prefix = Settings.model_config.get("env_prefix", "")
    lines = ["| flag | environment variable | default | description |", "|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        env = f"`{prefix}{name.upper()}`"
        lines.append(
            f"| {_flag(name, info)} | {env} | {_default(info.default)} | "
            f"{_cell(info.description or '')} |"
        )
    return "\n".join(lines)


def _span(text: str) -> tuple[int, int]:
    """Where the block's content starts and ends in `text`."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} block")
    return start + len(START), end


def replace_block(text: str, table: str) -> str:
    """`text` with the lines between START and END replaced by `table`."""
    start, end = _span(text)
    return text[:start] + "\n" + table + "\n" + text[end:]


def block(text: str) -> str:
    """The table between the markers of `text`."""
    start, end = _span(text)
    return text[start:end].strip("\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {COMMAND}", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(
        replace_block(path.read_text(encoding="utf-8"), settings_table()), encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
