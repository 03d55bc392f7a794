"""A request as the engine sees it: its sampling parameters, its one growing token list, and
what a caller reads back.

It has a module of its own because three parties share it -- the scheduler queues it, the
engine fills in its sampled tokens, servers and scripts read its outputs -- and none of them
should have to import the others to name it (nano-vllm's ``sequence.py`` plays the same part).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ray_attn.planner import ScheduledRequest


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            # the seed travels as an int64 to the ranks; a larger one would fail mid-step
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")


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
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # The same object goes to the planner every step, with the same growing token list: that is
    # what its fast path recognises, and no step copies a request's tokens.
    sched: ScheduledRequest = field(init=False)

    def __post_init__(self):
        self.sched = ScheduledRequest(self.request_id, self.token_ids, None)

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

    def drop_pending(self) -> None:
        if self.pending:
            del self.token_ids[-self.pending:]
            self.pending = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state.  From ``step()``: ``new_token_ids`` is what this step made, and the
    prompt and full output are filled only on the step the request finishes (copying them every
    step would cost O(length) per request).  ``output(id)`` always fills them."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
