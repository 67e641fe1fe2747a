"""Log-probabilities of committed tokens, for requests that ask for them (OpenAI `logprobs`).

They are the model's *raw* log-probabilities: log-softmax of the logits at temperature 1,
before temperature, top-k or top-p (as vLLM's default "raw_logprobs"). So they describe the
model, not the sampler, and are the same whatever sampling settings or speculation shape
produced the token: the node that produced a committed token has exactly the logits plain
decoding would have computed after the same prefix (see `verifier.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability and the `top` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, nodes: Sequence[int], token_ids: Sequence[int], top: int
) -> list[TokenLogprob]:
    """The logprob of `token_ids[i]` under the logits of tree node `nodes[i]`, with its top-`top`.

    logits: [num_nodes, vocab]; `nodes` are the root then the accepted nodes, whose choices
    are the round's committed tokens in order.
    """
    logprobs = torch.log_softmax(logits[list(nodes)].float(), dim=-1)  # [len(nodes), vocab]
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logprobs.device)[:, None])[
        :, 0
    ].tolist()
    best = logprobs.topk(top, dim=-1) if top > 0 else None
    out = []
    for i, token in enumerate(token_ids):
        alternatives = (
            [] if best is None else list(zip(best.indices[i].tolist(), best.values[i].tolist()))
        )
        out.append(TokenLogprob(token, chosen[i], alternatives))
    return out
