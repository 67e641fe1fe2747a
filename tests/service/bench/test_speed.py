"""`ngrammys speed`: prompt processing and decoding tokens/s from a method's `complete`, the
references beside the engine, and the command end to end."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from service.bench import speed
from service.bench.hf_generate_reference import HfGenerate
from service.engine.outputs import Completion
from tests.helpers.bench import write_dataset
from tests.helpers.models import make_tiny_model


def test_the_stream_cycles_the_prompts_to_the_length() -> None:
    assert speed.token_stream([[1, 2], [3]], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_rates_come_from_the_fastest_run_and_decoding_excludes_the_first_token() -> None:
    """A fake clock: a prompt costs 1 ms a token, a decoded token 10 ms, the first run of each
    call 5 ms more (the fastest counts)."""
    clock = {"now": 0.0}
    seen: dict[tuple[int, int], int] = {}

    def complete(prompt, params) -> Completion:
        key = (len(prompt), params.max_new_tokens)
        seen[key] = seen.get(key, 0) + 1
        clock["now"] += (
            0.001 * len(prompt)
            + 0.010 * (params.max_new_tokens - 1)
            + (0.005 if seen[key] == 1 else 0)
        )
        return Completion(token_ids=[0] * params.max_new_tokens)

    timed = pytest.MonkeyPatch()
    timed.setattr(speed.time, "perf_counter", lambda: clock["now"])
    try:
        result = speed.measure("fake", complete, list(range(300)), lengths=(100, 200), repeats=2)
    finally:
        timed.undo()
    assert result.prompt == pytest.approx({100: 1000.0, 200: 1000.0})
    assert result.decode == pytest.approx(100.0)
    table = speed.format_speeds([result, speed.Speed("half", {100: 500.0, 200: 500.0}, 50.0)])
    assert "| half | 500 (0.50×) | 500 (0.50×) | 50.0 (0.50×) |" in table


def test_a_method_that_stops_early_is_refused() -> None:
    with pytest.raises(RuntimeError, match="asked for 129 tokens, got 3"):
        speed.measure(
            "short",
            lambda prompt, params: Completion(token_ids=[0] * min(3, params.max_new_tokens)),
            list(range(100)),
            lengths=(10,),
            repeats=1,
        )


def test_transformers_without_stop_tokens_decodes_exactly_the_budget() -> None:
    from service.engine.params import GenerationParams

    model = make_tiny_model(seed=4)
    completion = HfGenerate(model, ()).complete([5, 9, 13], GenerationParams(max_new_tokens=20))
    assert len(completion.token_ids) == 20


@pytest.mark.slow
def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch) -> None:
    import service.runtime

    built = []
    build_engine = service.runtime.build_engine
    monkeypatch.setattr(
        service.runtime,
        "build_engine",
        lambda *a, **k: built.append(build_engine(*a, **k)) or built[-1],
    )
    out = tmp_path / "speed.json"
    main(
        [
            "speed",
            "--dataset",
            write_dataset(tmp_path),
            "--lengths",
            "16",
            "64",
            "--repeats",
            "1",
            "--transformers",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "| method | prompt 16 tok/s | prompt 64 tok/s | decode tok/s |" in printed
    rows = json.loads(out.read_text())
    assert [row["method"].split(" (")[0] for row in rows] == ["ngrammys", "transformers generate"]
    assert all(row["decode"] > 0 and set(row["prompt"]) == {"16", "64"} for row in rows)
    # each length runs several times, and the longer prompts start as the shorter:
    # none may be cached
    assert len(built) == 1 and built[0].scheduler.prefix is None
