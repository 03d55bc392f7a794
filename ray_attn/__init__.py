"""ray_attn: vLLM-style paged FlashAttention served across GPUs with Ray."""

__version__ = "0.1.0"
