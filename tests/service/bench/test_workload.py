"""The repetitive multi-request workload: methods on engines of their own, outputs checked."""

from __future__ import annotations

from drafting import default_mixer
from service.bench.specbench import BenchPrompt
from service.bench.workload import WorkloadMethod, format_workload, run_workload
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SpeculationParams


def test_the_suffix_index_pays_on_requests_that_repeat_each_other(tiny_runner, tiny_tables) -> None:
    def method(name: str, strategy: str, k: int, cache_tokens: int) -> WorkloadMethod:
        engine = Engine(
            tiny_runner,
            default_mixer(tiny_tables, suffix_cache_tokens=cache_tokens),
            eos_token_ids=[],
            max_context=512,
        )
        return WorkloadMethod(
            name,
            engine,
            GenerationParams(30, speculation=SpeculationParams(k, 4), strategy=strategy),
        )

    # one task, asked three times
    prompts = [BenchPrompt(str(i), "task", [5, 9, 13, 2, 7]) for i in range(3)]
    methods = [
        method("plain", "mixed", 0, 0),
        method("suffix", "suffix", 4, 10_000),
        method("mixed", "mixed", 4, 10_000),
        method("mixed no suffix", "mixed", 4, 0),
    ]
    results = run_workload(methods, prompts)
    assert all(r.identical == r.prompts == 3 for r in results.values())
    # the first request finds nothing (30 passes), the 2nd and 3rd replay it: 5 tokens a pass
    assert results["suffix"].totals.passes <= 30 + 2 * 30 // 5 + 4
    assert (
        results["mixed"].totals.tokens_per_pass > results["mixed no suffix"].totals.tokens_per_pass
    )
    table = format_workload(results)
    assert "| suffix | 90 |" in table and "| mixed no suffix |" in table
