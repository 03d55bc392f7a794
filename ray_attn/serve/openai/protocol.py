"""The OpenAI request and response bodies the Serve app speaks (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``), with vLLM's extra sampling fields.

Requests forbid unknown fields -- OpenAI answers "Unrecognized request argument" too -- so a typo
is a 400 naming the field rather than a silently ignored setting.  Fields OpenAI defines that we
do not implement (``logit_bias``, ``suffix``, ``echo``, tools) are accepted only at their
do-nothing value and refused by name otherwise.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's own limit on top_logprobs


class _Request(BaseModel):
    # strict: "2" is not an int and 1 is not a bool (JSON ints still fill float fields)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices) "
                                                   "before [DONE].")
    continuous_usage_stats: bool = Field(False, description="vLLM: `usage` on every chunk.")


class SamplingFields(_Request):
    """What both endpoints share: OpenAI's sampling fields, then vLLM's extras."""

    model: Optional[str] = Field(None, description="Must name the served model (GET /v1/models) when given.")
    n: int = Field(1, ge=1, description="Completions per prompt; they share the prompt's KV blocks.")
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False,
                                         description="0 is greedy; default 1.0 as in OpenAI.")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass; default 1.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of "
                                                                      "every token already generated.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once per earlier "
                                                                       "occurrence in the output.")
    seed: Optional[int] = Field(None, ge=0, le=INT64_MAX, description=(
        "Sampling seed: a completion's tokens depend only on (seed, choice index) and the logits, "
        "not on what else is batched."))
    stop: Union[str, list[str], None] = Field(None, description="Up to the server's max_stop strings; "
                                                                "the text ends before the first one found.")
    stream: bool = Field(False, description="Answer with server-sent events ending in `data: [DONE]`.")
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream=true.")
    user: Optional[str] = Field(None, max_length=256, description="Accepted and ignored.")
    logit_bias: Optional[dict[str, float]] = Field(None, description="Not supported: must be empty.")
    # vLLM's extra sampling parameters (the openai client sends them through `extra_body`)
    top_k: int = Field(0, ge=-1, description="Sample from the k most likely tokens; 0 or -1: all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="Divides positive (multiplies "
                                      "negative) logits of prompt and output tokens; 1 is off.")
    min_tokens: int = Field(0, ge=0, description="EOS and stop token ids are masked until this many tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")
    stop_token_ids: Optional[list[int]] = Field(None, description="Token ids that also end a completion.")
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    return_token_ids: bool = Field(False, description="Also return each choice's `token_ids` (and the "
                                                      "`prompt_token_ids`); always on without a tokenizer.")

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this server")
        if self.top_k == -1:
            self.top_k = 0
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        description="Text, token ids, or a list of either (one completion set per prompt).")
    max_tokens: Optional[int] = Field(16, ge=1, description="Tokens per completion at most (default 16).")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Return the log-probability of each sampled token and of the top `logprobs` tokens "
        "(log-softmax of the raw model logits)."))
    echo: bool = Field(False, description="Not supported: must be false.")
    best_of: Optional[int] = Field(None, ge=1, description="Only best_of == n is supported.")
    suffix: Optional[str] = Field(None, description="Not supported: must be null.")

    @model_validator(mode="after")
    def _check(self):
        if self.echo:
            raise ValueError("echo: not supported by this server")
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n is supported (got best_of={self.best_of}, n={self.n})")
        p = self.prompt
        if (isinstance(p, (str, list)) and len(p) == 0) or (isinstance(p, list) and any(len(x) == 0 for x in p
                                                                                       if isinstance(x, (str, list)))):
            raise ValueError("prompt: empty")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks.")
    content: Union[str, list[TextPart], None] = Field(None, description="Text, or a list of text parts.")
    name: Optional[str] = Field(None, max_length=256, description="Speaker name, passed to the template.")
    tool_call_id: Optional[str] = Field(None, description="For role 'tool'.")

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c or [])


class ResponseFormat(_Request):
    type: Literal["text"] = Field(description="Only plain text is supported.")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, rendered by the "
                                                                  "tokenizer's chat template.")
    max_tokens: Optional[int] = Field(None, ge=1, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description=(
        "Tokens per completion at most; default: the server's max_tokens_limit, or what the context "
        "leaves after the prompt if less."))
    logprobs: bool = Field(False, description="Return log-probabilities of the sampled tokens.")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="With logprobs: also the top k tokens at each position.")
    response_format: Optional[ResponseFormat] = Field(None, description="Only {'type': 'text'}.")
    tools: Optional[list[dict]] = Field(None, description="Not supported: must be empty.")
    tool_choice: Optional[Literal["none"]] = Field(None, description="Only 'none'.")
    add_generation_prompt: bool = Field(True, description="Template adds the assistant turn's opening.")

    @model_validator(mode="after")
    def _check(self):
        if self.tools:
            raise ValueError("tools: tool calling is not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens; give one")
        return self

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -------------------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = Field(description="Prompt tokens (each prompt counted once, whatever n is).")
    completion_tokens: int = Field(description="Tokens generated over all choices.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")


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
    root: Optional[str] = Field(None, description="The checkpoint folder, if any.")
    max_model_len: int = Field(description="Longest prompt + completion the model accepts.")
    vocab_size: int = Field(description="Token ids are below this.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
