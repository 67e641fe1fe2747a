"""The bench's questions file (Spec-Bench's question.jsonl): read into prompts, or refused with
a message that names the file and where to get it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from app.cli import main
from service.bench.specbench import DatasetError, load_specbench, specbench_questions

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another."]},
    {"question_id": 82, "category": "writing", "turns": ["Left out by per_category=1."]},
    {"question_id": "math_1", "category": "math", "turns": ["What is 2 + 2?"], "reference": ["4"]},
]


class TurnTokenizer:
    """Stands in for a tokenizer with a chat template: a user turn's ids are its characters'
    code points."""

    chat_template = "{{ the turns' characters }}"

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], **_: object
    ) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for m in messages for c in m["content"]]}


class BaseModelTokenizer:
    """Stands in for a base model's tokenizer (no chat template): a text's ids are a BOS (1)
    and its characters' code points."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [1, *(ord(c) for c in text)]


def write(directory: Path, lines: Sequence[str]) -> Path:
    path = directory / "question.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_written_file_loads_each_first_turn_as_a_prompt(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps(q) for q in QUESTIONS[:2]] + ["", json.dumps(QUESTIONS[2])])

    prompts = load_specbench(path, TurnTokenizer(), per_category=1)

    assert [(p.question_id, p.category) for p in prompts] == [("81", "writing"), ("math_1", "math")]
    assert prompts[0].prompt_ids == [ord(c) for c in "Write a haiku."]
    assert [q.question_id for q in specbench_questions(path, categories=["math"])] == ["math_1"]


def test_a_base_model_takes_each_question_as_plain_text(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps(QUESTIONS[0])])

    prompts = load_specbench(path, BaseModelTokenizer())

    assert prompts[0].prompt_ids == [1, *(ord(c) for c in "Write a haiku.")]


def test_a_missing_file_is_an_error_naming_it_and_its_source(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "question.jsonl"

    with pytest.raises(DatasetError) as raised:
        specbench_questions(missing)

    assert str(missing) in str(raised.value)
    assert "github.com/hemingkx/Spec-Bench" in str(raised.value)
    assert "data/spec_bench/question.jsonl" in str(raised.value)


def test_a_line_not_in_the_format_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [json.dumps(QUESTIONS[0]), json.dumps({"question_id": 2, "turns": ["no category"]})],
    )

    with pytest.raises(DatasetError, match="line 2"):
        specbench_questions(path)


@pytest.mark.parametrize("command", ["bench", "steps", "loadtest"])
def test_the_commands_stop_with_the_message_not_a_traceback(
    command: str, tmp_path: Path, capsys
) -> None:
    missing = tmp_path / "question.jsonl"

    with pytest.raises(SystemExit) as exited:
        main([command, "--dataset", str(missing)])

    assert exited.value.code == 2  # argparse's usage error, before any model loads
    printed = capsys.readouterr().err
    assert str(missing) in printed and "github.com/hemingkx/Spec-Bench" in printed
    assert "Traceback" not in printed
