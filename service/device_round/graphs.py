"""A device round's operators around the pass, replayed as CUDA graphs.

A round launches some 250 small operators besides the pass: the drafting gathers before it,
then the LM head, the choice, the acceptance, the KV commit, the table refresh and the packing
of the copy back after it. Launched one by one from Python they cost a step about as much as
the pass itself on a small model; recorded once and replayed, a handful of microseconds each.
So each round shape (template, rows, table) records two graphs at its first step:
- the drafting, from the step's uploaded inputs (every row's recent tokens and KV start) to its
  tokens and filled nodes [R, N];
- the rest, from those and the pass's hidden states [R * N, hidden] (copied into a buffer of
  its own: the pass's output moves when the pass is recorded again) to the packed copy back;
  one per set of cache buffers (the KV commit writes them), recorded again where they move.
The pass between them is the static pass's own graph (`service/model/static_pass.py`).

A first step runs every operator eagerly (the warm-up a recording wants, and the step's real
work: recording runs nothing), then records. Sampled rows (a chooser on the device), and any
round on a machine without graphs, run eagerly throughout.

Graphs share one memory pool: what a graph leaves (its tokens, its packed copy back) is read
within the step that replays it, before any other round graph replays.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

# Round shapes kept, the least recently used dropped first.
MAX_ROUNDS = 128

Draft = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # inputs -> tokens, valid
Forward = Callable[[torch.Tensor], torch.Tensor]  # tokens -> hidden [R * N, hidden]
# inputs, tokens, valid, hidden -> the packed copy back
After = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Recorded:
    """One round shape: its inputs, its drafting graph and what that leaves, the hidden states'
    buffer, and the rest's graph per set of cache buffers."""

    inputs: torch.Tensor
    draft: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    valid: torch.Tensor
    hidden: torch.Tensor
    after: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(
        default_factory=dict
    )
    # held so that the objects the key names by id stay alive while it is recorded
    keep: tuple = ()


class RoundGraphs:
    """The recorded rounds of one engine's device round; eager where `capture` is off."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.device = device
        self.capture = capture
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._rounds: OrderedDict[Hashable, _Recorded] = OrderedDict()
        self.capture_seconds = 0.0  # spent recording so far
        self.recorded = 0  # graphs recorded so far

    def run(
        self,
        key: Hashable | None,
        staging: torch.Tensor,
        draft: Draft,
        forward: Forward,
        after: After,
        buffers: Callable[[], tuple[int, ...]],
        keep: tuple = (),
    ) -> torch.Tensor:
        """The round on `staging` (its inputs on the host) as `draft`, `forward` and `after`
        compute it, replayed where `key` (the round's shape; None: eager) was recorded;
        `buffers()`: the identity of the cache buffers after the pass (`after` writes them)."""
        if not self.capture or key is None:
            inputs = _uploaded(staging, self.device)
            tokens, valid = draft(inputs)
            return after(inputs, tokens, valid, forward(tokens))
        record = self._rounds.get(key)
        if record is None:
            return self._first(key, staging, draft, forward, after, buffers, keep)
        self._rounds.move_to_end(key)
        on_gpu = self.device.type == "cuda"
        record.inputs.copy_(_pinned(staging) if on_gpu else staging, non_blocking=on_gpu)
        record.draft.replay()
        record.hidden.copy_(forward(record.tokens))
        identity = buffers()
        recorded = record.after.get(identity)
        if recorded is None:
            # the hidden states are in place: an eager run, then the recording
            packed = after(record.inputs, record.tokens, record.valid, record.hidden)
            record.after[identity] = self._record(
                lambda: after(record.inputs, record.tokens, record.valid, record.hidden)
            )
            return packed
        graph, packed = recorded
        graph.replay()
        return packed

    def _first(
        self,
        key: Hashable,
        staging: torch.Tensor,
        draft: Draft,
        forward: Forward,
        after: After,
        buffers: Callable[[], tuple[int, ...]],
        keep: tuple,
    ) -> torch.Tensor:
        """A round shape's first step: eager, then both graphs recorded on the same inputs."""
        inputs = _uploaded(staging, self.device)
        tokens, valid = draft(inputs)
        hidden = forward(tokens).clone()
        packed = after(inputs, tokens, valid, hidden)
        graph, (drafted, filled) = self._record(lambda: draft(inputs))
        record = _Recorded(inputs, graph, drafted, filled, hidden, keep=keep)
        record.after[buffers()] = self._record(lambda: after(inputs, drafted, filled, hidden))
        self._rounds[key] = record
        while len(self._rounds) > MAX_ROUNDS:
            self._rounds.popitem(last=False)
        return packed

    def _record(self, operators: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """`operators` recorded (not run) as a graph, with what they leave."""
        began = time.perf_counter()
        recorded = record_graph(operators, self._pool)
        self.capture_seconds += time.perf_counter() - began
        self.recorded += 1
        return recorded


def record_graph(
    operators: Callable[[], object], pool: object
) -> tuple[torch.cuda.CUDAGraph, object]:
    """`operators` recorded (not run) as a CUDA graph in memory `pool`, with what they leave."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        left = operators()
    return graph, left


def _pinned(staging: torch.Tensor) -> torch.Tensor:
    """From pinned memory a copy to the GPU is queued, the host not made to wait."""
    return staging.pin_memory()


def _uploaded(staging: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`staging` on `device`: on a GPU a copy the host does not wait for."""
    if device.type != "cuda":
        return staging.to(device)
    return _pinned(staging).to(device, non_blocking=True)
