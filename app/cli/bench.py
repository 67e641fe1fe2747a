"""`ngrammys bench`: plain vs speculative decoding on Spec-Bench prompts
(`service/bench/bench_run.py`); `--task`, a repetitive workload instead
(`service/bench/workload.py`); `--spike`, auto mode's recovery from a load spike."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from app.cli.flags import dataset, engine_config, llama_cpp_model, model_flags
from app.settings import Settings
from drafting import MIXED, STRATEGY_NAMES
from service.bench import bench_run, workload
from service.bench.command import UsageError
from service.engine.params import SamplingParams


def _shape(text: str) -> tuple[int, int]:
    k, _, w = text.lower().partition("x")
    return int(k), int(w)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", type=dataset, required=True, help="Spec-Bench question.jsonl")
    parser.add_argument(
        "--per-category", type=int, default=None, help="first N questions per category"
    )
    parser.add_argument(
        "--category", nargs="+", default=None, help="only these categories (default: all)"
    )
    parser.add_argument(
        "--k", type=int, default=4, help="speculations per round (the maximum in auto)"
    )
    parser.add_argument(
        "--w", type=int, default=4, help="tokens per speculation (the maximum in auto)"
    )
    parser.add_argument(
        "--grid",
        type=_shape,
        nargs="*",
        default=[],
        metavar="KxW",
        help="more fixed shapes for the first strategy, e.g. 1x1 2x4 8x8",
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help="also run the first strategy in auto mode (measures the cost profile first)",
    )
    parser.add_argument(
        "--task",
        default=None,
        metavar="TEMPLATE",
        help="instead: a repetitive workload, this task (with a {text} field) over each question's "
        "text, requests in order; each strategy with and without the suffix index",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --task: send the whole series this many times (popular requests asked again)",
    )
    parser.add_argument(
        "--spike",
        action="store_true",
        help="instead: auto mode fresh, under 3 busy processes, then after (load-spike recovery)",
    )
    parser.add_argument(
        "--strategy",
        nargs="+",
        default=[MIXED],
        help="draft strategies to compare (each against the same plain run): "
        f"{', '.join(STRATEGY_NAMES)}, self_draft_<m> when several --self-draft-layers are given, "
        "or a mix joined with '+' (e.g. context+self_draft)",
    )
    parser.add_argument(
        "--self-draft-layers",
        type=int,
        nargs="*",
        default=[],
        metavar="M",
        help="enable self-drafting with the model's first M layers (several M: strategies "
        "self_draft_<M>, to compare depths)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="enable the draft_model strategy with this model directory or .gguf",
    )
    parser.add_argument(
        "--staged",
        action="store_true",
        help="also the staged twin of every model draft (<name>_staged)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=Settings.model_fields["suffix_cache_tokens"].default,
        help=Settings.model_fields["suffix_cache_tokens"].description,
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; every run samples alike"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed of every run, so plain and speculative samples compare token for token",
    )
    model_flags(parser)
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also decode each prompt with llama.cpp's own greedy decoding of the same GGUF "
        "(needs the llama-cpp extra, which compiles llama.cpp)",
    )
    parser.add_argument(
        "--hf-generate",
        action="store_true",
        help="also decode each prompt with transformers' greedy generate and its prompt lookup, "
        "on the same model (greedy only)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.task:
        workload.run_command(
            args.model,
            engine_config(args),
            args.dataset,
            args.per_category,
            args.category,
            args.task,
            args.repeat,
            args.strategy,
            args.k,
            args.w,
            args.suffix_cache_tokens,
            args.max_new_tokens,
            sampling,
        )
        return
    if args.hf_generate and args.temperature > 0 and not args.spike:
        sys.exit("ngrammys bench: --hf-generate compares greedy decoding")
    config = engine_config(
        args,
        cost_profile=args.auto or args.spike,
        suffix_cache_tokens=args.suffix_cache_tokens,
        self_draft_layers=tuple(args.self_draft_layers),
        draft_model=args.draft_model,
        draft_staged=args.staged,
    )
    try:
        parted = bench_run.run_command(
            args.model,
            config,
            args.dataset,
            args.per_category,
            args.category,
            args.strategy,
            args.k,
            args.w,
            args.grid,
            args.auto,
            args.spike,
            args.max_new_tokens,
            sampling,
            llama_cpp_model(args) if args.llama_cpp and not args.spike else None,
            args.hf_generate,
            args.json,
        )
    except UsageError as error:
        sys.exit(f"ngrammys bench: {error}")
    if parted:
        sys.exit(
            "speculative output differed from plain decoding with the same sampling and seed, "
            f"not at a near tie: {', '.join(parted)}"
        )
