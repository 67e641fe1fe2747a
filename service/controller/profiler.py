"""Measure what a forward pass costs on this device: T(tokens, rows, context length).

For each (rows R, context L) a cache of R rows of length L is set up (the entries' values do
not change the work, so nothing is prefilled), then passes of R × m tokens are timed on top of
it and rolled back, so L stays fixed. The logits are read back so GPU timings include the work.
Beside those equal rows, each (R > 1, L) also times one row of a few tokens among one-token
rows, each time against the plain pass beside it: what that costs beyond its tokens' share of
the equal-rows curve is the row's own attention call (or the padding of every row), which the
controller charges to a row's first node (`CostProfile.wide_row_seconds`).

The controller trades tokens against *ratios* of costs, so the ratios must survive a busy
machine, and they do when every pass is timed against the same small reference pass (one row,
one token, the shortest context) run right after it: a neighbour on a shared host, stolen CPU
time or a core kept busy by other work slow the pass and the references either side of it
alike, so their ratio holds whatever the load level, and a size's cost is the median of its
repeats' ratios times the reference's own cost (the mean of its two fastest runs: other work
only ever adds time). Without it a steady neighbour left each (rows, L) sweep priced at the
load level of its own minutes (docs/benchmarks.md, "Profiling beside a busy core"). The live
slowdown from that other work is the calibration's load level, not the profile's business.
The result is validated before it is trusted or saved — costs must not fall as passes grow
(within noise), must not fall as context grows (a profile whose short-context passes look
slower than long ones was measured under changing load), and a size's repeats must agree (their
median deviation within the noise: a machine whose load changed faster than a pass). A profile
that fails is never saved, and a server never puts one in use (`profile_keeper.py`); nor is one
saved that other work on the cores may have bent (`measure_profile` with a `MachineLoad`).
Measurement is a generator of small increments, so the engine runs it between steps, only while
idle; `probe_steps` times a few of the profile's shapes again, to tell a neighbour's passing
slowdown from relative costs that changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import platform
import statistics
import time
from collections.abc import Generator, Sequence
from pathlib import Path

import torch

from service.controller.cost_profile import CostProfile
from service.controller.machine_load import MachineLoad
from service.model.kv_cache import TreeKVCache
from service.model.runner import ModelRunner, RowInput
from service.model.tables import model_fingerprint, run_to_end
from service.model.tree import chain_tree

log = logging.getLogger(__name__)

# The code whose speed a profile measures: a saved profile of other code is not reused.
# Paths under service/.
PASS_CODE = (
    "model/runner.py",
    "model/static_pass.py",
    "model/decoder_pass.py",
    "model/packed_pass.py",
    "model/attention.py",
    "model/kv_cache.py",
    "kernels/packed_linear.py",
    "kernels/packed_kernels.py",
    "kernels/layer_kernels.py",
    "kernels/int8_kernel.py",
    "kernels/int8_chunk_kernel.py",
    "kernels/attention_kernel.py",
    "kernels/chunk_attention_kernel.py",
)
ROWS = (1, 4, 16)
# A GPU serves more rows a pass (a pass there is host-bound, so rows are nearly free), and its
# cost past 16 rows extrapolated from 4 and 16 misprices them: 64 rows are measured too.
GPU_ROWS = (*ROWS, 64)
CONTEXT_LENGTHS = (32, 256, 1024)
TOKENS_PER_ROW = (1, 2, 4, 8, 16, 32, 64)
# Larger passes are extrapolated. A CPU's cost is already linear by 128 tokens; a GPU's stays
# flat far longer and is where batches of trees go, so its curve is measured up to 16 rows × 32.
CPU_MAX_PASS_TOKENS = 128
GPU_MAX_PASS_TOKENS = 512
REPEATS = 7
NOISE = 0.15  # relative slack of the validation rules
ATTEMPTS = 3  # measurements the profile command makes until one is valid
PROBE_REPEATS = 3
WIDE_ROW_TOKENS = 4  # the row whose own cost among one-token rows is measured: a small tree
WIDE_PAIRS = 3  # (wide pass, plain pass) pairs per repeat: their difference is small and noisy


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def profiled_rows(device: torch.device) -> tuple[int, ...]:
    """The row counts a profile on `device` measures."""
    return ROWS if device.type == "cpu" else GPU_ROWS


def pass_sizes(rows: int, device: torch.device) -> list[int]:
    """The pass sizes measured for `rows` equal rows on `device`."""
    largest = CPU_MAX_PASS_TOKENS if device.type == "cpu" else GPU_MAX_PASS_TOKENS
    return [rows * m for m in TOKENS_PER_ROW if rows * m <= largest]


def measure_steps(
    runner: ModelRunner,
    rows: Sequence[int] | None = None,
    context_lengths: Sequence[int] = CONTEXT_LENGTHS,
    repeats: int = REPEATS,
) -> Generator[None, None, tuple[CostProfile, list[str]]]:
    """Yield after every increment (one repeat of one (rows, L) sweep); return the profile and
    the validation problems found (empty when it can be trusted). `rows`: the device's own
    (`profiled_rows`) unless given."""
    rows = profiled_rows(runner.device) if rows is None else rows
    generator = torch.Generator().manual_seed(0)
    reference = _ReferencePass(runner, context_lengths[0], generator)
    ratios: dict[tuple[int, int], list[list[float]]] = {}  # each repeat over the reference
    wide_ratios: dict[tuple[int, int], list[float]] = {}
    for count, length in itertools.product(rows, context_lengths):
        cache = _filled_cache(runner, count, length)
        passes = [
            _chains(runner, count, size // count, generator)
            for size in pass_sizes(count, runner.device)
        ]
        wide = (
            []
            if count == 1
            else [
                _chains(runner, 1, WIDE_ROW_TOKENS, generator)
                + _chains(runner, count - 1, 1, generator)
            ]
        )
        for trees in passes + wide:  # warm-up
            _timed_pass(runner, cache, trees)
        cells = ratios.setdefault((count, length), [[] for _ in passes])
        for _ in range(repeats):
            for index, trees in enumerate(passes):
                cells[index].append(reference.relative(cache, trees))
            for trees in wide * WIDE_PAIRS:  # paired with the plain pass beside it: drift cancels
                extra = reference.relative(cache, trees) - reference.relative(cache, passes[0])
                wide_ratios.setdefault((count, length), []).append(extra)
            yield
        costs = " ".join(
            f"n{n}={statistics.median(c) * reference.seconds * 1e3:.0f}ms"
            for n, c in zip(pass_sizes(count, runner.device), cells)
        )
        log.info("profiled rows=%d L=%d: %s", count, length, costs)
    profile = CostProfile(
        rows=list(rows),
        context_lengths=list(context_lengths),
        tree_sizes=[pass_sizes(r, runner.device) for r in rows],
        seconds=[
            [
                [statistics.median(c) * reference.seconds for c in ratios[(r, length)]]
                for length in context_lengths
            ]
            for r in rows
        ],
        device=device_name(runner.device),
        model=model_fingerprint(runner.model),
        dtype=str(runner.dtype),
    )
    problems = validate(profile, ratios)
    equal_rows = _monotone(profile)
    wide_row_seconds = [
        [
            _wide_row_cost(
                equal_rows,
                r,
                length,
                [extra * reference.seconds for extra in wide_ratios.get((r, length), [])],
            )
            for length in context_lengths
        ]
        for r in rows
    ]
    log.info(
        "a wide row's own cost, ms [rows][L]: %s",
        [[round(s * 1e3, 1) for s in t] for t in wide_row_seconds],
    )
    return dataclasses.replace(equal_rows, wide_row_seconds=wide_row_seconds), problems


def _wide_row_cost(equal_rows: CostProfile, rows: int, length: int, extras: list[float]) -> float:
    """What the pass with one wide row measured over the plain pass, less what the equal-rows
    curve charges its extra tokens."""
    if not extras:
        return 0.0
    tokens = rows + WIDE_ROW_TOKENS - 1
    curve = equal_rows.cost(tokens, length, rows) - equal_rows.cost(rows, length, rows)
    return max(statistics.median(extras) - curve, 0.0)


def probe_steps(
    runner: ModelRunner, profile: CostProfile, repeats: int = PROBE_REPEATS
) -> Generator[None, None, float]:
    """How far this machine's relative pass costs now are from `profile`'s: of a few shapes
    timed again (the smallest and largest pass of one row and of the most rows, at the shortest
    context), the largest ratio between two shapes' measured-over-profiled factors (1: the
    profile's shape holds, whatever the load level). Far quicker than a measurement; yields
    after each repeat."""
    length = profile.context_lengths[0]
    generator = torch.Generator().manual_seed(1)
    shapes = []  # (rows, tokens, cache, trees)
    for index in sorted({0, len(profile.rows) - 1}):
        rows, sizes = profile.rows[index], profile.tree_sizes[index]
        cache = _filled_cache(runner, rows, length)
        shapes += [
            (rows, n, cache, _chains(runner, rows, n // rows, generator))
            for n in sorted({sizes[0], sizes[-1]})
        ]
    for _, _, cache, trees in shapes:  # warm-up
        _timed_pass(runner, cache, trees)
    timings: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats):
        for times, (_, _, cache, trees) in zip(timings, shapes):
            times.append(_timed_pass(runner, cache, trees))
        yield
    factors = [
        own_cost(times) / profile.cost(n, length, rows)
        for times, (rows, n, _, _) in zip(timings, shapes)
    ]
    return max(factors) / min(factors)


def measure_profile(
    runner: ModelRunner, machine: MachineLoad | None = None, **grid: Sequence[int]
) -> tuple[CostProfile, list[str]]:
    """`measure_steps` run to the end at once; with `machine`, one more problem where other
    work's load changed while it ran (`MachineLoad.changes`). Such a profile can pass validation
    and still be wrong in the ratios the controller trades on: one found in a cache priced a
    two-token pass nearly as cheap as a one-token pass, well below its price on the quiet
    machine (docs/benchmarks.md), and auto speculated where it lost."""
    steps = measure_steps(runner, **grid)
    if machine is None:
        return run_to_end(steps)  # type: ignore[arg-type]
    machine.update()
    changes = machine.changes
    while True:
        try:
            next(steps)
        except StopIteration as done:
            profile, problems = done.value
            break
        machine.update()
    if machine.changes > changes:
        problems = [*problems, "other work's load changed while it was measured"]
    return profile, problems


def validate(
    profile: CostProfile, samples: dict[tuple[int, int], list[list[float]]] | None = None
) -> list[str]:
    """What makes `profile` untrustworthy (nothing if it is fine); `samples`: each size's repeats
    per (rows, L), in any unit."""
    problems = []
    for r, table in zip(profile.rows, profile.seconds):
        for length, row in zip(profile.context_lengths, table):
            if any(b < a * (1 - NOISE) for a, b in zip(row, row[1:])):
                problems.append(f"rows={r} L={length}: a bigger pass measured cheaper: {_ms(row)}")
        for index in range(len(table[0])):
            column = [row[index] for row in table]
            if column[-1] < column[0] * (1 - NOISE):
                problems.append(
                    f"rows={r} n={profile.tree_sizes[profile.rows.index(r)][index]}: "
                    f"longer context measured cheaper: {_ms(column)}"
                )
    for (r, length), cells in (samples or {}).items():
        spread = statistics.median(_spread(c) for c in cells)
        if spread > NOISE:
            problems.append(
                f"rows={r} L={length}: the repeats disagree (median deviation {spread:.0%})"
            )
    return problems


def own_cost(values: Sequence[float]) -> float:
    """A pass's own cost from its repeats: the mean of the two fastest (other work on the
    machine only adds time, so the slow tail measures the neighbours, not the pass)."""
    return statistics.fmean(sorted(values)[:2])


def _spread(values: Sequence[float]) -> float:
    """How far the repeats lie from their median, relative to it (the median absolute
    deviation: up to half the repeats may be outliers without widening it)."""
    middle = statistics.median(values)
    return statistics.median(abs(v - middle) for v in values) / middle


def _ms(values: Sequence[float]) -> str:
    return " ".join(f"{v * 1e3:.1f}" for v in values) + " ms"


def _monotone(profile: CostProfile) -> CostProfile:
    """A larger pass is never recorded as cheaper (a dip is noise the controller must not bet
    on)."""
    seconds = [[list(itertools.accumulate(row, max)) for row in table] for table in profile.seconds]
    return dataclasses.replace(profile, seconds=seconds)


def _filled_cache(runner: ModelRunner, rows: int, length: int) -> TreeKVCache:
    cache = runner.new_cache()
    for _ in range(rows):
        cache.add_row()
    cache.lengths = [length] * rows  # the entries' values do not change the work
    return cache


def _chains(runner: ModelRunner, rows: int, m: int, generator: torch.Generator) -> list[RowInput]:
    return [
        RowInput(chain_tree(torch.randint(runner.vocab_size, (m,), generator=generator).tolist()))
        for _ in range(rows)
    ]


class _ReferencePass:
    """The pass every measured pass is timed against: one row of one token at context `length`,
    on a cache of its own, run after each measured pass."""

    def __init__(self, runner: ModelRunner, length: int, generator: torch.Generator) -> None:
        self.runner = runner
        self.cache = _filled_cache(runner, 1, length)
        self.trees = _chains(runner, 1, 1, generator)
        _timed_pass(runner, self.cache, self.trees)  # warm-up
        self.times = [_timed_pass(runner, self.cache, self.trees)]

    def relative(self, cache: TreeKVCache, rows: list[RowInput]) -> float:
        """A pass of `rows` on `cache`, timed over the mean of the reference passes either side
        of it."""
        elapsed = _timed_pass(self.runner, cache, rows)
        self.times.append(_timed_pass(self.runner, self.cache, self.trees))
        return elapsed / statistics.fmean(self.times[-2:])

    @property
    def seconds(self) -> float:
        """The reference pass's own cost."""
        return own_cost(self.times)


def _timed_pass(runner: ModelRunner, cache: TreeKVCache, rows: list[RowInput]) -> float:
    started = time.perf_counter()
    logits = runner.forward(cache, rows)
    float(logits[-1][-1, 0])  # wait for the device
    elapsed = time.perf_counter() - started
    for row in range(cache.num_rows):
        cache.commit(row, [])  # roll back: the context length stays fixed
    return elapsed


def pass_code_version() -> str:
    """A short hash of the torch version and the code a pass runs (`PASS_CODE`): a kernel or
    attention change alters the cost curve's shape, which a uniform drift check would miss."""
    digest = hashlib.sha256(torch.__version__.encode())
    for name in PASS_CODE:
        digest.update((Path(__file__).parents[1] / name).read_bytes())
    return digest.hexdigest()[:8]


def profile_path(cache_dir: Path, runner: ModelRunner) -> Path:
    fingerprint = model_fingerprint(runner.model)
    # the same packed weights compute otherwise with 8-bit activations (--quantization gguf-int8)
    int8 = (
        "-int8" if getattr(runner.model.get_output_embeddings(), "int8_activations", False) else ""
    )
    # fixed-shape passes (CUDA graphs) cost otherwise
    static = "-static" if runner.static is not None else ""
    ranks = f"-tp{runner.tensor_parallel_size}" if runner.tensor_parallel_size > 1 else ""
    name = (
        f"{device_name(runner.device)}-{fingerprint}{int8}{static}{ranks}-{runner.dtype}"
        f"-code{pass_code_version()}"
    )
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return cache_dir / "profiles" / f"{safe}.json"


def load_saved(runner: ModelRunner, cache_dir: Path) -> CostProfile | None:
    """The saved profile for this device/model/dtype, if there is one that passes validation."""
    path = profile_path(cache_dir, runner)
    if not path.exists():
        return None
    try:
        profile = CostProfile.load(path)
    except (ValueError, TypeError, KeyError) as error:
        log.warning("ignoring the saved cost profile: %s", error)
        return None
    if problems := validate(profile):
        log.warning(
            "ignoring the saved cost profile %s: %s; it will be measured again",
            path,
            "; ".join(problems),
        )
        return None
    return profile


def load_or_measure(
    runner: ModelRunner,
    cache_dir: Path,
    remeasure: bool = False,
    machine: MachineLoad | None = None,
    **grid: Sequence[int],
) -> CostProfile:
    """The saved profile for this device/model/dtype, measuring (and saving) it if absent: for
    the bench and profile commands, run by an operator. Up to `ATTEMPTS` measurements until one
    is valid and was measured while other work's load held steady (`machine`: this
    machine's); if none is, the last is used for this command only and never saved (a server
    never puts one in use: `profile_keeper.py`)."""
    saved = None if remeasure else load_saved(runner, cache_dir)
    if saved is not None:
        return saved
    path = profile_path(cache_dir, runner)
    log.info("measuring forward-pass costs (saved to %s)", path)
    machine = machine or MachineLoad()
    for attempt in range(1, ATTEMPTS + 1):
        profile, problems = measure_profile(runner, machine, **grid)
        if not problems:
            profile.save(path)
            return profile
        log.warning("cost profile attempt %d cannot be trusted: %s", attempt, "; ".join(problems))
    log.warning(
        "using the last cost profile for this command only (not saved); "
        "remedy: `ngrammys profile --remeasure` on an idle machine"
    )
    return profile
