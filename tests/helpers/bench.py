"""A small Spec-Bench-format question file for the bench commands."""

from __future__ import annotations

import json
from pathlib import Path

QUESTIONS = [
    {
        "question_id": 1,
        "category": "summarization",
        "turns": ["Repeat exactly: the cat sat on the mat. the cat sat on the mat.", "x"],
    },
    {
        "question_id": 2,
        "category": "summarization",
        "turns": ["Summarize: Alice met Bob. Bob met Carol."],
    },
    {"question_id": 3, "category": "summarization", "turns": ["ignored by --per-category 2"]},
    {"question_id": 4, "category": "math", "turns": ["What is 12 times 12?"]},
]


def write_dataset(directory: Path) -> str:
    """The questions as `directory`/question.jsonl; returns its path."""
    dataset = directory / "question.jsonl"
    dataset.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return str(dataset)
