"""How many of a draft's tokens the model accepts: a censored geometric estimate.

For a draft of a given key (strategy, rank, order: `drafting/mixer.py`), model the accepted
length L as: the first token is accepted with probability p; each further token, given the
previous one was, with probability c. Then E[min(L, w)] = p·(1 − c^w)/(1 − c): one estimate
serves every w, which is what lets the controller weigh a speculation shape it has not tried.

Observations are censored: a draft can match at most min(len(draft), len(committed))
tokens of what the model committed this round, so reaching that cap says "at least", not
"exactly". The estimator counts a continuation trial only where the outcome was seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class AcceptanceCounts:
    """Sufficient statistics of the censored geometric model."""

    first_trials: float = 0.0
    first_hits: float = 0.0
    next_trials: float = 0.0
    next_hits: float = 0.0

    def observe(self, accepted: int, cap: int, shared: int = 0) -> None:
        """`accepted` of the draft's tokens matched; no more than `cap` could have. The first
        `shared` tokens are nodes a better-valued draft of the round holds too: they count for
        that draft, and this one is scored from its first token of its own, a continuation
        trial once the shared part was accepted (see `RequestDrafts.observe`)."""
        if cap <= shared:
            return
        if shared == 0:
            self.first_trials += 1
            if accepted == 0:
                return
            self.first_hits += 1
            shared = 1
        elif accepted < shared:
            return
        self.next_hits += accepted - shared
        self.next_trials += accepted - shared + (1 if accepted < cap else 0)


class Acceptance(NamedTuple):
    """Estimated first-token (p) and continuation (c) acceptance probabilities. A named tuple:
    a round estimates one per candidate draft, and a frozen dataclass's guarded init is
    slower (docs/benchmarks.md, "Drafting's host share")."""

    p: float
    c: float

    def expected_tokens(self, w: int) -> float:
        """E[min(L, w)]: expected accepted tokens of a draft cut to w tokens."""
        if self.c >= 1.0:
            return self.p * w
        return self.p * (1.0 - self.c**w) / (1.0 - self.c)


def blend(counts: AcceptanceCounts, prior: Acceptance, prior_weight: float) -> Acceptance:
    """Posterior-mean style estimate: `prior` counts as `prior_weight` observations."""
    p = (counts.first_hits + prior.p * prior_weight) / (counts.first_trials + prior_weight)
    c = (counts.next_hits + prior.c * prior_weight) / (counts.next_trials + prior_weight)
    return Acceptance(p, c)
