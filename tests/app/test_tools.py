"""Tool calls on chat, through real HTTP on the tiny model and the openai client: its text is
random, but held to the tools' grammar its calls are always well formed. The generic format
(the embedded tokenizer's template has no tool syntax) and a Hermes template (a copy of the
tokenizer with a template of its own) each get the prompt, the grammar and the parsing they need."""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
import xgrammar

from app.main import create_app
from app.schemas import ChatCompletionRequest
from app.settings import Settings
from app.tool_parsing import ToolCallStream, parse_generic, parse_hermes
from app.tools import GENERIC_INTRO, NO_ARGUMENTS, chat_prompt, generic_prompt, tool_use
from service.model.loader import LoadedModel
from service.model.prompts import renders_tools
from service.runtime import grammar_compiler
from tests.helpers.http import QUIET, assert_openai_error, post, serving_ready, sse_events

MODEL = "tiny-random-llama"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# small enums and bounded integers, so that a random model's calls end within a few tokens
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, some days ahead",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"$ref": "#/$defs/Unit"},
            },  # a pydantic model's reference, into the parameters' own $defs
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
            "$defs": {"Unit": {"enum": ["C", "F"]}},
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "now", "description": "The current time", "strict": True},
}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {
    tool["function"]["name"]: tool["function"].get("parameters", NO_ARGUMENTS) for tool in TOOLS
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# room for a whole call of WEATHER or CLOCK (the random model spells it in ~1-2 characters a token)
WHOLE = {"max_tokens": 128, "temperature": 1.0}
SPECULATION = {"spec_mode": "fixed", "spec_k": 4, "spec_w": 4}
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions, given in <tools></tools>:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call one as <tool_call>\n"
    '{"name": <name>, "arguments": <arguments>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_served):
    with serving_ready(
        create_app(Settings(**SPECULATION, **QUIET), loader=lambda _: tiny_served)
    ) as base:
        yield base


@pytest.fixture(scope="module")
def hermes_tokenizer(tiny_served):
    """The embedded tokenizer with a Hermes template (Qwen2.5's convention, no download)."""
    tokenizer = copy.deepcopy(tiny_served.tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def hermes_server(tiny_served, hermes_tokenizer):
    loaded = LoadedModel(tiny_served.model, hermes_tokenizer, MODEL, 0.0, False)
    with serving_ready(
        create_app(Settings(**SPECULATION, **QUIET), loader=lambda _: loaded)
    ) as base:
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def ask(base: str, stream: bool, **fields) -> tuple[str | None, list[tuple[str, dict]], str]:
    """(content, [(name, arguments)], finish reason) through the openai client; a stream
    through its helper, which assembles the tool calls' deltas."""
    fields = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, **fields}
    extra = {key: fields.pop(key) for key in ("speculation",) if key in fields}
    if stream:
        try:
            with client(base).chat.completions.stream(**fields, extra_body=extra) as events:
                reply = events.get_final_completion()
        except openai.LengthFinishReasonError as cut:  # the helper's way to end a stream cut short
            reply = cut.completion
    else:
        reply = client(base).chat.completions.create(**fields, extra_body=extra)
    choice = reply.choices[0]
    calls = calls_of([call.model_dump() for call in choice.message.tool_calls or []])
    return choice.message.content, calls, choice.finish_reason


def calls_of(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    """Each call's name and arguments, checked: an OpenAI id, arguments JSON that validate
    against the function's parameters."""
    calls = []
    for call in tool_calls:
        assert (
            call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
        )
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, PARAMETERS[name])
        calls.append((name, arguments))
    return calls


# --- required, named, auto, none: the generic format -------------------------------------


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_required_and_named_answers_are_one_call_matching_its_schema_streamed_or_not(
    server: str, choice
) -> None:
    for seed in range(3):
        content, calls, finish = ask(
            server, False, tool_choice=choice, parallel_tool_calls=False, seed=seed, **WHOLE
        )
        assert finish == "tool_calls" and content is None and len(calls) == 1
        assert choice == "required" or calls[0][0] == "get_weather"
        assert ask(
            server, True, tool_choice=choice, parallel_tool_calls=False, seed=seed, **WHOLE
        ) == (content, calls, finish)


def test_parallel_calls_are_each_well_formed(server: str) -> None:
    for seed in range(2):
        content, calls, finish = ask(server, False, tool_choice="required", seed=seed, **WHOLE)
        assert finish in ("tool_calls", "length")  # a random model may go on calling
        assert finish == "length" or (content is None and calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_either_content_or_calls(server: str, stream: bool) -> None:
    for seed in range(3):
        content, calls, finish = ask(server, stream, seed=seed, max_tokens=48, temperature=1)
        if calls:  # (a whole answer may take the last token allowed: its calls stand, cut "length")
            assert finish in ("tool_calls", "length") and content is None
        else:  # a reply, or the JSON as far as it got: the random model's strings rarely end
            assert isinstance(content, str) and finish in ("stop", "length")


def test_none_answers_plain_text_from_a_prompt_without_tools(server: str) -> None:
    plain = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0
    )
    none = client(server).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        tools=TOOLS,
        tool_choice="none",
    )
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_greedy_answers_are_the_same_whatever_the_speculation(server: str, choice: str) -> None:
    answers = [
        ask(
            server, False, tool_choice=choice, max_tokens=64, temperature=0, speculation=speculation
        )
        for speculation in ({"mode": "off"}, {"mode": "fixed", "k": 4, "w": 4})
    ]
    assert answers[0] == answers[1]


def test_each_of_n_choices_parses_its_own_calls_streamed_or_not(server: str) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "n": 3,
        "seed": 11,
        **WHOLE,
    }
    whole = post(server, "chat/completions", body).json()["choices"]
    singles = [
        ask(server, False, tool_choice="required", parallel_tool_calls=False, seed=11 + i, **WHOLE)
        for i in range(3)
    ]
    assert [calls_of(c["message"]["tool_calls"]) for c in whole] == [s[1] for s in singles]
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    # choice -> call index -> the call's delta, joined
    streamed: dict[int, dict[int, dict]] = defaultdict(dict)
    finishes = {}
    for choice in (c for chunk in chunks for c in chunk["choices"]):
        assert not choice["delta"].get("content")  # calls only: no content before them
        for delta in choice["delta"].get("tool_calls") or []:
            call = streamed[choice["index"]].setdefault(
                delta["index"], {"function": {"arguments": ""}}
            )
            call.update({key: delta[key] for key in ("id", "type") if key in delta})
            call["function"]["name"] = delta["function"].get("name") or call["function"].get("name")
            call["function"]["arguments"] += delta["function"].get("arguments") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert [calls_of(list(streamed[i].values())) for i in range(3)] == [s[1] for s in singles]


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_copies_of_a_call_have_ids_of_their_own(server: str, stream: bool) -> None:
    """Greedy n = 2 is one answer twice, but a client answers each call by its id."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "n": 2,
        "max_tokens": 128,
        "stream": stream,
    }
    if stream:
        with httpx.stream(
            "POST", f"{server}/v1/chat/completions", json=body, timeout=60
        ) as response:
            choices = [c for e in sse_events(response)[:-1] for c in json.loads(e)["choices"]]
        calls = {
            c["index"]: c["delta"]["tool_calls"][0] for c in choices if c["delta"].get("tool_calls")
        }
    else:
        choices = post(server, "chat/completions", body).json()["choices"]
        calls = {c["index"]: c["message"]["tool_calls"][0] for c in choices}
    assert calls[0]["function"] == calls[1]["function"] and calls[0]["id"] != calls[1]["id"]
    assert all(call["id"].startswith("call_") for call in calls.values())


def test_streamed_logprobs_cover_every_token_while_the_calls_are_held_back(server: str) -> None:
    body = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "logprobs": True,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        **WHOLE,
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    logprobs = [
        lp
        for c in chunks
        for choice in c["choices"]
        for lp in (choice.get("logprobs") or {}).get("content") or []
    ]
    assert len(logprobs) == chunks[-1]["usage"]["completion_tokens"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


# --- the prompt ---------------------------------------------------------------------------


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_the_generic_prompt_describes_the_tools_in_a_system_message(
    server: str, tiny_served
) -> None:
    tokenizer = tiny_served.tokenizer
    assert not renders_tools(tokenizer)
    request = chat_request(tools=TOOLS)
    ids, use = chat_prompt(tokenizer, request.messages, tool_use(request))
    text = tokenizer.decode(ids)
    assert not use.native and generic_prompt(use) in text and GENERIC_INTRO in text
    for tool in TOOLS:
        function = tool["function"]
        described = {
            "name": function["name"],
            "description": function["description"],
            "parameters": function.get("parameters", NO_ARGUMENTS),
        }
        assert json.dumps(described) in text
    assert '{"content": "<your reply>"}' in text and text.index("<|im_start|>system") < text.index(
        "What is the"
    )
    reply = client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=1
    )
    assert reply.usage.prompt_tokens == len(ids)  # the server renders that very prompt

    own = [{"role": "system", "content": "Be brief."}, *MESSAGES]  # the tools join a system message
    request = chat_request(messages=own, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False)
    text = tokenizer.decode(chat_prompt(tokenizer, request.messages, tool_use(request))[0])
    assert text.count("<|im_start|>system") == 1 and "Be brief.\n\n" + GENERIC_INTRO in text
    assert 'calling the tool "get_weather": {"tool_calls": [{"name": "get_weather"' in text


def test_a_conversation_with_calls_and_results_renders_in_the_generic_convention(
    server: str, tiny_served
) -> None:
    arguments = {"city": "Paris", "days": 1, "unit": "C"}
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "now", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    request = chat_request(messages=messages, tools=TOOLS)
    text = tiny_served.tokenizer.decode(
        chat_prompt(tiny_served.tokenizer, request.messages, tool_use(request))[0]
    )
    calls = json.dumps(
        {
            "tool_calls": [
                {"name": "get_weather", "arguments": arguments},
                {"name": "now", "arguments": {}},
            ]
        }
    )
    assert (
        f"<|im_start|>assistant\n{calls}<|im_end|>" in text
    )  # the answer as the grammar would have it
    assert (
        "<|im_start|>user\nTool result (call id call_1, tool get_weather):\nSunny, 21 C\n\n"
        "Tool result (call id call_2, tool now):\nnoon<|im_end|>"
    ) in text  # one message, the roles alternating
    _, calls, finish = ask(
        server,
        False,
        messages=messages,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=0,
        **WHOLE,
    )
    assert finish == "tool_calls" and len(calls) == 1


# --- a template with tool syntax: Hermes ---------------------------------------------------


def test_a_hermes_template_gets_the_tools_and_the_conversation_as_they_are(
    hermes_tokenizer,
) -> None:
    assert renders_tools(hermes_tokenizer)
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    request = chat_request(messages=messages, tools=TOOLS)
    ids, use = chat_prompt(hermes_tokenizer, request.messages, tool_use(request))
    text = hermes_tokenizer.decode(ids)
    assert use.native and GENERIC_INTRO not in text
    assert "<tools>" in text and '"name": "get_weather"' in text and '"$defs"' in text
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\nnoon\n</tool_response>" in text
    none = chat_request(messages=messages, tools=TOOLS, tool_choice="none")
    ids, use = chat_prompt(hermes_tokenizer, none.messages, tool_use(none))
    assert use.native and "<tools>" not in hermes_tokenizer.decode(ids)  # history still native


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_hermes_required_and_named_answers_are_one_tagged_call_streamed_or_not(
    hermes_server: str, choice
) -> None:
    for seed in range(2):
        fields = {
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "seed": seed,
            **WHOLE,
            "max_tokens": 160,
        }
        # (the tags and a newline or space between tokens)
        content, calls, finish = ask(hermes_server, False, **fields)
        assert finish == "tool_calls" and content is None and len(calls) == 1
        assert choice == "required" or calls[0][0] == "get_weather"
        assert ask(hermes_server, True, **fields) == (content, calls, finish)


def test_hermes_auto_is_free_text_parsed_for_calls(hermes_server: str) -> None:
    answers = [
        ask(hermes_server, stream, seed=0, max_tokens=16, temperature=1) for stream in (False, True)
    ]
    content, calls, finish = answers[0]
    assert (
        calls == [] and content and finish == "length"
    )  # random text holds no tag: all of it is content
    assert answers[1] == answers[0]


def test_the_hermes_grammar_compiles_for_the_embedded_tokenizer(tiny_served) -> None:
    tokenizer = tiny_served.tokenizer
    compiler = grammar_compiler(
        tokenizer, tiny_served.model.config.vocab_size, (tokenizer.eos_token_id,)
    )
    request = chat_request(tools=TOOLS, tool_choice="required")
    spec = replace(tool_use(request), native=True).grammar()
    assert spec is not None and spec.kind == "structural_tag" and spec.field == "tools"
    compiled = compiler.compile(spec)
    call = (
        '<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo", "days": 2, "unit": "F"}}\n</tool_call>'
    )
    assert matches(compiled, call) and matches(
        compiled, call + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    assert not matches(compiled, call.replace("Oslo", "Rome")) and not matches(compiled, "Sunny.")
    assert not matches(compiled, call.replace("get_weather", "get_time"))


def test_the_generic_grammar_takes_calls_or_a_reply(tiny_served) -> None:
    tokenizer = tiny_served.tokenizer
    compiler = grammar_compiler(
        tokenizer, tiny_served.model.config.vocab_size, (tokenizer.eos_token_id,)
    )
    auto = compiler.compile(tool_use(chat_request(tools=TOOLS)).grammar())
    call = '{"name": "get_weather", "arguments": {"city": "Lima", "days": 7, "unit": "C"}}'
    assert matches(auto, '{"content": "Sunny."}') and matches(
        auto, f'{{"tool_calls": [{call}, {call}]}}'
    )
    assert not matches(auto, '{"tool_calls": []}') and not matches(
        auto, call.join(['{"tool_calls": [', "]"])
    )
    single = compiler.compile(
        tool_use(chat_request(tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False)).grammar()
    )
    assert matches(single, f'{{"tool_calls": [{call}]}}') and not matches(
        single, f'{{"tool_calls": [{call}, {call}]}}'
    )
    assert not matches(single, '{"content": "Sunny."}')
    assert not matches(single, '{"tool_calls": [{"name": "now", "arguments": {}}]}')


def matches(compiled: xgrammar.CompiledGrammar, text: str) -> bool:
    """Whether `text` is a whole answer the grammar takes."""
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


# --- parsing --------------------------------------------------------------------------------


HERMES_ANSWERS = [
    ("Plain text.", "Plain text.", []),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", [("now", {})]),
    (
        (
            'Let me look.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
            "<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        ),
        "Let me look.",
        [("now", {}), ("get_weather", {"city": "Oslo"})],
    ),
    (
        '<tool_call>\n{"name": "now", "arguments": {}}',
        "",
        [("now", {})],
    ),  # a model that ended without the tag
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nDone.', "Done.", [("now", {})]),
    (
        '<tool_call>\n{"name": "now", "argu',
        '<tool_call>\n{"name": "now", "argu',
        [],
    ),  # cut: content as written
    ("<tool_call>\nnot JSON\n</tool_call>", "<tool_call>\nnot JSON\n</tool_call>", []),
    ("a <tool_c", "a <tool_c", []),  # a partial tag at the end is text once the answer ended
    ("Two  spaces,\n\nand a <b>tag</b>.", "Two  spaces,\n\nand a <b>tag</b>.", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_ANSWERS)
def test_hermes_answers_split_into_content_and_calls_alike_whole_or_streamed(
    text: str, content: str, calls
) -> None:
    for pieces in ([text], list(text)):  # whole, and a character at a time
        stream = ToolCallStream("hermes")
        sent = "".join(stream.push(piece) for piece in pieces)
        rest = stream.finish()
        assert sent + rest.content == content
        assert [(c.name, json.loads(c.arguments)) for c in rest.calls] == calls


def test_hermes_content_is_sent_until_a_tag_may_begin() -> None:
    stream = ToolCallStream("hermes")
    assert stream.push("Let me") == "Let me"
    assert stream.push(" look. <tool") == " look."  # the space and a partial tag wait
    assert stream.push("box> is a tag?") == " <toolbox> is a tag?"
    assert stream.push("\n<tool_call>\n{") == "" and stream.finish().content == "\n<tool_call>\n{"


def test_generic_answers_parse_into_content_or_calls() -> None:
    assert (
        parse_generic('{"content": "Hi."}').content == "Hi."
        and not parse_generic('{"content": "Hi."}').calls
    )
    parsed = parse_generic(
        '{"tool_calls": [{"name": "now", "arguments": {}}, {"name": "f", "arguments": {"a": [1]}}]}'
    )
    assert parsed.content == "" and [(c.name, c.arguments) for c in parsed.calls] == [
        ("now", "{}"),
        ("f", '{"a": [1]}'),
    ]
    assert len({c.id for c in parsed.calls}) == 2
    for broken in (
        '{"tool_calls": [{"name": "now"',
        '{"tool_calls": [{"name": 5, "arguments": {}}]}',
        "[]",
        '{"other": 1}',
        '{"tool_calls": 7}',
    ):
        assert parse_generic(broken) is None
    assert parse_hermes("no calls") is None
    stream = ToolCallStream("generic")
    assert (
        stream.push('{"content": "Hi') == ""
        and stream.push('."}') == ""
        and stream.finish().content == "Hi."
    )


def test_a_calls_id_is_made_of_the_prompt_and_the_answer() -> None:
    """The same request answered alike gets the same ids (a conversation replayed, or sent
    through another route, puts the same text before the model); another prompt or answer,
    others; without a seed they are random."""
    answer = '{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]}'

    def ids(seed: bytes | None, text: str = answer) -> list[str]:
        stream = ToolCallStream("generic", seed)
        stream.push(text)
        return [call.id for call in stream.finish().calls]

    first = ids(b"prompt")
    assert first == ids(b"prompt") and len(set(first)) == 2
    assert all(re.fullmatch("call_[A-Za-z0-9]{24}", i) for i in first)
    assert not set(first) & set(ids(b"other prompt"))
    assert ids(b"prompt", answer.replace('"a"', '"c"'))[1] != first[1]
    assert ids(None) != ids(None)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": {"name": "f"}}, "tools"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"not": {"type": "object"}}},
                    }
                ]
            },
            "tools.0.function.parameters.not",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"$ref": "#/$defs/Missing"}},
                    }
                ]
            },
            "tools",
        ),  # a schema the grammar cannot compile
        ({"messages": [*MESSAGES, {"role": "tool", "content": "noon"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
            "messages.0.tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(server: str, fields: dict, param: str) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **fields}
    assert_openai_error(post(server, "chat/completions", body), 400, param)


@pytest.mark.parametrize(
    "field,value", [("tools", TOOLS), ("tool_choice", "auto"), ("tool_choice", NAMED)]
)
def test_tools_on_completions_are_400_naming_the_field(server: str, field: str, value) -> None:
    error = assert_openai_error(
        post(server, "completions", {"prompt": "hi", field: value}), 400, field
    )
    assert "chat" in error["message"]


def test_tools_that_ask_for_nothing_are_accepted(server: str) -> None:
    for fields in (
        {"tools": [], "tool_choice": "none"},
        {"tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}},
    ):
        assert (
            post(
                server, "chat/completions", {"messages": MESSAGES, "max_tokens": 2, **fields}
            ).status_code
            == 200
        )
    assert (
        post(
            server,
            "completions",
            {"prompt": "hi", "max_tokens": 2, "tools": [], "tool_choice": "none"},
        ).status_code
        == 200
    )


def test_the_published_schema_has_the_tool_fields(server: str) -> None:
    components = httpx.get(f"{server}/openapi.json").json()["components"]["schemas"]
    message = components["ChatMessage"]["properties"]
    assert "tool" in message["role"]["enum"] and {"tool_calls", "tool_call_id"} <= set(message)
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(
        components["ChatCompletionRequest"]["properties"]
    )
    assert "tool_calls" in components["AssistantMessage"]["properties"]
    assert "tool_calls" in components["ChatDelta"]["properties"]
    tools = components["CompletionRequest"]["properties"]["tools"]
    assert tools["enum"] == [None, []]
