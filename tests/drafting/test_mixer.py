"""The mixer: slots follow measured acceptance, duplicates are skipped, all candidates learn."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from drafting import (
    MODEL_STRATEGY_NAMES,
    STRATEGY_NAMES,
    Draft,
    Mixer,
    ModelTables,
    TableSlot,
    TokenHistory,
    default_mixer,
)
from drafting.mixer import CHEAP_GRACE, UNSEEN


@dataclass(frozen=True)
class Fixed:
    """A strategy that always proposes the same ranked drafts."""

    name: str
    drafts: tuple[tuple[int, ...], ...]

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        return [Draft(d[:w], self.name, rank) for rank, d in enumerate(self.drafts[:k])]


def test_slots_go_to_the_strategy_that_gets_accepted() -> None:
    mixer = Mixer([Fixed("a", ((1, 2), (3, 4))), Fixed("b", ((5, 6), (7, 8)))])
    request_drafts = mixer.for_request([0, 0])
    for _ in range(10):
        request_drafts.propose(2, 2)
        request_drafts.observe([5, 6, 9])  # b's first draft matches fully, a's never
    assert [d.strategy for d in request_drafts.propose(2, 2)] == ["b", "a"]
    assert [d.strategy for d in request_drafts.propose(1, 2)] == ["b"]


def test_unchosen_candidates_are_measured_too() -> None:
    mixer = Mixer([Fixed("a", ((1,),)), Fixed("b", ((2,),))])
    request_drafts = mixer.for_request([0])
    for _ in range(10):
        request_drafts.propose(1, 1)  # one slot: only one strategy is verified
        request_drafts.observe([2])  # ...but b is scored even while a holds the slot
    assert request_drafts.propose(1, 1)[0].strategy == "b"


@dataclass(frozen=True)
class Echo:
    """Guesses token 5 on every other round (as a better strategy does), 6 on the others."""

    name: str = "echo"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        return [Draft((5,) if len(history) % 4 == 0 else (6,), self.name, 0)]


def test_a_guess_shared_with_a_better_draft_counts_for_that_draft() -> None:
    """`echo` is right exactly when it repeats `a`'s guess: the node it adds of its own (6)
    never is, and that is what its estimate says, not the 50% it matches overall."""
    mixer = Mixer([Fixed("a", ((5,),)), Echo()])
    request_drafts = mixer.for_request([0, 0])
    for _ in range(40):
        request_drafts.candidates(2, 1)
        request_drafts.observe([5, 9])  # two tokens a round: echo alternates between 5 and 6
    assert request_drafts.acceptance(Draft((5,), "a")).p > 0.9
    assert request_drafts.acceptance(Draft((6,), "echo")).p < 0.1
    assert mixer.prior(("echo", 0, 0)).p < 0.1


@dataclass(frozen=True)
class Matcher:
    """Continues a 4-token match on even rounds (and is right), a 1-token match on odd ones
    (and is wrong): the same strategy and rank, told apart by the match's length."""

    name: str = "matcher"

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        long_match = len(history) % 4 == 0
        return [Draft((5,) if long_match else (6,), self.name, 0, 4 if long_match else 1)]


def test_acceptance_is_learned_per_match_length() -> None:
    mixer = Mixer([Matcher()])
    request_drafts = mixer.for_request([0, 0])
    for _ in range(40):
        request_drafts.candidates(1, 1)
        request_drafts.observe([5, 9])  # two tokens a round: the match length alternates
    assert request_drafts.acceptance(Draft((5,), "matcher", 0, 4)).p > 0.9
    assert request_drafts.acceptance(Draft((6,), "matcher", 0, 1)).p < 0.1
    assert mixer.prior(("matcher", 0, 4)).p > 0.9


def test_global_statistics_inform_new_requests() -> None:
    mixer = Mixer([Fixed("a", ((1,),)), Fixed("b", ((2,),))])
    first = mixer.for_request([0])
    for _ in range(20):
        first.propose(1, 1)
        first.observe([2])
    assert mixer.for_request([0]).propose(1, 1)[0].strategy == "b"


def test_duplicates_and_prefixes_do_not_take_slots() -> None:
    mixer = Mixer([Fixed("a", ((1, 2, 3),)), Fixed("b", ((1, 2), (1, 2, 3), (4,)))])
    drafts = mixer.for_request([0]).propose(3, 3)
    assert sorted(d.token_ids for d in drafts) == [(1, 2, 3), (4,)]


def test_single_strategy_requests_and_unknown_names() -> None:
    mixer = default_mixer()
    assert mixer.names == [
        n for n in STRATEGY_NAMES if n not in MODEL_STRATEGY_NAMES
    ]  # none enabled
    assert mixer.for_request([1, 2, 1], "context").propose(2, 2) == [Draft((2, 1), "context", 0, 1)]
    with pytest.raises(ValueError, match="unknown strategy 'trigram'"):
        mixer.for_request([1], "trigram")


def test_mixed_mode_lengthens_short_context_drafts_by_bigram_chaining() -> None:
    bigram = np.array([[1], [2], [3], [0]], dtype=np.uint32)  # x -> x + 1 (mod 4)
    slot = TableSlot(ModelTables(unigram=np.array([0], dtype=np.uint32), bigram=bigram))
    request_drafts = default_mixer(slot).for_request([2, 3, 2])  # context: after 2 came 3
    context_drafts = [d for d in request_drafts.propose(4, 3) if d.strategy == "context"]
    assert context_drafts == [Draft((3, 2, 3), "context", 0, 1)]  # (3, 2) then 2 -> 3
    alone = default_mixer(slot).for_request([2, 3, 2], "context").propose(4, 3)
    assert alone == [Draft((3, 2), "context", 0, 1)]  # single strategy: not lengthened


@dataclass(frozen=True)
class Costly(Fixed):
    """A strategy that reports drafting time, as the model drafts do."""

    seconds_per_token: float = 0.01
    calls: list[int] = dataclasses.field(default_factory=list)

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        self.calls.append(len(history))
        return super().propose(history, k, w)


def test_a_costly_strategy_the_controller_passes_over_is_only_probed() -> None:
    costly, cheap = Costly("model", ((1, 2),)), Fixed("cheap", ((3, 4),))
    request_drafts = Mixer([costly, cheap]).for_request([0])
    asked = []
    for round_number in range(1, 31):
        before = len(costly.calls)
        scored = request_drafts.candidates(1, 2)
        # the controller's pick
        request_drafts.chosen([s.draft for s in scored if s.draft.strategy == "cheap"])
        request_drafts.observe([3, 4, 5])
        if len(costly.calls) > before:
            asked.append(round_number)
    assert asked == [1, 10, 27]  # then after 8 skipped rounds, then 16 (the wait doubles)
    request_drafts.chosen([Draft((1, 2), "model")])  # picked again: asked every round
    request_drafts.candidates(1, 2)
    assert len(costly.calls) == 4


def test_a_new_request_waits_as_long_as_the_last_one_that_passed_a_costly_strategy_over() -> None:
    costly, cheap = Costly("model", ((1, 2),)), Fixed("cheap", ((3, 4),))
    mixer = Mixer([costly, cheap])

    def rounds_asked(request_drafts, rounds: int, take_costly: bool = False) -> list[int]:
        asked = []
        for round_number in range(1, rounds + 1):
            before = len(costly.calls)
            scored = request_drafts.candidates(1, 2)
            request_drafts.chosen(
                [s.draft for s in scored if (s.draft.strategy == "model") == take_costly]
            )
            request_drafts.observe([3, 4, 5])
            if len(costly.calls) > before:
                asked.append(round_number)
        return asked

    assert rounds_asked(mixer.for_request([0]), 30) == [1, 10, 27]  # its wait reached 32 rounds
    assert rounds_asked(mixer.for_request([0]), 40) == [33]  # not in its first round: after 32
    assert rounds_asked(mixer.for_request([0]), 68, take_costly=True) == [
        65,
        66,
        67,
        68,
    ]  # waits 64; taken
    assert rounds_asked(mixer.for_request([0]), 2) == [1]  # taken again: a new request asks at once


@dataclass(frozen=True)
class Counted(Fixed):
    """A cheap strategy that counts the rounds it is asked in."""

    calls: list[int] = dataclasses.field(default_factory=list)

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        self.calls.append(len(history))
        return super().propose(history, k, w)


@dataclass(frozen=True)
class Matching(Counted):
    follows_matches: ClassVar[bool] = True


def test_a_passed_over_cheap_strategy_waits_but_one_that_follows_matches_does_not() -> None:
    """The table-like strategy is asked in every round while taken and for `CHEAP_GRACE`
    rounds passed over, then after 8, 16 and every 32 rounds (its own wait, not a new
    request's); the match-following one in every round, though never taken."""
    table, matching = Counted("table", ((1, 2),)), Matching("matching", ((3, 4),))
    mixer = Mixer([table, matching])
    request_drafts = mixer.for_request([0])
    asked = []
    for round_number in range(1, 121):
        before = len(table.calls)
        request_drafts.candidates(1, 2)
        request_drafts.chosen([Draft((1, 2), "table")] if round_number <= 3 else [])
        request_drafts.observe([5])
        if len(table.calls) > before:
            asked.append(round_number)
    waits = [CHEAP_GRACE + 3 + 9, CHEAP_GRACE + 3 + 9 + 17, CHEAP_GRACE + 3 + 9 + 17 + 33]
    assert asked == [*range(1, CHEAP_GRACE + 4), *waits, waits[-1] + 33]
    assert len(matching.calls) == 120 and not mixer.probe_waits
    new_request = mixer.for_request([0])
    before = len(table.calls)
    new_request.candidates(1, 2)
    assert len(table.calls) == before + 1  # a new request asks at once


def test_the_best_acceptance_is_that_of_the_best_first_ranked_draft_seen_over_all_requests() -> (
    None
):
    mixer = Mixer([Fixed("a", ((1, 2, 3), (1, 9, 9))), Fixed("b", ((4, 5, 6),))])
    assert mixer.best_acceptance(3) == UNSEEN  # nothing recorded: what an untried draft starts at
    for prompt in ([0], [7]):  # two requests
        request_drafts = mixer.for_request(prompt)
        for _ in range(20):
            request_drafts.candidates(2, 3)
            request_drafts.observe([1, 2, 3])  # a's first draft is always right, b's never
    best = mixer.best_acceptance(3)
    assert best == mixer.prior(("a", 0, 0)) and best.p > 0.9
    assert mixer.prior(("a", 1, 0)).p < best.p  # a's second draft shares a's first's first token


def test_strategies_are_asked_for_about_what_the_controller_takes() -> None:
    """A plain round: next, two drafts of two tokens per strategy; after one draft of three
    tokens was taken, four of eight; outside auto mode (no `chosen`), all k × w."""
    long = tuple(range(1, 11))
    strategy = Fixed("a", tuple(tuple(t + 100 * r for t in long) for r in range(8)))
    request_drafts = Mixer([strategy]).for_request([0])
    assert [len(s.draft.token_ids) for s in request_drafts.candidates(8, 10)] == [10] * 8
    request_drafts.chosen([])
    assert [len(s.draft.token_ids) for s in request_drafts.candidates(8, 10)] == [2, 2]
    request_drafts.chosen([Draft((1, 2, 3), "a", 0)])
    assert [len(s.draft.token_ids) for s in request_drafts.candidates(8, 10)] == [8] * 4
    request_drafts.chosen([Draft(long[:9], "a", 0), Draft((101, 102), "a", 1)])
    assert [len(s.draft.token_ids) for s in request_drafts.candidates(8, 10)] == [10] * 6
