"""The engine's token logprobs in OpenAI's two wire shapes.

Completions (legacy): `{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}`.
Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
A formatter lives as long as its request, so the `text_offset`s of a streamed completion
continue from chunk to chunk and the chunks' lists concatenate to the non-streamed ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from service.engine.logprobs import TokenLogprob

# JSON has no -Infinity; a token the model gives no probability at all (float underflow) is
# reported at this floor instead, as vLLM does.
LOGPROB_FLOOR = -9999.0


@dataclass
class LogprobsFormatter:
    """Formats one request's token logprobs, chunk after chunk."""

    tokenizer: PreTrainedTokenizerBase
    chat: bool
    text_offset: int = 0  # completions: where the next token's text starts in the completion

    def format(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(lp) for lp in logprobs]}
        tokens = [self._text(lp.token_id) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [self._top_dict(lp) for lp in logprobs],
            "text_offset": offsets,
        }

    def _top_dict(self, lp: TokenLogprob) -> dict[str, float]:
        """Keyed by text, as OpenAI's shape is: where ids share a text (e.g. partial
        characters), the likeliest one's logprob stands."""
        top: dict[str, float] = {}
        for token_id, logprob in lp.top:
            top.setdefault(self._text(token_id), _finite(logprob))
        return top

    def _chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        return {
            **self._chat_token(lp.token_id, lp.logprob),
            "top_logprobs": [self._chat_token(t, v) for t, v in lp.top],
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)
