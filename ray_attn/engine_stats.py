"""What ``LLMEngine`` records of its steps: the counters it reports (``EngineStats``), the step
still out with the ranks (``SubmittedStep``), and the error it raises once it has stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_attn.request import Request


class EngineDeadError(RuntimeError):
    """The ranks kept failing; the engine ended its requests and accepts no more."""


@dataclass
class SubmittedStep:
    """A step handed to the ranks whose tokens the engine has not applied yet."""

    step_id: int
    reqs: list[Request]
    samples: list[bool]  # per row: whether it samples (a prompt's last chunk, or a decode)
    num_tokens: int
    local: bool
    cascade_groups: int  # prefix groups of a cascade step; 0 when it did not cascade
    # (request, first prompt position, count) per row that computes prompt logprobs, in the
    # order of the step's PromptLogprobsInputs
    prompt_spans: list = None


@dataclass
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    tokens_computed: int = 0
    cascade_steps: int = 0
    multi_group_cascade_steps: int = 0
    local_steps: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    recoveries: int = 0
    last_recovery_s: float | None = None
    busy_s: float = 0.0
    kv_copy_s: float = 0.0  # rank 0's time copying between KV tiers (planner/tiers.py)
    # speculative decoding (ray_attn/spec/decoder.py, vLLM's SpecDecodingStats): rows that
    # speculated in a step, draft tokens, accepted ones (in all and by draft position), and
    # 1 + accepted / drafts
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list = field(default_factory=list)
    spec_mean_acceptance_length: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)
