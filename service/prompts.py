"""Turning chat messages into prompt token ids with the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]
) -> list[int]:
    """Token ids of `messages` rendered by the chat template, ready for the assistant's turn."""
    encoded = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, eos_token_id: int | list[int] | None) -> list[int]:
    """The tokens that end a turn: the model config's EOS id(s) and the tokenizer's."""
    ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    ids = [*ids, tokenizer.eos_token_id]
    return sorted({i for i in ids if i is not None})
