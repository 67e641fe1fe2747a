"""`ngrammys serve`, `worker`, `prepare`, `bench`, `profile`, `steps`, `loadtest` and `neighbour`.

`serve` flags are generated from the `Settings` fields, so a flag, its `NGRAMMYS_*`
variable and its documentation never drift apart.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from app.loadtest import MODES as LOAD_MODES
from app.prefix_workloads import WORKLOADS as PREFIX_WORKLOADS
from app.settings import DEVICE_ROUND_SWITCH, Settings
from drafting import MIXED, STRATEGY_NAMES
from service.engine.config import EngineConfig
from service.engine.params import SamplingParams
from service.model.loader import DEFAULT_CACHE_DIR
from service.kernels.packed_linear import QUANTIZATIONS
from service.bench.speed import PROMPT_LENGTHS
from service.bench.step_bench import REQUESTS_PER_SLOT

if TYPE_CHECKING:
    from service.bench.near_ties import Parting


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; a boolean one is a switch, `--x` / `--no-x`. Unset flags stay None,
    so the `NGRAMMYS_*` variables and the defaults decide them."""
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        shown_default = "" if info.default is None else f"; default: {info.default}"
        text = f"{info.description} [env NGRAMMYS_{name.upper()}{shown_default}]"
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=text)


def serve_settings(args: argparse.Namespace) -> Settings:
    """The server's settings: the flags given, else the `NGRAMMYS_*` variables, else the defaults."""
    return Settings(**{name: getattr(args, name) for name in Settings.model_fields if getattr(args, name) is not None})


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.main import create_app
    from app.shutdown import DrainingServer

    def stop() -> None:  # the model failed to load: this process can never serve
        server.should_exit = True

    try:
        settings = serve_settings(args)
        app = create_app(settings, on_load_failure=stop)
    except (ValueError, OSError) as error:  # bad settings, an unreadable key file
        sys.exit(f"ngrammys serve: {error}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, app, settings.drain_timeout)
    server.run()
    if app.state.load_error:
        sys.exit(f"ngrammys serve: the model failed to load: {app.state.load_error}")
    if not server.started:
        sys.exit(3)  # uvicorn could not start (e.g. the port is taken); it logged why


def _worker(args: argparse.Namespace) -> None:
    from app.ranks import run_worker

    try:
        settings = serve_settings(args)
    except ValueError as error:
        sys.exit(f"ngrammys worker: {error}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(settings)


def _prepare(args: argparse.Namespace) -> None:
    """Convert the model and compute its tables into the cache `serve` will read (an image bakes them);
    when the quantization resolves to gguf, also the packed tiles and the compiled numba kernels
    (`<cache>/numba`), so a server with the same settings starts without compiling."""
    from service.model.loader import load_model
    from service.model.tables import load_or_compute_tables
    from service.model.prompts import assistant_prefix_ids

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = Settings()  # unset flags fall back to NGRAMMYS_*, as `serve` reads them
    model, device, dtype = args.model or env.model, args.device or env.device, args.dtype or env.dtype
    cache_dir, quantization = args.cache_dir or env.cache_dir, args.quantization or env.quantization
    loaded = load_model(model, device, dtype, cache_dir, quantization)
    before = set((cache_dir / "tables").glob("*.npz"))
    load_or_compute_tables(loaded.model, cache_dir, assistant_prefix_ids(loaded.tokenizer), show_progress=False)
    tables = "computed" if set((cache_dir / "tables").glob("*.npz")) - before else "cached"
    print(f"{loaded.name} ({loaded.model.dtype}) in {cache_dir}: weights "
          f"{'cached' if loaded.from_cache else 'converted'}, tables {tables}", flush=True)


def _bench(args: argparse.Namespace) -> None:
    from service.bench import specbench as bench
    from service.model.loader import load_model
    from service.runtime import build_engine, build_engine_with_tables, drafters_for

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
    if args.task:
        _workload(loaded, args)
        return
    config = _engine_config(args, cost_profile=args.auto or args.spike, suffix_cache_tokens=args.suffix_cache_tokens,
                            self_draft_layers=tuple(args.self_draft_layers), draft_model=args.draft_model,
                            draft_staged=args.staged)
    drafters = drafters_for(loaded, config)
    engine = build_engine_with_tables(loaded, config, drafters)
    for strategy in args.strategy:
        try:
            engine.mixer.for_request([0], strategy)
        except ValueError as error:
            sys.exit(f"ngrammys bench: {error}")
    prompts = bench.load_specbench(args.dataset, loaded.tokenizer, args.per_category, args.category)
    strategies = list(dict.fromkeys(args.strategy))
    methods = bench.bench_methods(strategies, args.k, args.w, args.grid, args.auto)
    print(f"{loaded.name}: {len(prompts)} prompts; methods: {', '.join(methods)}; "
          f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, device={loaded.model.device}",
          flush=True)

    def progress(prompt: Any, plain: Any, specs: dict[str, Any], partings: dict[str, Parting]) -> None:
        cells = [
            f"{name} {spec.tokens_per_pass:.2f} tok/pass {spec.seconds:.2f}s"
            + ("" if spec.token_ids == plain.token_ids else " DIFFERENT" + _parting_text(partings.get(name)))
            for name, spec in specs.items()
        ]
        print(f"  {prompt.category}/{prompt.question_id}: plain {len(plain.token_ids)} tok "
              f"{plain.seconds:.2f}s | " + " | ".join(cells), flush=True)

    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.spike:
        _spike(engine, prompts, args, sampling)
        return

    def new_engine() -> Any:  # each method learns across requests from its own runs only
        fresh = build_engine(loaded, engine.mixer.tables, config, drafters)
        fresh.profile = engine.profile
        return fresh

    references = _llama_cpp(args, engine.eos_token_ids) if args.llama_cpp else {}
    if args.hf_generate:
        from service.bench.hf_generate_reference import hf_references

        if args.temperature > 0:
            sys.exit("ngrammys bench: --hf-generate compares greedy decoding")

        references |= hf_references(loaded.model, engine.eos_token_ids)
    results = bench.run_bench(engine, prompts, methods, args.max_new_tokens, progress, sampling, new_engine, references)
    for name, by_category in results.items():
        print(f"\n### {name}\n\n{bench.format_table(by_category)}")
    if len(results) > 1:
        print(f"\n### tokens per pass (speedup over plain)\n\n{bench.format_summary(results)}")
    ours = {name: rows for name, rows in results.items() if name not in references}
    if args.auto:
        print(f"\n### auto vs fixed\n\n{bench.format_auto_report(ours)}")
    if args.json:
        args.json.write_text(bench.results_as_json(
            results, model=loaded.name, k=args.k, w=args.w, max_new_tokens=args.max_new_tokens, sampling=asdict(sampling),
            device=str(loaded.model.device), dtype=str(loaded.model.dtype),
        ))
        print(f"wrote {args.json}")
    near_ties = sum(rows[-1].near_ties for rows in ours.values())
    if near_ties:
        print(f"\n{near_ties} answers parted from plain decoding at a near tie of two tokens' logits "
              f"(their true gap, recomputed at a higher precision, within what {loaded.model.dtype}'s rounding "
              "moves logits there: not a defect)")
    parted = bench.parted_beyond_near_ties(ours)
    if parted:
        sys.exit("speculative output differed from plain decoding with the same sampling and seed, "
                 f"not at a near tie: {', '.join(parted)}")


def _engine_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The engine settings of a bench command, from the flags `_model_flags` adds and `fields`
    (what the command decides itself); the queue's fields are the server's alone."""
    return EngineConfig(cache_dir=args.cache_dir, enforce_eager=args.enforce_eager, device=args.device,
                        dtype=args.dtype, quantization=args.quantization,
                        device_round=DEVICE_ROUND_SWITCH[args.device_round], **fields)


def _parting_text(parting: Parting | None) -> str:
    """Where an answer parted from plain decoding's (greedy runs): " from token i (n ulps...)"."""
    if parting is None:
        return ""
    unit = "ulp" if parting.ulps == 1 else "ulps"
    return f" from token {parting.index} ({parting.ulps:g} {unit}{', a near tie' if parting.near_tie else ''})"


def _llama_cpp(args: argparse.Namespace, eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """`--llama-cpp`: llama.cpp's greedy decoding of the bench's own GGUF, same threads."""
    import torch

    from service.bench.llama_cpp_reference import LLAMA_CPP, LlamaCppGreedy
    from service.model.loader import embedded_gguf_path

    path = Path(args.model) if args.model else embedded_gguf_path()
    if path.suffix != ".gguf" or getattr(args, "temperature", 0) > 0:
        sys.exit(f"ngrammys {args.command}: --llama-cpp compares greedy decoding of a GGUF model")
    try:
        return {LLAMA_CPP: LlamaCppGreedy(path, eos_token_ids, torch.get_num_threads())}
    except RuntimeError as error:
        sys.exit(f"ngrammys {args.command}: {error}")


def _workload(loaded: Any, args: argparse.Namespace) -> None:
    """`--task`: one task over many inputs, requests in order; each strategy with and without
    the suffix index (each on its own engine), against plain decoding."""
    from service.bench import specbench as bench
    from service.bench import workload
    from service.engine.params import GenerationParams, SpeculationParams
    from service.runtime import build_engine_with_tables

    config = _engine_config(args, cost_profile=False)
    questions = bench.specbench_questions(args.dataset, args.per_category, args.category)
    prompts = workload.task_prompts(questions, args.task, loaded.tokenizer) * args.repeat
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)

    def method(name: str, strategy: str, k: int, cache_tokens: int) -> workload.WorkloadMethod:
        params = GenerationParams(args.max_new_tokens, speculation=SpeculationParams(k, args.w), strategy=strategy,
                                  sampling=sampling)
        engine = build_engine_with_tables(loaded, replace(config, suffix_cache_tokens=cache_tokens))
        return workload.WorkloadMethod(name, engine, params)

    methods = [method("plain", MIXED, 0, 0)]
    for strategy in dict.fromkeys(args.strategy):
        methods.append(method(f"{strategy} k{args.k}w{args.w}", strategy, args.k, args.suffix_cache_tokens))
        if strategy != "suffix":
            methods.append(method(f"{strategy} k{args.k}w{args.w} no suffix", strategy, args.k, 0))
    print(f"{loaded.name}: {len(prompts)} requests of one task, in order; methods: "
          f"{', '.join(m.name for m in methods)}; max_new_tokens={args.max_new_tokens}", flush=True)
    print(workload.format_workload(workload.run_workload(methods, prompts)))


def _extract(args: argparse.Namespace) -> None:
    """`ngrammys extract`: the JSON extraction workload, with the grammar and without, plain vs
    speculative, every method on an engine of its own."""
    import json

    from service.bench import structured
    from service.bench.workload import WorkloadMethod
    from service.engine.params import GenerationParams, SpeculationParams
    from service.engine.scheduler import SchedulerConfig
    from service.grammar import GrammarSpec
    from service.model.loader import load_model
    from service.runtime import build_engine_with_tables

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
    config = _engine_config(args, cost_profile=True, scheduler=SchedulerConfig(prefix_cache=False))
    grammar = GrammarSpec("json_schema", json.dumps(structured.SCHEMA))

    def method(name: str, speculation: SpeculationParams, constrained: bool) -> WorkloadMethod:
        params = GenerationParams(args.max_new_tokens, speculation=speculation,
                                  grammar=grammar if constrained else None)
        return WorkloadMethod(name, build_engine_with_tables(loaded, config), params)

    shapes = {"plain": SpeculationParams(0, 0, "off"), "auto": SpeculationParams(args.k, args.w, "auto"),
              f"k{args.k}w{args.w}": SpeculationParams(args.k, args.w, "fixed")}
    groups = [[method(f"{name}, {label}", shape, constrained) for name, shape in shapes.items()]
              for label, constrained in (("schema", True), ("free", False))]
    docs = structured.documents(args.documents)
    print(f"{loaded.name}: {len(docs)} documents -> one JSON schema, {args.max_new_tokens} tokens at most, greedy; "
          "each method on an engine of its own", flush=True)
    results = structured.run(groups, structured.prompts(loaded.tokenizer, docs),
                             lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True))
    print(structured.format_results(results, {m.name: group[0].name for group in groups for m in group}))


def _spike(engine: Any, prompts: list[Any], args: argparse.Namespace, sampling: SamplingParams) -> None:
    from service.bench import specbench as bench
    from service.engine.params import GenerationParams, SpeculationParams

    params = GenerationParams(args.max_new_tokens, speculation=SpeculationParams(args.k, args.w, "auto"),
                              strategy=args.strategy[0], sampling=sampling)
    print("| prompt | fresh tok/s | under load | after: first 50 rounds | after: later rounds | after: rounds with drafts |")
    print("|---|---|---|---|---|---|")
    for prompt in prompts:
        r = bench.spike_recovery(engine, prompt.prompt_ids, params)
        rest = f"{r.after_rest:.1f}" if r.after_rest else f"— (done within {r.rounds} rounds)"
        print(f"| {prompt.category}/{prompt.question_id} | {r.fresh:.1f} | {r.during:.1f} | {r.after_first_rounds:.1f} "
              f"({r.after_first_rounds / r.fresh:.0%}) | {rest} | {r.after_drafted_rounds} |", flush=True)


def _steps(args: argparse.Namespace) -> None:
    """`ngrammys steps`: the engine's steps in process, speculation off against auto."""
    from service.bench import step_bench
    from service.bench.specbench import load_specbench
    from service.model.loader import load_model
    from service.runtime import build_engine, build_engine_with_tables
    from service.engine.scheduler import SchedulerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
    # no suffix index: the prompts cycle, and it would draft a repeated prompt's earlier answer whole
    config = _engine_config(args, cost_profile=True, suffix_cache_tokens=0)
    engine = build_engine_with_tables(loaded, config)
    prompts = [p.prompt_ids for p in load_specbench(args.dataset, loaded.tokenizer, args.per_category)]

    batch = SchedulerConfig(max_running_requests=max(args.concurrency))  # C in flight means C in the pass

    def new_engine() -> Any:
        fresh = build_engine(loaded, engine.mixer.tables, replace(config, scheduler=batch))
        fresh.profile = engine.profile
        return fresh

    print(f"{loaded.name} on {loaded.model.device}, {loaded.model.dtype}: {len(prompts)} prompts cycled, "
          f"{args.max_new_tokens} tokens each, C x {args.requests_per_slot} requests a run, greedy, "
          f"auto up to k={args.k} w={args.w}\n\n{step_bench.HEADER}", flush=True)
    runs = step_bench.run_step_bench(new_engine, prompts, args.concurrency, args.max_new_tokens, args.k, args.w,
                                     args.repeats, args.requests_per_slot, progress=lambda run: print(run.row(), flush=True))
    print(f"\n{step_bench.format_summary(runs)}")


def _speed(args: argparse.Namespace) -> None:
    """`ngrammys speed`: prompt processing and decoding tokens/s, and the references'."""
    import json

    from drafting import TableSlot
    from service.bench import speed
    from service.bench.hf_generate_reference import HF_GENERATE, HfGenerate
    from service.bench.specbench import load_specbench
    from service.model.loader import load_model, resolve_device, resolve_quantization
    from service.engine.scheduler import SchedulerConfig
    from service.runtime import build_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
    quantization = resolve_quantization(args.quantization, args.model is None or str(args.model).endswith(".gguf"),
                                        resolve_device(args.device), args.dtype)
    prompts = [p.prompt_ids for p in load_specbench(args.dataset, loaded.tokenizer)]
    stream = speed.token_stream(prompts, max([*args.lengths, speed.DECODE_PROMPT]))
    # no prefix cache: each length runs several times, and a repeat would find its prompt cached
    engine = build_engine(loaded, TableSlot(), _engine_config(args, scheduler=SchedulerConfig(prefix_cache=False)))
    engine.eos_token_ids = frozenset()  # every method decodes its whole budget: no stop token ends a run
    methods: dict[str, Any] = {f"ngrammys ({quantization})": engine.complete}
    if args.transformers:  # the library's own float32 forward of the same model, unpacked
        floats = load_model(args.model, args.device, "float32", args.cache_dir, "none")
        methods[f"{HF_GENERATE} (float32)"] = HfGenerate(floats.model, ()).complete
    methods |= {name: reference.complete for name, reference in (_llama_cpp(args, ()) if args.llama_cpp else {}).items()}
    print(f"{loaded.name} on {loaded.model.device}: prompts of {', '.join(map(str, args.lengths))} tokens cut from "
          f"Spec-Bench's questions, fastest of {args.repeats} runs each", flush=True)
    speeds = []
    for name, complete in methods.items():
        speeds.append(speed.measure(name, complete, stream, args.lengths, args.repeats))
        print(speed.format_speeds(speeds).splitlines()[-1], flush=True)
    print(f"\n{speed.format_speeds(speeds)}")
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in speeds], indent=2))


def _profile(args: argparse.Namespace) -> None:
    from service.controller.heatmap import write_heatmap
    from service.model.loader import load_model, random_model
    from service.model.runner import ModelRunner
    from service.controller.profiler import load_or_measure

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.random_weights:
        if not args.model:
            sys.exit("ngrammys profile: --random-weights needs --model, a directory with the model's config.json")
        model, name = random_model(args.model, args.device, args.dtype), f"{Path(args.model).name} (random weights)"
    else:
        loaded = load_model(args.model, args.device, args.dtype, args.cache_dir, args.quantization)
        model, name = loaded.model, loaded.name
    runner = ModelRunner(model, static_passes=_engine_config(args).static_passes)
    profile = load_or_measure(runner, args.cache_dir, remeasure=args.remeasure)
    print(f"{name} on {profile.device}, {profile.dtype}: median ms per pass (slowdown vs n=rows)")
    for rows, sizes, table in zip(profile.rows, profile.tree_sizes, profile.seconds):
        print(f"\n{rows} row(s); n = tokens in the pass\n")
        _print_table(["L \\ n", *sizes], [[length, f"{row[0] * 1e3:.1f}", *(f"x{s / row[0]:.2f}" for s in row[1:])]
                                          for length, row in zip(profile.context_lengths, table)])
    if profile.wide_row_seconds:
        print("\nwhat one wide row (a tree among one-token rows) adds beyond its tokens, ms\n")
        _print_table(["rows \\ L", *profile.context_lengths],
                     [[rows, *(f"{c * 1e3:.1f}" for c in costs)] for rows, costs in zip(profile.rows, profile.wide_row_seconds)])
    if args.png:
        write_heatmap(profile, args.context_length, args.png)
        print(f"\nwrote {args.png}")


def _print_table(header: list[object], rows: list[list[object]]) -> None:
    """A markdown table."""
    for line in [header, ["---"] * len(header), *rows]:
        print("| " + " | ".join(str(cell) for cell in line) + " |")


def loadtest_server_flags(args: argparse.Namespace, prefix_cache: bool = False) -> list[str]:
    """`ngrammys serve` flags of the server the load test starts: without a prefix cache unless
    asked (the Spec-Bench load test cycles its questions through both modes on one server, and
    the mode that runs later would find the earlier one's prompts cached)."""
    flags = ["--max-running-requests", str(args.max_running_requests), "--max-waiting", str(max(args.concurrency) * 2),
             "--max-tokens-per-pass", str(args.max_tokens_per_pass), "--suffix-cache-tokens", str(args.suffix_cache_tokens),
             *([] if prefix_cache else ["--no-prefix-cache"])]
    if args.max_prefill_tokens_while_decoding is not None:
        flags += ["--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding)]
    if args.prefill_pass_ms is not None:
        flags += ["--prefill-pass-ms", str(args.prefill_pass_ms)]
    return flags + _model_serve_flags(args)


def _model_serve_flags(args: argparse.Namespace) -> list[str]:
    """The `ngrammys serve` flags that load the model `args` names (`_model_flags`)."""
    flags = ["--cache-dir", str(args.cache_dir)]
    for flag, value in (("--model", args.model), ("--device", args.device), ("--dtype", args.dtype),
                        ("--quantization", args.quantization)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def _loadtest(args: argparse.Namespace) -> None:
    from contextlib import nullcontext

    from app import loadtest
    from app.background import serving_process
    from service.bench.specbench import specbench_questions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the table
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here stops too
    if args.workload != "specbench":
        return _prefix_workload(args)
    questions = specbench_questions(args.dataset, args.per_category)
    with (nullcontext(args.url) if args.url else serving_process(loadtest_server_flags(args))) as base:
        _wait_warm(base, args.url is None)
        print(f"{len(questions)} questions, {args.max_tokens} tokens each, greedy; server {base}\n", flush=True)
        print(loadtest.HEADER, flush=True)
        results = loadtest.run_loadtest(base, questions, args.concurrency, args.requests_per_client,
                                        args.max_tokens, progress=lambda row: print(row, flush=True),
                                        modes=tuple(args.modes), repeats=args.repeats)
    print(f"\n{loadtest.format_comparison(results)}", flush=True)
    if args.json:
        loadtest.write_json(results, args.json, max_tokens=args.max_tokens, per_category=args.per_category,
                            max_running_requests=args.max_running_requests, repeats=args.repeats)
        print(f"wrote {args.json}")
    if args.png:
        loadtest.write_plot(results, args.png, f"{args.max_tokens} tokens per request, greedy")
        print(f"wrote {args.png}")


def _prefix_workload(args: argparse.Namespace) -> None:
    """`loadtest --workload chat|document`: with the prefix cache and without, a server each."""
    import json
    from contextlib import contextmanager

    from app import prefix_workloads
    from app.background import serving_process
    from service.bench.specbench import specbench_questions

    if args.url:
        sys.exit("ngrammys loadtest: --workload chat|document starts its own servers (one with the prefix cache, "
                 "one without); leave out --url")
    turns = args.turns or prefix_workloads.DEFAULT_TURNS[args.workload]
    workload = prefix_workloads.build(args.workload, specbench_questions(args.dataset), args.conversations, turns)

    mode = args.modes[-1]

    @contextmanager
    def server(prefix_cache: bool) -> Iterator[str]:
        with serving_process(loadtest_server_flags(args, prefix_cache)) as base:
            _wait_warm(base, True)  # (the profile prices the prompt chunks in every mode)
            yield base

    print(f"workload {args.workload}: {len(workload.conversations)} conversations x "
          f"{len(workload.conversations[0])} turns, {workload.clients} at a time, {args.max_tokens} tokens each, "
          f"greedy, speculation {mode}\n\n{prefix_workloads.HEADER}", flush=True)
    results = prefix_workloads.compare(server, workload, mode, args.max_tokens,
                                       progress=lambda row: print(row, flush=True))
    print(f"\n{prefix_workloads.format_comparison(results)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"workload": args.workload, "max_tokens": args.max_tokens,
                                         "results": [r.summary() for r in results]}, indent=2))
        print(f"wrote {args.json}")


def _neighbour(args: argparse.Namespace) -> None:
    import json
    from contextlib import nullcontext

    from app import neighbour
    from app.background import serving_process

    if args.url and args.pid is None:
        sys.exit("ngrammys neighbour: --url needs --pid, the server's process id (its CPU time is read)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here stops too
    pids = [args.pid]
    flags = ["--suffix-cache-tokens", "0", "--no-prefix-cache", *_model_serve_flags(args)]  # its prompt repeats
    with nullcontext(args.url) if args.url else serving_process(flags, started=pids.append) as base:
        _wait_warm(base, True)
        figures = neighbour.run(base, pids[-1], args.neighbours, args.seconds, args.max_tokens)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def _wait_warm(base: str, warm_up: bool) -> None:
    """Until /ready, and (for a server started here) until the cost profile and tables exist."""
    import httpx

    while True:
        ready = httpx.get(f"{base}/ready", timeout=10).status_code == 200
        health = httpx.get(f"{base}/health", timeout=10).json()
        if ready and (not warm_up or (health.get("cost_profile") and health.get("model_tables"))):
            return
        time.sleep(1)


def _shape(text: str) -> tuple[int, int]:
    k, _, w = text.lower().partition("x")
    return int(k), int(w)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: embedded)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None,
                        help=Settings.model_fields["dtype"].description)
    parser.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default=Settings.model_fields["quantization"].default,
                        help=Settings.model_fields["quantization"].description)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--enforce-eager", action="store_true", help=Settings.model_fields["enforce_eager"].description)
    parser.add_argument("--device-round", choices=tuple(DEVICE_ROUND_SWITCH), default="auto",
                        help=Settings.model_fields["device_round"].description)


def _dataset(text: str) -> Path:
    """`--dataset`, read as it is parsed: a missing, unreadable or malformed questions file stops
    the command with a message saying where to get it, before a model loads, not with a traceback."""
    from service.bench.specbench import DatasetError, specbench_questions

    path = Path(text)
    try:
        specbench_questions(path)
    except DatasetError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ngrammys", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _settings_flags(serve)
    serve.set_defaults(run=_serve)
    worker = commands.add_parser(
        "worker", help="a tensor-parallel rank other than 0: a pod's first starts the pod's others (LeaderWorkerSet)")
    _settings_flags(worker)
    worker.set_defaults(run=_worker)
    prepare = commands.add_parser(
        "prepare", help="convert the model and compute its draft tables into the cache (for images)")
    prepare.add_argument("--model", default=None, help="model directory or .gguf [env NGRAMMYS_MODEL; default: embedded]")
    prepare.add_argument("--device", default=None, help="[env NGRAMMYS_DEVICE]")
    prepare.add_argument("--dtype", default=None,
                         help="the dtype `serve` will use: the tables are keyed by it [env NGRAMMYS_DTYPE]")
    prepare.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default=None,
                         help="the quantization `serve` will use: gguf also bakes the packed tiles and "
                              "compiles the numba kernels [env NGRAMMYS_QUANTIZATION; default: auto]")
    prepare.add_argument("--cache-dir", type=Path, default=None, help="[env NGRAMMYS_CACHE_DIR]")
    prepare.set_defaults(run=_prepare)
    bench = commands.add_parser("bench", help="plain vs speculative decoding on Spec-Bench prompts")
    bench.add_argument("--dataset", type=_dataset, required=True, help="Spec-Bench question.jsonl")
    bench.add_argument("--per-category", type=int, default=None, help="first N questions per category")
    bench.add_argument("--category", nargs="+", default=None, help="only these categories (default: all)")
    bench.add_argument("--k", type=int, default=4, help="speculations per round (the maximum in auto)")
    bench.add_argument("--w", type=int, default=4, help="tokens per speculation (the maximum in auto)")
    bench.add_argument("--grid", type=_shape, nargs="*", default=[], metavar="KxW",
                       help="more fixed shapes for the first strategy, e.g. 1x1 2x4 8x8")
    bench.add_argument("--auto", action="store_true",
                       help="also run the first strategy in auto mode (measures the cost profile first)")
    bench.add_argument("--task", default=None, metavar="TEMPLATE",
                       help="instead: a repetitive workload, this task (with a {text} field) over each question's "
                            "text, requests in order; each strategy with and without the suffix index")
    bench.add_argument("--repeat", type=int, default=1,
                       help="with --task: send the whole series this many times (popular requests asked again)")
    bench.add_argument("--spike", action="store_true",
                       help="instead: auto mode fresh, under 3 busy processes, then after (load-spike recovery)")
    bench.add_argument("--strategy", nargs="+", default=[MIXED],
                       help=f"draft strategies to compare (each against the same plain run): {', '.join(STRATEGY_NAMES)}, "
                            "self_draft_<m> when several --self-draft-layers are given, or a mix joined "
                            "with '+' (e.g. context+self_draft)")
    bench.add_argument("--self-draft-layers", type=int, nargs="*", default=[], metavar="M",
                       help="enable self-drafting with the model's first M layers (several M: strategies "
                            "self_draft_<M>, to compare depths)")
    bench.add_argument("--draft-model", default=None,
                       help="enable the draft_model strategy with this model directory or .gguf")
    bench.add_argument("--staged", action="store_true",
                       help="also the staged twin of every model draft (<name>_staged)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--suffix-cache-tokens", type=int, default=Settings.model_fields["suffix_cache_tokens"].default,
                       help=Settings.model_fields["suffix_cache_tokens"].description)
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; every run samples alike")
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--seed", type=int, default=0,
                       help="sampling seed of every run, so plain and speculative samples compare token for token")
    _model_flags(bench)
    bench.add_argument("--llama-cpp", action="store_true",
                       help="also decode each prompt with llama.cpp's own greedy decoding of the same GGUF "
                            "(needs the llama-cpp extra, which compiles llama.cpp)")
    bench.add_argument("--hf-generate", action="store_true",
                       help="also decode each prompt with transformers' greedy generate and its prompt lookup, "
                            "on the same model (greedy only)")
    bench.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    bench.set_defaults(run=_bench)
    extract = commands.add_parser("extract", help="JSON extraction: structured output vs free text, plain vs speculative")
    extract.add_argument("--documents", type=int, default=30, help="profiles to extract from")
    extract.add_argument("--max-new-tokens", type=int, default=128)
    extract.add_argument("--k", type=int, default=8, help="drafts (auto's maximum)")
    extract.add_argument("--w", type=int, default=8, help="draft depth (auto's maximum)")
    _model_flags(extract)
    extract.set_defaults(run=_extract)
    fast = commands.add_parser("speed", help="prompt processing and decoding tokens/s, beside llama.cpp's and transformers'")
    fast.add_argument("--dataset", type=_dataset, required=True, help="Spec-Bench question.jsonl (the prompts' text)")
    fast.add_argument("--lengths", type=int, nargs="+", default=list(PROMPT_LENGTHS), help="prompt lengths, tokens")
    fast.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the fastest counts")
    _model_flags(fast)
    fast.add_argument("--llama-cpp", action="store_true",
                      help="also llama.cpp on the same GGUF and token ids (needs the llama-cpp extra)")
    fast.add_argument("--transformers", action="store_true",
                      help="also transformers' own float32 forward of the same model (unpacked: its memory too)")
    fast.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    fast.set_defaults(run=_speed)
    profile = commands.add_parser("profile", help="measure forward-pass cost over tree size and context length")
    _model_flags(profile)
    profile.add_argument("--remeasure", action="store_true",
                         help="ignore the saved profile (the remedy when auto mode misjudges costs: run it on an "
                              "idle machine; a profile failing validation is never saved)")
    profile.add_argument("--random-weights", action="store_true",
                         help="build --model's architecture (its config.json alone) with random weights: the cost "
                              "curves of a model size whose weights are not here (a pass costs the same)")
    profile.add_argument("--png", type=Path, default=None, help="write the (k, w) slowdown heatmap here")
    profile.add_argument("--context-length", type=int, default=256, help="context length of the heatmap")
    profile.set_defaults(run=_profile)
    steps = commands.add_parser("steps", help="engine steps in process over C requests: off vs auto, where a step's time goes")
    steps.add_argument("--dataset", type=_dataset, required=True, help="Spec-Bench question.jsonl")
    steps.add_argument("--per-category", type=int, default=2, help="questions per category to cycle through")
    steps.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="requests decoded together, C")
    steps.add_argument("--max-new-tokens", type=int, default=64)
    steps.add_argument("--k", type=int, default=Settings.model_fields["spec_k"].default, help="auto's maximum drafts")
    steps.add_argument("--w", type=int, default=Settings.model_fields["spec_w"].default, help="auto's maximum depth")
    steps.add_argument("--requests-per-slot", type=int, default=REQUESTS_PER_SLOT,
                       help="requests a run = C x this; C in flight, a new one joining as one ends")
    steps.add_argument("--repeats", type=int, default=2, help="runs of each (C, mode), the order alternating")
    _model_flags(steps)
    steps.set_defaults(run=_steps)
    load = commands.add_parser("loadtest", help="concurrent streaming clients: throughput and latency, off vs auto")
    load.add_argument("--dataset", type=_dataset, required=True, help="Spec-Bench question.jsonl")
    load.add_argument("--per-category", type=int, default=2, help="questions per category to cycle through")
    load.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="client counts C")
    load.add_argument("--requests-per-client", type=int, default=2, help="requests = C x this (at least 4)")
    load.add_argument("--repeats", type=int, default=1,
                      help="runs of each (C, mode), order alternating (off-auto-auto-off); ratios from their means")
    load.add_argument("--max-tokens", type=int, default=64)
    load.add_argument("--url", default=None, help="a running server (default: start one here)")
    load.add_argument("--max-running-requests", type=int, default=64, help="for the server started here")
    load.add_argument("--max-tokens-per-pass", type=int, default=512, help="for the server started here")
    load.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None,
                      help="for the server started here (default: the server's)")
    load.add_argument("--prefill-pass-ms", type=float, default=None,
                      help="for the server started here (default: the server's)")
    load.add_argument("--suffix-cache-tokens", type=int, default=0,
                      help="for the server started here (default 0, off: the load test cycles its questions, and "
                           "the shared suffix index would draft a repeated question's earlier greedy answer whole, "
                           "favouring whichever mode runs later; give a size to measure that effect)")
    load.add_argument("--modes", nargs="+", choices=LOAD_MODES, default=list(LOAD_MODES),
                      help="speculation modes to compare (a prefix workload runs the last one)")
    load.add_argument("--workload", choices=("specbench", *PREFIX_WORKLOADS), default="specbench",
                      help="specbench: its questions, off vs auto; chat: conversations behind a long system prompt, "
                           "document: questions about one long document, each with the prefix cache and without")
    load.add_argument("--conversations", type=int, default=8, help="chat/document: conversations (or clients' "
                      "question lists)")
    load.add_argument("--turns", type=int, default=None, help="chat/document: turns per conversation (default: 6 "
                      "for chat, 4 for document: 32 questions)")
    _model_flags(load)
    load.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    load.add_argument("--png", type=Path, default=None, help="plot tokens/s and p99 ITL against C")
    load.set_defaults(run=_loadtest)
    near = commands.add_parser("neighbour", help="the server beside busy processes: its cost profile, auto vs off "
                                                 "before and after")
    near.add_argument("--neighbours", type=int, default=2, help="busy processes")
    near.add_argument("--seconds", type=float, default=120.0,
                      help="the neighbours run this long while the server serves, then as long while it is idle")
    near.add_argument("--max-tokens", type=int, default=128)
    near.add_argument("--url", default=None, help="a running server (default: start one here); needs --pid")
    near.add_argument("--pid", type=int, default=None, help="the process id of the server at --url")
    _model_flags(near)
    near.add_argument("--json", type=Path, default=None, help="also write the figures here")
    near.set_defaults(run=_neighbour)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
