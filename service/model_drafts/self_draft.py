"""Self-drafting: the target's first m layers, its final norm and its LM head as a draft model.

Learning-free and weight-free: the truncated model is a view that *shares* the target's
modules (no copy), and it drafts in the target's own KV rows (`service/model_drafts/draft_rows.py`,
`TargetRows`), so it takes no memory at all. Shallower is cheaper per token and less often
right; the best m is a measurement (docs/benchmarks.md).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PreTrainedModel

# Default depth, as a share of the model's layers: on the embedded model a deep exit drafted
# far more tokens a pass than a shallow one, and shallower exits barely ever agree with the full
# model (docs/benchmarks.md, "Model drafts").
DEFAULT_SHARE = 0.8


def default_layers(model: PreTrainedModel) -> int:
    """The measured default depth for `model` (at least 1, at most all layers but one)."""
    total = model.config.num_hidden_layers
    return max(1, min(total - 1, round(DEFAULT_SHARE * total)))


def first_layers(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM running only `model`'s first `num_layers` decoder layers (weights shared)."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"self-draft layers must be in [1, {total - 1}] for this {total}-layer model, "
            f"got {num_layers}"
        )
    config = copy.copy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    base = _shallow_module_copy(model.base_model)
    base.layers = nn.ModuleList(list(model.base_model.layers)[:num_layers])  # type: ignore[union-attr]
    base.config = config
    view = _shallow_module_copy(model)
    setattr(view, model.base_model_prefix, base)
    view.config = config
    return view


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing `module`'s parameters and submodules (own registry)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # so replacing a child leaves the original alone
    return clone
