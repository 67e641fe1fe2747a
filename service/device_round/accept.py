"""Greedy acceptance of every row's tree at once, on the device.

Node i is accepted when it holds the model's choice after its parent and its parent is
accepted (the root always is): with the template's ancestor matrix that is "no ancestor of i,
i included, mismatches", one batched reduction. A row's walk ends at its deepest accepted node
(the first such in node order, should a context and a table node hold the same token); its
path is that node's ancestors, one per depth, and the model's choice there is the bonus token.
The same tokens the host's node-by-node walk (`service.engine.verifier`) commits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.device_round.template import TemplateTensors


@dataclass(frozen=True)
class Accepted:
    """A round's outcome per row, on the device."""

    # int64 [R, W + 1]: the accepted path's node at each depth (root at 0; 0 past its end)
    path: torch.Tensor
    counts: torch.Tensor  # int64 [R]: accepted drafted tokens
    # int64 [R, W + 1]: the accepted tokens then the bonus (garbage past counts + 1)
    tokens: torch.Tensor


def accept_greedy(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    choices: torch.Tensor,
    template: TemplateTensors,
    max_depth: int,
) -> Accepted:
    """`tokens`, `valid` and `choices` (the model's argmax after each node): [R, N]; the
    template's deepest node at `max_depth` (a host number: reading it off the device would wait)."""
    nodes = tokens.shape[1]
    parent_choice = choices[:, template.parents]  # [R, N]
    match = valid & (tokens == parent_choice)
    match[:, 0] = True
    accepted = ~((~match)[:, None, :] & template.ancestors[None]).any(-1)  # [R, N]
    index = torch.arange(nodes, device=tokens.device)
    score = torch.where(accepted, template.depths * nodes + (nodes - 1 - index), -1)
    deepest = score.argmax(-1)  # [R]
    counts = template.depths[deepest]
    on_path = template.ancestors[deepest]  # [R, N]
    levels = torch.arange(max_depth + 1, device=tokens.device)
    # [R, W + 1, N]
    by_depth = on_path[:, None, :] & (template.depths[None, None, :] == levels[None, :, None])
    # [R, W + 1]: one node a depth up to the row's count, none (0) past it
    path = (by_depth * index).sum(-1)
    drafted = tokens.gather(1, path[:, 1:])  # [R, W]
    # the bonus's slot
    after = torch.arange(max_depth, device=tokens.device)[None] == counts[:, None]
    bonus = choices.gather(1, deepest[:, None])  # [R, 1]
    committed = torch.cat([torch.where(after, bonus, drafted), bonus], dim=1)
    return Accepted(path=path, counts=counts, tokens=committed)
