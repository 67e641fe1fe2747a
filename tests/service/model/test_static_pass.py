"""Fixed-shape passes (recorded as CUDA graphs on a GPU, run eagerly here): every node's
logits as in a plain decode, and the engine's output token for token that of plain decoding."""

from __future__ import annotations

import pytest
import torch

from drafting import Draft, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.scheduler import SchedulerConfig
from service.model.runner import ModelRunner, RowInput
from service.model.static_pass import FixedShape
from service.model.tree import build_tree, chain_tree
from tests.helpers.batch import LENGTHS, MODES, PROMPTS
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.engines import reference_greedy
from tests.helpers.models import make_tiny_model
from tests.helpers.passes import DRAFTS, PROMPT, assert_nodes_match, prefilled, sequential_logits

LONG = [Draft(tuple((10 + i) % 64 for i in range(70)), "x")]  # 71 nodes: the widest slots (128)
# 141 nodes: wider than the widest slots
WIDE = [Draft(tuple((10 + i) % 64 for i in range(140)), "x")]


def test_rows_padded_to_a_fixed_shape_give_each_node_its_own_logits() -> None:
    model = make_tiny_model(seed=3)
    runner = ModelRunner(model, static_passes=True)
    assert runner.static is not None
    prompts = [PROMPT, [7, 3], list(range(2, 40)), [11, 12, 13]]
    cache = prefilled(runner, prompts)
    for drafts, shape in [
        ([[], [], DRAFTS, []], (4, 16, 16)),
        ([[Draft((4,), "x")], [], [], []], (4, 2, 8)),
        ([[], [], [], []], (4, 1, 4)),
        ([[], LONG, [], []], (4, 128, 128)),
        ([[], WIDE, [], []], None),
    ]:
        seen = runner.static.shapes
        trees = [build_tree(prompt[-1], d) for prompt, d in zip(prompts, drafts)]
        logits = runner.forward(cache, [RowInput(tree) for tree in trees])
        for prompt, tree, row_logits in zip(prompts, trees, logits):
            assert_nodes_match(model, prompt, tree, row_logits)
        assert runner.static.shapes == (
            seen if shape is None else [*seen, FixedShape(*shape)]
        )  # the wide tree ran eagerly


def test_a_fixed_shape_pass_continues_from_what_the_last_one_kept() -> None:
    """Commits after fixed-shape passes (a root's copies wrote where the root did), and a row
    that joins: the cache's buffers grow, and the shapes recorded on the old ones are dropped."""
    model = make_tiny_model(seed=2)
    runner = ModelRunner(model, static_passes=True)
    assert runner.static is not None
    prompts = [PROMPT, [7, 3, 9]]
    cache = prefilled(runner, prompts)
    trees = [build_tree(p[-1], DRAFTS) for p in prompts]
    runner.forward(cache, [RowInput(tree) for tree in trees])
    second = trees[0].children[0][3]
    cache.commit_rows({0: [0, second, trees[0].children[second][9]], 1: [0]})
    logits = runner.forward(cache, [RowInput(chain_tree([10])), RowInput(chain_tree([12]))])
    cache.commit_rows({0: [0], 1: [0]})
    histories = [PROMPT + [3, 9, 10], [7, 3, 9, 12]]
    for history, row_logits in zip(histories, logits):
        torch.testing.assert_close(
            row_logits[0], sequential_logits(model, history), atol=1e-5, rtol=1e-5
        )
    assert runner.static.shapes == [FixedShape(2, 16, 32), FixedShape(2, 1, 2)]
    # a third request: its prompt's chunk fits a fixed shape, on grown buffers (of 4 rows)
    cache.add_row()
    runner.forward(
        cache,
        [RowInput(chain_tree([1])), RowInput(chain_tree([2])), RowInput(chain_tree([5, 6]), 2)],
    )
    cache.commit_rows({0: [0], 1: [0], 2: [0, 1]})
    assert runner.static.shapes == [FixedShape(4, 2, 4)]  # three rows and a padding row
    logits = runner.forward(cache, [RowInput(chain_tree([4])) for _ in range(3)])
    for history, row_logits in zip(
        [[*histories[0], 1, 4], [*histories[1], 2, 4], [5, 6, 4]], logits
    ):
        torch.testing.assert_close(
            row_logits[0], sequential_logits(model, history), atol=1e-5, rtol=1e-5
        )


@pytest.fixture(scope="module")
def static_engine(tiny_tables) -> Engine:
    engine = Engine(
        ModelRunner(make_tiny_model(), static_passes=True),
        default_mixer(tiny_tables),
        eos_token_ids=[],
        max_context=512,
    )
    engine.profile = MEMORY_BOUND
    return engine


@pytest.mark.parametrize("k,w", [(0, 0), (1, 4), (3, 3), (8, 5)])
def test_speculation_on_fixed_shapes_is_lossless(
    tiny_model, static_engine: Engine, k: int, w: int
) -> None:
    for prompt in PROMPTS[:4]:
        completion = static_engine.complete(
            prompt, GenerationParams(30, speculation=SpeculationParams(k, w))
        )
        assert completion.token_ids == reference_greedy(tiny_model, prompt, 30)


def test_a_batch_on_fixed_shapes_equals_each_request_alone(
    tiny_model, static_engine: Engine
) -> None:
    requests = [(p, GenerationParams(n, speculation=s)) for p, n, s in zip(PROMPTS, LENGTHS, MODES)]
    for (prompt, params), completion in zip(requests, static_engine.complete_many(requests)):
        assert completion.token_ids == reference_greedy(tiny_model, prompt, params.max_new_tokens)
    sampled = (
        PROMPTS[0],
        GenerationParams(16, speculation=MODES[1], sampling=SamplingParams(0.8, seed=3)),
    )
    plain = (PROMPTS[0], GenerationParams(16, sampling=SamplingParams(0.8, seed=3)))
    assert static_engine.complete(*sampled).token_ids == static_engine.complete(*plain).token_ids
    assert (
        static_engine.runner.static is not None and static_engine.runner.static.shapes
    )  # they did run


def test_the_buffers_pass_on_so_the_next_engine_replays_what_the_first_recorded(
    tiny_tables,
) -> None:
    """Passes recorded as graphs hold the KV buffers' addresses: when a cache's last row leaves,
    its buffers (a power of two of rows) wait for the model's next cache, here another engine's."""
    model = make_tiny_model()
    engines = [
        Engine(
            ModelRunner(model, static_passes=True),
            default_mixer(tiny_tables),
            eos_token_ids=[],
            max_context=512,
        )
        for _ in range(2)
    ]
    static = engines[0].runner.static
    assert static is not None and engines[1].runner.static is static  # one set of graphs per model
    requests = [(p, GenerationParams(12)) for p in PROMPTS[:3]]
    first = engines[0].complete_many(requests)
    shapes, spare = static.shapes, static.spare.nbytes
    assert (
        engines[0].cache.nbytes == 0 and spare == 4 * 256 * engines[0].runner.kv_bytes_per_token
    )  # 3 rows -> 4
    second = engines[1].complete_many(requests)
    assert [c.token_ids for c in second] == [c.token_ids for c in first]
    assert (
        static.spare.nbytes == spare and shapes and set(shapes) <= set(static.shapes)
    )  # (+ the prompts' pass)


def test_spare_buffers_count_against_the_kv_budget(tiny_tables) -> None:
    """Buffers taken up come with their rows (a power of two) and capacity: admission counts
    them; spare buffers too small for the next request are freed before it allocates."""
    runner = ModelRunner(make_tiny_model(), static_passes=True)
    assert runner.static is not None
    per_token = runner.kv_bytes_per_token
    budget = 4 * 256 * per_token  # four rows of the initial capacity
    engine = Engine(
        runner,
        default_mixer(tiny_tables),
        eos_token_ids=[],
        max_context=512,
        scheduler_config=SchedulerConfig(kv_cache_bytes=budget),
    )
    engine.profile = MEMORY_BOUND
    short = [
        engine.add_request(p, GenerationParams(12, speculation=SpeculationParams(3, 3)))
        for p in PROMPTS[:3] * 2
    ]
    long_prompt = list(range(2, 60)) * 5  # 290 tokens: a capacity of 512
    late = engine.add_request(long_prompt, GenerationParams(8))
    while engine.has_work:
        engine.step()
        assert engine.cache.nbytes + runner.static.spare.nbytes <= budget
    assert all(len(r.output_ids) == 12 for r in short)
    assert late.output_ids == reference_greedy(engine.runner.model, long_prompt, 8)
    assert (
        engine.cache.nbytes == 0 and runner.static.spare.nbytes == 512 * per_token
    )  # it ran alone, on new buffers


def test_a_pass_that_records_a_graph_is_not_taken_for_its_shapes_price(
    tiny_tables, monkeypatch
) -> None:
    """Recording a graph (35-150 ms on an H200) is a one-off: the calibration, which learns what
    each pass shape costs, must not see it; the step reports it."""
    engine = Engine(
        ModelRunner(make_tiny_model(), static_passes=True),
        default_mixer(tiny_tables),
        eos_token_ids=[],
        max_context=512,
    )
    engine.profile = MEMORY_BOUND
    static, forward = engine.runner.static, engine.runner.forward
    assert static is not None

    passes: list[int] = []

    def recording_every_other_pass(cache, rows):  # as a GPU records a new shape's graph
        passes.append(len(passes))
        static.capture_seconds += 0.25 if len(passes) % 2 else 0.0
        return forward(cache, rows)

    observed: list[float] = []
    monkeypatch.setattr(engine.runner, "forward", recording_every_other_pass)
    monkeypatch.setattr(
        engine.calibration,
        "observe_pass",
        lambda tokens, profiled, seconds, rows=1: observed.append(seconds),
    )
    engine.add_request(PROMPTS[0], GenerationParams(6, speculation=SpeculationParams(2, 2, "auto")))
    captured = []
    while engine.has_work:
        _, stats = engine.step()
        captured.append(stats.capture_seconds)
    assert len(captured) >= 2 and captured == [
        0.25 if step % 2 == 0 else 0.0 for step in range(len(captured))
    ]
    assert len(observed) == captured.count(0.0) and all(seconds < 0.25 for seconds in observed)
