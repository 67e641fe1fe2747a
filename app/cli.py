"""`ngrammys serve` and `ngrammys bench`.

`serve` flags are generated from the `Settings` fields, so a flag, its `NGRAMMYS_*`
variable and its documentation never drift apart.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.settings import Settings
from drafting import MIXED, STRATEGY_NAMES
from service.config import SamplingParams
from service.model_loader import DEFAULT_CACHE_DIR
from service.packed_linear import QUANTIZATIONS


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        shown_default = "" if info.default is None else f"; default: {info.default}"
        parser.add_argument(
            flag, dest=name, default=None, metavar=name.upper(),
            help=f"{info.description} [env NGRAMMYS_{name.upper()}{shown_default}]",
        )


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.main import create_app

    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name) is not None}
    settings = Settings(**given)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower())


def _bench(args: argparse.Namespace) -> None:
    from service import bench
    from service.model_loader import load_model
    from service.runtime import build_engine_with_tables

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
    engine = build_engine_with_tables(loaded, args.cache_dir, profile=args.auto)
    prompts = bench.load_specbench(args.dataset, loaded.tokenizer, args.per_category, args.category)
    strategies = list(dict.fromkeys(args.strategy))
    methods = bench.bench_methods(strategies, args.k, args.w, args.grid, args.auto)
    print(f"{loaded.name}: {len(prompts)} prompts; methods: {', '.join(methods)}; "
          f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, device={loaded.model.device}",
          flush=True)

    def progress(prompt: Any, plain: Any, specs: dict[str, Any]) -> None:
        cells = [
            f"{name} {spec.tokens_per_pass:.2f} tok/pass {spec.seconds:.2f}s"
            + ("" if spec.token_ids == plain.token_ids else " DIFFERENT")
            for name, spec in specs.items()
        ]
        print(f"  {prompt.category}/{prompt.question_id}: plain {len(plain.token_ids)} tok "
              f"{plain.seconds:.2f}s | " + " | ".join(cells), flush=True)

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    results = bench.run_bench(engine, prompts, methods, args.max_new_tokens, progress, sampling)
    for name, by_category in results.items():
        print(f"\n### {name}\n\n{bench.format_table(by_category)}")
    if len(results) > 1:
        print(f"\n### tokens per pass (speedup over plain)\n\n{bench.format_summary(results)}")
    if args.auto:
        print(f"\n### auto vs fixed\n\n{bench.format_auto_report(results)}")
    if args.json:
        args.json.write_text(bench.results_as_json(
            results, model=loaded.name, k=args.k, w=args.w, max_new_tokens=args.max_new_tokens, sampling=asdict(sampling),
            device=str(loaded.model.device), dtype=str(loaded.model.dtype),
        ))
        print(f"wrote {args.json}")
    if any(r.identical != r.prompts for rows in results.values() for r in rows):
        sys.exit("speculative output differed from plain decoding with the same sampling and seed")


def _profile(args: argparse.Namespace) -> None:
    from service.heatmap import write_heatmap
    from service.model_loader import load_model
    from service.model_runner import ModelRunner
    from service.profiler import load_or_measure

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
    profile = load_or_measure(ModelRunner(loaded.model), args.cache_dir, remeasure=args.remeasure)
    print(f"{loaded.name} on {profile.device}, {profile.dtype}: median ms per pass (slowdown vs n=1)\n")
    print("| L \\ n | " + " | ".join(str(n) for n in profile.tree_sizes) + " |")
    print("|---" * (len(profile.tree_sizes) + 1) + "|")
    for length, row in zip(profile.context_lengths, profile.seconds):
        cells = [f"{row[0] * 1e3:.1f}"] + [f"x{s / row[0]:.2f}" for s in row[1:]]
        print(f"| {length} | " + " | ".join(cells) + " |")
    if args.png:
        write_heatmap(profile, args.context_length, args.png)
        print(f"\nwrote {args.png}")


def _shape(text: str) -> tuple[int, int]:
    k, _, w = text.lower().partition("x")
    return int(k), int(w)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: embedded)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: bfloat16 on GPUs and on CPUs with native bf16)")
    parser.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default=Settings.model_fields["quantization"].default,
                        help=Settings.model_fields["quantization"].description)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ngrammys", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _settings_flags(serve)
    serve.set_defaults(run=_serve)
    bench = commands.add_parser("bench", help="plain vs speculative decoding on Spec-Bench prompts")
    bench.add_argument("--dataset", type=Path, required=True, help="Spec-Bench question.jsonl")
    bench.add_argument("--per-category", type=int, default=None, help="first N questions per category")
    bench.add_argument("--category", nargs="+", default=None, help="only these categories (default: all)")
    bench.add_argument("--k", type=int, default=4, help="speculations per round (the maximum in auto)")
    bench.add_argument("--w", type=int, default=4, help="tokens per speculation (the maximum in auto)")
    bench.add_argument("--grid", type=_shape, nargs="*", default=[], metavar="KxW",
                       help="more fixed shapes for the first strategy, e.g. 1x1 2x4 8x8")
    bench.add_argument("--auto", action="store_true",
                       help="also run the first strategy in auto mode (measures the cost profile first)")
    bench.add_argument("--strategy", choices=STRATEGY_NAMES, nargs="+", default=[MIXED],
                       help="draft strategies to compare (each against the same plain run)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; every run samples alike")
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--seed", type=int, default=0,
                       help="sampling seed of every run, so plain and speculative samples compare token for token")
    _model_flags(bench)
    bench.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    bench.set_defaults(run=_bench)
    profile = commands.add_parser("profile", help="measure forward-pass cost over tree size and context length")
    _model_flags(profile)
    profile.add_argument("--remeasure", action="store_true", help="ignore the saved profile")
    profile.add_argument("--png", type=Path, default=None, help="write the (k, w) slowdown heatmap here")
    profile.add_argument("--context-length", type=int, default=256, help="context length of the heatmap")
    profile.set_defaults(run=_profile)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
