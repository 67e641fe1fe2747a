"""vLLM's /tokenize and /detokenize, and /v1/models' context, over real HTTP: the ids are those
the generation routes prompt the model with (the same encoding, chat template and tools)."""

from __future__ import annotations

import httpx
import pytest

from app.background import serving
from app.main import create_app
from app.schemas import ChatMessage, ChatTool
from app.settings import Settings
from app.tools import ToolUse, chat_prompt
from service.model.prompts import chat_prompt_ids
from tests.helpers.http import QUIET, assert_openai_error, wait_ready

KEY = "tokenize-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Count the tokens of this."}]
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(tiny_served):
    with serving(create_app(Settings(api_keys=KEY, **QUIET), loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        yield base


def post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers=HEADERS, timeout=60)


def test_a_prompt_tokenizes_as_completions_encode_it(server, tiny_served) -> None:
    tokenizer = tiny_served.tokenizer
    text = "The quick brown fox"
    reply = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert reply == {
        "count": len(ids),
        "max_model_len": tiny_served.model.config.max_position_embeddings,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None


def test_messages_tokenize_as_chat_completions_prompts_them(server, tiny_served) -> None:
    tokenizer = tiny_served.tokenizer
    reply = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert reply["tokens"] == chat_prompt_ids(tokenizer, MESSAGES)
    unopened = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert unopened.json()["tokens"] == chat_prompt_ids(
        tokenizer, MESSAGES, add_generation_prompt=False
    )
    assert unopened.json()["count"] < reply["count"]
    with_tools = post(server, "/tokenize", {"messages": MESSAGES, "tools": [TOOL]}).json()
    use = ToolUse((ChatTool.model_validate(TOOL).function,))
    messages = [ChatMessage.model_validate(m) for m in MESSAGES]
    assert with_tools["tokens"] == chat_prompt(tokenizer, messages, use)[0]
    assert with_tools["count"] > reply["count"]  # the tools are shown to the model


def test_detokenize_gives_the_text_back(server, tiny_served) -> None:
    ids = tiny_served.tokenizer.encode("Hello there, general")
    assert post(server, "/detokenize", {"tokens": ids}).json() == {
        "prompt": tiny_served.tokenizer.decode(ids)
    }
    whole = post(server, "/detokenize", {"tokens": [float(i) for i in ids]})  # JSON's 5.0 is 5
    assert whole.json()["prompt"] == tiny_served.tokenizer.decode(ids)


def test_models_give_the_context(server, tiny_served) -> None:
    card = httpx.get(f"{server}/v1/models", headers=HEADERS).json()["data"][0]
    assert card["max_model_len"] == tiny_served.model.config.max_position_embeddings


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/tokenize", {"prompt": "x", "model": "another"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ],
)
def test_bad_input_is_a_4xx_in_openais_shape(server, path, body, status, param) -> None:
    assert_openai_error(post(server, path, body), status, param)


def test_a_key_is_asked_for(server) -> None:
    response = httpx.post(f"{server}/tokenize", json={"prompt": "x"}, timeout=30)
    assert response.status_code == 401
