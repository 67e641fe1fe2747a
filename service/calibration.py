"""How far the controller's forecasts are from what happens, learned while it runs.

Two biases make a forecast too rosy. The acceptance model over-promises exactly where the
controller looks: it picks the candidates whose estimates look best, and the best-looking
estimate is more often lucky than good (the winner's curse). And the cost profile was measured
once, perhaps under another load. Both show in every auto round, as predicted vs accepted draft
tokens and predicted vs measured pass seconds; decayed sums of those give correction factors,
so a forecast that keeps failing stops winning rounds, and speculation stays no slower than
plain decoding.

Pass costs are the device's business, so their factors are global. Acceptance depends on the
text, so each request has its own factor, which starts at the global one and moves away as the
request's rounds are observed.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.regime import Correction, Forecast

DECAY = 0.98  # sums forget with a horizon of about 50 rounds, so a change of load shows
PRIOR_ROUNDS = 4.0  # a factor is trusted like the prior until about this many rounds


@dataclass
class Ratio:
    """Decayed sums of predicted and realized amounts, and how many rounds fed them."""

    predicted: float = 0.0
    realized: float = 0.0
    rounds: float = 0.0

    def observe(self, predicted: float, realized: float) -> None:
        self.predicted = self.predicted * DECAY + predicted
        self.realized = self.realized * DECAY + realized
        self.rounds = self.rounds * DECAY + 1.0

    def factor(self, prior: float = 1.0) -> float:
        """realized / predicted, shrunk toward `prior` while few rounds are in."""
        if self.predicted <= 0.0:
            return prior
        ratio = self.realized / self.predicted
        return (self.rounds * ratio + PRIOR_ROUNDS * prior) / (self.rounds + PRIOR_ROUNDS)


class Calibration:
    """The global factors (one per engine); `session` opens a request's own."""

    def __init__(self) -> None:
        self.draft_tokens = Ratio()
        self.spec_seconds = Ratio()
        self.plain_seconds = Ratio()

    def session(self) -> RequestCalibration:
        return RequestCalibration(self)


class RequestCalibration:
    """One request's acceptance factor, over the global one; feeds both."""

    def __init__(self, shared: Calibration) -> None:
        self.shared = shared
        self.draft_tokens = Ratio()

    def correction(self) -> Correction:
        return Correction(
            draft_tokens=self.draft_tokens.factor(prior=self.shared.draft_tokens.factor()),
            spec_seconds=self.shared.spec_seconds.factor(),
            plain_seconds=self.shared.plain_seconds.factor(),
        )

    def observe(self, forecast: Forecast, accepted: int, seconds: float) -> None:
        """One auto round: its forecast (uncorrected parts), what it accepted and cost."""
        if forecast.tree_nodes > 1:
            self.draft_tokens.observe(forecast.draft_tokens, accepted)
            self.shared.draft_tokens.observe(forecast.draft_tokens, accepted)
            self.shared.spec_seconds.observe(forecast.seconds, seconds)
        else:
            self.shared.plain_seconds.observe(forecast.seconds, seconds)
