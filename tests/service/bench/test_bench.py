"""`ngrammys bench` end to end on a small Spec-Bench-format file and the embedded model."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from drafting import STANDALONE_NAMES, STRATEGY_NAMES
from tests.helpers.bench import write_dataset


@pytest.mark.slow
def test_bench_prints_table_and_writes_json(tmp_path, capsys, embedded) -> None:
    dataset, out = write_dataset(tmp_path), tmp_path / "bench.json"
    main(
        [
            "bench",
            "--dataset",
            dataset,
            "--per-category",
            "2",
            "--k",
            "4",
            "--w",
            "3",
            "--max-new-tokens",
            "12",
            "--strategy",
            "context",
            "mixed",
            "--grid",
            "1x2",
            "--auto",
            "--json",
            str(out),
        ]
    )

    printed = capsys.readouterr().out
    methods = ["context k4w3", "mixed k4w3", "context k1w2", "context auto"]
    assert all(f"### {name}" in printed for name in methods)
    assert "| summarization | 2 |" in printed and "| math | 1 |" in printed
    assert "### tokens per pass (speedup over plain)" in printed
    assert "### auto vs fixed" in printed
    report = json.loads(out.read_text())
    assert report["run"]["k"] == 4 and report["run"]["w"] == 3
    assert list(report["methods"]) == methods
    for name, categories in report["methods"].items():
        check_report(name.split()[0], categories)


def check_report(strategy: str, categories: list[dict]) -> None:
    by_name = {c["category"]: c for c in categories}
    assert set(by_name) == {"summarization", "math", "overall"}
    overall = by_name["overall"]
    assert overall["prompts"] == 3 and overall["identical"] == 3
    assert overall["plain"]["tokens"] == overall["speculative"]["tokens"] > 0
    assert overall["plain"]["passes"] == overall["plain"]["tokens"]  # plain: one token per pass
    assert overall["speculative_tokens_per_pass"] >= 1.0
    shares = overall["accepted_share_by_strategy"]
    assert set(shares) <= (
        {"context"} if strategy == "context" else set(STRATEGY_NAMES) - {"mixed", *STANDALONE_NAMES}
    )
    if shares:
        assert sum(shares.values()) == pytest.approx(1.0)
    assert 0 <= overall["speculative_draft_share"] < 1


@pytest.mark.slow
def test_bench_samples_alike_so_speculation_still_matches_plain(tmp_path, capsys, embedded) -> None:
    dataset, out = write_dataset(tmp_path), tmp_path / "bench.json"
    main(
        [
            "bench",
            "--dataset",
            dataset,
            "--category",
            "math",
            "--k",
            "4",
            "--w",
            "3",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--seed",
            "5",
            "--json",
            str(out),
        ]
    )

    report = json.loads(out.read_text())
    assert report["run"]["sampling"] == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "seed": 5,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
    }
    by_category = {c["category"]: c for c in report["methods"]["mixed k4w3"]}
    assert set(by_category) == {"math", "overall"}
    assert by_category["overall"]["identical"] == by_category["overall"]["prompts"] == 1
    assert (
        by_category["overall"]["plain"]["tokens"]
        == by_category["overall"]["speculative"]["tokens"]
        > 0
    )


def test_a_reference_decoder_runs_with_plain_parameters_and_its_agreement_is_counted(
    tiny_engine,
) -> None:
    """`references` (e.g. llama.cpp's greedy decoding) answer the same prompts with the plain
    parameters; their rows count agreement with plain decoding instead of requiring it."""
    from drafting import default_mixer
    from service.bench.specbench import BenchPrompt, bench_methods, run_bench
    from service.engine.engine import Engine
    from service.model.runner import ModelRunner
    from tests.helpers.models import make_tiny_model

    other = Engine(
        ModelRunner(make_tiny_model(seed=9)), default_mixer(None), eos_token_ids=[], max_context=512
    )
    prompts = [BenchPrompt(str(i), "math", [5, 9, 13, i + 2] * 3) for i in range(3)]
    results = run_bench(
        tiny_engine,
        prompts,
        bench_methods(["context"], 2, 2),
        10,
        references={"other model": other, "same model": tiny_engine},
    )
    assert list(results) == ["context k2w2", "other model", "same model"]
    same, different = (results[name][-1] for name in ("same model", "other model"))
    assert same.identical == same.prompts == 3  # the plain run again
    assert different.identical < 3  # another model's greedy answers
    for row in (same, different):
        assert row.speculative.passes == row.speculative.tokens == 30  # plain: a token a pass
        assert row.speculative.draft_tokens == 0


def test_transformers_generate_answers_like_plain_decoding_and_counts_its_passes() -> None:
    """`--hf-generate`: transformers' greedy generate and its prompt lookup, on the model object
    the engine serves, agree with plain decoding; greedy takes a pass a token, prompt lookup
    fewer once the answer repeats itself (a random model's greedy answers soon loop)."""
    from drafting import default_mixer
    from service.bench.hf_generate_reference import HF_GENERATE, HF_PROMPT_LOOKUP, hf_references
    from service.bench.specbench import BenchPrompt, run_bench
    from service.engine.engine import Engine
    from service.model.runner import ModelRunner
    from tests.helpers.models import make_tiny_model

    runner = ModelRunner(make_tiny_model(seed=4))
    engine = Engine(runner, default_mixer(None), eos_token_ids=[1], max_context=512)
    prompts = [BenchPrompt(str(i), "math", [5, 9, 13, i + 2] * 3) for i in range(3)]
    results = run_bench(engine, prompts, {}, 40, references=hf_references(runner.model, [1]))
    greedy, lookup = (results[name][-1] for name in (HF_GENERATE, HF_PROMPT_LOOKUP))
    assert greedy.identical == lookup.identical == greedy.prompts == 3
    assert greedy.speculative.passes == greedy.speculative.tokens == greedy.plain.tokens > 0
    assert lookup.speculative.passes < lookup.speculative.tokens == greedy.speculative.tokens
