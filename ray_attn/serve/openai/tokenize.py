"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes.

``/tokenize`` takes a completion-style ``prompt`` or chat ``messages`` (vLLM's
``TokenizeCompletionRequest`` / ``TokenizeChatRequest``, told apart by which of the two the body
holds) and answers ``{count, max_model_len, tokens}`` (and ``token_strs`` when asked): the very ids
``/v1/completions`` and ``/v1/chat/completions`` would feed the engine, so a client can count and
budget a prompt before it sends it.  ``/detokenize`` turns ids back into text.
"""

from __future__ import annotations

import json
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from ray_attn.serve.http import HTTPError, read_body
from ray_attn.serve.openai.chat import render_messages
from ray_attn.serve.openai.protocol import ChatMessage, _Request
from ray_attn.serve.openai.serving import check_model, parse
from ray_attn.serve.schemas import out_of_vocab


class TokenizeCompletionRequest(_Request):
    model: Optional[str] = Field(None, description="Must name the served model when given.")
    prompt: str = Field(description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS), as "
                                                       "/v1/completions does.")
    return_token_strs: Optional[bool] = Field(False, description="Also return each token's string.")


class TokenizeChatRequest(_Request):
    model: Optional[str] = Field(None, description="Must name the served model when given.")
    messages: list[ChatMessage] = Field(min_length=1, description="Rendered by the chat template, as "
                                                                  "/v1/chat/completions renders them.")
    add_generation_prompt: bool = Field(True, description="Template adds the assistant turn's opening.")
    continue_final_message: bool = Field(False, description="Leave the last message open (no end of "
                                                            "turn): the model continues it.")
    add_special_tokens: bool = Field(False, description="Add special tokens on top of the template's "
                                                        "own (off: the template writes them).")
    return_token_strs: Optional[bool] = Field(False, description="Also return each token's string.")

    @model_validator(mode="after")
    def _check(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
        return self


class TokenizeResponse(BaseModel):
    count: int = Field(description="How many tokens.")
    max_model_len: int = Field(description="The model's context length.")
    tokens: list[int] = Field(description="The token ids.")
    token_strs: Optional[list[str]] = Field(None, description="Each token's string (return_token_strs).")


class DetokenizeRequest(_Request):
    model: Optional[str] = Field(None, description="Must name the served model when given.")
    tokens: list[int] = Field(description="Token ids to decode.")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The decoded text (special tokens kept, as vLLM does).")


def _tokenizer(server, field: str):
    if server.tokenizer is None:
        raise HTTPError(400, [(field, f"{field}: tokenizing needs a tokenizer on the server (app "
                                      f"config 'tokenizer')")])
    return server.tokenizer


def _is_chat(body: bytes) -> bool:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False  # parse() below answers the malformed body with its own 400
    return isinstance(obj, dict) and "messages" in obj


async def tokenize(server, request: Request):
    body = await read_body(request, server.cfg.max_body_bytes)
    strict = server.cfg.strict_request_fields
    if _is_chat(body):
        req = parse(TokenizeChatRequest, body, strict)
        check_model(server, req.model)
        _tokenizer(server, "messages")
        ids = render_messages(server, req.messages, req.add_generation_prompt, req.add_special_tokens,
                              req.continue_final_message)
    else:
        req = parse(TokenizeCompletionRequest, body, strict)
        check_model(server, req.model)
        tok = _tokenizer(server, "prompt")
        ids = list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    strs = server.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    resp = TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(resp.model_dump(exclude_none=True))


async def detokenize(server, request: Request):
    req = parse(DetokenizeRequest, await read_body(request, server.cfg.max_body_bytes),
                server.cfg.strict_request_fields)
    check_model(server, req.model)
    tok = _tokenizer(server, "tokens")
    # ids the model has but the tokenizer lacks decode to nothing; beyond the model's, refused
    bad = out_of_vocab(req.tokens, "tokens", server.vocab_size)
    if bad:
        raise HTTPError(400, bad)
    try:
        text = tok.decode(req.tokens)
    except Exception as e:  # noqa: BLE001 - a tokenizer may raise on ids it does not know
        raise HTTPError(400, [("tokens", f"tokens: the tokenizer cannot decode them: {type(e).__name__}")]) from None
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
