"""The OpenAI response bodies of the Serve app (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``); the requests are in ``protocol.py``."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

# -------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache (each prompt "
                                           "counted once: the fewest hits among its n samples).")


class UsageInfo(BaseModel):
    prompt_tokens: int = Field(description="Prompt tokens (each prompt counted once, whatever n is).")
    completion_tokens: int = Field(description="Tokens generated over all choices.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list, description="Each sampled token's text.")
    token_logprobs: list[float] = Field(default_factory=list, description="Its log-probability.")
    top_logprobs: list[dict[str, float]] = Field(default_factory=list, description="The top tokens' texts "
                                                                                   "and log-probabilities.")
    text_offset: list[int] = Field(default_factory=list, description="Where each token's text starts.")


class CompletionChoice(BaseModel):
    index: int = Field(description="prompt index x n + sample index.")
    text: str = Field(description="The generated text (empty without a tokenizer: see token_ids).")
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = Field(None, description="'stop', 'length' or 'abort'.")
    stop_reason: Union[int, str, None] = Field(None, description="The stop string or token id that ended it.")
    token_ids: Optional[list[int]] = Field(None, description="The generated ids (return_token_ids).")
    prompt_token_ids: Optional[list[int]] = Field(None, description="The prompt's ids (return_token_ids).")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatLogprob]] = None


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str = Field(description="The name requests put in `model`.")
    object: Literal["model"] = "model"
    created: int = Field(description="When the replica started (Unix seconds).")
    owned_by: str = "ray_attn"
    root: Optional[str] = Field(None, description="The checkpoint folder, if any (an adapter's folder).")
    parent: Optional[str] = Field(None, description="For a LoRA adapter: the model it adapts.")
    max_model_len: int = Field(description="Longest prompt + completion the model accepts.")
    vocab_size: int = Field(description="Token ids are below this.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
