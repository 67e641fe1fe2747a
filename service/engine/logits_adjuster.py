"""logit_bias and the penalties, applied at every tree node from the tokens of its own path.

Plain decoding adjusts the next token's logits from the tokens before it. A tree node stands
for a prefix of its own: the committed tokens, then the drafted tokens from the root down to
the node. So each node's logits are adjusted from exactly that prefix, and the node's choice
(argmax, or the inverse-CDF sample of its position's uniform) is the one plain decoding would
make after it: speculation stays lossless, greedy output token-identical, a seeded sample the
same sample (`verifier.py`).

Order, as vLLM's: logit_bias, then the repetition penalty, then the frequency and presence
penalties; greedy takes the argmax of the result, sampling goes on with temperature, min-p,
top-k and top-p (`sampling.target_probs`). Which tokens count:
- `frequency_penalty`, `presence_penalty` (OpenAI's): the generated tokens only, prompt
  excluded. logit -= frequency × count(token) + presence × [count(token) > 0].
- `repetition_penalty` (CTRL's, as HF and vLLM): every token of the prompt or the output. A
  positive logit is divided by it, a negative one multiplied (> 1 discourages repeats).
A tree node's path tokens (root excluded: it is committed already) count as generated tokens.

Requests without these controls never build an adjuster (no tensor work per round); those with
them pay one [num_nodes, vocab] count matrix and a few elementwise passes over it per round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from service.engine.params import SamplingParams
from service.model.tree import TokenTree


class LogitsAdjuster:
    """One request's logit_bias and penalties, with the counts of its generated tokens, kept
    up to date from its committed tokens before each round."""

    def __init__(
        self,
        sampling: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if any(token >= vocab_size for token in sampling.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size})")
        self.sampling = sampling
        self.num_prompt_tokens = len(prompt_ids)
        self.bias = _dense(sampling.logit_bias, vocab_size, device)  # [vocab] or None
        self.prompt_seen = (
            None
            if sampling.repetition_penalty == 1
            else (token_counts(prompt_ids, vocab_size, device) > 0)
        )  # [vocab] bool
        self.output_counts = torch.zeros(vocab_size, device=device)  # [vocab]
        self._counted = 0  # output tokens in `output_counts`

    @classmethod
    def for_request(
        cls,
        sampling: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> LogitsAdjuster | None:
        """An adjuster, or None for a request that asks for no adjustment (the common case)."""
        return cls(sampling, prompt_ids, vocab_size, device) if sampling.adjusts_logits else None

    def __call__(
        self, logits: torch.Tensor, tree: TokenTree, token_ids: Sequence[int]
    ) -> torch.Tensor:
        """The [num_nodes, vocab] logits of `tree`'s nodes (a new tensor), each adjusted from
        its own path; `token_ids` are the request's committed tokens, prompt then output."""
        new = token_ids[self.num_prompt_tokens + self._counted :]
        if new:
            self.output_counts += token_counts(
                new, len(self.output_counts), self.output_counts.device
            )
            self._counted += len(new)
        counts = self.output_counts[None]  # [1, vocab]: a plain round's one node
        if tree.num_nodes > 1:
            counts = counts + path_counts(tree, len(self.output_counts), self.output_counts.device)
        return adjusted_logits(
            logits[: tree.num_nodes], counts, self.prompt_seen, self.bias, self.sampling
        )


def adjusted_logits(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor | None,
    bias: torch.Tensor | None,
    sampling: SamplingParams,
) -> torch.Tensor:
    """logits [n, vocab] after logit_bias ([vocab]), the repetition penalty (over tokens in the
    prompt, `prompt_seen` [vocab], or the output) and the frequency and presence penalties
    (over the output's `counts` [n, vocab]). Out of place: the caller's logits stay raw."""
    out = logits.float() if bias is None else logits.float() + bias  # [n, vocab]
    if sampling.repetition_penalty != 1:
        seen = counts > 0 if prompt_seen is None else (counts > 0) | prompt_seen  # [n, vocab]
        factor = torch.where(seen, sampling.repetition_penalty, 1.0)  # [n, vocab]
        out = torch.where(out > 0, out / factor, out * factor)
    if sampling.frequency_penalty:
        out = out - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        out = out - sampling.presence_penalty * (counts > 0)
    return out


def path_counts(tree: TokenTree, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_nodes, vocab]: how often each token occurs on the path from the root (excluded)
    down to each node (included): one scatter of the (node, ancestor) pairs, at most
    num_nodes × depth of them."""
    # [num_nodes, num_nodes]: column j on row i if j is i or above it
    ancestors = tree.ancestor_mask()
    ancestors[:, 0] = False  # the root is a committed token, counted already
    nodes, on_path = np.nonzero(ancestors)
    tokens = np.asarray(tree.token_ids)[on_path]
    counts = torch.zeros(tree.num_nodes, vocab_size, device=device)
    index = (torch.from_numpy(nodes).to(device), torch.from_numpy(tokens).to(device))
    return counts.index_put_(index, torch.ones(len(nodes), device=device), accumulate=True)


def token_counts(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab] float: occurrences of each token in `token_ids`."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab_size).float()


def _dense(bias: Mapping[int, float], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """logit_bias as a [vocab] vector to add, None when empty."""
    if not bias:
        return None
    dense = torch.zeros(vocab_size, device=device)
    dense[torch.tensor(list(bias), device=device)] = torch.tensor(
        list(bias.values()), device=device
    )
    return dense
