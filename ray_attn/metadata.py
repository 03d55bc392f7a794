"""The attention metadata of one step: built once on the driver, read by every layer on every rank.

The planner fills these dataclasses with int32 numpy arrays (no torch on the driver); the worker
calls :meth:`FlashAttentionMetadata.to_device` once per step and every layer then reads the same
device tensors.  Field names follow vLLM v1's ``FlashAttentionMetadata`` so that vLLM users can map
one onto the other; the cascade fields are generalised to several prefix groups (see
docs/architecture.md, "Multi-group cascade"): with one group they mean exactly what vLLM's do.  How
the lengths relate (``query_start_loc``, ``seq_lens``, the block table, ``slot_mapping``): the
diagram in ray_attn/planner/plan.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class LocalAttentionMetadata:
    """Chunked-local attention as virtual batches (see ``make_local_attention_virtual_batches``)."""

    local_query_start_loc: Any  # [num_virtual + 1]
    local_seqused_k: Any  # [num_virtual]
    local_block_table: Any  # [num_virtual, pages_per_chunk]
    local_max_query_len: int
    local_max_seq_len: int


@dataclass
class FlashAttentionMetadata:
    """Everything a layer needs to run one step of paged attention.

    Arrays are ``np.ndarray`` (int32) on the driver and ``torch.Tensor`` on the worker.
    """

    num_actual_tokens: int  # tokens in the batch, excluding padding
    max_query_len: int
    query_start_loc: Any  # [B + 1] cumulative query lengths
    max_seq_len: int
    seq_lens: Any  # [B] kv length of each request after this step's tokens are written
    block_table: Any  # [B, max_blocks]; entries past a request's blocks are ignored
    slot_mapping: Any  # [num_tokens] flat cache slot per token (int32 or int64); < 0 = do not write

    # Cascade attention.  Tokens are ordered so that each prefix group is contiguous.
    use_cascade: bool = False
    common_prefix_len: int = 0  # longest group prefix (a multiple of block_size)
    cu_prefix_query_lens: Any = None  # [G + 1] query tokens of each group
    prefix_kv_lens: Any = None  # [G] shared-prefix length of each group
    prefix_block_table: Any = None  # [G, max_prefix_blocks]
    suffix_kv_lens: Any = None  # [B] seq_len minus the request's group prefix
    suffix_block_table: Any = None  # [B, max_suffix_blocks] the blocks after the group prefix
    max_suffix_kv_len: int = 0

    # Chunked local attention (Llama 4 iRoPE layers); None when no layer needs it.
    local_attn_metadata: LocalAttentionMetadata | None = None

    # Kernel-specific, ahead-of-time scheduling data (FlashAttention 3); filled on the worker.
    scheduler_metadata: Any = None
    prefix_scheduler_metadata: Any = None
    suffix_scheduler_metadata: Any = None
    # FlashAttention 3's KV split count for the plain (non-cascade) pass; 0 = its heuristic.
    # Decode graphs set it (see runtime/cuda_graphs.py: decode_num_splits).
    num_splits: int = 0
    # Set once the array values were checked on the host (ray_attn.backend.validate): the worker
    # checks its numpy plan before the device copy, so no layer has to read device values back.
    host_checked: bool = False

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def to_device(self, device, non_blocking: bool = True, put=None) -> "FlashAttentionMetadata":
        """Every array field as an int32 torch tensor on ``device`` (zero-copy on CPU); an int64
        ``slot_mapping`` (vLLM's) stays int64, which the cache write reads as it is.

        ``put(name, array) -> tensor`` lets the worker stage the arrays in its persistent buffers
        (``ray_attn.runtime.buffers.StepBuffers``) instead of allocating fresh ones each step."""
        if put is None:
            return _map_arrays(self, lambda name, a: _to_tensor(a, device, non_blocking, _dtype(name, a)))
        return _map_arrays(self, put)


def _dtype(name: str, a: np.ndarray):
    return np.int64 if name == "slot_mapping" and a.dtype == np.int64 else np.int32


def _to_tensor(a: np.ndarray, device, non_blocking: bool, dtype=np.int32):
    import torch

    a = np.ascontiguousarray(a, dtype=dtype)
    if not a.flags.writeable:  # Ray hands over zero-copy read-only buffers; torch wants writable
        a = a.copy()
    t = torch.from_numpy(a)
    if torch.device(device).type == "cpu":
        return t
    if non_blocking:
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


def _map_arrays(obj, fn, prefix: str = ""):
    """A copy of dataclass ``obj`` with each array ``a`` at field path ``name`` replaced by
    ``fn(name, a)``, nested dataclasses included."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, np.ndarray):
            changes[f.name] = fn(prefix + f.name, v)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _map_arrays(v, fn, prefix + f.name + ".")
    return dataclasses.replace(obj, **changes)
