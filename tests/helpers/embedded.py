"""Questions for the embedded model and the rule its lossless tests judge outputs by: equal, or
parted at a near tie of the reference (`service/bench/near_ties.py`)."""

from __future__ import annotations

from service.bench.near_ties import first_difference, parting

QUESTIONS = [
    "List the first five prime numbers.",
    "Repeat exactly, three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the factorial of n.",
    "Summarize in one sentence: The meeting moved to Tuesday. Tuesday's room is booked, so the "
    "meeting is in room 4.",
]


def compare(model, prompt: list[int], got: list[int], want: list[int]) -> str:
    """ "identical", "tie" (the first difference is a near tie), or a failure message."""
    if got == want:
        return "identical"
    parted = parting(model, prompt, want, got)
    if parted is not None and parted.near_tie:
        return "tie"
    at = first_difference(want, got)
    gap = "" if parted is None else f" ({parted.ulps:g} ulps apart)"
    return f"differs at token {at}: got {got[at : at + 5]}, want {want[at : at + 5]}{gap}"
