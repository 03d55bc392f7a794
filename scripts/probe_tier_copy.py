#!/usr/bin/env python
"""Where a tier offload's time goes on a GPU (issue 26): each piece of ``RankKVTiers`` timed alone.

Small offloads (1-16 blocks) reached 16-64% of a bare pinned copy of the same bytes on the H200;
this splits one offload into its parts and times candidate replacements beside them:
- ``index``: block ids from numpy onto the device (``RankKVTiers._index``);
- ``select``: the gather alone (index_select over the block-first view), ids already on the device;
- ``gather``: both (``RankKVTiers.gather``);
- ``bare``: one pinned device -> host copy of the same bytes;
- ``gather_copy``: gather then the copy, one stream;
- ``offload``: ``RankKVTiers.apply`` with the offload alone (what a step pays);
- ``direct``: a Triton kernel that reads the blocks out of the cache and writes them straight into
  pinned host memory (no staging buffer, no separate copy), if Triton accepts the host pointer.
Times are medians over ``--iters`` synchronised calls (host wall time: what the step would wait).

    python scripts/probe_tier_copy.py            # Llama-3-8B-shaped cache, bf16, block 16
Writes benchmarks/results/probe_tier_copy.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.planner.tiers import KVTransfers  # noqa: E402
from ray_attn.runtime.kv_tiers import RankKVTiers  # noqa: E402

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _direct_kernel(src_ptr, ids_ptr, dst_ptr, piece, piece_stride, PIECES: tl.constexpr,
                       BLOCK: tl.constexpr):
        # program (i, p): piece p (layer x k/v) of the i-th block, ``piece`` elements
        i = tl.program_id(0)
        p = tl.program_id(1)
        b = tl.load(ids_ptr + i).to(tl.int64)
        src = src_ptr + p.to(tl.int64) * piece_stride + b * piece
        dst = dst_ptr + (i.to(tl.int64) * PIECES + p) * piece
        for off in range(0, piece, BLOCK):
            o = off + tl.arange(0, BLOCK)
            m = o < piece
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)
except Exception:  # pragma: no cover
    triton = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", default="1,4,16,64,256")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--output", default="benchmarks/results/probe_tier_copy.json")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    ns = [int(x) for x in a.blocks.split(",")]
    nb = max(ns) * 2 + 8
    stack = torch.empty((a.layers, 2, nb, a.block_size, a.kv_heads, a.head_size), dtype=torch.bfloat16, device=dev)
    stack.view(torch.uint8).random_(0, 256)
    model = SimpleNamespace(kv_cache_stack=stack)
    block_bytes = stack[:, :, 0].numel() * stack.element_size()
    tiers = RankKVTiers(model, 1.05 * max(ns) * block_bytes / (1 << 30), 0, 1, dev)
    wide = stack.view(torch.uint8).view(tiers.wide_dtype)
    piece = wide[0, 0, 0].numel()  # elements of one block of one layer's K or V
    rng = np.random.default_rng(0)
    rows = []
    for n in ns:
        blocks = np.sort(rng.choice(nb, n, replace=False)).astype(np.int32)
        slots = np.arange(n, dtype=np.int32)
        idx = tiers._index(blocks)
        dev_flat = torch.empty(n * block_bytes, dtype=torch.uint8, device=dev)
        host_flat = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=True)
        want = tiers.gather(blocks).cpu()
        t = dict(
            index=bl.synced_timeit(lambda: tiers._index(blocks), dev, a.iters),
            select=bl.synced_timeit(lambda: tiers._blocks().index_select(0, idx), dev, a.iters),
            gather=bl.synced_timeit(lambda: tiers.gather(blocks), dev, a.iters),
            bare=bl.synced_timeit(lambda: host_flat.copy_(dev_flat, non_blocking=True), dev, a.iters),
            gather_copy=bl.synced_timeit(lambda: host_flat.view(want.shape).copy_(tiers.gather(blocks), non_blocking=True), dev, a.iters),
            offload=bl.synced_timeit(lambda: tiers.apply(KVTransfers(offload_blocks=blocks, offload_slots=slots)), dev, a.iters),
        )
        row = dict(blocks=n, bytes=n * block_bytes)
        if triton is not None:
            host_wide = torch.empty((n * block_bytes) // wide.element_size(), dtype=wide.dtype, pin_memory=True)
            ids = torch.from_numpy(blocks.astype(np.int64)).to(dev)
            pieces = a.layers * 2

            def direct():
                _direct_kernel[(n, pieces)](wide, ids, host_wide, piece, nb * piece, PIECES=pieces, BLOCK=1024)
            try:
                t["direct"] = bl.synced_timeit(direct, dev, a.iters)
                row["direct_exact"] = bool(torch.equal(host_wide.view(torch.uint8).view(want.shape), want))
            except Exception as e:  # Triton refusing a host pointer is itself the answer
                row["direct_error"] = f"{type(e).__name__}: {e}"[:300]
        row.update({f"{k}_us": v * 1e6 for k, v in t.items()})
        row.update({f"{k}_frac_of_bare": t["bare"] / v for k, v in t.items() if k != "index"})
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
