"""A JSON extraction workload: documents in, one fixed schema out, with the grammar and without.

Thirty short profiles (made here from fixed lists and a fixed seed, so every run reads the same
text) are each turned into a JSON object by the model. Every method runs on an engine of its
own (no method drafts from another's outputs) and methods take turns per document. Within each
group (constrained, unconstrained) the first method is plain decoding, the reference every other
method's output must equal. What it reports per method: tokens per pass, tokens/s against
plain, the answers that parse and match the schema, and the grammar's time against the passes'.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import jsonschema
from transformers import PreTrainedTokenizerBase

from service.bench.command import load
from service.bench.workload import WorkloadMethod
from service.engine.config import EngineConfig
from service.engine.outputs import Completion
from service.model.prompts import chat_prompt_ids

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "email", "skills", "employed"],
}
FIRST = [
    "Ada",
    "Liam",
    "Mei",
    "Omar",
    "Sofia",
    "Kenji",
    "Amara",
    "Lucas",
    "Priya",
    "Noah",
    "Elena",
    "Tariq",
]
LAST = [
    "Lovelace",
    "Okafor",
    "Chen",
    "Haddad",
    "Rossi",
    "Tanaka",
    "Mensah",
    "Silva",
    "Patel",
    "Berg",
]
CITIES = [
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Toronto",
    "Lyon",
    "Austin",
    "Krakow",
    "Pune",
    "Bergen",
    "Quito",
]
JOBS = [
    "nurse",
    "civil engineer",
    "baker",
    "data analyst",
    "teacher",
    "pilot",
    "librarian",
    "electrician",
]
SKILLS = [
    "Python",
    "welding",
    "public speaking",
    "Spanish",
    "first aid",
    "accounting",
    "carpentry",
    "SQL",
    "photography",
    "negotiation",
]


def documents(count: int = 30, seed: int = 0) -> list[str]:
    """`count` short profiles in prose, each naming every field of `SCHEMA`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        skills = rng.sample(SKILLS, rng.randint(1, 3))
        employed = rng.random() < 0.7
        out.append(
            f"{first} {last} is {rng.randint(19, 70)} years old and lives in {rng.choice(CITIES)}. "
            f"{'Works' if employed else 'Until last year worked'} as a {rng.choice(JOBS)}"
            f"{'' if employed else ' and is looking for a new position'}. "
            "Good at "
            f"{', '.join(skills[:-1]) + ' and ' + skills[-1] if len(skills) > 1 else skills[0]}. "
            f"Reach them at {first.lower()}.{last.lower()}@example.org."
        )
    return out


def prompts(tokenizer: PreTrainedTokenizerBase, docs: Sequence[str]) -> list[list[int]]:
    """The extraction request for each document, in the model's chat template."""
    fields = ", ".join(SCHEMA["properties"])
    return [
        chat_prompt_ids(
            tokenizer,
            [
                {
                    "role": "user",
                    "content": (
                        f"Extract {fields} from this profile as a JSON object.\n\nProfile: {doc}"
                    ),
                }
            ],
        )
        for doc in docs
    ]


@dataclass
class StructuredResult:
    completions: list[Completion] = field(default_factory=list)
    identical: int = 0  # outputs equal to the group's first method's
    valid: int = 0  # outputs that parse as JSON and match the schema

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def passes(self) -> int:
        return sum(c.num_passes for c in self.completions)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.completions)

    @property
    def grammar_share(self) -> float:
        """The grammar's time (masks, drafts cut, forced text) against the passes' time."""
        forward = sum(c.forward_seconds for c in self.completions)
        return sum(c.grammar_seconds for c in self.completions) / forward if forward else 0.0


def run(
    groups: Sequence[Sequence[WorkloadMethod]], prompt_ids: Sequence[list[int]], decode: callable
) -> dict[str, StructuredResult]:  # type: ignore[valid-type]
    """Every document through every method, methods in turn (rotating which goes first)."""
    methods = [m for group in groups for m in group]
    results = {m.name: StructuredResult() for m in methods}
    for index, prompt in enumerate(prompt_ids):
        shift = index % len(methods)
        done = {
            m.name: m.engine.complete(prompt, m.params)
            for m in [*methods[shift:], *methods[:shift]]
        }
        for group in groups:
            reference = done[group[0].name].token_ids
            for method in group:
                completion, result = done[method.name], results[method.name]
                result.completions.append(completion)
                result.identical += completion.token_ids == reference
                result.valid += _matches(decode(completion.token_ids))
    return results


def _matches(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def format_results(results: dict[str, StructuredResult], plain: dict[str, str]) -> str:
    """One row per method; `plain` names each method's reference (its group's plain decoding)."""
    header = (
        "| method | tokens | passes | tokens/pass | tok/s | vs its plain | valid JSON | identical "
        "| grammar time "
        "/ pass time |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for name, r in results.items():
        reference = results[plain[name]]
        speedup = (r.tokens / r.seconds) / (reference.tokens / reference.seconds)
        rows.append(
            f"| {name} | {r.tokens} | {r.passes} | {r.tokens / r.passes:.2f} "
            f"| {r.tokens / r.seconds:.1f} "
            f"| {speedup:.2f}x | {r.valid}/{len(r.completions)} "
            f"| {r.identical}/{len(r.completions)} "
            f"| {r.grammar_share:.1%} |"
        )
    return "\n".join([header, *rows])


def run_command(
    model: str | None,
    config: EngineConfig,
    document_count: int,
    max_new_tokens: int,
    k: int,
    w: int,
) -> None:
    """`ngrammys extract`: the workload with the grammar and without, plain vs speculative
    (auto, and fixed at k drafts of depth w), every method on an engine of its own; the table."""
    from service.engine.params import GenerationParams, SpeculationParams
    from service.engine.scheduler import SchedulerConfig
    from service.grammar import GrammarSpec
    from service.runtime import build_engine_with_tables

    loaded = load(model, config)
    config = replace(config, cost_profile=True, scheduler=SchedulerConfig(prefix_cache=False))
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))

    def method(name: str, speculation: SpeculationParams, constrained: bool) -> WorkloadMethod:
        params = GenerationParams(
            max_new_tokens, speculation=speculation, grammar=grammar if constrained else None
        )
        return WorkloadMethod(name, build_engine_with_tables(loaded, config), params)

    shapes = {
        "plain": SpeculationParams(0, 0, "off"),
        "auto": SpeculationParams(k, w, "auto"),
        f"k{k}w{w}": SpeculationParams(k, w, "fixed"),
    }
    groups = [
        [method(f"{name}, {label}", shape, constrained) for name, shape in shapes.items()]
        for label, constrained in (("schema", True), ("free", False))
    ]
    docs = documents(document_count)
    print(
        f"{loaded.name}: {len(docs)} documents -> one JSON schema, "
        f"{max_new_tokens} tokens at most, greedy; "
        "each method on an engine of its own",
        flush=True,
    )
    results = run(
        groups,
        prompts(loaded.tokenizer, docs),
        lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True),
    )
    print(format_results(results, {m.name: group[0].name for group in groups for m in group}))
