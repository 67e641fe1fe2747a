"""Per-request speculation statistics, named as vLLM names them so existing tools read them.

The engine never imports a metrics library; the HTTP edge turns these into JSON (and, later,
Prometheus samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.engine.outputs import RoundOutput


@dataclass
class SpecDecodingStats:
    """Accumulates the rounds of one request."""

    num_spec_steps: int = 0  # verification passes
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + bonus tokens
    acceptance_histogram: list[int] = field(default_factory=list)  # [accepted per pass] -> passes
    accepted_by_strategy: dict[str, int] = field(default_factory=dict)
    k: int = 0  # shape of the last round
    w: int = 0

    def observe(self, round_output: RoundOutput) -> None:
        self.num_spec_steps += 1
        self.num_draft_tokens += round_output.num_draft_tokens
        self.num_accepted_draft_tokens += round_output.num_accepted_tokens
        self.num_emitted_tokens += len(round_output.token_ids)  # after a stop or max_tokens cut
        accepted = round_output.num_accepted_tokens
        self.acceptance_histogram.extend([0] * (accepted + 1 - len(self.acceptance_histogram)))
        self.acceptance_histogram[accepted] += 1
        for strategy in round_output.accepted_strategies:
            self.accepted_by_strategy[strategy] = self.accepted_by_strategy.get(strategy, 0) + 1
        self.k, self.w = round_output.k, round_output.w

    def as_dict(self) -> dict[str, Any]:
        steps, drafted = self.num_spec_steps, self.num_draft_tokens
        return {
            "num_spec_steps": steps,
            "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "mean_acceptance_length": self.num_emitted_tokens / steps if steps else 0.0,
            "draft_acceptance_rate": self.num_accepted_draft_tokens / drafted if drafted else 0.0,
            "acceptance_histogram": list(self.acceptance_histogram),
            "k": self.k,
            "w": self.w,
            "accepted_by_strategy": dict(self.accepted_by_strategy),
        }
