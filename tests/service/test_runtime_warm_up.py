"""The server's warm-up (service/runtime.py): the model tables reach the strategies as they
are computed, the rows done so far first."""

from __future__ import annotations

from collections.abc import Generator
from types import SimpleNamespace

import numpy as np

from drafting import ModelTables, TableSlot
from service import runtime

BIGRAM = np.arange(40, dtype=np.uint32).reshape(5, 8) % 5
FINAL = ModelTables(unigram=np.array([0, 1], dtype=np.uint32), bigram=BIGRAM)
PARTIAL = ModelTables(unigram=FINAL.unigram, bigram=BIGRAM[:2])


def test_the_strategies_draft_from_partial_tables_until_the_whole_ones_come(monkeypatch) -> None:
    monkeypatch.setattr(runtime, "compile_table_kernels", lambda: None)
    slot = TableSlot()
    engine = SimpleNamespace(mixer=SimpleNamespace(tables=slot))

    def tables() -> Generator[ModelTables | None, None, ModelTables]:
        yield None
        yield PARTIAL
        yield None
        return FINAL

    steps = runtime.warm_up(engine, None, tables())  # type: ignore[arg-type]
    next(steps)  # the successor tables' kernels
    seen = [(next(steps), slot.tables) for _ in range(4)]
    assert all(worked is True for worked, _ in seen)
    assert [held for _, held in seen] == [None, PARTIAL, PARTIAL, FINAL]  # (the same objects)
    assert next(steps) is False  # nothing left to do
