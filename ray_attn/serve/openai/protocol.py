"""The OpenAI request bodies the Serve app speaks (``/v1/completions``, ``/v1/chat/completions``),
with vLLM's extra sampling fields; the responses are in ``responses.py``.

Every field of OpenAI's own request schemas is declared here: honoured, or accepted and ignored
where ignoring it cannot change the answer (``store``, ``metadata``, ``service_tier``,
``prediction``...: what vLLM does too), or refused by name at a value we cannot honour (audio
output, ``suffix``, the deprecated ``functions``).  The SDKs and agent frameworks send these fields unasked, so
refusing them as unknown would break ordinary clients.

A field nobody defines is kept aside (``extra="allow"``) for ``serving.parse``: logged and
ignored, as vLLM does, or a 400 naming it when the app sets ``strict_request_fields``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's own limit on top_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries; each is one (row, id) on the device
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias in [-100, 100]


class _Request(BaseModel):
    # strict: "2" is not an int and 1 is not a bool (JSON ints still fill float fields)
    model_config = ConfigDict(extra="allow", strict=True)


def unknown_fields(obj: Any, path: str = "") -> list[tuple[str, type]]:
    """The fields of ``obj`` (and of the request models inside it) that no model declares, as
    (path, the model that lacks it): ``stream_options.foo``, ``messages[1].bar``."""
    out: list[tuple[str, type]] = []
    if isinstance(obj, BaseModel):
        out += [(f"{path}.{k}" if path else k, type(obj)) for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            out += unknown_fields(getattr(obj, name), f"{path}.{name}" if path else name)
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            if isinstance(x, BaseModel):
                out += unknown_fields(x, f"{path}[{i}]")
    return out


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices) "
                                                   "before [DONE].")
    continuous_usage_stats: bool = Field(False, description="vLLM: `usage` on every chunk.")
    include_obfuscation: Optional[bool] = Field(None, description="Accepted and ignored (OpenAI pads "
                                                                  "chunks against side channels).")


class JsonSchemaFormat(_Request):
    name: str = Field("response", max_length=64, description="The schema's name (OpenAI's).")
    description: Optional[str] = Field(None, description="Accepted and ignored.")
    schema_: Union[dict, bool, None] = Field(None, alias="schema", description="The JSON schema the output matches.")
    strict: Optional[bool] = Field(None, description="Accepted: the output always matches the schema.")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: unconstrained; json_object: any JSON object; json_schema: the schema given.")
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="With type json_schema.")


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: Union[dict, bool, str, None] = Field(None, alias="json", description="A JSON schema.")
    json_object: Optional[bool] = Field(None, description="Any JSON object.")
    regex: Optional[str] = Field(None, max_length=4096, description="A regular expression the whole output matches.")
    choice: Optional[list[str]] = Field(None, max_length=256, description="The output is one of these strings.")
    grammar: Optional[str] = Field(None, max_length=65536, description="An EBNF grammar (xgrammar's GBNF).")


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
    logit_bias: Optional[dict[str, float]] = Field(None, description=(
        f"Token id (as a string) -> bias in [-100, 100] added to its logit before sampling; at most "
        f"{MAX_LOGIT_BIAS} entries. -100 bans a token, +100 all but forces it."))
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
    response_format: Optional[ResponseFormat] = Field(None, description="json_object or json_schema "
                                                      "constrain the output (structured outputs).")
    structured_outputs: Optional[StructuredOutputsField] = Field(None, description="vLLM's structured outputs.")
    guided_json: Union[dict, bool, str, None] = Field(None, description="vLLM's older name of structured_outputs.json.")
    guided_regex: Optional[str] = Field(None, max_length=4096, description="vLLM's older structured_outputs.regex.")
    guided_choice: Optional[list[str]] = Field(None, max_length=256, description="vLLM's older structured_outputs.choice.")
    guided_grammar: Optional[str] = Field(None, max_length=65536, description="vLLM's older structured_outputs.grammar.")
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "vLLM: each prompt token's log-probability given the tokens before it, with the top "
        "`prompt_logprobs` there (the first token has none). Not with stream=true."))

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true (as in vLLM); use echo "
                             "with logprobs on /v1/completions")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: {len(self.logit_bias)} entries exceeds the limit of "
                                 f"{MAX_LOGIT_BIAS}")
            for k, v in self.logit_bias.items():
                if not (k.isascii() and k.isdigit() and len(k) <= 10):
                    raise ValueError(f"logit_bias: key {k[:32]!r} is not a token id")
                if not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:  # NaN fails this too
                    raise ValueError(f"logit_bias: bias {v} of token {k} is outside [-100, 100]")
        if self.top_k == -1:
            self.top_k = 0
        return self

    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, sorted by id (ids checked against the vocabulary by the server)."""
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        description="Text, token ids, or a list of either (one completion set per prompt).")
    max_tokens: Optional[int] = Field(16, ge=0, description="Tokens per completion at most (default 16); "
                                                            "0 only with echo: the prompt alone.")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "Return the log-probability of each sampled token and of the top `logprobs` tokens "
        "(log-softmax of the raw model logits); with echo, of each prompt token too."))
    echo: bool = Field(False, description="Return the prompt before the completion (and, with logprobs, "
                                          "the prompt tokens' logprobs, the first null): lm-eval's "
                                          "loglikelihood requests.")
    best_of: Optional[int] = Field(None, ge=1, description="Only best_of == n is supported.")
    suffix: Optional[str] = Field(None, description="Not supported: must be null.")

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo=true")
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


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$", description="The function's name.")
    description: Optional[str] = Field(None, description="Shown to the model through the chat template.")
    parameters: Optional[dict] = Field(None, description="The arguments' JSON schema.")
    strict: Optional[bool] = Field(None, description="Accepted: forced calls always match the schema.")


class ToolDef(_Request):
    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDef


class NamedFunction(_Request):
    name: str = Field(description="One of the request's tools.")


class NamedToolChoice(_Request):
    type: Literal["function"] = Field(description="Force a call of this function.")
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="Who speaks ('function': OpenAI's deprecated tool role).")
    content: Union[str, list[TextPart], None] = Field(None, description="Text, or a list of text parts.")
    name: Optional[str] = Field(None, max_length=256, description="Speaker name, passed to the template.")
    tool_call_id: Optional[str] = Field(None, description="For role 'tool'; passed to the template.")
    tool_calls: Optional[list[dict]] = Field(None, description="An earlier assistant turn's tool calls; "
                                                               "passed to the template.")
    function_call: Optional[dict] = Field(None, description="Deprecated form of tool_calls; ignored.")
    refusal: Optional[str] = Field(None, description="An earlier assistant refusal; ignored.")
    audio: Optional[dict] = Field(None, description="An earlier audio answer's id; ignored.")

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c or [])



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
    tools: Optional[list[ToolDef]] = Field(None, max_length=128, description=(
        "Functions the model may call, rendered by the chat template."))
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="none; auto (the default with tools: the app's tool_call_parser reads calls "
                          "out of the text); required or a named function (forced: the call always parses).")
    functions: Optional[list[dict]] = Field(None, description="Deprecated tools: must be empty.")
    function_call: Union[Literal["none", "auto"], dict, None] = Field(None, description="Deprecated "
                                                                                        "tool_choice.")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call with "
                                                                  "tool_choice required.")
    modalities: Optional[list[Literal["text", "audio"]]] = Field(None, description="Only ['text'].")
    audio: Optional[dict] = Field(None, description="Audio output settings; ignored (text only).")
    prediction: Optional[dict] = Field(None, description="Predicted output, a latency hint; ignored "
                                                         "(the answer is the same without it).")
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = Field(
        None, description="Accepted and ignored (the model has no reasoning budget).")
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(None, description="Accepted and ignored.")
    web_search_options: Optional[dict] = Field(None, description="Accepted and ignored (no web search).")
    store: Optional[bool] = Field(None, description="Accepted and ignored: nothing is stored.")
    metadata: Optional[dict[str, str]] = Field(None, description="Accepted and ignored (for store).")
    service_tier: Optional[str] = Field(None, max_length=64, description="Accepted and ignored: one tier.")
    prompt_cache_key: Optional[str] = Field(None, description="Accepted and ignored: prefix caching is "
                                                              "automatic.")
    safety_identifier: Optional[str] = Field(None, max_length=256, description="Accepted and ignored.")
    add_generation_prompt: bool = Field(True, description="Template adds the assistant turn's opening.")

    @model_validator(mode="after")
    def _check(self):
        if self.functions:
            raise ValueError("functions: deprecated by OpenAI and not served; use tools")
        if isinstance(self.function_call, dict):
            raise ValueError("function_call: deprecated by OpenAI and not served; use tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        tc = self.tool_choice
        if (tc == "required" or isinstance(tc, NamedToolChoice)) and not names:
            raise ValueError("tool_choice: forcing a call needs tools")
        if isinstance(tc, NamedToolChoice) and tc.function.name not in names:
            raise ValueError(f"tool_choice: function {tc.function.name[:64]!r} is not among the tools")
        if self.modalities and "audio" in self.modalities:
            raise ValueError("modalities: only text output is supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens; give one")
        return self

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self):
        """None (no tools, or tool_choice none), "auto", "required", or the NamedToolChoice."""
        if not self.tools or self.tool_choice == "none":
            return None
        return self.tool_choice or "auto"

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
