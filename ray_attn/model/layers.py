"""Decoder building blocks: the shards that describe every parameter, norms, RoPE and ALiBi (the
tensor-parallel linears are ``parallel_linear``, the MLP ``mlp``).

Every parameter is described by a :class:`Shard`: which full (checkpoint-shaped) tensor it is cut
from, along which dim and where.  Loading a checkpoint and seeded random init both go through it,
so any TP size computes the same function from the same full weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ray_attn.model.fused import apply_rope, rms_norm


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
    # The safetensors dtype the checkpoint must hold (an fp8 weight: "F8_E4M3"); None: any, cast.
    dtype: str | None = None
    # Tensors that travel with this weight, by checkpoint suffix (a quantized weight's
    # "weight_scale" / "weight_scale_inv" / "input_scale"): ``CausalLM.weight_shards`` names them
    # after the weight, so the families' ``layer_shards`` need not know about quantization.
    companions: dict = field(default_factory=dict)

    def index(self) -> tuple[slice, ...]:
        """Where ``dest`` sits inside the full tensor."""
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.dest.shape[self.dim]),)

    def pieces(self) -> list["Shard"]:
        return [self]


@dataclass
class BroadcastShard(Shard):
    """A whole (small) checkpoint tensor copied into every element of ``dest``: a per-tensor scale
    held once per output row, or replicated on every rank."""

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * len(self.full_shape)


@dataclass
class FusedShard:
    """This rank's pieces of one checkpoint tensor that stacks several projections (MPT's Wqkv is
    q, k and v rows in one tensor): each rank's q, k and v rows sit apart in it, so one slice
    cannot describe them."""
    parts: list[Shard]  # each with the fused tensor's full_shape and its own start
    full_shape: tuple[int, ...]
    init: Init = "matrix"
    dtype: str | None = None
    companions: dict = field(default_factory=dict)

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
