"""FA3 paged decode replayed from a CUDA graph: how the captured ``max_seqlen_k`` bound and the
split count change the GPU time.  Decode graphs are captured with ``max_seqlen_k`` at the model's
limit (``max_position_embeddings``), and FA3 picks its KV split count on the host from it.

    python scripts/probe_fa3_splits.py [--bound 16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.backend.kernels import FlashAttn3Kernel  # noqa: E402

H, HK, D = 32, 8, 128


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--bound", type=int, default=16384, help="max_seqlen_k a graph is captured with")
    p.add_argument("--points", default="64x1024,256x1024,32x4096,64x4096")
    p.add_argument("--splits", default="0,1,2,4,8,16")
    args = p.parse_args(argv)
    dev = bl.device()
    if dev.type != "cuda":
        print("needs a GPU with FlashAttention 3")
        return
    copy_bw = bl.copy_bandwidth(1 << 30, dev)
    k = FlashAttn3Kernel()
    rows = []
    for point in args.points.split(","):
        b, c = (int(x) for x in point.split("x"))
        meta, cache, q, _, _ = bl.paged_decode_inputs(b, c, 16, HK, D, torch.bfloat16, dev, num_q_heads=H)
        m = meta.to_device(dev)
        kc, vc = cache.unbind(0)
        out = torch.empty_like(q)
        nbytes = b * c * 2 * HK * D * 2
        for bound in (c, args.bound):
            for s in (int(x) for x in args.splits.split(",")):
                def call():
                    k._raw(q, kc, vc, out, m.query_start_loc, 1, m.seq_lens, bound, m.block_table,
                           D ** -0.5, True, (-1, -1), 0.0, None, None, None, None, s)
                t = bl.graph_timeit(call)
                rows.append(dict(batch=b, ctx=c, max_seqlen_k=bound, num_splits=s, us=t * 1e6,
                                 frac_of_copy=nbytes / t / copy_bw))
        del cache
    bl.print_table(rows, ["batch", "ctx", "max_seqlen_k", "num_splits", "us", "frac_of_copy"],
                   "FA3 decode from a CUDA graph (bf16, page 16)")
    bl.save("probe_fa3_splits", rows, copy_GBps=copy_bw / 1e9)


if __name__ == "__main__":
    main()
