"""Split-K for the decode GEMVs (``gemv.py``, ``fp8_kernels.fp8_skinny``), reduced in the same
launch and in a fixed order.

Why: at one row a GEMV is a weight stream, and the narrow projections give too few programs to
keep an H200's memory busy -- o_proj's N = 4096 in 32-row tiles is 128 programs on 132 SMs, one
each.  Splitting K gives every output tile SPLIT_K programs.  Their partial sums must still be
added: atomics into y would add them in whatever order the programs finish (a token's logits
would change from run to run), and a second kernel costs a launch (~2 us inside a graph, more
than the split saves on a small matrix).  So each program writes its float32 partial tile to a
workspace and takes a ticket from a per-tile counter; the program that draws the last ticket
adds the SPLIT_K partials in split order -- the same order whichever program finishes last --
applies the epilogue and resets the counter to zero for the next launch (CUDA-graph replays
included).  CUTLASS's split-K "serial reduction" works the same way.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU machines without triton
    triton = None

MAX_TILES = 1 << 16  # counters per device; a launch with more output tiles runs unsplit
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed tile counters (int32 [MAX_TILES]), made on first use.  None while a
    CUDA graph is being captured and none exist yet: made inside the capture they would live in
    the graph's private memory, so that launch runs unsplit instead (the model warms up before
    capturing, so in practice they exist).  One set per device: the model's forward runs on one
    stream at a time, and a launch leaves every counter it used at zero."""
    device = torch.device(device)
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return c


def split_k(split: int, k: int, block_k: int, tiles: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """The split a launch can take: at most one per BLOCK_K step of K, 1 without counters or with
    more tiles than counters; with the counters to pass (None: unsplit)."""
    split = max(1, min(split, triton.cdiv(k, block_k)))
    if split == 1 or tiles > MAX_TILES:
        return 1, None
    c = counters(device)
    return (1, None) if c is None else (split, c)


def workspace(split: int, m: int, n: int, device: torch.device) -> torch.Tensor | None:
    """The float32 partial tiles [split, m, n] of a split launch (None unsplit)."""
    return torch.empty(split, m, n, dtype=torch.float32, device=device) if split > 1 else None


if triton is not None:

    @triton.jit
    def k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """[start, end) of this program's share of K (axis 2 of the grid is the split): whole
        BLOCK_K steps, so a K that BLOCK_K divides stays divided in every share."""
        pid_k = tl.program_id(2)
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        start = pid_k * per
        return start, tl.minimum(start + per, K)

    @triton.jit
    def reduce_partials(acc, part_ptr, counter_ptr, tile, offs, mask, plane, SPLIT_K: tl.constexpr):
        """Store this program's partial ``acc`` at ``offs`` of its split's [M, N] plane, take a
        ticket; returns (the sum of all SPLIT_K partials in split order, ``mask`` where this
        program holds that sum and all False elsewhere).  Only the last program's loads run (they are masked by it), and it resets the
        tile's counter."""
        pid_k = tl.program_id(2)
        tl.store(part_ptr + pid_k * plane + offs, acc, mask=mask)
        # Every thread's partial is written before the ticket is taken; the ticket (acq_rel, GPU
        # scope) publishes them to the program that draws the last one, and orders its loads after.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        last = ticket == SPLIT_K - 1
        # the tile's mask, for this program alone if it holds the last ticket (a tensor, not the
        # scalar: Triton's interpreter takes only tensor masks)
        mine = mask & ((offs * 0 + ticket) == SPLIT_K - 1)
        total = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + s * plane + offs, mask=mine, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr + tile, 0, mask=last)
        return total, mine
