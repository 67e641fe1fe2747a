"""Reasoning apart from the answer (`--reasoning-parser think`): the parser on its own, and a
tiny model that writes a scripted `<think>…</think>` answer through chat, Responses and
Messages, streamed and not, whether the answer or the chat template opens the reasoning."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import openai
import pytest

from app.background import serving
from app.main import create_app
from app.reasoning import ReasoningStream, Split
from app.settings import Settings
from service.model.loader import LoadedModel
from service.model.prompts import chat_prompt_ids
from tests.helpers.http import QUIET, wait_ready
from tests.helpers.models import make_successor_model

REASONING, ANSWER = "Count", '"Two"'
# the script's tokens, each once (the model's next token depends on the current one only)
OPENING = ["<", "think", ">"]
SCRIPT = ["Count", "</", "th", "ink", '>"', "Two", '"']
MESSAGES = [{"role": "user", "content": "Name a prime."}]
OPENED_TEMPLATE_END = "{{ '<|im_start|>assistant\n<think>\n' }}"


def whole(stream: ReasoningStream, pieces: list[str]) -> Split:
    splits = [stream.push(piece) for piece in pieces] + [stream.finish()]
    return Split("".join(s.reasoning for s in splits), "".join(s.answer for s in splits))


@pytest.mark.parametrize(
    "text,opened,expected",
    [
        ("<think>Let me see.</think>\n\nIt is 2.", False, Split("Let me see.", "It is 2.")),
        ("  <think>a</think>b", False, Split("a", "b")),
        ("It is 2.", False, Split("", "It is 2.")),
        ("<thin", False, Split("", "<thin")),  # never a tag: text
        ("Let me see.</think>It is 2.", True, Split("Let me see.", "It is 2.")),
        ("Let me see, cut sho", True, Split("Let me see, cut sho", "")),
        ("a</thi", True, Split("a</thi", "")),
        ("<think></think>", False, Split("", "")),
        ("x < y </think> so 2 < 3", True, Split("x < y ", "so 2 < 3")),
    ],
)
def test_the_parser_splits_alike_however_the_text_is_cut(text, opened, expected) -> None:
    assert whole(ReasoningStream(opened), [text]) == expected
    assert whole(ReasoningStream(opened), list(text)) == expected  # a character a delta
    for cut in range(len(text) + 1):
        assert whole(ReasoningStream(opened), [text[:cut], text[cut:]]) == expected


def thinker(embedded, opened_by_template: bool) -> LoadedModel:
    """A model that answers the chat prompt of MESSAGES with the script (the reasoning opened
    by its answer, or by its chat template)."""
    tokenizer = copy.deepcopy(embedded.tokenizer)
    if opened_by_template:
        tokenizer.chat_template = tokenizer.chat_template.replace(
            "{{ '<|im_start|>assistant\n' }}", OPENED_TEMPLATE_END
        )
        assert tokenizer.chat_template.endswith(OPENED_TEMPLATE_END + "{% endif %}")
    pieces = SCRIPT if opened_by_template else OPENING + SCRIPT
    script = tokenizer.convert_tokens_to_ids(pieces)
    assert len(set(script)) == len(script) and tokenizer.unk_token_id not in script
    last = chat_prompt_ids(tokenizer, MESSAGES)[-1]
    successors = dict(zip([last, *script[:-1]], script))
    model = make_successor_model(
        successors, default=tokenizer.eos_token_id, vocab_size=embedded.model.config.vocab_size
    )
    return LoadedModel(model, tokenizer, "thinker", 0.0, False)


@pytest.fixture(scope="module", params=[False, True], ids=["answer-opens", "template-opens"])
def server(embedded, request):
    loaded = thinker(embedded, opened_by_template=request.param)
    tokens = len(SCRIPT) + (0 if request.param else len(OPENING))
    settings = Settings(reasoning_parser="think", max_tokens=tokens, **QUIET)
    with serving(create_app(settings, loader=lambda _: loaded)) as base:
        wait_ready(base)
        yield base


def test_chat_returns_the_reasoning_apart_streamed_and_not(server) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    message = client.chat.completions.create(model="thinker", messages=MESSAGES).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (REASONING, ANSWER)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="thinker", messages=MESSAGES, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_responses_give_a_reasoning_item_before_the_message(server) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model="thinker", input=MESSAGES)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == REASONING and response.output_text == ANSWER
    with httpx.stream(
        "POST", f"{server}/v1/responses", json={"input": MESSAGES, "stream": True}
    ) as reply:
        events = [
            json.loads(line.removeprefix("data: "))
            for line in reply.iter_lines()
            if line.startswith("data: ")
        ]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, said) == (REASONING, ANSWER)
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]


def test_messages_give_a_thinking_block_before_the_text(server) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    message = client.messages.create(model="thinker", max_tokens=32, messages=MESSAGES)
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content
    ] == [
        ("thinking", REASONING),
        ("text", ANSWER),
    ]
    with client.messages.stream(model="thinker", max_tokens=32, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == ANSWER


def test_without_the_parser_the_reasoning_is_answer_text(embedded) -> None:
    loaded = thinker(embedded, opened_by_template=False)
    settings = Settings(max_tokens=len(OPENING) + len(SCRIPT), **QUIET)
    with serving(create_app(settings, loader=lambda _: loaded)) as base:
        wait_ready(base)
        reply = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES}).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == f"<think>{REASONING}</think>{ANSWER}"
    assert "reasoning_content" not in message


def test_structured_output_holds_the_answer_after_the_reasoning(server) -> None:
    # the script's reasoning is not JSON and its answer is '"Two"': the grammar lets the
    # reasoning through and holds the answer to the schema, which the model must then follow
    schema = {"type": "string", "enum": ["One"]}
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    message = (
        client.chat.completions.create(
            model="thinker",
            messages=MESSAGES,
            max_tokens=32,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "prime", "schema": schema},
            },
        )
        .choices[0]
        .message
    )
    assert (message.model_extra["reasoning_content"], message.content) == (REASONING, '"One"')
    response = client.responses.create(
        model="thinker",
        input=MESSAGES,
        max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "prime", "schema": schema}},
    )
    assert response.output[0].content[0].text == REASONING and response.output_text == '"One"'
