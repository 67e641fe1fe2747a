"""The `ngrammys serve` flags of the servers `loadtest` and `neighbour` start (`app/background.py`)
when no `--url` is given; their load clients (`service/bench/`) only see the URL."""

from __future__ import annotations

import argparse


def loadtest_server_flags(args: argparse.Namespace, prefix_cache: bool = False) -> list[str]:
    """`ngrammys serve` flags of the server the load test starts: without a prefix cache unless
    asked (the Spec-Bench load test cycles its questions through both modes on one server, and
    the mode that runs later would find the earlier one's prompts cached)."""
    flags = [
        "--max-running-requests",
        str(args.max_running_requests),
        "--max-waiting",
        str(max(args.concurrency) * 2),
        "--max-tokens-per-pass",
        str(args.max_tokens_per_pass),
        "--suffix-cache-tokens",
        str(args.suffix_cache_tokens),
        *([] if prefix_cache else ["--no-prefix-cache"]),
    ]
    if args.max_prefill_tokens_while_decoding is not None:
        flags += [
            "--max-prefill-tokens-while-decoding",
            str(args.max_prefill_tokens_while_decoding),
        ]
    if args.prefill_pass_ms is not None:
        flags += ["--prefill-pass-ms", str(args.prefill_pass_ms)]
    return flags + model_serve_flags(args)


def model_serve_flags(args: argparse.Namespace) -> list[str]:
    """The `ngrammys serve` flags that load the model `args` names (`app/cli/flags.py`'s
    `model_flags`)."""
    flags = ["--cache-dir", str(args.cache_dir)]
    for flag, value in (
        ("--model", args.model),
        ("--device", args.device),
        ("--dtype", args.dtype),
        ("--quantization", args.quantization),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags
