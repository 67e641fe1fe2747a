"""The `speculation.trace` extension: each round of a choice as a `RoundTrace` (app/schemas.py).

Every committed token is listed with its text and its source: the strategy that drafted it,
or `model` for the model's own token (the bonus token that ends each round, and every token of
plain decoding). A client that shows where a text came from (the web page, app/web/) reads it;
OpenAI clients ignore it, and without the request field nothing of it is sent.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from service.engine.detokenizer import TextStream
from service.engine.outputs import RoundOutput

MODEL_SOURCE = "model"


def token_sources(output: RoundOutput) -> list[str]:
    """The source of each committed token of `output`: its accepted tokens' strategies in order,
    then the model's own (a round cut at a stop or at max_tokens may end inside its drafts)."""
    accepted = output.accepted_strategies
    return [
        accepted[i] if i < len(accepted) else MODEL_SOURCE for i in range(len(output.token_ids))
    ]


class RoundTracer:
    """The traces of one choice's rounds, in order, each token's text decoded on its own (with
    the context of the tokens before it, so the texts join into the choice's text)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._texts = TextStream(tokenizer)  # no stop strings: every settled character released
        self._rounds = 0

    def trace(self, output: RoundOutput) -> dict[str, Any]:
        """The trace of `output`, the choice's next round."""
        texts = [self._texts.push([token]).text for token in output.token_ids]
        if output.finish_reason is not None and texts:  # an unfinished character, as the text has
            texts[-1] += self._texts.finish().text
        body = {
            "round": self._rounds,
            "k": output.k,
            "w": output.w,
            "tree_size": output.num_draft_tokens,
            "committed": len(output.token_ids),
            "accepted": output.num_accepted_tokens,
            "forecast_tokens_per_second": output.predicted_tokens_per_second,
            "realized_tokens_per_second": _finite(output),
            "tokens": [
                {"text": text, "source": source}
                for text, source in zip(texts, token_sources(output))
            ],
        }
        self._rounds += 1
        return body


def _finite(output: RoundOutput) -> float:
    """The round's tokens per second (0 for a round that took no measured time)."""
    seconds = output.draft_seconds + output.forward_seconds
    return len(output.token_ids) / seconds if seconds > 0 else 0.0
