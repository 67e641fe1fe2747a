"""llama.cpp's own greedy decoding of the same GGUF: what a CPU user would run instead.

A bench reference (`ngrammys bench --llama-cpp`), not a serving path: it answers the same
prompt ids as the engine, with the same stop tokens and budget, so the bench can put its
tokens/s beside plain and speculative decoding measured in the same run, prefill included.
It needs the optional `llama-cpp-python` package (`pip install 'ngrammys[llama-cpp]'`), which
compiles llama.cpp at install time (minutes on a small CPU), so it stays out of
`make test`'s setup.

Its output need not equal the engine's: llama.cpp multiplies 4-bit weights by activations it
first rounds to 8 bits, so its logits are not the served model's; the bench reports how often
the greedy outputs agree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from service.bench.command import UsageError
from service.engine.outputs import Completion
from service.engine.params import GenerationParams

LLAMA_CPP = "llama.cpp greedy"  # the method's name in bench tables
INSTALL_HINT = (
    "llama.cpp's reference needs `pip install 'ngrammys[llama-cpp]'` (compiles llama.cpp, minutes)"
)


class LlamaCppGreedy:
    """Greedy decoding by llama.cpp of one GGUF file; `complete` is shaped like the engine's."""

    def __init__(
        self, gguf_path: Path, eos_token_ids: Sequence[int], threads: int, context: int = 4096
    ) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as error:
            raise RuntimeError(INSTALL_HINT) from error
        self.llama: Any = Llama(
            model_path=str(gguf_path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.eos_token_ids = frozenset(eos_token_ids)

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> Completion:
        """Up to `params.max_new_tokens` greedy tokens after `prompt_ids`, from an empty cache
        (no prefix reuse between calls: prefill counts, as it does for the engine)."""
        if params.sampling.temperature > 0:
            raise ValueError("llama.cpp's reference decodes greedily only")
        self.llama.reset()
        completion = Completion(finish_reason="length")
        started = time.perf_counter()
        for token in self.llama.generate(
            list(prompt_ids),
            top_k=1,
            top_p=1.0,
            min_p=0.0,
            temp=0.0,
            repeat_penalty=1.0,
            reset=True,
        ):
            completion.token_ids.append(int(token))  # a stop token included, as the engine does
            if token in self.eos_token_ids:
                completion.finish_reason = "stop"
                break
            if len(completion.token_ids) == params.max_new_tokens:
                break  # before the generator feeds this token back: the engine does not either
        completion.seconds = completion.forward_seconds = time.perf_counter() - started
        completion.num_passes = len(completion.token_ids)  # one token a pass
        return completion


def llama_cpp_references(
    gguf_path: Path, eos_token_ids: Sequence[int]
) -> dict[str, LlamaCppGreedy]:
    """`--llama-cpp`: llama.cpp's greedy decoding of the measured GGUF, on as many threads as
    the engine's; without the package, a `UsageError` saying how to get it."""
    try:
        return {LLAMA_CPP: LlamaCppGreedy(gguf_path, eos_token_ids, torch.get_num_threads())}
    except RuntimeError as error:
        raise UsageError(str(error)) from None
