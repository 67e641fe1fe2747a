"""`ngrammys bench`: plain against speculative decoding on Spec-Bench prompts, each method on an
engine of its own (so each learns across requests from its own runs only), beside the
references asked for; the tables, the JSON, and which answers parted from plain decoding.
`spike` instead measures auto mode's recovery from a load spike."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from service.bench import specbench as bench
from service.bench.command import UsageError, load
from service.bench.near_ties import Parting
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams


def run_command(
    model: str | None,
    config: EngineConfig,
    dataset: Path,
    per_category: int | None,
    categories: list[str] | None,
    strategies: list[str],
    k: int,
    w: int,
    grid: list[tuple[int, int]],
    auto: bool,
    spike: bool,
    max_new_tokens: int,
    sampling: SamplingParams,
    llama_cpp: Path | None,
    hf_generate: bool,
    json_path: Path | None,
) -> list[str]:
    """Run and print the bench (`llama_cpp`: the GGUF llama.cpp decodes as a reference;
    `hf_generate`: transformers' references, greedy); the methods whose answers parted from
    plain decoding's beyond near ties."""
    from service.runtime import build_engine, build_engine_with_tables, drafters_for

    loaded = load(model, config)
    drafters = drafters_for(loaded, config)
    engine = build_engine_with_tables(loaded, config, drafters)
    for strategy in strategies:
        try:
            engine.mixer.for_request([0], strategy)
        except ValueError as error:
            raise UsageError(str(error)) from None
    prompts = bench.load_specbench(dataset, loaded.tokenizer, per_category, categories)
    methods = bench.bench_methods(list(dict.fromkeys(strategies)), k, w, grid, auto)
    print(
        f"{loaded.name}: {len(prompts)} prompts; methods: {', '.join(methods)}; "
        f"max_new_tokens={max_new_tokens}, temperature={sampling.temperature}, "
        f"device={loaded.model.device}",
        flush=True,
    )

    def progress(
        prompt: Any, plain: Any, specs: dict[str, Any], partings: dict[str, Parting]
    ) -> None:
        cells = [
            f"{name} {spec.tokens_per_pass:.2f} tok/pass {spec.seconds:.2f}s"
            + (
                ""
                if spec.token_ids == plain.token_ids
                else " DIFFERENT" + _parting_text(partings.get(name))
            )
            for name, spec in specs.items()
        ]
        print(
            f"  {prompt.category}/{prompt.question_id}: plain {len(plain.token_ids)} tok "
            f"{plain.seconds:.2f}s | " + " | ".join(cells),
            flush=True,
        )

    if spike:
        _spike(
            engine,
            prompts,
            GenerationParams(
                max_new_tokens,
                speculation=SpeculationParams(k, w, "auto"),
                strategy=strategies[0],
                sampling=sampling,
            ),
        )
        return []

    def new_engine() -> Any:  # each method learns across requests from its own runs only
        fresh = build_engine(loaded, engine.mixer.tables, config, drafters)
        fresh.profile = engine.profile
        return fresh

    references: dict[str, Any] = {}
    if llama_cpp:
        from service.bench.llama_cpp_reference import llama_cpp_references

        references |= llama_cpp_references(llama_cpp, engine.eos_token_ids)
    if hf_generate:
        from service.bench.hf_generate_reference import hf_references

        references |= hf_references(loaded.model, engine.eos_token_ids)
    results = bench.run_bench(
        engine, prompts, methods, max_new_tokens, progress, sampling, new_engine, references
    )
    for name, by_category in results.items():
        print(f"\n### {name}\n\n{bench.format_table(by_category)}")
    if len(results) > 1:
        print(f"\n### tokens per pass (speedup over plain)\n\n{bench.format_summary(results)}")
    ours = {name: rows for name, rows in results.items() if name not in references}
    if auto:
        print(f"\n### auto vs fixed\n\n{bench.format_auto_report(ours)}")
    if json_path:
        json_path.write_text(
            bench.results_as_json(
                results,
                model=loaded.name,
                k=k,
                w=w,
                max_new_tokens=max_new_tokens,
                sampling=asdict(sampling),
                device=str(loaded.model.device),
                dtype=str(loaded.model.dtype),
            )
        )
        print(f"wrote {json_path}")
    near_ties = sum(rows[-1].near_ties for rows in ours.values())
    if near_ties:
        print(
            f"\n{near_ties} answers parted from plain decoding at a near tie of two tokens' logits "
            "(their true gap, recomputed at a higher precision, within what "
            f"{loaded.model.dtype}'s rounding "
            "moves logits there: not a defect)"
        )
    return bench.parted_beyond_near_ties(ours)


def _parting_text(parting: Parting | None) -> str:
    """Where an answer parted from plain decoding's (greedy runs): " from token i (n ulps...)"."""
    if parting is None:
        return ""
    unit = "ulp" if parting.ulps == 1 else "ulps"
    return (
        f" from token {parting.index} ({parting.ulps:g} {unit}"
        f"{', a near tie' if parting.near_tie else ''})"
    )


def _spike(engine: Engine, prompts: list[bench.BenchPrompt], params: GenerationParams) -> None:
    """Auto mode fresh, under busy processes, then after: a table row per prompt."""
    print(
        "| prompt | fresh tok/s | under load | after: first 50 rounds | after: later rounds "
        "| after: rounds with drafts |"
    )
    print("|---|---|---|---|---|---|")
    for prompt in prompts:
        r = bench.spike_recovery(engine, prompt.prompt_ids, params)
        rest = f"{r.after_rest:.1f}" if r.after_rest else f"— (done within {r.rounds} rounds)"
        print(
            f"| {prompt.category}/{prompt.question_id} | {r.fresh:.1f} | {r.during:.1f} "
            f"| {r.after_first_rounds:.1f} "
            f"({r.after_first_rounds / r.fresh:.0%}) | {rest} | {r.after_drafted_rounds} |",
            flush=True,
        )
