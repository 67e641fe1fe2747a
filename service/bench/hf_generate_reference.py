"""transformers' own `generate` on the served model: what a user of the plain library runs instead.

A bench reference (`ngrammys bench --hf-generate`), not a serving path: greedy `generate`, and
`generate` with prompt lookup (`prompt_lookup_num_tokens`, the library's learning-free n-gram
speculation), on the very model object the engine serves, with the same prompt ids, stop
tokens and budget, so the bench puts their tokens/s beside plain and speculative decoding
measured in the same run, prefill included. Their greedy outputs should equal plain decoding's
but for numerical near-ties (other attention and matmul shapes); the bench reports agreement.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from service.engine.outputs import Completion
from service.engine.params import GenerationParams

HF_GENERATE = "transformers generate"
HF_PROMPT_LOOKUP = "transformers prompt lookup"
PROMPT_LOOKUP_TOKENS = 10  # the library's documented example value


class HfGenerate:
    """Greedy `model.generate`, optionally with prompt lookup; `complete` is shaped like the
    engine's."""

    def __init__(
        self, model: PreTrainedModel, eos_token_ids: Sequence[int], prompt_lookup_tokens: int = 0
    ) -> None:
        """No `eos_token_ids`: every call decodes exactly its `max_new_tokens`
        (`ngrammys speed`)."""
        self.model = model
        self.eos_token_ids = list(eos_token_ids)
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self._passes = 0
        model.register_forward_hook(self._count_pass)  # generate does not report its passes

    def _count_pass(self, *_: object) -> None:
        self._passes += 1

    @torch.inference_mode()
    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> Completion:
        """Up to `params.max_new_tokens` greedy tokens after `prompt_ids`, from an empty cache."""
        if params.sampling.temperature > 0:
            raise ValueError("the transformers reference decodes greedily only")
        config = GenerationConfig(  # not the model's own defaults: those may sample
            max_new_tokens=params.max_new_tokens,
            do_sample=False,
            eos_token_id=self.eos_token_ids or None,
            min_new_tokens=None
            if self.eos_token_ids
            else params.max_new_tokens,  # the model's own EOS held off
            pad_token_id=(self.eos_token_ids or [0])[0],
            prompt_lookup_num_tokens=self.prompt_lookup_tokens or None,
        )
        input_ids = torch.tensor([list(prompt_ids)], device=self.model.device)
        self._passes = 0
        started = time.perf_counter()
        output = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
        tokens = output[0, len(prompt_ids) :].tolist()  # waits for the device
        seconds = time.perf_counter() - started
        stopped = bool(tokens) and tokens[-1] in self.eos_token_ids
        return Completion(
            token_ids=tokens,
            finish_reason="stop" if stopped else "length",
            seconds=seconds,
            forward_seconds=seconds,
            num_passes=self._passes,
        )


def hf_references(model: PreTrainedModel, eos_token_ids: Sequence[int]) -> dict[str, HfGenerate]:
    """Both references, by their bench names."""
    return {
        HF_GENERATE: HfGenerate(model, eos_token_ids),
        HF_PROMPT_LOOKUP: HfGenerate(model, eos_token_ids, PROMPT_LOOKUP_TOKENS),
    }
