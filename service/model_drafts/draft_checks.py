"""Start-time checks that a draft model can draft for the target at all.

A draft proposes token ids that the target verifies, so the two must mean the same token by
the same id; a mismatch would never give a wrong answer (the target decides) but would make
every draft wrong, silently. Device, dtype and context length are refused up front for the
same reason: better a clear error at start than a slow or useless draft at request time.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

MAX_NAMED_TOKENS = 5  # differing tokens named in the error


class IncompatibleDraft(ValueError):
    """The draft model cannot draft for the target."""


def check_draft(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Raise `IncompatibleDraft` unless the draft shares the target's vocabulary, device,
    dtype and (at least) context length."""
    check_tokenizers(target_tokenizer, draft_tokenizer)
    if draft.device != target.device:
        raise IncompatibleDraft(
            f"the draft model is on {draft.device}, the target on {target.device}; "
            "load both on one device"
        )
    if draft.dtype != target.dtype:
        raise IncompatibleDraft(
            f"the draft model computes in {draft.dtype}, the target in {target.dtype}; "
            "load both in one dtype"
        )
    draft_context = draft.config.max_position_embeddings
    target_context = target.config.max_position_embeddings
    if draft_context < target_context:
        raise IncompatibleDraft(
            f"the draft model's context ({draft_context} tokens) is shorter than the "
            f"target's ({target_context}); long requests could not be drafted"
        )


def check_tokenizers(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Raise `IncompatibleDraft` naming the tokens whose ids differ (or that one side lacks)."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    differing = sorted(
        (
            token
            for token in target_vocab.keys() | draft_vocab.keys()
            if target_vocab.get(token) != draft_vocab.get(token)
        ),
        key=lambda token: (
            min(target_vocab.get(token, 1 << 62), draft_vocab.get(token, 1 << 62)),
            token,
        ),
    )
    if differing:
        named = ", ".join(
            f"{token!r} (target id {target_vocab.get(token)}, draft id {draft_vocab.get(token)})"
            for token in differing[:MAX_NAMED_TOKENS]
        )
        raise IncompatibleDraft(
            f"the draft model's tokenizer differs from the target's in {len(differing)} "
            f"tokens: {named}{', ...' if len(differing) > MAX_NAMED_TOKENS else ''}"
        )
