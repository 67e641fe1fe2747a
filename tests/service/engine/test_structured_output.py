"""Structured output under speculation: the output always matches its grammar, and equals plain
constrained decoding (greedy token for token, seeded samples the same sample), with fixed and
auto speculation, batched with unconstrained requests."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafting import Draft, Mixer, TokenHistory, default_mixer
from service.engine.engine import Engine
from service.engine.params import GenerationParams, SamplingParams, SpeculationParams
from service.grammar import GrammarError, GrammarSpec
from tests.helpers.costs import MEMORY_BOUND
from tests.helpers.engines import PROMPTS, reference_decode
from tests.helpers.grammar import (
    EOS,
    PIECES,
    reference_constrained,
    schema_spec,
    text_of,
    tiny_compiler,
)

NEW_TOKENS = 48
SPECULATIONS = [
    SpeculationParams(0, 0, "off"),
    SpeculationParams(4, 4, "fixed"),
    SpeculationParams(8, 8, "auto"),
]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=7)]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
        "id": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
}

COMPILER = tiny_compiler()


def engine_for(runner, tables, strategies=None) -> Engine:
    mixer = default_mixer(tables) if strategies is None else Mixer(strategies)
    engine = Engine(runner, mixer, eos_token_ids=[EOS], max_context=512, grammars=COMPILER)
    engine.profile = MEMORY_BOUND  # auto rows speculate
    return engine


def params(
    spec: GrammarSpec | None,
    speculation: SpeculationParams,
    sampling: SamplingParams,
    strategy: str = "mixed",
) -> GenerationParams:
    return GenerationParams(
        max_new_tokens=NEW_TOKENS,
        speculation=speculation,
        sampling=sampling,
        grammar=spec,
        strategy=strategy,
    )


def check_valid(tokens: list[int], schema: dict | None) -> None:
    """A finished output is one JSON value that matches `schema` (any object without one)."""
    if tokens and tokens[-1] == EOS:
        value = json.loads(text_of(tokens))
        jsonschema.validate(value, schema or {"type": "object"})


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("speculation", SPECULATIONS, ids=["off", "k4w4", "auto"])
def test_batched_with_free_requests_equals_plain_constrained(
    tiny_model, tiny_runner, tiny_tables, speculation, sampling
) -> None:
    engine = engine_for(tiny_runner, tiny_tables)
    specs = [schema_spec(PERSON), None, GrammarSpec("json_object"), None]
    completions = engine.complete_many(
        [(prompt, params(spec, speculation, sampling)) for prompt, spec in zip(PROMPTS, specs)]
    )
    for prompt, spec, completion in zip(PROMPTS, specs, completions):
        if spec is None:
            want = reference_decode(tiny_model, prompt, len(completion.token_ids), sampling)
        else:
            want = reference_constrained(tiny_model, COMPILER, spec, prompt, NEW_TOKENS, sampling)
            check_valid(completion.token_ids, PERSON if spec.kind == "json_schema" else None)
        assert completion.token_ids == want


def test_constrained_outputs_finish_and_match(tiny_runner, tiny_tables) -> None:
    """The grammar ends the output: the end-of-text token comes once the JSON is whole."""
    engine = engine_for(tiny_runner, tiny_tables)
    completion = engine.complete(
        PROMPTS[1], params(schema_spec(PERSON), SPECULATIONS[1], SAMPLINGS[0])
    )
    assert completion.token_ids[-1] == EOS and completion.finish_reason == "stop"
    check_valid(completion.token_ids, PERSON)


class DecoyDrafter:
    """Proposes the true continuation among decoys that leave the grammar at once or midway."""

    name = "decoy"

    def __init__(self, prompt: list[int], truth: list[int]) -> None:
        self.full = prompt + truth
        self.proposed: list[tuple[int, ...]] = []

    def propose(self, history: TokenHistory, k: int, w: int) -> list[Draft]:
        true_next = tuple(self.full[len(history) : len(history) + w])
        wrong = tuple((t + 17) % 64 for t in true_next)
        drafts = [d for d in (true_next, true_next[:1] + wrong[1:], wrong, (EOS,) * w) if d]
        self.proposed += drafts
        return [Draft(d, self.name, rank) for rank, d in enumerate(drafts[:k])]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_grammar_illegal_drafts_are_cut_and_never_committed(
    tiny_model, tiny_runner, sampling
) -> None:
    prompt, spec = PROMPTS[0], schema_spec(PERSON)
    truth = reference_constrained(tiny_model, COMPILER, spec, prompt, NEW_TOKENS, sampling)
    drafter = DecoyDrafter(prompt, truth)
    engine = engine_for(tiny_runner, None, [drafter])
    rounds = list(
        engine.generate(prompt, params(spec, SpeculationParams(4, 8, "fixed"), sampling, "decoy"))
    )
    tokens = [t for r in rounds for t in r.token_ids]
    assert tokens == truth
    check_valid(tokens, PERSON)
    assert (
        sum(r.num_accepted_tokens for r in rounds) > len(truth) // 2
    )  # the true drafts went through
    # every decoy left the grammar somewhere: the pass saw fewer draft tokens than were proposed
    assert sum(r.num_draft_tokens for r in rounds) < sum(len(d) for d in drafter.proposed)


@given(
    drafts=st.lists(
        st.lists(st.sampled_from([2, 3, 6, 9, 10, 11, 13, 45, 58, 60]), min_size=1, max_size=6),
        max_size=8,
    )
)
@settings(max_examples=50, deadline=None)
def test_drafts_sharing_prefixes_are_judged_as_alone(drafts) -> None:
    """Tried together (each shared prefix once), each draft's legal length is what trying it
    alone gives; the matcher is where it was."""
    from service.grammar import Constraint

    together = Constraint(COMPILER.compile(schema_spec(PERSON)), [EOS])
    for token in (PIECES.index("{"), PIECES.index('"')):
        assert together.accept(token)
    lengths = together.legal_lengths(drafts)
    alone = [Constraint(COMPILER.compile(schema_spec(PERSON)), [EOS]) for _ in drafts]
    for constraint, draft, length in zip(alone, drafts, lengths):
        constraint.accept(PIECES.index("{"))
        constraint.accept(PIECES.index('"'))
        assert constraint.legal_lengths([draft]) == [length]
    assert together.legal_lengths(drafts) == lengths


def test_drafts_are_cut_at_their_first_illegal_token(tiny_runner) -> None:
    from service.grammar import Constraint

    engine = engine_for(tiny_runner, None, [DecoyDrafter([0], [])])
    request = engine.add_request(
        [0, 5], params(schema_spec(PERSON), SPECULATIONS[1], SAMPLINGS[0], "decoy")
    )
    brace, quote, name = PIECES.index("{"), PIECES.index('"'), PIECES.index("name")
    drafts = [
        Draft((brace, quote, name, brace), "decoy"),
        Draft((quote,), "decoy"),
        Draft((PIECES.index('{"'), name), "decoy"),
    ]
    assert request.drafts._legal(drafts) == [
        Draft((brace, quote, name), "decoy"),
        Draft((PIECES.index('{"'), name), "decoy"),
    ]
    # nothing is tried after the end of text: an empty object then EOS, then more
    whole = [PIECES.index("{"), PIECES.index("}"), EOS, brace]
    assert Constraint(COMPILER.compile(GrammarSpec("json_object")), [EOS]).legal_lengths(
        [whole]
    ) == [3]
    # trying the drafts left the matcher where it was
    assert request.constraint is not None and request.constraint.legal_lengths([[brace]]) == [1]


@st.composite
def json_schemas(draw, depth: int = 0) -> dict:
    """Schemas over the features the grammar enforces, bounded so random outputs end soon."""
    leaves = st.sampled_from(
        [
            {"type": "boolean"},
            {"type": "null"},
            {"type": "integer", "minimum": -5, "maximum": 99},
            {"type": "string", "maxLength": 3},
            {"enum": ["a", "bc", 10, None]},
            {"const": "id"},
            {"type": "string", "pattern": "^[a-c]{1,2}$"},
            {"type": ["integer", "null"], "maximum": 9},
        ]
    )
    if depth >= 2:
        return draw(leaves)
    kind = draw(st.sampled_from(["leaf", "object", "array", "anyOf"]))
    if kind == "leaf":
        return draw(leaves)
    if kind == "array":
        return {
            "type": "array",
            "items": draw(json_schemas(depth + 1)),
            "maxItems": draw(st.integers(0, 2)),
        }
    if kind == "anyOf":
        return {"anyOf": draw(st.lists(json_schemas(depth + 1), min_size=1, max_size=2))}
    names = draw(
        st.lists(
            st.sampled_from(["name", "age", "id", "tags", "a", "bc"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    properties = {name: draw(json_schemas(depth + 1)) for name in names}
    required = draw(st.lists(st.sampled_from(names), unique=True))
    return {"type": "object", "properties": properties, "required": required}


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    schema=st.builds(
        lambda s: {"type": "object", "properties": {"v": s}, "required": ["v"]}, json_schemas()
    ),
    seeded=st.booleans(),
    prompt=st.sampled_from(PROMPTS),
)
def test_generated_schemas(tiny_model, tiny_runner, tiny_tables, schema, seeded, prompt) -> None:
    """Hypothesis-made schemas: fixed and auto speculation, batched with a free request, equal
    plain constrained decoding, and every finished output validates."""
    sampling = SAMPLINGS[1] if seeded else SAMPLINGS[0]
    spec = schema_spec(schema)
    want = reference_constrained(tiny_model, COMPILER, spec, prompt, NEW_TOKENS, sampling)
    check_valid(want, schema)
    for speculation in SPECULATIONS[1:]:
        engine = engine_for(tiny_runner, tiny_tables)
        got, _ = engine.complete_many(
            [
                (prompt, params(spec, speculation, sampling)),
                (PROMPTS[1], params(None, speculation, sampling)),
            ]
        )
        assert got.token_ids == want


@pytest.mark.parametrize(
    "schema, field",
    [
        (
            {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
            "schema.properties.a.not",
        ),
        (
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "schema.uniqueItems",
        ),
        ({"if": {"type": "integer"}, "then": {"minimum": 0}}, "schema.if"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "schema.allOf"),
        (
            {"anyOf": [{"type": "object", "dependentSchemas": {}}]},
            "schema.anyOf[0].dependentSchemas",
        ),
    ],
)
def test_unenforced_keywords_are_refused_by_name(schema, field) -> None:
    with pytest.raises(GrammarError) as refused:
        COMPILER.compile(GrammarSpec("json_schema", json.dumps(schema), field="schema"))
    assert refused.value.field == field


@pytest.mark.parametrize("source", ["{", "[1]", '{"type": "nope"}'])
def test_schemas_that_do_not_compile_are_refused(source) -> None:
    with pytest.raises(GrammarError) as refused:
        COMPILER.compile(GrammarSpec("json_schema", source))
    assert refused.value.field == "response_format"


def test_an_engine_without_a_tokenizer_refuses_grammars(tiny_runner, tiny_tables) -> None:
    engine = Engine(tiny_runner, default_mixer(tiny_tables), eos_token_ids=[EOS], max_context=512)
    with pytest.raises(GrammarError):
        engine.add_request(
            [3, 4], params(GrammarSpec("json_object"), SPECULATIONS[0], SAMPLINGS[0])
        )


def test_masked_logits_keep_only_allowed_tokens() -> None:
    from service.grammar import Constraint

    constraint = Constraint(COMPILER.compile(GrammarSpec("json_object")), [EOS])
    masked = constraint.masked(torch.zeros(64))
    allowed = {PIECES[i] for i in torch.nonzero(torch.isfinite(masked)).flatten().tolist()}
    assert allowed == {"{", '{"'}  # an object starts with a brace (no free whitespace)


def test_forced_text_is_drafted_as_the_tokenizer_spells_it() -> None:
    from service.grammar import Constraint, ForcedText

    constraint = Constraint(COMPILER.compile(schema_spec(PERSON)), [EOS])
    drafts = ForcedText(constraint, COMPILER.encode).propose(TokenHistory([0]), 4, 8)
    assert [text_of(list(d.token_ids)) for d in drafts] == ['{"name": "']
    assert drafts[0].token_ids == tuple(PIECES.index(p) for p in ['{"', "name", '": "'])
    assert (
        ForcedText(constraint, COMPILER.encode).propose(TokenHistory([0]), 4, 2)[0].token_ids
        == drafts[0].token_ids[:2]
    )
    for token in drafts[0].token_ids:
        constraint.accept(token)
    assert (
        ForcedText(constraint, COMPILER.encode).propose(TokenHistory([0]), 4, 8) == []
    )  # the name is free text


def test_forced_text_drafts_are_accepted(tiny_model, tiny_runner) -> None:
    """Drafting nothing but the grammar's forced text, the keys and separators come in whole
    rounds."""
    spec = schema_spec(PERSON)
    engine = engine_for(tiny_runner, None, [DecoyDrafter([0], [])])
    rounds = list(
        engine.generate(
            PROMPTS[0], params(spec, SpeculationParams(1, 8, "fixed"), SAMPLINGS[0], "decoy")
        )
    )
    assert [t for r in rounds for t in r.token_ids] == reference_constrained(
        tiny_model, COMPILER, spec, PROMPTS[0], NEW_TOKENS, SAMPLINGS[0]
    )
    assert (
        sum(r.accepted_strategies.count("grammar") for r in rounds) >= 3
    )  # '{"', 'name', '": "' at least
