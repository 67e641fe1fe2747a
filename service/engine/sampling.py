"""From logits to the target distribution p, and the randomness that samples from it.

p: temperature, then min-p, top-k, then top-p (nucleus), the order vLLM applies them (on logits
that logit_bias and the penalties adjusted first: `logits_adjuster.py`). Temperature 0 is
greedy (argmax), with no randomness at all.

Sampling is by inverse CDF with one uniform number per *output position*: the token at
position t is F⁻¹_p(u_t), where p is the model's distribution given the prefix and u_t comes
from the request's seeded generator. Plain decoding and speculation look the same u_t up
for the same position, so with the same seed they emit the same tokens — the speculative
output is not just distributed like plain sampling, it *is* the plain sample — and a seed
reproduces a request whatever speculation shape the controller picked.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from service.engine.params import SamplingParams
from service.kernels.packed_linear import loaded_kernels


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits → [n, vocab] probabilities after temperature, min-p, top-k, top-p."""
    scaled = logits.float() / params.temperature
    if params.min_p > 0:
        scaled = _min_p_cut(scaled, params.min_p)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab]
        cut = mass_before >= params.top_p
        # the top one stays: a top_p below float32's range (5e-324) compares as 0 >= 0
        cut[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _min_p_cut(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """[n, vocab] logits with the tokens below min_p × the row's largest probability masked
    out (vLLM's rule: the likeliest token always stays)."""
    probs = scaled.softmax(dim=-1)  # [n, vocab]
    return scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> list[int]:
    """The token chosen after each node: argmax when greedy, else F⁻¹_p(u) per node.

    logits: [n, vocab]; uniforms: [n], the u of the position each node's choice would fill.
    """
    if params.greedy:
        return greedy_choices(logits)
    assert uniforms is not None
    return sampled_tokens(logits, params, uniforms).tolist()


def sampled_tokens(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> torch.Tensor:
    """F⁻¹_p(u) per node ([n, vocab] logits, [n] uniforms → [n] ids), on the logits' device:
    what `choose_tokens` returns when sampling, left there (a device round reads it there)."""
    cdf = target_probs(logits, params).cumsum(dim=-1)  # [n, vocab]
    u = uniforms.to(cdf.device)[:, None] * cdf[:, -1:]  # [n, 1]: scaled to the float total
    return torch.searchsorted(cdf, u).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)


def greedy_choices(logits: torch.Tensor) -> list[int]:
    """Each row's argmax ([n, vocab] → n ids; the first of equal maxima and NaN as the
    maximum, as torch picks). Float32 CPU logits go through numpy: torch's reduction over a
    vocabulary row costs far more than its arithmetic there, more still right after the packed
    kernels streamed the weights through the caches (docs/benchmarks.md, figures behind design
    choices). Other devices and dtypes keep torch."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1).tolist()
    return logits.detach().numpy().argmax(axis=-1).tolist()


def top_token_ids(logits: torch.Tensor, k: int) -> np.ndarray:
    """[n, k] ids of each row's k largest logits, largest first ([n, vocab], k <= vocab): what
    the drafting layer's successor tables learn from every pass. On the CPU fast path (its
    kernels loaded, float32 logits) a numba kernel takes it, faster than torch.topk there;
    torch.topk otherwise. Equal logits may come in either order, and the kernel ranks NaN last
    where torch ranks it first."""
    kernels = loaded_kernels()
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return kernels.top_k_ids(logits.detach().contiguous().numpy(), k)
    return torch.topk(logits, k, dim=-1).indices.cpu().numpy()


def greedy_choices_of_rows(
    logits: list[torch.Tensor], together: bool | None = None
) -> list[list[int]]:
    """`greedy_choices` of each row's logits. `together` (default: off the CPU) takes all rows
    in one call: a call per row would wait for the device and copy back once per running
    request; on the CPU a call per row reads the rows where they are."""
    return _each_row(logits, greedy_choices, together)


def top_token_ids_of_rows(
    logits: list[torch.Tensor], k: int, together: bool | None = None
) -> list[np.ndarray]:
    """`top_token_ids` of each row's logits (k at most its vocabulary), `together` as in
    `greedy_choices_of_rows`."""
    return _each_row(logits, lambda rows: top_token_ids(rows, min(k, rows.shape[-1])), together)


def _each_row(
    logits: list[torch.Tensor], take: Callable[[torch.Tensor], Any], together: bool | None
) -> list[Any]:
    """`take` of each row's logits, or of all rows at once and split back into rows."""
    if not logits or not (logits[0].device.type != "cpu" if together is None else together):
        return [take(row) for row in logits]
    flat = take(torch.cat(logits))
    return [
        flat[end - len(row) : end]
        for row, end in zip(logits, itertools.accumulate(map(len, logits)))
    ]


class PositionUniforms:
    """u_t for output positions t = 0, 1, ... drawn in order from a seeded generator."""

    def __init__(self, seed: int | None) -> None:
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._drawn = torch.empty(0)

    def at(self, positions: list[int]) -> torch.Tensor:
        """[len(positions)] uniforms; a position always gets the same one."""
        needed = max(positions, default=-1) + 1
        if needed > len(self._drawn):
            extra = torch.rand(
                max(needed - len(self._drawn), 64), generator=self.generator, dtype=torch.float64
            )
            self._drawn = torch.cat([self._drawn.double(), extra])
        return self._drawn[positions]
