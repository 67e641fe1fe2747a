"""A step on the device round (`service/device_round/`) where it can take the step, on the host
path otherwise.

Each step the device round is asked first; what it cannot do (prompt chunks, logprobs,
grammars, logit controls, rows of several shapes or modes) keeps the step on the host, where
the same tokens come out. The host then drafts from its own successor tables, which take what
the device rounds learned first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.device_round.round import Chooser, DeviceRound, TemplateChoice
from service.device_round.template import TreeTemplate
from service.engine.host_step import HostStep
from service.engine.policy import SpeculationPolicy
from service.engine.request import Request
from service.engine.sampling import sampled_tokens
from service.engine.step_row import PassFailed, StepRounds, StepRow, take_round
from service.engine.timing import StepTimer
from service.model.runner import ModelRunner


class DeviceStep:
    """Runs a step on the device round when it can take it, else on `host`."""

    def __init__(
        self,
        device_round: DeviceRound,
        host: HostStep,
        runner: ModelRunner,
        policy: SpeculationPolicy,
    ) -> None:
        self.device_round = device_round
        self.host = host
        self.runner = runner
        self.policy = policy

    @property
    def _capture_seconds(self) -> float:
        """Spent recording CUDA graphs so far: the passes' and the rounds' own."""
        return self.runner.capture_seconds + self.device_round.graphs.capture_seconds

    def run(self, rows: list[StepRow], budget: int, timer: StepTimer) -> StepRounds:
        """The step's rounds (`HostStep.run`'s, from the device round's one copy back where it
        takes the step); raises `PassFailed` if the pass does."""
        choice = self._choice(rows, budget)
        if choice is None:
            self.device_round.hand_tables_to_host()
            return self.host.run(rows, budget, timer)
        template = choice.template
        rows = [self._shaped(row, template, choice.forecast) for row in rows]
        timer.mark_drafted(self._capture_seconds)
        try:
            step = self.device_round.run(
                self.host.cache,
                [row.request.drafts.history for row in rows],
                choice,
                device_chooser([row.request for row in rows], template, self.runner.device),
            )
        except Exception as error:
            raise PassFailed(str(error)) from error
        timer.mark_passed(self._capture_seconds)
        chain_drafted = step.drafted[:, 1 : 1 + template.chain].sum(1).tolist()
        table_drafted = step.drafted[:, 1 + template.chain :].sum(1).tolist()
        table = choice.table or ""
        rounds = []
        for index, row in enumerate(rows):
            committed = step.token_ids(index)
            row.request.drafts.observe(committed)
            drafted = {
                name: count
                for name, count in (
                    ("context", chain_drafted[index]),
                    (table, table_drafted[index]),
                )
                if count
            }
            accepted = [
                "context" if node <= template.chain else table
                for node in step.accepted_nodes(index)
            ]
            rounds.append(take_round(row, committed, accepted, drafted, sum(drafted.values())))
        timer.mark_verified()
        return StepRounds(rows, rounds, wait_seconds=step.wait_seconds, syncs=1)

    def _shaped(self, row: StepRow, template: TreeTemplate, forecast: float | None) -> StepRow:
        """A row with the step's template as its tree (the pass's shape, what statistics count)
        and the shape it reports: the template's in auto mode, the configured one in fixed."""
        spec = row.request.speculation
        if self.policy.is_auto(row.request):
            return row.with_tree(template.shape_tree, template.k, template.w, forecast)
        return row.with_tree(
            template.shape_tree, *((spec.k, spec.w) if spec.mode == "fixed" else (0, 0))
        )

    def _choice(self, rows: Sequence[StepRow], budget: int) -> TemplateChoice | None:
        """The device round's template when it can take this step: every row decoding, with
        nothing that needs its logits on the host (logprobs, a grammar, logit_bias or
        penalties), and all in fixed mode asking for the same (k, w) drafts, or all in auto mode
        (the step's template then the device's choice), of a strategy the device drafts, within
        the pass's node budget; None: the host path takes the step."""
        policy = self.policy
        modes, strategies, ks, ws = set(), set(), [], []
        for row in rows:
            request = row.request
            if (
                row.chunk
                or request.prefill_remaining
                or request.constraint is not None
                or request.logits_adjuster is not None
                or request.params.logprobs is not None
            ):
                return None
            spec = request.speculation
            modes.add(
                "auto" if policy.is_auto(request) else "fixed" if spec.mode == "fixed" else "plain"
            )
            strategies.add(request.params.strategy)
            ks.append(spec.k)
            ws.append(policy.max_depth(request, spec.w))
        if len(modes) != 1 or len(strategies) != 1:
            return None
        mode, strategy = modes.pop(), strategies.pop()
        if mode == "fixed" and len(set(ks)) == 1 and len(set(ws)) == 1:
            choice = self.device_round.fixed_template(ks[0], ws[0], strategy)
        elif mode == "auto":
            assert policy.profile is not None  # auto mode's rows have one
            context = sum(row.request.context_length for row in rows) / len(rows)
            choice = self.device_round.auto_template(
                min(ks), min(ws), strategy, policy.profile, context, len(rows), budget
            )
        else:
            return None
        return (
            choice
            if choice is not None and len(rows) * (choice.template.num_nodes - 1) <= budget
            else None
        )


def device_chooser(
    requests: Sequence[Request], template: TreeTemplate, device: torch.device
) -> Chooser | None:
    """The model's choice after each node of a device step whose rows are `requests`, each
    drafting into `template`: the argmax, and for the sampled rows F⁻¹_p(u) with each node's
    position's uniform, the rows of equal sampling settings in one call. Their rows and
    uniforms go to the device before the pass, queued (from pinned memory on a GPU); nothing
    comes back. None where every row is greedy."""
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for index, request in enumerate(requests):
        sampling = request.params.sampling
        if not sampling.greedy:
            groups.setdefault(
                (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p), []
            ).append(index)
    if not groups:
        return None
    nodes = template.num_nodes

    def upload(values: torch.Tensor) -> torch.Tensor:
        return (values.pin_memory() if device.type == "cuda" else values).to(
            device, non_blocking=True
        )

    sampled = [
        (
            requests[members[0]].params.sampling,
            upload(torch.tensor(members)),
            upload(
                torch.cat(
                    [
                        requests[i].uniforms.at(
                            [requests[i].context_length + d for d in template.depths]
                        )  # type: ignore[union-attr]
                        for i in members
                    ]
                )
            ),
        )
        for members in groups.values()
    ]

    def choose(logits: torch.Tensor) -> torch.Tensor:
        choices = logits.argmax(-1).view(len(requests), nodes)
        by_row = logits.view(len(requests), nodes, -1)
        for params, rows, uniforms in sampled:
            choices[rows] = sampled_tokens(by_row[rows].flatten(0, 1), params, uniforms).view(
                len(rows), nodes
            )
        return choices.flatten()

    return choose
