"""vLLM's `/tokenize` and `/detokenize`: a prompt or chat messages to the token ids the
generation routes would prompt the model with (the same encoding, chat template and tools),
and token ids back to text. Clients count tokens, or check what a template makes of their
messages, without generating."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request

from app.auth import client_identity
from app.deps import RuntimeDep
from app.errors import ApiError
from app.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    error_responses,
)
from app.serving import check_model, tokenize_off_loop
from app.tools import ToolUse, chat_prompt

router = APIRouter(dependencies=[Depends(client_identity)], responses=error_responses(401))


@router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404))
async def tokenize(body: TokenizeRequest, request: Request, runtime: RuntimeDep) -> dict:
    check_model(request, body.model)
    tokenizer = runtime.tokenizer
    if isinstance(body, TokenizeChatRequest):
        use = ToolUse(tuple(tool.function for tool in body.tools or ()))
        ids, _ = await tokenize_off_loop(
            request,
            "messages",
            chat_prompt,
            tokenizer,
            body.messages,
            use,
            body.add_generation_prompt,
        )
    else:
        encode = functools.partial(tokenizer.encode, add_special_tokens=body.add_special_tokens)
        ids = await tokenize_off_loop(request, "prompt", encode, body.prompt)
    return {
        "count": len(ids),
        "max_model_len": runtime.max_context,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


@router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404))
async def detokenize(body: DetokenizeRequest, request: Request, runtime: RuntimeDep) -> dict:
    check_model(request, body.model)
    if any(token >= runtime.vocab_size for token in body.tokens):
        raise ApiError(
            400, f"tokens: token ids must be in [0, {runtime.vocab_size})", param="tokens"
        )
    text = await tokenize_off_loop(request, "tokens", runtime.tokenizer.decode, body.tokens)
    return {"prompt": text}
