"""Which steps the device round takes (`service/device_round/`), and how its sampled rows choose.

The engine asks `device_step_plan` first every step; a plan sends the whole step to the device
round, None to the host path. What the device cannot do (prompt chunks, logprobs, grammars,
logit controls, rows of several shapes or modes) keeps a step on the host, where the same
tokens come out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from service.controller.policy import SpeculationPolicy
from service.device_round.round import Chooser, DevicePlan, DeviceRound
from service.device_round.template import TreeTemplate
from service.engine.request import Request
from service.engine.sampling import sampled_tokens


class StepRow(Protocol):
    """A running request's part of a step (the engine's row)."""

    request: Request
    chunk: list[int]


def device_step_plan(device_round: DeviceRound, policy: SpeculationPolicy, rows: Sequence[StepRow],
                     budget: int) -> DevicePlan | None:
    """The device round's plan when it can take this step: every row decoding, with nothing
    that needs its logits on the host (logprobs, a grammar, logit_bias or penalties), and all
    in fixed mode asking for the same (k, w) drafts, or all in auto mode (the step's template
    then the device planner's choice), of a strategy the device drafts, within the pass's node
    budget; None: the host path takes the step."""
    modes, strategies, ks, ws = set(), set(), [], []
    for row in rows:
        request = row.request
        if (row.chunk or request.prefill_remaining or request.constraint is not None
                or request.logits_adjuster is not None or request.params.logprobs is not None):
            return None
        spec = request.speculation
        modes.add("auto" if policy.is_auto(request) else "fixed" if spec.mode == "fixed" else "plain")
        strategies.add(request.params.strategy)
        ks.append(spec.k)
        ws.append(policy.max_depth(request, spec.w))
    if len(modes) != 1 or len(strategies) != 1:
        return None
    mode, strategy = modes.pop(), strategies.pop()
    if mode == "fixed" and len(set(ks)) == 1 and len(set(ws)) == 1:
        plan = device_round.plan(ks[0], ws[0], strategy)
    elif mode == "auto":
        assert policy.profile is not None  # auto mode's rows have one
        context = sum(row.request.context_length for row in rows) / len(rows)
        plan = device_round.plan_auto(min(ks), min(ws), strategy, policy.profile, context, len(rows), budget)
    else:
        return None
    return plan if plan is not None and len(rows) * (plan.template.num_nodes - 1) <= budget else None


def device_chooser(requests: Sequence[Request], template: TreeTemplate, device: torch.device) -> Chooser | None:
    """The model's choice after each node of a device step whose rows are `requests`, each
    drafting into `template`: the argmax, and for the sampled rows F⁻¹_p(u) with each node's
    position's uniform, the rows of equal sampling settings in one call. Their rows and
    uniforms go to the device before the pass, queued (from pinned memory on a GPU); nothing
    comes back. None where every row is greedy."""
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for index, request in enumerate(requests):
        sampling = request.params.sampling
        if not sampling.greedy:
            groups.setdefault((sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p), []).append(index)
    if not groups:
        return None
    nodes = template.num_nodes

    def upload(values: torch.Tensor) -> torch.Tensor:
        return (values.pin_memory() if device.type == "cuda" else values).to(device, non_blocking=True)

    sampled = [(requests[members[0]].params.sampling, upload(torch.tensor(members)),
                upload(torch.cat([requests[i].uniforms.at([requests[i].context_length + d for d in template.depths])  # type: ignore[union-attr]
                                  for i in members])))
               for members in groups.values()]

    def choose(logits: torch.Tensor) -> torch.Tensor:
        choices = logits.argmax(-1).view(len(requests), nodes)
        by_row = logits.view(len(requests), nodes, -1)
        for params, rows, uniforms in sampled:
            choices[rows] = sampled_tokens(by_row[rows].flatten(0, 1), params, uniforms).view(len(rows), nodes)
        return choices.flatten()
    return choose
