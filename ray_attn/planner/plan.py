"""What the planner hands to the engine and, through one object ref, to every worker.

The lengths of one request in a step, as the builder names them (vLLM's ``flash_attn.py`` draws
the same); here block_size 4, 6 tokens already in the cache and 3 computed this step::

    token position     0   1   2   3   4   5   6   7   8   9   10  11
    block_table[r]    |--- column 0 --|--- column 1 --|--- column 2 --|
                      |----- computed = 6 ----|
                                              |-- q = 3 --|
                      |------------- seq = 9 -------------|

    computed  num_computed_tokens[r]: tokens whose KV is in the cache before the step (vLLM's
              context length); for a new request, its prefix-cache hit (whole blocks), which
              may take blocks an earlier row of the same step computes: every layer writes the
              step's K/V into the cache before it attends.
    q         query_lens[r] = qsl[r + 1] - qsl[r]: r's tokens this step, at positions
              computed .. seq - 1 (``positions``); their ids are token_ids[computed:seq].
    seq       seq_lens[r] = computed + q: r's KV length once the step ran.
    qsl       query_start_loc [B + 1] = 0, q[0], q[0] + q[1], ...: r's tokens are entries
              qsl[r] .. qsl[r + 1] - 1 of the per-token arrays (input_token_ids, positions,
              slot_mapping), request after request; logits_indices[r] = qsl[r + 1] - 1.
    columns   position p lives in block table column p // block_size; row r uses its first
              num_blocks[r] >= ceil(seq / block_size) columns (here 3, the last one not full).
    slots     slot_mapping[qsl[r] + i] = block_table[r, p // block_size] * block_size
              + p % block_size for p = computed + i: where the step writes that token's KV
              (-1 for padding: not written).

Cascade splits ``seq`` at the group's shared prefix of P whole blocks, P * block_size <= computed:
prefix_kv_lens[g] = P * block_size and suffix_kv_lens[r] = seq - P * block_size.  Chunked local
attention splits it at multiples of the chunk size (virtual batches, local.py).  Once the plan is
built the planner counts ``seq`` as computed (``Planner._commit_step``): r's next step starts at
position 9, in column 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from ray_attn.metadata import FlashAttentionMetadata

from .block_pool import ROOT_HASH


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
    # Take no prefix-cache hits when admitted (vLLM's skip_reading_prefix_cache): a request that
    # needs every prompt position's logits.  Its own blocks are still cached for the others.
    skip_prefix_cache: bool = False
    # Speculative decoding: the last ``num_draft_tokens`` of the scheduled tokens are drafts that the
    # step verifies.  Their blocks are never indexed for the prefix cache (nor offered as hits to
    # the step's other rows): a rejected draft's KV is overwritten later, under the same block.
    # The engine then sets the request back to its accepted length (``Planner.rollback``).
    num_draft_tokens: int = 0
    # Multi-LoRA: the device slot of the request's adapter (-1: the base model), read when the
    # request is admitted and carried by every plan row (``StepPlan.lora_slots``); and the root of
    # its prefix-cache hash chains (``LoRARequest.cache_root``), so that KV computed under one
    # adapter is never a hit for another.
    lora_slot: int = -1
    cache_root: int = ROOT_HASH


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
    kv_transfers: object = None  # planner.tiers.KVTransfers: copies between KV tiers before the forward
    lora_slots: np.ndarray | None = None  # [B] int32 each row's adapter slot (-1 base); None: no adapter

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
