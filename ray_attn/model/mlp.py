"""The feed-forward block: ``down(act(up(x)))``, or gated (SwiGLU, GeGLU) with gate and up in one
column-parallel matmul; down is row-parallel (``parallel_linear``)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ray_attn.model.fused import silu_mul
from ray_attn.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from ray_attn.model.tp import TPGroup


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

    def forward(self, x) -> torch.Tensor:
        h = self.gate_up(x)
        if not self.gated:
            return self.down(self.act(h))
        if self.activation == "silu":
            y = self.down.forward_silu_mul(h)  # one row, bf16: the product inside down's GEMV
            if y is not None:
                return y
            # One kernel on CUDA, which also quantizes for FP8 weights; down reads only the codes
            # then, and the product itself only for an adapter (LoRA takes the plain activation).
            return self.down(silu_mul(h, quant=self.down.wants_fp8_input(h[..., :h.shape[-1] // 2]),
                                      value=self.down.lora is not None))
        gate, up = h.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)
