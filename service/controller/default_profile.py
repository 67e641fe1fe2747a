"""The cost profile auto mode prices passes with until this machine's own is measured: a
conservative guess for the device class, so that a server speculates from its first request
where drafts pay well, instead of decoding plainly until a measurement can run (on a machine
that other work never leaves quiet, that could be long).

Conservative means every pass size is priced above the dearest relative cost measured for it in
the profiles of this project's CPU figures (docs/benchmarks.md, "The default cost profile"):
a second token costs a step (on a CPU a wider pass leaves the one-token kernels), each further
one a share of a one-token pass. Auto then speculates only where the drafts' acceptance clearly
pays for the tokens, and keeps trees small. Its absolute level does not matter to the
controller's choices, which compare shapes under the calibration's live load level; the
scheduler does not size prefill chunks by it (`Engine.use_default_profile`).
"""

from __future__ import annotations

import torch

from service.controller.cost_profile import CostProfile
from service.controller.profiler import CONTEXT_LENGTHS, pass_sizes, profiled_rows
from service.model.runner import ModelRunner
from service.model.tables import model_fingerprint

# a pass of more than one token costs this share of a one-token pass more
STEP_SHARE = {"cpu": 0.85, "cuda": 0.1}
# and each token beyond the first this share
EXTRA_TOKEN_SHARE = {"cpu": 0.16, "cuda": 0.01}
ONE_TOKEN_SECONDS = {"cpu": 0.02, "cuda": 0.005}  # the level; calibration corrects it live
CONTEXT_SHARE = 0.25  # a pass at a context of 1,024 costs this much more than at none
WIDE_ROW_TOKENS = 2  # one wide row beside one-token rows adds a step and these tokens' shares


def device_class(device: torch.device) -> str:
    """The class whose default a device gets: a CPU, or an accelerator (priced like a GPU)."""
    return "cpu" if device.type == "cpu" else "cuda"


def default_profile(runner: ModelRunner) -> CostProfile:
    """The conservative profile for `runner`'s device class, on the profiler's grid."""
    kind = device_class(runner.device)
    one, step, share = ONE_TOKEN_SECONDS[kind], STEP_SHARE[kind], EXTRA_TOKEN_SHARE[kind]
    rows = profiled_rows(runner.device)

    def seconds(tokens: int, length: int) -> float:
        extra = (step if tokens > 1 else 0.0) + share * (tokens - 1)
        return one * (1 + CONTEXT_SHARE * length / 1024) * (1 + extra)

    return CostProfile(
        rows=list(rows),
        context_lengths=list(CONTEXT_LENGTHS),
        tree_sizes=[pass_sizes(r, runner.device) for r in rows],
        seconds=[
            [
                [seconds(n, length) for n in pass_sizes(r, runner.device)]
                for length in CONTEXT_LENGTHS
            ]
            for r in rows
        ],
        wide_row_seconds=[
            [
                0.0 if r == 1 else seconds(1, length) * (step + share * WIDE_ROW_TOKENS)
                for length in CONTEXT_LENGTHS
            ]
            for r in rows
        ],
        device=f"default ({kind})",
        model=model_fingerprint(runner.model),
        dtype=str(runner.dtype),
    )
