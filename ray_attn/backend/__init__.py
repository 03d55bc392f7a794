"""Executor side: the FlashAttention backend one worker runs over its KV-cache shard."""

from ray_attn.backend.flash_attn import (AttentionLayer, AttentionType, FlashAttentionBackend,
                                         FlashAttentionImpl, cascade_attention)
from ray_attn.backend.kernels import LayerKernelSpec, select_kernel, unsupported_reason
from ray_attn.backend.merge import merge_attn_states
from ray_attn.metadata import FlashAttentionMetadata, LocalAttentionMetadata

__all__ = ["AttentionLayer", "AttentionType", "FlashAttentionBackend", "FlashAttentionImpl",
           "FlashAttentionMetadata", "LocalAttentionMetadata", "LayerKernelSpec",
           "cascade_attention", "merge_attn_states", "select_kernel", "unsupported_reason"]
