"""A request as the engine sees it: its sampling parameters, its one growing token list, and
what a caller reads back.

It has a module of its own because three parties share it -- the scheduler queues it, the
engine fills in its sampled tokens, servers and scripts read its outputs -- and none of them
should have to import the others to name it (nano-vllm's ``sequence.py`` plays the same part).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ray_attn.planner import ScheduledRequest
from ray_attn.sampling_params import SamplingParams  # noqa: F401  (importable from here)


PLACEHOLDER = -1  # a token id sampled on the ranks but not yet read back (see LLMEngine.step)


@dataclass
class Request:
    request_id: str
    token_ids: list[int]  # the prompt, then every generated token: one list, grown in place
    num_prompt_tokens: int
    params: SamplingParams
    # Tokens submitted for sampling and not yet read back: the last ``pending`` entries of
    # ``token_ids`` are PLACEHOLDER.  0 or 1 between steps; 2 while async scheduling has step N+1
    # submitted and step N's output not yet applied.
    pending: int = 0
    sampled_row: int = -1  # its row in the last step that samples it
    # Speculative decoding: draft tokens appended to ``token_ids`` (before any PLACEHOLDER) for
    # the step being planned to verify; dropped again once its tokens are read (spec/decoder.py).
    num_drafts: int = 0
    # speculative_config.method='draft_model': how many of its leading tokens the draft model's
    # KV cache holds (spec/draft_inputs.py); 0 again once its blocks are given away.
    num_draft_computed: int = 0
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    # Prompt tokens taken from the prefix cache on its first admission; None until admitted.
    num_cached_tokens: int | None = None
    arrival: float = field(default_factory=time.monotonic)
    # One TokenLogprobs per output token read back, when params.logprobs is set.
    logprobs: list[TokenLogprobs] | None = None
    # With params.prompt_logprobs: one per prompt token read back, the first None (nothing
    # predicts it); and the prompt positions up to which steps were submitted for them (steps
    # run ahead of their answers under async scheduling).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_submitted: int = 1
    # With params.structured_outputs: its GrammarState (ray_attn.structured_output), advanced
    # by each token read back.
    grammar: object | None = None
    # Its adapter (ray_attn.lora.LoRARequest), None for the base model.
    lora_request: object | None = None
    # The same object goes to the planner every step, with the same growing token list: that is
    # what its fast path recognises, and no step copies a request's tokens.
    sched: ScheduledRequest = field(init=False)

    # An int32 copy of token_ids[:_np_len], for the penalties' history: grown by the tokens that
    # came back since the last step instead of converting the whole list every step.
    _np_tokens: np.ndarray = field(init=False, repr=False)
    _np_len: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        wants_prompt = self.params.prompt_logprobs is not None
        self.sched = ScheduledRequest(self.request_id, self.token_ids, None, skip_prefix_cache=wants_prompt)
        if self.lora_request is not None:
            self.sched.cache_root = self.lora_request.cache_root
        if self.params.logprobs is not None:
            self.logprobs = []
        if wants_prompt:
            self.prompt_logprobs = [None]
        self._np_tokens = np.empty(0, np.int32)

    def token_array(self) -> np.ndarray:
        """``all_token_ids`` as int32 (a view, valid until the next call).  The tokens read back
        never change (preemption and recovery only drop the pending ones past them), so only the
        new ones are converted."""
        n = len(self.token_ids) - self.pending
        if n > len(self._np_tokens):
            grown = np.empty(max(n, 2 * len(self._np_tokens), 64), np.int32)
            grown[: self._np_len] = self._np_tokens[: self._np_len]
            self._np_tokens = grown
        if n > self._np_len:
            self._np_tokens[self._np_len: n] = self.token_ids[self._np_len: n]
            self._np_len = n
        return self._np_tokens[:n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids[: len(self.token_ids) - self.pending]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens: len(self.token_ids) - self.pending]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens read back so far."""
        return len(self.token_ids) - self.num_prompt_tokens - self.pending

    @property
    def last_token_in_flight(self) -> bool:
        """Its final token (by max_tokens) is being sampled: nothing more to schedule."""
        return self.pending > 0 and len(self.token_ids) - self.num_prompt_tokens >= self.params.max_tokens

    def append_drafts(self, drafts) -> None:
        """Draft tokens to verify, appended as the tokens the next step computes after the last one."""
        if self.pending or self.num_drafts:
            raise RuntimeError(f"request {self.request_id}: drafts appended with {self.pending} tokens out "
                               f"and {self.num_drafts} drafts already there")
        self.token_ids.extend(int(t) for t in drafts)
        self.num_drafts = len(drafts)

    def drop_drafts(self) -> None:
        """Remove the drafts (they sit just before any placeholders).  ``token_array``'s copy
        forgets them too: the positions they held will hold other tokens."""
        if self.num_drafts:
            end = len(self.token_ids) - self.pending
            del self.token_ids[end - self.num_drafts:end]
            self.num_drafts = 0
            self._np_len = min(self._np_len, len(self.token_ids) - self.pending)

    def drop_pending(self) -> None:
        """Forget what the steps still out would have answered (the ranks died with them)."""
        self.drop_drafts()
        self.num_draft_computed = 0  # the ranks' caches are gone or about to be recomputed
        if self.pending:
            del self.token_ids[-self.pending:]
            self.pending = 0
        if self.prompt_logprobs is not None:
            self.prompt_logprobs_submitted = len(self.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability under the raw model logits (log_softmax before any
    penalty, temperature or filter: vLLM's default ``raw_logprobs``), its rank there (1 = the most
    likely; tokens that tie with it count as better, as in vLLM), and the ``logprobs`` most likely
    tokens as (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """A request's state.  From ``step()``: ``new_token_ids`` is what this step made, and the
    prompt and full output are filled only on the step the request finishes (copying them every
    step would cost O(length) per request).  ``output(id)`` always fills them.  The logprobs
    follow the same rule, aligned with ``new_token_ids`` and ``output_token_ids``; they are None
    for a request that did not ask (``SamplingParams.logprobs`` None)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens that were prefix-cache hits (vLLM's name)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None, on the
    # request's first output with a token (and every ``output(id)``); else None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
