"""Merging two partial attention states, FlashInfer's "state = (output, LSE)" algebra.

Attention over keys A ∪ B equals the LSE-weighted mix of attention over A and over B:
``o = (e^lse_a · o_a + e^lse_b · o_b) / (e^lse_a + e^lse_b)``.  This is what lets cascade attention
compute a shared prefix once and each request's suffix separately.
"""

from __future__ import annotations

import torch


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
) -> None:
    """Write the merge of two states into ``output`` [T, H, D]; LSEs are [H, T].

    A state whose LSE is +inf or -inf carries no keys (FlashAttention reports an empty row either
    way), so it gets weight zero; two empty states give a zero output. An empty prefix gives the
    suffix's values exactly, whatever the prefix output holds.
    """
    if output.is_cuda and output_lse is None and output.dtype != torch.float64:
        from ray_attn.backend import triton_ops

        if triton_ops.available() and output.is_contiguous():
            triton_ops.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)
            return
    merge_attn_states_torch(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)


def merge_attn_states_torch(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                            output_lse=None) -> None:
    """The same merge in plain torch ops (CPU, float64 and the LSE output)."""
    acc = torch.promote_types(output.dtype, torch.float32)  # float64 stays float64 (the oracle)
    p_lse = prefix_lse.to(acc)
    s_lse = suffix_lse.to(acc)
    p_lse = torch.where(p_lse == float("inf"), float("-inf"), p_lse)
    s_lse = torch.where(s_lse == float("inf"), float("-inf"), s_lse)
    max_lse = torch.maximum(p_lse, s_lse)
    max_lse = torch.where(max_lse.isinf(), 0.0, max_lse)
    p_w = torch.exp(p_lse - max_lse)
    s_w = torch.exp(s_lse - max_lse)
    total = p_w + s_w
    safe_total = torch.where(total == 0, 1.0, total)
    p_scale = (p_w / safe_total).t().unsqueeze(-1)  # [T, H, 1]
    s_scale = (s_w / safe_total).t().unsqueeze(-1)
    merged = prefix_output.to(acc) * p_scale + suffix_output.to(acc) * s_scale
    # an empty prefix gives the suffix's own values (as the Triton merge does)
    only_suffix = (p_lse == float("-inf")) & (s_lse != float("-inf"))
    merged = torch.where(only_suffix.t().unsqueeze(-1), suffix_output.to(acc), merged)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.where(total == 0, float("-inf"), torch.log(safe_total) + max_lse))
