"""One request's whole state, owned in one place: what it asked for, what it has committed,
how far its prompt is in the KV cache, and its drafting/calibration/sampling state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from drafting import RequestDrafts
from service.controller.calibration import RequestCalibration
from service.engine.logits_adjuster import LogitsAdjuster
from service.engine.params import GenerationParams, SpeculationParams
from service.engine.sampling import PositionUniforms
from service.grammar import Constraint


def kv_tokens_needed(num_prompt_tokens: int, params: GenerationParams) -> int:
    """The most KV entries a request's row can ever hold: prompt, output and one tree in flight."""
    return num_prompt_tokens + params.max_new_tokens + params.speculation.max_tree_nodes


class Status(enum.Enum):
    WAITING = "waiting"  # queued; no KV row yet
    RUNNING = "running"  # has a KV row: prefilling its prompt, then decoding
    FINISHED = "finished"  # stopped, hit its budget, was aborted, or failed


@dataclass(eq=False)
class Request:
    """A generation in flight. The committed tokens are `drafts.history` (prompt, then output);
    the KV row holds all but the newest of them once the prompt is prefilled."""

    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    drafts: RequestDrafts
    calibration: RequestCalibration
    uniforms: PositionUniforms | None
    stop_ids: frozenset[int]
    logits_adjuster: LogitsAdjuster | None = None  # logit_bias and penalties, when asked for
    constraint: Constraint | None = None  # the output's grammar (structured output), when asked for
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    kv_row: int | None = None  # KV cache row while running
    num_cached: int = 0  # committed tokens the prefix cache and prompt chunks put in the KV row
    num_prefix_cached: int = 0  # of the prompt's, those the prefix cache gave at admission
    num_generated: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    started_at: float | None = None  # first admitted to the running batch
    aborted: bool = False  # asked to stop; leaves the batch at the next step
    preemptions: int = 0  # times its row was given up for interactive load (batch requests)
    # the committed tokens its row must hold before it decodes: all of the prompt's but the
    # last; after a preemption, all but the newest (recomputed, `Scheduler.preempt`)
    prefill_target: int = field(init=False)

    def __post_init__(self) -> None:
        self.prefill_target = len(self.prompt_ids) - 1

    @property
    def speculation(self) -> SpeculationParams:
        return self.params.speculation

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_remaining(self) -> int:
        """Committed tokens still to put in the cache before the row decodes."""
        return self.prefill_target - self.num_cached

    @property
    def token_budget(self) -> int:
        return self.params.max_new_tokens - self.num_generated

    @property
    def max_kv_tokens(self) -> int:
        return kv_tokens_needed(self.num_prompt_tokens, self.params)

    @property
    def context_length(self) -> int:
        return len(self.drafts.history)

    @property
    def token_ids(self) -> list[int]:
        """The committed tokens: the prompt, then the output (with the cut-off rest of a final
        round, if any)."""
        return self.drafts.history.token_ids

    @property
    def output_ids(self) -> list[int]:
        """The tokens generated so far (the history may also hold the cut-off rest of a final
        round)."""
        start = self.num_prompt_tokens
        return self.token_ids[start : start + self.num_generated]
