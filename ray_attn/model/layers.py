"""Decoder building blocks; the parallel linears keep only this rank's slice of each weight.

Every parameter is described by a :class:`Shard`: which full (checkpoint-shaped) tensor it is cut
from, along which dim and where.  Loading a checkpoint and seeded random init both go through it,
so any TP size computes the same function from the same full weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ray_attn.model.fused import apply_rope, rms_norm, silu_mul
from ray_attn.model.gemv import linear
from ray_attn.model.tp import TPGroup


# How the seeded random model draws a full tensor (``weights.random_full_tensor``): a matrix
# scaled by 1/sqrt(fan_in), the same stored input-major (fan_in is dim -2: Llama 4's stacked
# expert tensors), the embedding, a norm weight near 1, a norm weight near 0 for norms that scale
# by ``1 + weight`` (Gemma), or a projection bias.
Init = Literal["matrix", "matrix_t", "embedding", "norm", "norm_offset", "bias"]


@dataclass
class Shard:
    dest: torch.Tensor  # this rank's piece (a view into the parameter)
    full_shape: tuple[int, ...]  # the checkpoint tensor's shape
    dim: int = 0
    start: int = 0
    init: Init = "matrix"

    def index(self) -> tuple[slice, ...]:
        """Where ``dest`` sits inside the full tensor."""
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.dest.shape[self.dim]),)

    def pieces(self) -> list["Shard"]:
        return [self]


@dataclass
class FusedShard:
    """This rank's pieces of one checkpoint tensor that stacks several projections (MPT's Wqkv is
    q, k and v rows in one tensor): each rank's q, k and v rows sit apart in it, so one slice
    cannot describe them."""
    parts: list[Shard]  # each with the fused tensor's full_shape and its own start
    full_shape: tuple[int, ...]
    init: Init = "matrix"

    def pieces(self) -> list[Shard]:
        return self.parts


def new_param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def replicated(p: torch.Tensor, init: Init = "matrix") -> Shard:
    return Shard(p, tuple(p.shape), init=init)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype, device):
        super().__init__()
        self.weight = new_param(size, dtype=dtype, device=device)
        self.eps = eps

    def shard(self) -> Shard:
        return replicated(self.weight, "norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale after casting back, as HF Llama does (one kernel on CUDA).
        return rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """``x_hat * (1 + weight)``: Gemma stores the scale's offset from 1 (zero-initialised)."""

    def shard(self) -> Shard:
        return replicated(self.weight, "norm_offset")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Unlike Llama, the scale multiplies in float32 before the cast back (HF Gemma2RMSNorm).
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(RMSNorm):
    """LayerNorm with a weight and no bias (MPT's ``no_bias`` checkpoints carry none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, self.eps)


def rope_inv_freq(head_size: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported (default, llama3)")
    # Llama 3.1's frequency-dependent rescaling, as in HF's _compute_llama3_parameters.
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) RoPE with a float32 cos/sin table over all positions."""

    def __init__(self, head_size: int, max_positions: int, theta: float, scaling: dict | None = None,
                 *, device):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * rope_inv_freq(head_size, theta, scaling)
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] each, gathered once per step and shared by every layer."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W's rows split over ranks.  ``parts`` (full_rows, start, rows) stacks
    several checkpoint tensors (q/k/v, gate/up) into one local weight so one matmul serves them
    all; a bias is cut the same way, each part's piece following its rows."""

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], *, bias: bool = False,
                 dtype, device):
        super().__init__()
        self.parts = parts
        self.sizes = [rows for _, _, rows in parts]
        self.weight = new_param(sum(self.sizes), in_features, dtype=dtype, device=device)
        self.bias = new_param(sum(self.sizes), dtype=dtype, device=device) if bias else None

    def shard(self, i: int) -> Shard:
        full_rows, start, rows = self.parts[i]
        offset = sum(self.sizes[:i])
        return Shard(self.weight[offset:offset + rows], (full_rows, self.weight.shape[1]), 0, start)

    def bias_shard(self, i: int) -> Shard:
        """Part ``i``'s bias: the same rows of the checkpoint's bias as ``shard(i)`` takes of its
        weight (a replicated KV head's rows on every rank that holds it)."""
        full_rows, start, rows = self.parts[i]
        offset = sum(self.sizes[:i])
        return Shard(self.bias[offset:offset + rows], (full_rows,), 0, start, init="bias")

    def fused_shard(self) -> FusedShard:
        """The whole weight as pieces of one checkpoint tensor stacking every part's full rows."""
        full = (sum(full_rows for full_rows, _, _ in self.parts), self.weight.shape[1])
        before = [sum(full_rows for full_rows, _, _ in self.parts[:i]) for i in range(len(self.parts))]
        return FusedShard([Shard(s.dest, full, 0, before[i] + s.start)
                           for i, s in enumerate(map(self.shard, range(len(self.parts))))], full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T: W's columns split; the partial sums are all-reduced."""

    def __init__(self, full_in: int, out_features: int, start: int, cols: int, tp: TPGroup, *,
                 dtype, device):
        super().__init__()
        self.full_in, self.start, self.tp = full_in, start, tp
        self.weight = new_param(out_features, cols, dtype=dtype, device=device)

    def shard(self) -> Shard:
        return Shard(self.weight, (self.weight.shape[0], self.full_in), 1, self.start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight))


def qkv_parallel(hidden: int, num_heads: int, num_kv_heads: int, head_size: int, tp: TPGroup, *,
                 bias: bool = False, dtype, device) -> tuple[ColumnParallelLinear, int, int]:
    """The fused q/k/v projection of this rank (with q/k/v biases when ``bias``), and its
    (query heads, kv heads).

    With fewer KV heads than ranks each KV head is replicated on ``tp // num_kv_heads`` ranks.
    """
    if num_heads % tp.size:
        raise ValueError(f"tp_size={tp.size} must divide num_attention_heads={num_heads}")
    if num_kv_heads >= tp.size:
        if num_kv_heads % tp.size:
            raise ValueError(f"tp_size={tp.size} must divide num_key_value_heads={num_kv_heads}")
        hk, kv_first = num_kv_heads // tp.size, tp.rank * (num_kv_heads // tp.size)
    else:
        if tp.size % num_kv_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} must divide tp_size={tp.size}")
        hk, kv_first = 1, tp.rank // (tp.size // num_kv_heads)
    h = num_heads // tp.size
    D = head_size
    kv = (num_kv_heads * D, kv_first * D, hk * D)
    parts = [(num_heads * D, tp.rank * h * D, h * D), kv, kv]
    return ColumnParallelLinear(hidden, parts, bias=bias, dtype=dtype, device=device), h, hk


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """down(act(up(x))), up column-parallel, down row-parallel; ``gated``: down(act(gate(x)) * up(x))
    with gate and up in one matmul (SwiGLU for silu, GeGLU for the gelus)."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, *, activation: str = "silu",
                 gated: bool = True, dtype, device):
        super().__init__()
        if intermediate % tp.size:
            raise ValueError(f"tp_size={tp.size} must divide intermediate_size={intermediate}")
        n = intermediate // tp.size
        part = (intermediate, tp.rank * n, n)
        self.gated, self.activation = gated, activation
        self.act = ACTIVATIONS[activation]
        self.gate_up = ColumnParallelLinear(hidden, [part] * (2 if gated else 1), dtype=dtype, device=device)
        self.down = RowParallelLinear(intermediate, hidden, tp.rank * n, n, tp, dtype=dtype, device=device)

    def hf_shards(self, prefix: str) -> dict:
        """A gated MLP under HF's Llama names (gate_proj, up_proj, down_proj)."""
        return {prefix + "gate_proj.weight": self.gate_up.shard(0), prefix + "up_proj.weight": self.gate_up.shard(1),
                prefix + "down_proj.weight": self.down.shard()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        if not self.gated:
            return self.down(self.act(h))
        if self.activation == "silu":
            return self.down(silu_mul(h))  # one kernel on CUDA
        gate, up = h.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> list[float]:
    """ALiBi slopes ``2 ** (-bias_max * i / n)``, i = 1..n, for n the power of 2 at or above
    ``num_heads``; a head count that is not a power of 2 takes the even-indexed slopes first, then
    the odd ones.  This is MPT's ``alibi_bias_max`` form (HF ``build_mpt_alibi_tensor``); with
    bias_max 8 it is the ALiBi paper's interpolation."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * i / n) for i in range(1, n + 1)]
    if n != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return slopes
