"""Where two greedy answers part, and whether rounding alone can explain it.

Speculation verifies a tree of tokens in one pass; plain decoding computes the same logits one
token a pass. In float32 on the CPU paths every kernel gives each row the same result whatever
the pass's size, so greedy answers are token-identical and any difference is a defect. In
bf16 (a GPU's default, and the unpacked path on a CPU with native bf16) a pass of other shape
rounds the logits otherwise, and where the two likeliest tokens are within that rounding the
answers can part there and go their own ways.

The rule that tells the two apart asks the truth, not the rounded logits. At the first token
where the answers differ, one more pass over the prompt and the common part of the answers
computes the logits at a higher precision from the same weights (bf16 and float16 weights cast
exactly to float32, float32 ones to float64): the two tokens' true gap. One more pass in the
served dtype measures how far its rounding moves logits at that very position: the largest
deviation from the truth among the `ROUNDING_TOP` likeliest tokens. The two answers were chosen
by two passes, each off the truth by about that much, so a parting is a tie only if the true
gap is within twice that deviation (and never less than `MIN_TIE_ULPS` ulps of the served dtype
at the logits' magnitude); anything wider fails. The former rule measured the gap on the served
dtype's own logits and let any parting within 4 ulps pass: 1.0 of a logit in bf16 at
magnitudes 32-64, where a slightly wrong position or mask could hide. Packed CPU weights
(float32, kernels of their own) are their own reference: there a tie needs a gap within
float32's rounding, ~1e-6 of a logit.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from service.kernels.packed_linear import PackedLinear

MIN_TIE_ULPS = 1.0
ROUNDING_TOP = 8
HIGHER_PRECISION = {
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
    torch.float32: torch.float64,
}
_REFERENCES: weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedModel] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class Parting:
    """Where an answer first differs from plain decoding's, and the logits' gap there."""

    index: int  # the first answer token that differs
    gap: float  # |logit(plain's token) - logit(the other's)| at the higher precision
    bound: float  # the widest gap the served dtype's rounding there explains
    ulps: float  # the gap in ulps of the served dtype at the logits' magnitude (for reports)

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound


def first_difference(plain: Sequence[int], other: Sequence[int]) -> int | None:
    """The first index where the answers differ (the shorter one's length where it is the
    other's beginning); None if they are equal."""
    for index, (a, b) in enumerate(zip(plain, other)):
        if a != b:
            return index
    return None if len(plain) == len(other) else min(len(plain), len(other))


def parting(
    model: PreTrainedModel, prompt_ids: Sequence[int], plain: Sequence[int], other: Sequence[int]
) -> Parting | None:
    """Where greedy answer `other` parts from plain decoding's `plain` after `prompt_ids`, with
    the gap between the two tokens chosen there (`reference_of(model)`'s logits, in ulps of
    `model`'s dtype); None if the answers are equal or one is the other cut short (no token
    chosen otherwise: no tie to explain it)."""
    index = first_difference(plain, other)
    if index is None or index >= min(len(plain), len(other)):
        return None
    ids, chosen = [*prompt_ids, *plain[:index]], [plain[index], other[index]]
    reference = reference_of(model)
    truth = next_token_logits(reference, ids).double()
    gap = abs(float(truth[chosen[0]] - truth[chosen[1]]))
    unit = ulp(float(truth[chosen].abs().max()), model.dtype)
    deviation = 0.0
    if reference is not model:
        top = truth.topk(ROUNDING_TOP).indices
        deviation = float((next_token_logits(model, ids).double()[top] - truth[top]).abs().max())
    return Parting(index, gap, max(2 * deviation, MIN_TIE_ULPS * unit), gap / unit)


def reference_of(model: PreTrainedModel) -> PreTrainedModel:
    """`model` at a higher precision from the same weights (kept while `model` lives); packed
    CPU weights, which compute in float32 with kernels of their own, are their own reference."""
    if any(isinstance(module, PackedLinear) for module in model.modules()):
        return model
    reference = _REFERENCES.get(model)
    if reference is None:
        reference = _REFERENCES[model] = _rebuilt(model, HIGHER_PRECISION[model.dtype])
    return reference


def _rebuilt(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A new `type(model)` from its config holding `model`'s weights in `dtype`, on its device.
    Rebuilt rather than deep-copied: a served model is reachable from what serves it (a CUDA
    graph cannot be copied)."""
    with torch.device(model.device):
        rebuilt = type(model)(model.config).to(dtype)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt.eval()


def ulp(magnitude: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values at `magnitude` (its smallest normal number at 0)."""
    info = torch.finfo(dtype)
    if magnitude < info.tiny:
        return info.tiny
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1
    return info.eps * 2.0 ** (exponent - 1)


@torch.inference_mode()
def next_token_logits(model: PreTrainedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """The model's logits after `token_ids` ([vocab], its own dtype), from one pass through
    transformers' forward on an empty cache: the engine's rows, caches and recorded passes stay
    untouched. Only the last position's logits where the model can keep just those."""
    input_ids = torch.tensor([list(token_ids)], device=model.device)
    last_only = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )
    return model(input_ids, **last_only).logits[0, -1]
