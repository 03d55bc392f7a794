"""A GGUF's 4-bit weights run as they are stored, on CPU ranks (``ModelConfig.quantization='gguf'``).

Why: a CPU decode step is a stream of weight reads.  Dequantized to float32, SmolLM2-135M's
linears are 425 MB a step; its Q4_0 / Q4_1 blocks are 66 MB.  torch's int4 CPU matmul
(``aten._weight_int4pack_mm_for_cpu``, the kernel gpt-fast's int4 path and torchao use) reads
them packed, with one scale and zero per 32 inputs -- exactly the GGUF block -- and computes in
bfloat16.  On 2 Intel Xeon cores all 30 layers' linears took 8.7 ms at one row against MKL's
25 ms in float32, and 27 against oneDNN's 37 at eight (``python scripts/bench_cpu_linear.py``).
vLLM serves a GGUF this way too (its ``quantization='gguf'``: the blocks stay quantized).

What it changes: the activations entering these linears are rounded to bfloat16 and the scales
too (a block's fp16 scale keeps 8 of its 11 significant bits), so logits move by about bf16's
rounding and greedy tokens can fork from the float32 run at near-ties -- as llama.cpp's, which
quantizes activations to 8 bits, do.  The default (quantization unset) stays HF's float32 function.

How: after the dense load (``gguf_weights.load_gguf``), ``gguf_weights.pack_q4`` reads every 2-D
weight whose pieces all come from Q4_0 / Q4_1 tensors again as blocks (``q4_blocks``), for exactly
the rows and columns this rank holds, and packs it once; ``gemv.linear`` takes the packed copy
wherever that weight is used on CPU (a tied LM head too).  Other tensor types (Q8_0, K-quants,
floats) stay dense.  GPU ranks keep the dense weights.  The dense copy stays: the embedding, a
reload and the tests read it.

Layout: a Q4_0 block is an fp16 scale d and 32 4-bit codes q (value (q - 8) d); Q4_1 adds an fp16
minimum m (value q d + m).  torch's kernel computes (q - 8) * scale + zero: scale = d and zero = 0
(Q4_0) or m + 8 d (Q4_1).  Byte j of a block's codes holds element j (low nibble) and j + 16.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

GROUP = 32  # inputs per GGUF block, and per scale of torch's kernel
_PACKED = "_ray_attn_gguf_q4"
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}

log = logging.getLogger(__name__)


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def q4_blocks(tensor, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``rows`` (GGUF row order) of a Q4_0 / Q4_1 ``ReaderTensor`` as (codes uint8 [R, K],
    scale float32 [R, K / 32], zero float32 [R, K / 32]): value = (code - 8) * scale + zero."""
    kind = tensor.tensor_type.name
    nbytes = BLOCK_BYTES[kind]
    k = int(tensor.shape[0])  # a GGUF lists the innermost dim first
    blocks = np.ascontiguousarray(tensor.data[rows]).reshape(len(rows), k // GROUP, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + np.float32(8) * d
    else:
        zero = np.zeros_like(d)
    qs = blocks[..., nbytes - GROUP // 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(len(rows), k)
    return codes, d, zero


class Blocks:
    """One weight's blocks as its pieces fill them."""

    def __init__(self, w: torch.Tensor):
        self.w = w
        n, k = w.shape
        self.codes = np.zeros((n, k), dtype=np.uint8)
        self.scale = np.zeros((n, k // GROUP), dtype=np.float32)
        self.zero = np.zeros((n, k // GROUP), dtype=np.float32)
        self.filled = np.zeros(n, dtype=bool)
        self.ok = k % GROUP == 0

    def pack(self) -> None:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(self.codes.astype(np.int32)), 1)
        sz = torch.stack([torch.from_numpy(self.scale), torch.from_numpy(self.zero)], -1)
        sz = sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [K / 32, N, 2], as the kernel reads
        setattr(self.w, _PACKED, (self.w._version, packed, sz))


def packed(w: torch.Tensor):
    """(packed codes, scales and zeros) of ``w`` when it was packed and has not changed since."""
    cached = w.__dict__.get(_PACKED)
    if cached is None or (not w.is_inference() and cached[0] != w._version):
        return None
    return cached


def linear(x: torch.Tensor, q, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) on W's packed 4-bit blocks, in bfloat16, returned in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if x2.shape[0] == 0:
        y = x.new_empty(0, q[2].shape[1])
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, q[1], GROUP, q[2]).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, y.shape[-1])
