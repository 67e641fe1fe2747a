"""The engine's device round: greedy output equal to plain decoding, the same rounds as the
host path where both draft alike, and one device → host copy a step with nothing else that
would make the host wait for the device."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drafting import Recycled, TokenHistory, default_mixer
from service.device_round.drafts import draft_trees
from service.device_round.round import RecentWindows
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.engine.scheduler import SchedulerConfig
from service.model.runner import ModelRunner
from service.model.tree import build_tree
from tests.helpers.costs import COMPUTE_BOUND, MEMORY_BOUND
from tests.helpers.engines import NEW_TOKENS, PROMPTS, reference_greedy

DEVICE_STRATEGIES = ["mixed", "recycled", "token_recycling", "context", "context+recycled"]


def _engine(runner: ModelRunner, device_round: bool = True) -> Engine:
    return Engine(
        runner, default_mixer(), eos_token_ids=[], max_context=512, device_round=device_round
    )


def _params(
    k: int, w: int, strategy: str = "mixed", max_new_tokens: int = NEW_TOKENS
) -> GenerationParams:
    return GenerationParams(
        max_new_tokens, speculation=SpeculationParams(mode="fixed", k=k, w=w), strategy=strategy
    )


@pytest.mark.parametrize("strategy", DEVICE_STRATEGIES)
@pytest.mark.parametrize("k,w", [(1, 1), (4, 4), (8, 8)])
def test_batched_greedy_output_is_plain_decoding(
    tiny_model, tiny_runner: ModelRunner, strategy: str, k: int, w: int
) -> None:
    engine = _engine(tiny_runner)
    completions = engine.complete_many([(prompt, _params(k, w, strategy)) for prompt in PROMPTS])
    assert [c.token_ids for c in completions] == [
        reference_greedy(tiny_model, p, NEW_TOKENS) for p in PROMPTS
    ]
    assert engine.device_round is not None and engine.device_round.copies > NEW_TOKENS // (w + 1)
    assert sum(c.num_accepted_tokens for c in completions) > 0


def test_rows_the_device_cannot_take_send_the_step_to_the_host_path(
    tiny_model, tiny_runner: ModelRunner
) -> None:
    """A sampled request, one asking for logprobs, and one in another shape beside greedy
    device-eligible ones: every answer stays exact; the device takes the steps once they leave."""
    engine = _engine(tiny_runner)
    seeded = SamplingParams(temperature=0.8, seed=3)
    requests = [
        (PROMPTS[0], _params(4, 4)),
        (PROMPTS[1], _params(4, 4, max_new_tokens=12)),
        (
            PROMPTS[3],
            GenerationParams(
                8, speculation=SpeculationParams(mode="fixed", k=4, w=4), sampling=seeded
            ),
        ),
        (
            PROMPTS[2],
            GenerationParams(10, speculation=SpeculationParams(mode="fixed", k=2, w=3), logprobs=2),
        ),
    ]
    completions = engine.complete_many(requests)
    alone = _engine(tiny_runner, device_round=False).complete_many(requests)
    assert completions[0].token_ids == reference_greedy(tiny_model, PROMPTS[0], NEW_TOKENS)
    assert completions[1].token_ids == reference_greedy(tiny_model, PROMPTS[1], 12)
    assert (
        completions[2].token_ids == alone[2].token_ids
    )  # the seeded sample, exact on the host path
    assert completions[3].token_ids == reference_greedy(tiny_model, PROMPTS[2], 10)
    assert len(completions[3].logprobs) == 10
    assert engine.device_round.copies > 0  # the first request's rounds after the others ended


@pytest.mark.parametrize("strategy", ["recycled", "token_recycling"])
def test_device_rounds_draft_the_trees_the_host_would(
    tiny_runner: ModelRunner, strategy: str
) -> None:
    """Every device step of a batch, its tables as the passes left them: each row's filled
    template holds exactly the nodes of the host's tree (`Recycled.propose` on a host copy of
    the same table, merged into a trie). The tables' refresh itself is held to the host's in
    test_tables.py; the two paths' node orders differ, so a token seen at two nodes of a pass
    may keep another node's successors, and whole runs are compared by their output."""
    engine = _engine(tiny_runner)
    device_round = engine.device_round
    run, checked = device_round.run, []

    def checking_run(cache, histories, plan, choose=None):
        device_table = device_round.tables[plan.table]
        if device_round._newest_on_device:
            device_table.pull()  # the host copy: what the host path would draft from now
        else:
            device_table.push()
        device_table.sync_fallback()
        recent = torch.tensor([[-1, *history.token_ids][-2:] for history in histories])
        tokens, valid = draft_trees(recent, plan.template, device_table)
        for row, history in enumerate(histories):
            host_tree = build_tree(
                history.last_token,
                Recycled(device_table.host).propose(history, plan.template.k, plan.template.w),
            )
            assert _filled_paths(plan.template, tokens[row], valid[row]) == _paths(host_tree)
            checked.append(host_tree.num_nodes)
        return run(cache, histories, plan, choose)

    device_round.run = checking_run
    completions = engine.complete_many([(prompt, _params(4, 4, strategy)) for prompt in PROMPTS])
    assert [len(c.token_ids) for c in completions] == [NEW_TOKENS] * len(PROMPTS)
    assert len(checked) > NEW_TOKENS and max(checked) > 5  # many rounds, bushy trees among them


def _filled_paths(template, tokens: torch.Tensor, valid: torch.Tensor) -> set[tuple[int, ...]]:
    paths: dict[int, tuple[int, ...]] = {}
    for node, (parent, token) in enumerate(zip(template.parents, tokens.tolist())):
        if valid[node]:
            paths[node] = (paths[parent] if parent >= 0 else ()) + (token,)
    return set(paths.values())


def _paths(tree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tree.token_ids[node],))
    return set(paths)


# ops whose result the host must read (on a GPU, each waits for the device)
SYNCING = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
    "aten.item.default",
}


class _Syncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_device_step_copies_to_the_host_once_and_never_waits_otherwise(
    tiny_runner: ModelRunner,
) -> None:
    engine = _engine(tiny_runner)
    requests = [engine.add_request(prompt, _params(4, 4)) for prompt in PROMPTS[:2]]
    while any(r.prefill_remaining for r in requests):
        engine.step()
    engine.step()  # both rows decoding from here
    for _ in range(5):
        copies = engine.device_round.copies
        with _Syncs() as syncs:
            engine.step()
        assert engine.device_round.copies == copies + 1
        assert syncs.seen == []


def test_auto_mode_steps_on_the_device_with_the_templates_that_pay(
    tiny_model, tiny_runner: ModelRunner
) -> None:
    """Auto rows where drafts pay (a flat pass) speculate on the device; where every node costs
    half a pass, the device's steps decode plainly (the root alone). Output is plain greedy's."""
    auto = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(mode="auto", k=8, w=6))
    expected = [reference_greedy(tiny_model, prompt, NEW_TOKENS) for prompt in PROMPTS[:2]]
    drafted = {}
    for name, profile in (("flat", MEMORY_BOUND), ("steep", COMPUTE_BOUND)):
        engine = _engine(tiny_runner)
        engine.profile = profile
        completions = engine.complete_many([(prompt, auto) for prompt in PROMPTS[:2]])
        assert [c.token_ids for c in completions] == expected
        assert engine.device_round.copies > NEW_TOKENS // 4
        drafted[name] = sum(c.num_draft_tokens for c in completions)
        assert all(c.predicted_seconds > 0 for c in completions)  # the device planner's forecasts
    assert drafted["flat"] > 20 * drafted["steep"]


@pytest.mark.parametrize("mode", ["fixed", "auto"])
def test_seeded_samples_are_the_host_paths_samples(tiny_runner: ModelRunner, mode: str) -> None:
    """Sampled rows (two settings, one seed each) beside a greedy one, on the device: each
    the very sample the host path draws (which is plain sampling's), and drafts accepted."""

    def params(sampling: SamplingParams) -> GenerationParams:
        return GenerationParams(
            NEW_TOKENS, speculation=SpeculationParams(mode=mode, k=4, w=4), sampling=sampling
        )

    requests = [
        (PROMPTS[1], params(SamplingParams(temperature=0.8, seed=1))),
        (PROMPTS[0], params(SamplingParams(temperature=0.8, seed=2))),
        (PROMPTS[3], params(SamplingParams(temperature=1.2, top_p=0.9, top_k=20, seed=3))),
        (PROMPTS[2], params(SamplingParams(temperature=0))),
    ]
    runs = []
    for device_round in (True, False):
        engine = _engine(tiny_runner, device_round)
        engine.profile = MEMORY_BOUND
        runs.append(engine.complete_many(requests))
        if device_round:
            assert engine.device_round.copies > NEW_TOKENS // 4
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert sum(c.num_accepted_tokens for c in runs[0][:3]) > 0
    plain = _engine(tiny_runner, False).complete_many(
        [
            (
                p,
                GenerationParams(
                    NEW_TOKENS, speculation=SpeculationParams(mode="off"), sampling=r.sampling
                ),
            )
            for p, r in requests
        ]
    )
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in plain]


def test_recent_windows_follow_their_histories() -> None:
    windows = RecentWindows(6)
    history = TokenHistory([1, 2, 3])
    assert windows.of(history).tolist() == [-1, -1, -1, 1, 2, 3]
    history.extend([4, 5])
    assert windows.of(history).tolist() == [-1, 1, 2, 3, 4, 5]
    history.extend([6, 7, 8, 9, 10, 11, 12])  # more than the window gained at once
    assert windows.of(history).tolist() == [7, 8, 9, 10, 11, 12]
    history.extend([13])
    assert windows.of(history).tolist() == [8, 9, 10, 11, 12, 13]


def test_auto_keeps_to_the_pass_budget_on_the_device(tiny_model, tiny_runner: ModelRunner) -> None:
    """Four auto rows under a 24-token pass budget: the device's templates are cut to fit (at
    most 5 drafted nodes a row), never handing the step to the host for it."""
    engine = Engine(
        tiny_runner,
        default_mixer(),
        eos_token_ids=[],
        max_context=512,
        device_round=True,
        scheduler_config=SchedulerConfig(max_tokens_per_pass=24),
    )
    engine.profile = MEMORY_BOUND
    auto = GenerationParams(NEW_TOKENS, speculation=SpeculationParams(mode="auto", k=8, w=6))
    requests = [engine.add_request(prompt, auto) for prompt in PROMPTS]
    widest = device_steps = 0
    while engine.has_work:
        copies = engine.device_round.copies
        _, stats = engine.step()
        if engine.device_round.copies > copies:
            device_steps += 1
            widest = max(widest, stats.tokens)
    assert device_steps > NEW_TOKENS // 2 and 4 < widest <= 24
    assert [r.output_ids[:NEW_TOKENS] for r in requests] == [
        reference_greedy(tiny_model, p, NEW_TOKENS) for p in PROMPTS
    ]
