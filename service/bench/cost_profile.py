"""`ngrammys profile`: the forward-pass cost profile auto mode plans with, measured (or loaded),
printed as markdown tables of median ms per pass and slowdown over tree size and context
length, and optionally its (k, w) heatmap."""

from __future__ import annotations

from pathlib import Path

from service.bench.command import load
from service.engine.config import EngineConfig


def run_command(
    model: str | None,
    config: EngineConfig,
    random_weights: bool,
    remeasure: bool,
    png: Path | None,
    context_length: int,
) -> None:
    """Measure or load the profile of `model` (`random_weights`: its architecture alone, from its
    config.json, with random weights) and print it; `png`: the heatmap at `context_length`."""
    from service.controller.heatmap import write_heatmap
    from service.controller.profiler import load_or_measure
    from service.model.loader import random_model
    from service.model.runner import ModelRunner

    if random_weights:
        network, name = (
            random_model(model, config.device, config.dtype),
            f"{Path(model).name} (random weights)",
        )
    else:
        loaded = load(model, config)
        network, name = loaded.model, loaded.name
    runner = ModelRunner(network, static_passes=config.static_passes)
    profile = load_or_measure(runner, config.cache_dir, remeasure=remeasure)
    print(f"{name} on {profile.device}, {profile.dtype}: median ms per pass (slowdown vs n=rows)")
    for rows, sizes, table in zip(profile.rows, profile.tree_sizes, profile.seconds):
        print(f"\n{rows} row(s); n = tokens in the pass\n")
        _print_table(
            ["L \\ n", *sizes],
            [
                [length, f"{row[0] * 1e3:.1f}", *(f"x{s / row[0]:.2f}" for s in row[1:])]
                for length, row in zip(profile.context_lengths, table)
            ],
        )
    if profile.wide_row_seconds:
        print("\nwhat one wide row (a tree among one-token rows) adds beyond its tokens, ms\n")
        _print_table(
            ["rows \\ L", *profile.context_lengths],
            [
                [rows, *(f"{c * 1e3:.1f}" for c in costs)]
                for rows, costs in zip(profile.rows, profile.wide_row_seconds)
            ],
        )
    if png:
        write_heatmap(profile, context_length, png)
        print(f"\nwrote {png}")


def _print_table(header: list[object], rows: list[list[object]]) -> None:
    """A markdown table."""
    for line in [header, ["---"] * len(header), *rows]:
        print("| " + " | ".join(str(cell) for cell in line) + " |")
