"""Turning chat messages into prompt token ids with the model's own chat template."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

# a function the probe of a template offers it (any would do: a template shows tools or not)
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "a probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


NO_TEMPLATE = (
    "the model has no chat template (a base model): send the text as a prompt to /v1/completions"
)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered by the chat template, ready for the assistant's turn
    (unless not `add_generation_prompt`); `tools` (OpenAI's function list) go to the template,
    which may show them or not. A model without a template (a base model) has no chat:
    ValueError saying so."""
    if not tokenizer.chat_template:
        raise ValueError(NO_TEMPLATE)
    encoded = tokenizer.apply_chat_template(
        list(messages),
        tools=None if tools is None else list(tools),
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=True,
    )
    return list(encoded["input_ids"])


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template shows the model the tools it is given: a template without
    tool syntax ignores `tools=`, and the caller has to describe them itself."""
    template = tokenizer.chat_template
    return bool(template) and _renders_tools(tokenizer, str(template))


@functools.lru_cache(maxsize=8)
def _renders_tools(tokenizer: PreTrainedTokenizerBase, template: str) -> bool:
    """(Once per tokenizer and template: the template is part of the key, as it may be replaced.)"""
    messages = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    offered = tokenizer.apply_chat_template(
        messages, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False
    )
    return plain != offered


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, eos_token_id: int | list[int] | None
) -> list[int]:
    """The tokens that end a turn: the model config's EOS id(s) and the tokenizer's."""
    ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    ids = [*ids, tokenizer.eos_token_id]
    return sorted({i for i in ids if i is not None})


def assistant_prefix_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that open an assistant turn (what `add_generation_prompt` appends), or BOS.

    A neutral context for probing the model one token at a time: alone at position 0 a token
    acts as an attention sink and the model's predictions degenerate to punctuation.
    """
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": "x"}]
        plain = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        opened = chat_prompt_ids(tokenizer, messages)
        if opened[: len(plain)] == list(plain) and len(opened) > len(plain):
            return opened[len(plain) :]
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
