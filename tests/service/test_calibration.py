"""Correction factors learned from forecasts vs outcomes, and their effect on the controller."""

from __future__ import annotations

import pytest

from service.calibration import PRIOR_ROUNDS, Calibration, Ratio
from service.regime import Correction, Forecast, choose_shape
from tests.service.test_regime import CPU_LIKE, candidates

SPECULATIVE = Forecast(tree_nodes=9, draft_tokens=2.0, seconds=0.2)
PLAIN = Forecast(tree_nodes=1, draft_tokens=0.0, seconds=0.1)


def test_a_ratio_starts_at_its_prior_and_converges_to_what_happens() -> None:
    ratio = Ratio()
    assert ratio.factor(prior=0.8) == 0.8
    ratio.observe(predicted=2.0, realized=1.0)
    assert 0.5 < ratio.factor() < 1.0  # one round moves it only part of the way
    for _ in range(200):
        ratio.observe(predicted=2.0, realized=1.0)
    assert ratio.factor() == pytest.approx(0.5, abs=0.05)  # the prior keeps a little weight
    for _ in range(400):  # the horizon is finite: a new regime takes over
        ratio.observe(predicted=2.0, realized=2.0)
    assert ratio.factor() == pytest.approx(1.0, abs=0.02)


def test_speculative_rounds_teach_acceptance_and_pass_cost_plain_rounds_the_plain_cost() -> None:
    shared = Calibration()
    request = shared.session()
    for _ in range(50):
        request.observe(SPECULATIVE, accepted=1, seconds=0.3)  # half the tokens, 1.5x the time
        request.observe(PLAIN, accepted=0, seconds=0.1)
    correction = request.correction()
    assert correction.draft_tokens == pytest.approx(0.5, abs=0.06)
    assert correction.spec_seconds == pytest.approx(1.5, abs=0.08)
    assert correction.plain_seconds == pytest.approx(1.0)


def test_a_request_starts_from_the_global_factor_and_keeps_its_own() -> None:
    shared = Calibration()
    pessimist = shared.session()
    for _ in range(50):
        pessimist.observe(SPECULATIVE, accepted=0, seconds=0.2)
    newcomer = shared.session()
    assert newcomer.correction().draft_tokens == pytest.approx(shared.draft_tokens.factor())
    for _ in range(50):
        newcomer.observe(SPECULATIVE, accepted=4, seconds=0.2)  # this text is easy to draft
    assert newcomer.correction().draft_tokens > 1.5
    assert pessimist.correction().draft_tokens < newcomer.correction().draft_tokens
    assert shared.draft_tokens.rounds > PRIOR_ROUNDS


def test_a_corrected_forecast_turns_an_unpaying_speculation_into_plain_decoding() -> None:
    drafts = candidates(0.6, 0.7)
    assert choose_shape(drafts, CPU_LIKE, 100, 8, 8).k > 0
    overpromised = Correction(draft_tokens=0.3)
    assert choose_shape(drafts, CPU_LIKE, 100, 8, 8, overpromised).k == 0
    slow_trees = Correction(spec_seconds=2.0)
    assert choose_shape(drafts, CPU_LIKE, 100, 8, 8, slow_trees).k == 0
    slow_plain = Correction(plain_seconds=3.0, draft_tokens=0.3)  # plain got slower than measured too
    assert choose_shape(drafts, CPU_LIKE, 100, 8, 8, slow_plain).k > 0
