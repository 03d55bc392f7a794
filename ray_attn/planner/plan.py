"""What the planner hands to the engine and, through one object ref, to every worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from ray_attn.metadata import FlashAttentionMetadata


@dataclass(eq=False, slots=True)  # identity equality: the planner spots a repeated batch cheaply
class ScheduledRequest:
    """One request the engine schedules this step.

    ``token_ids`` holds every token so far (prompt + generated); the tokens computed this step are
    ``token_ids[num_computed : num_computed + num_new_tokens]`` where ``num_computed`` is what the
    planner already holds in cache.  ``num_new_tokens=None`` means "all the rest".

    ``token_ids`` only ever grows: tokens already computed must not change (the planner keeps a
    reference to hash the request's full blocks when it is freed).  ``req_id`` must not change on
    an object the engine schedules again.
    """

    req_id: Hashable
    token_ids: Sequence[int] | np.ndarray
    num_new_tokens: int | None = None


@dataclass
class StepPlan:
    """One step: the batch order, the attention metadata and the model inputs (int32 numpy).

    Arrays over tokens (``input_token_ids``, ``positions``, ``attn.slot_mapping``) have
    ``num_tokens >= attn.num_actual_tokens`` entries; the padding (when the planner pads to a token
    bucket) has token 0, position 0 and slot -1.
    """

    req_ids: list  # batch order; run and sample in this order, map results back by id
    attn: FlashAttentionMetadata
    input_token_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens] index of each token in its request (RoPE)
    logits_indices: np.ndarray  # [B] each request's last scheduled token
    num_computed_tokens: np.ndarray  # [B] tokens in cache before this step (after prefix hits)
    cascade_reason: str = ""
    num_cascade_groups: int = 0
    cascade_group_ids: np.ndarray | None = None  # [B] group of each request when cascading
    num_prefix_cache_hit_tokens: int = 0  # tokens new requests took from the prefix cache
    num_new_blocks: int = 0  # blocks allocated for this step

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.attn.query_start_loc)

    def completes_prompt(self, token_counts: np.ndarray) -> np.ndarray:
        """Whether each request reaches its last token this step, given its ``len(token_ids)``
        (chunked prefill steps must not sample)."""
        return self.num_computed_tokens + self.query_lens >= np.asarray(token_counts)
