"""The device round's recorded operators (`service/device_round/graphs.py`), their bookkeeping
checked on the CPU with a stand-in for a CUDA graph: a recording keeps the operators and what
they left, a replay runs them again and writes the results into those same tensors, as a graph
writes its outputs where it recorded them. Every step must then give what running the
operators eagerly on its own inputs gives: the inputs go where the recording reads them, the
pass's hidden states into their buffer, and each set of cache buffers has its own graph. (On a
GPU, `tests/gpu` runs the real graphs inside the engine against the host path.)"""

from __future__ import annotations

import torch

from service.device_round import graphs
from service.device_round.graphs import RoundGraphs


class StandInGraph:
    def __init__(self, operators) -> None:
        self.operators = operators
        self.left = operators()

    def replay(self) -> None:
        for kept, fresh in zip(_tensors(self.left), _tensors(self.operators())):
            kept.copy_(fresh)


def _tensors(left) -> list[torch.Tensor]:
    return list(left) if isinstance(left, tuple) else [left]


def draft(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return inputs[:, :-1] * 3, inputs[:, :-1] % 2 == 0


def forward(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.float()[:, :, None] + torch.arange(4.0)  # a "pass": new tensors every call


def after(inputs, tokens, valid, hidden) -> torch.Tensor:
    return torch.cat([tokens + inputs[:, -1:], valid.long(), hidden.sum(-1).long()], dim=1)


def eager(staging: torch.Tensor) -> torch.Tensor:
    tokens, valid = draft(staging)
    return after(staging, tokens, valid, forward(tokens))


def recording_on_the_cpu(monkeypatch) -> RoundGraphs:
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(
        graphs, "record_graph", lambda operators, pool: (g := StandInGraph(operators), g.left)
    )
    return RoundGraphs(torch.device("cpu"), capture=True)


def stagings(count: int, rows: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return [torch.randint(0, 100, (rows, 6), generator=generator) for _ in range(count)]


def test_replays_compute_each_steps_own_inputs(monkeypatch) -> None:
    rounds = recording_on_the_cpu(monkeypatch)
    for step, staging in enumerate(stagings(5)):
        got = rounds.run("shape", staging, draft, forward, after, lambda: (1, 2))
        assert torch.equal(got, eager(staging)), step
    assert rounds.recorded == 2  # the drafting and the rest, at the first step


def test_each_set_of_cache_buffers_and_each_shape_records_its_own(monkeypatch) -> None:
    rounds = recording_on_the_cpu(monkeypatch)
    narrow, wide = stagings(4), stagings(2, rows=5)
    for staging, buffers in zip(narrow, [(1,), (1,), (2,), (1,)]):
        got = rounds.run("narrow", staging, draft, forward, after, lambda: buffers)
        assert torch.equal(got, eager(staging))
    assert rounds.recorded == 3  # the buffers moved once: the rest recorded again
    for staging in wide:
        assert torch.equal(
            rounds.run("wide", staging, draft, forward, after, lambda: (1,)), eager(staging)
        )
    assert rounds.recorded == 5


def test_a_round_without_a_key_runs_eagerly(monkeypatch) -> None:
    rounds = recording_on_the_cpu(monkeypatch)
    for staging in stagings(3):
        assert torch.equal(
            rounds.run(None, staging, draft, forward, after, lambda: ()), eager(staging)
        )
    assert rounds.recorded == 0 and rounds.capture_seconds == 0
