"""Every row's draft tree at once: the template filled by gathers, one depth at a time."""

from __future__ import annotations

import torch

from service.device_round.context import context_drafts
from service.device_round.tables import DeviceTable
from service.device_round.template import TreeTemplate


def draft_trees(
    recent: torch.Tensor, template: TreeTemplate, table: DeviceTable | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' tokens and filled nodes [R, N] from their `recent` tokens [R, L] (-1 before a
    row's first; the last one is the root): the context chain (`context_drafts`), then the
    table's trie, each node the rank-th successor of its parent's token (keyed by its
    grandparent's too: the root's previous token for depth 1)."""
    device = recent.device
    shape = template.tensors(device)
    rows = recent.shape[0]
    tokens = torch.zeros(rows, template.num_nodes, dtype=torch.long, device=device)
    valid = torch.zeros(rows, template.num_nodes, dtype=torch.bool, device=device)
    tokens[:, 0], valid[:, 0] = recent[:, -1], True
    if template.chain:
        chain, filled = context_drafts(recent, template.chain)
        tokens[:, 1 : 1 + template.chain], valid[:, 1 : 1 + template.chain] = chain, filled
    if table is None or not shape.table_levels:
        return tokens, valid
    single = table.single_rows()
    # column i + 1: node i's token; column 0: the root's previous
    before = torch.cat([recent[:, -2:-1], tokens], dim=1)
    for level in shape.table_levels:
        following = table.step(
            before[:, level.grandparent_columns],
            tokens[:, level.parents],
            level.ranks.expand(rows, -1),
            single,
        )
        filled = valid[:, level.parents] & (following >= 0)
        tokens[:, level.nodes] = torch.where(filled, following, 0)
        valid[:, level.nodes] = filled
        before[:, level.nodes + 1] = tokens[:, level.nodes]
    return tokens, valid
