"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

Why: at batch 1 a Llama-3-8B layer is about ten kernels of 2-40 us, replayed from a CUDA graph.
At each boundary the GPU drains one grid before it launches the next, whose programs then wait on
their first loads: a few microseconds per boundary in which no weight streams, ~300 boundaries a
step.  Launched with PDL (``launch_pdl``; Hopper's ``griddepcontrol``), a kernel's programs become
resident while the kernel before still runs; they issue what does not depend on it -- a GEMV's
first weight tile -- and then wait (``gdc_wait``) until that kernel has finished and its writes
are visible.  CUDA-graph capture keeps the launches' programmatic edges.

The rule every kernel launched this way keeps: ``gdc_wait`` before its first load of anything an
earlier kernel writes (activations, never weights) and before its first store.  Each also calls
``gdc_launch_dependents`` first thing, so the kernel after it may launch as soon as all of its
programs have started; that one still waits for this one to finish before it reads.  A kernel
launched without PDL (cuBLAS, FlashAttention, torch's) waits for the one before as always.

RAY_ATTN_PDL=0 launches them all without it (an A/B switch; read at import).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

ENABLED = os.environ.get("RAY_ATTN_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    try:
        from triton.language.extra import cuda as tl_cuda
    except Exception:  # a Triton without the extra CUDA ops
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl_cuda, "gdc_wait")


def launch(device: torch.device) -> dict:
    """The launch arguments of a PDL-aware kernel on ``device``: ``USE_PDL`` (its constexpr) and,
    where PDL runs, ``launch_pdl``.  Off on CPU (Triton's interpreter), before Hopper, and with
    RAY_ATTN_PDL=0."""
    if not ENABLED or triton is None or device.type != "cuda":
        return {"USE_PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"USE_PDL": True, "launch_pdl": True} if _supported(index) else {"USE_PDL": False}
