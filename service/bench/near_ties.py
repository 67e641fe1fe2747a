"""Where two greedy answers part, and whether rounding alone can explain it.

Speculation verifies a tree of tokens in one pass; plain decoding computes the same logits one
token a pass. In float32 on the CPU paths every kernel gives each row the same result whatever
the pass's size, so greedy answers are token-identical and any difference is a defect. In
bf16 (a GPU's default, and the unpacked path on a CPU with native bf16) a pass of other shape
rounds the logits otherwise, and where the two likeliest tokens are within that rounding the
answers can part there and go their own ways. The bench tells the two apart: it takes the
logits at the first token where the answers differ from one more pass over the prompt and the
common part of the answers, and measures the two tokens' gap in units in the last place (ulps)
of the logits' own dtype at their magnitude.

A gap of at most `NEAR_TIE_ULPS` counts as a near tie: twice the widest parting measured. On
the dev CPU's bf16 path (embedded model, 13 Spec-Bench prompts x 128 tokens, fixed k=8, w=8
and auto) 20 answers parted from plain decoding, each at a gap of 0, 1 or 2 ulps (0 to 0.25
at logits of 15-36, where an ulp is 0.0625-0.25); an earlier bf16 test run saw one at 2 ulps
(0.25 at 16.5). A defect (a node that attends to the wrong tokens) moves logits by far more;
in float32 a few ulps are ~1e-6 of a logit, which no defect hides in. The engine's tests hold
speculative answers to the same rule (`tests/service/engine/test_embedded_lossless.py`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

NEAR_TIE_ULPS = 4.0


@dataclass(frozen=True)
class Parting:
    """Where an answer first differs from plain decoding's, and the logits' gap there."""

    index: int  # the first answer token that differs
    ulps: float  # |logit(plain's token) - logit(the other's)| in ulps of the logits' dtype

    @property
    def near_tie(self) -> bool:
        return self.ulps <= NEAR_TIE_ULPS


def first_difference(plain: Sequence[int], other: Sequence[int]) -> int | None:
    """The first index where the answers differ (the shorter one's length where it is the
    other's beginning); None if they are equal."""
    for index, (a, b) in enumerate(zip(plain, other)):
        if a != b:
            return index
    return None if len(plain) == len(other) else min(len(plain), len(other))


def parting(model: PreTrainedModel, prompt_ids: Sequence[int], plain: Sequence[int], other: Sequence[int]) -> Parting | None:
    """Where greedy answer `other` parts from plain decoding's `plain` after `prompt_ids`, with
    the gap between the two tokens chosen there; None if the answers are equal or one is the
    other cut short (no token chosen otherwise: no tie to explain it)."""
    index = first_difference(plain, other)
    if index is None or index >= min(len(plain), len(other)):
        return None
    logits = next_token_logits(model, [*prompt_ids, *plain[:index]])
    return Parting(index, gap_ulps(logits, plain[index], other[index]))


def gap_ulps(logits: torch.Tensor, token: int, other: int) -> float:
    """|logits[token] - logits[other]| in ulps of the logits' dtype, at the larger magnitude."""
    a, b = float(logits[token]), float(logits[other])
    return abs(a - b) / ulp(max(abs(a), abs(b)), logits.dtype)


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
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    return model(input_ids, **last_only).logits[0, -1]
