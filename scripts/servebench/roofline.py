"""A lower bound on how long a serving workload must take, from its own token counts and the
device's measured rates: the engine's roofline for that workload.

Everything is per rank, for rank 0 (which also computes the logits): under tensor parallelism each
rank holds 1/tp of every layer's matmuls and KV heads (a KV head replicated when there are fewer
than ranks) and the whole LM head.

    prefill_s = prefill FLOPs / G
        prefill FLOPs = sum over prompt tokens that must be computed of
                        2 * layer params + 4 * heads * head_size * layers * (position + 1)
                        (the matmuls, then QK^T and PV over the causal context),
                      + 2 * vocab * hidden per request (the first token's logits)
        "must be computed": all of a prompt but the full blocks an earlier prompt of the workload
        already holds (a prefix cache that never evicts); the last token is always computed.
    decode_s  = max(S * W / C, decode tokens * 2 * (layer params + vocab * hidden) / G)
                + sum over decode tokens of context * K / C
        S = max(ceil(decode tokens / B), longest output - 1): decode steps at the largest batch
            B the workload allows (max_num_seqs, its prompt count, its concurrency limit, and the
            requests the KV cache holds at their full length), and never fewer than the longest
            request's own sequential steps.
        W = weight bytes read per step (layers + LM head + norms; the embedding is a gather of
            one row a token, not read whole);  K = KV bytes per token of context;
        a decode token j (1-based, after a prompt of p) reads p + j tokens of KV.
    work_s    = prefill_s + decode_s
    roofline_s = max(work_s, arrival bound)  for a workload sent at a finite rate: the last
        request arrives at n / rate (vLLM's schedule) and then needs at least its own prefill
        and its decode steps at batch 1.

C is the device-to-device copy rate (bytes read + written per second, as ``benchlib`` measures
it), G the dense GEMM rate at the model's own shapes (8192-token rows).  The bound is loose where
prefill and decode share a step -- a mixed step reads the weights once for both -- so it
counts the decode steps' weight reads in full; it is the brief's model and conservative in the
engine's favour only by that.  ``achieved / roofline`` is reported as ``roofline_s / duration``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


@dataclass(frozen=True)
class ModelCosts:
    """What one rank (rank 0) computes and reads, per token and per step."""

    layer_params: int  # matmul weights one token goes through, every layer, this rank's share
    lm_head_params: int  # vocab * hidden (replicated)
    weight_bytes: int  # read by a batch-1 decode step: layers (its token's experts), LM head, norms
    kv_bytes_per_token: int  # K and V of one token, every layer, this rank's heads
    attn_flops_per_pair: int  # QK^T + PV for one (query, key) pair over every layer
    # MoE: one expert of every sparse layer (this rank's slice), the routed experts, the top k
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0

    def experts_hit(self, batch: int) -> float:
        """Distinct experts per sparse layer a step of ``batch`` tokens reads, expected under
        uniform routing: E (1 - (1 - k/E)^batch); k at batch 1, all E for a large batch."""
        if not self.num_experts:
            return 0.0
        E, k = self.num_experts, self.top_k
        return E * (1.0 - (1.0 - k / E) ** max(batch, 1))

    def step_weight_bytes(self, batch: int = 1) -> float:
        """Weights a decode step of ``batch`` tokens reads: the batch-1 step's plus the experts
        the other tokens add (the union of experts hit); a dense model reads the same at any batch."""
        return self.weight_bytes + self.expert_bytes * (self.experts_hit(batch) - self.top_k)

    @classmethod
    def from_config(cls, m, tp: int = 1, kv_cache_dtype: str = "auto") -> "ModelCosts":
        """``m``: a ``ModelConfig``."""
        if tp < 1 or m.num_attention_heads % tp:
            raise ValueError(f"tp must divide num_attention_heads={m.num_attention_heads}, got {tp}")
        h, i, L, D = m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.head_size
        heads = m.num_attention_heads // tp
        kv_heads = max(m.num_key_value_heads // tp, 1)
        mlp = (2 if m.architecture == "MPTForCausalLM" else 3) * h * (i // tp)  # gated: gate, up, down
        attn = h * (heads + 2 * kv_heads) * D + heads * D * h
        sparse = len(getattr(m, "moe_layer_ids", ()))
        E, k, expert = 0, 0, 0
        moe = 0
        if sparse:  # a sparse layer: the router (replicated), k experts and the shared expert per token
            E, k = m.num_local_experts, m.num_experts_per_tok
            expert = 3 * h * (m.expert_intermediate_size // tp)
            moe = h * E + k * expert + 3 * h * ((m.shared_expert_intermediate_size or 0) // tp)
        layers = L * attn + (L - sparse) * mlp + sparse * moe
        el = _dtype_bytes(m.dtype)
        kv_el = 1 if kv_cache_dtype.startswith("fp8") else el
        linear_bytes = layers * el
        if getattr(m, "quantization", None):
            # FP8 weights: the decoder's linears are a byte a weight plus a float32 scale per output
            # row (dense models only: MoE families are refused with FP8); the embedding, the LM head
            # and the norms stay in the model dtype
            up = 1 if m.architecture == "MPTForCausalLM" else 2
            rows = L * ((heads + 2 * kv_heads) * D + h) + (L - sparse) * (up * (i // tp) + h)
            linear_bytes = layers + 4 * rows
        norms = (2 * L + 1) * h + (2 * D * L if m.architecture.startswith("Qwen3") else 0)  # + Qwen3's q/k norms
        return cls(layer_params=layers, lm_head_params=m.vocab_size * h,
                   weight_bytes=linear_bytes + (m.vocab_size * h + norms) * el,
                   kv_bytes_per_token=2 * L * kv_heads * D * kv_el,
                   attn_flops_per_pair=4 * heads * D * L,
                   expert_bytes=sparse * expert * el, num_experts=E, top_k=k)

    def as_dict(self) -> dict:
        return asdict(self)


def gemm_shapes(m, tp: int = 1, tokens: int = 8192) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of one layer's matmuls on one rank for a ``tokens``-row step."""
    h, D = m.hidden_size, m.head_size
    heads, kv_heads = m.num_attention_heads // tp, max(m.num_key_value_heads // tp, 1)
    i = m.intermediate_size // tp
    up = 1 if m.architecture == "MPTForCausalLM" else 2
    shapes = [("qkv_proj", tokens, h, (heads + 2 * kv_heads) * D), ("o_proj", tokens, heads * D, h)]
    sparse = len(getattr(m, "moe_layer_ids", ()))
    if sparse < m.num_hidden_layers:
        shapes += [("gate_up_proj", tokens, h, up * i), ("down_proj", tokens, i, h)]
    if sparse:  # one expert's GEMMs at its share of the rows under uniform routing
        ie, rows = m.expert_intermediate_size // tp, max(1, tokens * m.num_experts_per_tok // m.num_local_experts)
        shapes += [("experts.gate_up_proj", rows, h, 2 * ie), ("experts.down_proj", rows, ie, h)]
    return shapes


def computed_starts(prompts: list[list[int]], block_size: int) -> list[int]:
    """Per prompt, how many leading tokens a never-evicting prefix cache already holds when it
    arrives (in order): whole blocks whose chain of block contents an earlier prompt had."""
    seen: set[bytes] = set()
    starts = []
    for p in prompts:
        h = hashlib.blake2b(digest_size=16)
        hit, alive = 0, True
        for b in range(len(p) // block_size):
            h.update(repr(p[b * block_size:(b + 1) * block_size]).encode())
            key = h.copy().digest()
            if alive and key in seen:
                hit = (b + 1) * block_size
            else:
                alive = False
            seen.add(key)
        starts.append(min(hit, len(p) - 1))  # the last prompt token is always computed
    return starts


def prefill_flops(c: ModelCosts, prompt_len: int, start: int = 0) -> float:
    """FLOPs to compute a prompt's tokens [start, prompt_len) and its first token's logits."""
    if not 0 <= start < prompt_len:
        raise ValueError(f"need 0 <= start < prompt_len, got start={start}, prompt_len={prompt_len}")
    n, s = prompt_len, start
    pairs = (n * (n + 1) - s * (s + 1)) // 2  # sum of (position + 1) over the computed positions
    return 2.0 * c.layer_params * (n - s) + c.attn_flops_per_pair * pairs + 2.0 * c.lm_head_params


def decode_kv_tokens(prompt_len: int, output_len: int) -> int:
    """KV tokens read by a request's decode tokens: token j reads prompt_len + j, j < output_len."""
    k = output_len - 1
    return k * prompt_len + k * (k + 1) // 2


def batch1_decode_s(c: ModelCosts, copy_Bps: float, prompt_len: int, output_len: int) -> float:
    """A request's decode steps alone: weights and its own KV each step."""
    return ((output_len - 1) * c.weight_bytes + decode_kv_tokens(prompt_len, output_len)
            * c.kv_bytes_per_token) / copy_Bps


def itl_roofline_s(c: ModelCosts, copy_Bps: float, prompt_len: int, output_len: int) -> float:
    """The mean decode step at batch 1 (what ITL at concurrency 1 is bounded by)."""
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 for a decode step, got {output_len}")
    return batch1_decode_s(c, copy_Bps, prompt_len, output_len) / (output_len - 1)


def workload_roofline(c: ModelCosts, copy_Bps: float, gemm_flops: float, prompt_lens: list[int],
                      output_lens: list[int], starts: list[int] | None = None, max_batch: int = 1,
                      last_arrival_s: float = 0.0) -> dict:
    """The bound of the module docstring, with its parts (seconds, tokens, FLOPs)."""
    n = len(prompt_lens)
    if n == 0 or len(output_lens) != n or (starts is not None and len(starts) != n):
        raise ValueError(f"need as many output lengths (and starts) as prompts, got {n}, "
                         f"{len(output_lens)}, {None if starts is None else len(starts)}")
    if copy_Bps <= 0 or gemm_flops <= 0 or max_batch < 1:
        raise ValueError(f"copy_Bps, gemm_flops must be > 0 and max_batch >= 1, got {copy_Bps}, "
                         f"{gemm_flops}, {max_batch}")
    starts = starts or [0] * n
    pf = sum(prefill_flops(c, p, s) for p, s in zip(prompt_lens, starts))
    prefill_s = pf / gemm_flops
    dec_tokens = sum(o - 1 for o in output_lens)
    steps = max(math.ceil(dec_tokens / max_batch), max(output_lens) - 1) if dec_tokens else 0
    weight_s = steps * c.step_weight_bytes(min(max_batch, n)) / copy_Bps
    compute_s = dec_tokens * 2.0 * (c.layer_params + c.lm_head_params) / gemm_flops
    kv_s = sum(decode_kv_tokens(p, o) for p, o in zip(prompt_lens, output_lens)) * c.kv_bytes_per_token / copy_Bps
    decode_s = max(weight_s, compute_s) + kv_s
    work_s = prefill_s + decode_s
    p_last, o_last, s_last = prompt_lens[-1], output_lens[-1], starts[-1]
    arrival_s = (last_arrival_s + prefill_flops(c, p_last, s_last) / gemm_flops
                 + batch1_decode_s(c, copy_Bps, p_last, o_last)) if last_arrival_s > 0 else 0.0
    roof = max(work_s, arrival_s)
    return dict(roofline_s=roof, work_s=work_s, arrival_bound_s=arrival_s, prefill_s=prefill_s,
                prefill_flops=pf, prefill_tokens=sum(p - s for p, s in zip(prompt_lens, starts)),
                decode_s=decode_s, decode_weight_s=weight_s, decode_compute_s=compute_s,
                decode_kv_s=kv_s, decode_tokens=dec_tokens, decode_steps=steps, max_batch=max_batch,
                roofline_request_throughput=n / roof,
                roofline_output_throughput=sum(output_lens) / roof)
