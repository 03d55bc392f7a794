#!/usr/bin/env python
"""The kernels that bound a decode step, each replayed from a CUDA graph (GPU time only), against
the device's copy rate -- the probe behind benchmarks/NOTES.md's "what we tried" for the serving
goals (ITL at concurrency 1, decode at 256 x 1k).

  gemv     the Llama-3-8B layer's four matmuls (and the LM head) at 1-8 rows, 32 layers' worth of
           distinct weights (so nothing is served from L2): cuBLASLt (torch's default), cuBLAS,
           and our Triton GEMV (``ray_attn/model/gemv.py``) over a few block sizes.
  fa3_b1   FA3 paged decode at batch 1 x 1k over 32 layers' caches: FA3's split heuristic vs a
           fixed split count (a split count > 1 adds a combine kernel).
  fa3_pages FA3 paged decode at 256 x 1k and 64 x 4k by page size, split count 1 (what decode
           graphs pass there) and pack-GQA on/off/heuristic.
  fa3_engine_call  the bare FA3 call against the one a decode graph makes (max_seqlen_k at the
           graph's bound, the ahead-of-time plan, a wide block table, shuffled pages).

    python scripts/probe_decode_kernels.py [--only gemv,fa3_b1,fa3_pages,fa3_engine_call]
Writes benchmarks/results/probe_decode_kernels.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

H, HK, D, LAYERS = 32, 8, 128, 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def graph_us(fn, iters=20) -> float | None:
    t = bl.graph_timeit(fn, iters=iters)
    return None if t is None else t * 1e6


def probe_gemv(rows_list, copy_bw, dev):
    from ray_attn.model import gemv as G

    out = []
    for name, (n, k) in SHAPES.items():
        copies = 2 if name == "lm_head" else LAYERS
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
        nbytes = n * k * 2 * copies
        for m in rows_list:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = F.linear(x.double(), ws[0].double())
            variants = {"cublaslt": None, "cublas": None}
            # Triton reuses a compiled kernel across shapes (N, K and strides are all multiples
            # of 16 here), so this grid compiles ~16 kernels in all.
            cfgs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=3)
                    for bn in ((4, 8, 16) if m == 1 else (4, 8)) for bk in ((512, 1024) if m == 1 else (128, 256))
                    for nw in ((4, 8) if m == 1 else (4,))]
            for lib in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = graph_us(lambda: [F.linear(x, w) for w in ws])
                variants[lib] = us
            torch.backends.cuda.preferred_blas_library("cublaslt")
            best = None
            for c in cfgs:
                try:
                    y = G.gemv(x, ws[0], **c)
                    err = (y.double() - ref).abs().max().item()
                    us = graph_us(lambda: [G.gemv(x, w, **c) for w in ws])
                except Exception as e:  # a config Triton cannot build: skip it, say so
                    print(f"  {name} m={m} {c}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if us is not None and (best is None or us < best[0]):
                    best = (us, c, err)
            default_c = G.config(m, n, k)
            us_default = graph_us(lambda: [G.gemv(x, w) for w in ws])
            row = dict(shape=name, n=n, k=k, rows=m, cublaslt_us=variants["cublaslt"] / copies,
                       cublas_us=variants["cublas"] / copies, triton_default_us=us_default / copies,
                       triton_default_cfg=default_c,
                       triton_best_us=best[0] / copies if best else None, triton_best_cfg=best[1] if best else None,
                       triton_max_abs_err=best[2] if best else None)
            for key in ("cublaslt", "cublas", "triton_default", "triton_best"):
                if row[f"{key}_us"]:
                    row[f"{key}_frac_of_copy"] = nbytes / copies / (row[f"{key}_us"] * 1e-6) / copy_bw
            out.append(row)
            print(row)
        ws = []
        torch.cuda.empty_cache()
    return out


def fa3_call(q, kc, vc, out, m, max_k, num_splits, pack_gqa, sched=None, table=None):
    from ray_attn.backend.kernels import FlashAttn3Kernel

    FlashAttn3Kernel._raw(q, kc, vc, out, m.query_start_loc, 1, m.seq_lens, max_k,
                          m.block_table if table is None else table, D ** -0.5, True, (-1, -1), 0.0,
                          None, None, None, sched, num_splits, pack_gqa)


def probe_fa3_engine_call(copy_bw, dev, bound=16384):
    """The bare call against the call a decode graph makes: max_seqlen_k at the graph's bound,
    FA3's ahead-of-time plan (built for that bound, as the engine builds it), an engine-wide
    block table (a row per max_num_seqs, columns for the bound) and shuffled pages."""
    from ray_attn.backend.kernels import FlashAttn3Kernel

    k3 = FlashAttn3Kernel()
    rows = []
    for b, c in ((256, 1024), (64, 4096), (8, 1024)):
        meta, cache, q, _, _ = bl.paged_decode_inputs(b, c, 16, HK, D, torch.bfloat16, dev, num_q_heads=H)
        m, out = meta.to_device(dev), torch.empty_like(q)
        nbytes = b * c * 2 * HK * D * 2
        wide = torch.zeros(b, bound // 16, dtype=torch.int32, device=dev)
        wide[:, : m.block_table.shape[1]] = m.block_table
        perm = torch.randperm(cache.shape[1], device=dev).to(torch.int32)
        shuffled = perm[m.block_table.long()]

        def plan(max_k, splits):
            return k3.scheduler_metadata(batch_size=b, max_seqlen_q=1, max_seqlen_k=max_k, num_heads_q=H,
                                         num_heads_kv=HK, head_size=D, cache_seqlens=m.seq_lens,
                                         qkv_dtype=torch.bfloat16, cu_seqlens_q=m.query_start_loc, page_size=16,
                                         causal=True, window_size=(-1, -1), has_softcap=False, num_splits=splits)
        splits = 1 if b * HK >= 132 else 0
        variants = {"bare": (c, None, None), "bound": (bound, None, None),
                    "aot_exact": (c, plan(c, splits), None), "aot_bound": (bound, plan(bound, splits), None),
                    "aot_bound_wide_table": (bound, plan(bound, splits), wide),
                    "shuffled_pages": (c, None, shuffled)}
        for name, (max_k, sched, table) in variants.items():
            us = graph_us(lambda: fa3_call(q, cache[0], cache[1], out, m, max_k, splits, None, sched, table))
            rows.append(dict(batch=b, ctx=c, call=name, num_splits=splits, us=us,
                             frac_of_copy=nbytes / (us * 1e-6) / copy_bw))
            print(rows[-1])
        cache = None
        torch.cuda.empty_cache()
    return rows


def probe_fa3_b1(copy_bw, dev, ctx=1024):
    rows = []
    layers = []
    for _ in range(LAYERS):
        meta, cache, q, _, _ = bl.paged_decode_inputs(1, ctx, 16, HK, D, torch.bfloat16, dev, num_q_heads=H)
        layers.append((meta.to_device(dev), cache, q, torch.empty_like(q)))
    nbytes = ctx * 2 * HK * D * 2 * LAYERS
    for splits in (0, 1, 2, 4, 8, 16):
        for pack in (None, True):
            us = graph_us(lambda: [fa3_call(q, c[0], c[1], o, m, ctx, splits, pack) for m, c, q, o in layers])
            rows.append(dict(batch=1, ctx=ctx, num_splits=splits, pack_gqa=pack, us_per_layer=us / LAYERS,
                             frac_of_copy=nbytes / (us * 1e-6) / copy_bw))
            print(rows[-1])
    return rows


def probe_fa3_pages(copy_bw, dev):
    rows = []
    for b, c in ((256, 1024), (64, 4096), (128, 2048)):
        for page in (16, 32, 64, 128, 256):
            meta, cache, q, _, _ = bl.paged_decode_inputs(b, c, page, HK, D, torch.bfloat16, dev, num_q_heads=H)
            m, out = meta.to_device(dev), torch.empty_like(q)
            nbytes = b * c * 2 * HK * D * 2
            for splits in (1, 0):
                for pack in (None, True, False):
                    us = graph_us(lambda: fa3_call(q, cache[0], cache[1], out, m, c, splits, pack))
                    rows.append(dict(batch=b, ctx=c, page=page, num_splits=splits, pack_gqa=pack, us=us,
                                     frac_of_copy=nbytes / (us * 1e-6) / copy_bw))
                    print(rows[-1])
            cache = None
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="gemv,fa3_b1,fa3_pages,fa3_engine_call")
    p.add_argument("--rows", default="1,2,4,8", help="GEMV row counts")
    p.add_argument("--suffix", default=None, help="result file name suffix")
    a = p.parse_args(argv)
    dev = bl.device()
    if dev.type != "cuda":
        print("needs a GPU")
        return 0
    copy_bw = bl.copy_bandwidth(1 << 30, dev)
    print(f"copy {copy_bw / 1e9:,.0f} GB/s")
    res = dict(copy_GBps=copy_bw / 1e9)
    only = a.only.split(",")
    if "gemv" in only:
        res["gemv"] = probe_gemv([int(r) for r in a.rows.split(",")], copy_bw, dev)
    if "fa3_b1" in only:
        res["fa3_b1"] = probe_fa3_b1(copy_bw, dev)
    if "fa3_pages" in only:
        res["fa3_pages"] = probe_fa3_pages(copy_bw, dev)
    if "fa3_engine_call" in only:
        res["fa3_engine_call"] = probe_fa3_engine_call(copy_bw, dev)
    rows = [r for key in ("gemv", "fa3_b1", "fa3_pages", "fa3_engine_call") for r in res.pop(key, [])]
    bl.save("probe_decode_kernels" + (a.suffix or ""), rows, **res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
