"""FA3 paged decode replayed from a CUDA graph: how the captured ``max_seqlen_k`` bound, the
split count, pack-GQA and the KV page size change the GPU time.  Decode graphs are captured with
``max_seqlen_k`` at the model's limit (``max_position_embeddings``), and FA3 picks its KV split
count on the host from it.  The planner picks the page size (``CacheConfig.block_size``), so a
page size that wins at large batch can become the default (issue 39: decode 256 x 1k).

    python scripts/probe_fa3_splits.py [--bound 16384] [--pages 16,64,128] [--pack-gqa auto,on,off]
"""

from __future__ import annotations

import argparse
import itertools
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
    p.add_argument("--pages", default="16", help="KV page sizes (tokens a block)")
    p.add_argument("--pack-gqa", default="auto", help="auto (FA3's heuristic), on, off")
    args = p.parse_args(argv)
    packs = {"auto": None, "on": True, "off": False}
    pack_gqa = [packs[x] for x in args.pack_gqa.split(",")]
    dev = bl.device()
    if dev.type != "cuda":
        print("needs a GPU with FlashAttention 3")
        return
    copy_bw = bl.copy_bandwidth(1 << 30, dev)
    k = FlashAttn3Kernel()
    rows = []
    for point, page in itertools.product(args.points.split(","), (int(x) for x in args.pages.split(","))):
        b, c = (int(x) for x in point.split("x"))
        meta, cache, q, _, _ = bl.paged_decode_inputs(b, c, page, HK, D, torch.bfloat16, dev, num_q_heads=H)
        m = meta.to_device(dev)
        kc, vc = cache.unbind(0)
        out = torch.empty_like(q)
        nbytes = b * c * 2 * HK * D * 2
        for bound, pack, s in itertools.product((c, args.bound), pack_gqa, (int(x) for x in args.splits.split(","))):
            def call():
                k._raw(q, kc, vc, out, m.query_start_loc, 1, m.seq_lens, bound, m.block_table,
                       D ** -0.5, True, (-1, -1), 0.0, None, None, None, None, s, pack)
            t = bl.graph_timeit(call)
            rows.append(dict(batch=b, ctx=c, page=page, max_seqlen_k=bound, pack_gqa=pack, num_splits=s,
                             us=t * 1e6, frac_of_copy=nbytes / t / copy_bw))
        del cache
    bl.print_table(rows, ["batch", "ctx", "page", "max_seqlen_k", "pack_gqa", "num_splits", "us", "frac_of_copy"],
                   "FA3 decode from a CUDA graph (bf16)")
    bl.save("probe_fa3_splits", rows, copy_GBps=copy_bw / 1e9)


if __name__ == "__main__":
    main()
