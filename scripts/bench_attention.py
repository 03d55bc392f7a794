"""Our attention step (cache write + paged attention through FlashAttentionImpl.forward) against
the bare kernel call and a device-to-device copy of the same bytes, all in one run.

Decode: GB/s of KV read and its fraction of copy bandwidth.  Prefill: TFLOP/s (causal).
Llama-3-8B heads on one rank: 32 query / 8 KV heads, head 128.  ``--small`` (default on CPU)
shrinks the grid so that the script also runs without a GPU.

    python scripts/bench_attention.py            # GPU: full grid; CPU: small grid
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.backend import AttentionLayer, FlashAttentionImpl  # noqa: E402
from ray_attn.backend.kernels import LayerKernelSpec, unsupported_reason  # noqa: E402

H, HK, D = 32, 8, 128


def bare_call(kernel: str, meta, cache, q, fp8: bool):
    """The kernel alone, as a user of flash-attn would call it with the same metadata."""
    kc, vc = cache.unbind(0)
    if kernel == "fa3":
        from flash_attn_interface import flash_attn_with_kvcache

        ds = torch.ones(meta.num_reqs, HK, device=q.device) if fp8 else None
        qq = q.to(torch.float8_e4m3fn) if fp8 else q
        return lambda: flash_attn_with_kvcache(
            qq, kc, vc, cache_seqlens=meta.seq_lens, page_table=meta.block_table,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len, causal=True,
            q_descale=ds, k_descale=ds, v_descale=ds)
    if kernel == "fa2":
        from flash_attn import flash_attn_varlen_func

        cu_k = torch.nn.functional.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return lambda: flash_attn_varlen_func(
            q, kc, vc, meta.query_start_loc, cu_k, meta.max_query_len, meta.max_seq_len,
            causal=True, block_table=meta.block_table)
    return None


def measure(kernel, kv_dtype, batch, ctx, q_per_seq, dev, dtype, block=None):
    block = block or (256 if kernel == "fa2" else 16)
    fp8 = kv_dtype == "fp8"
    meta, cache, q, k, v = bl.paged_decode_inputs(
        batch, ctx, block, HK, D, dtype, dev, q_per_seq=q_per_seq, num_q_heads=H,
        cache_dtype=torch.float8_e4m3fn if fp8 else None)
    dmeta = meta.to_device(dev)
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "fp8" if fp8 else "auto",
                              dtype=dtype, block_size=block, device=dev, kernel=kernel)
    layer = AttentionLayer(device=dev)
    out = torch.empty_like(q)
    iters = 3 if dev.type == "cpu" else 20
    ours = bl.timeit(lambda: impl.forward(layer, q, k, v, cache, dmeta, out), iters=iters)
    bare_fn = bare_call(kernel, dmeta, cache, q, fp8)
    bare = bl.timeit(bare_fn, iters=iters) if bare_fn else None
    kv_bytes = batch * ctx * 2 * HK * D * cache.element_size()
    del cache
    return ours, bare, kv_bytes


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="CPU-sized grid")
    p.add_argument("--block-sweep", default="16,64,128,256",
                   help="FA3 page sizes to compare at batch >= 64, context >= 4k ('' to skip)")
    args = p.parse_args(argv)
    dev = bl.device()
    small = args.small or dev.type == "cpu"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernels = [k for k in ("fa3", "fa2", "torch") if unsupported_reason(
        k, LayerKernelSpec(D, dtype, "auto", 256 if k == "fa2" else 16), dev) is None]
    if dev.type == "cuda":
        kernels = [k for k in kernels if k != "torch"]
    batches = [1, 4] if small else [1, 8, 64, 256]
    ctxs = [256, 1024] if small else [1024, 4096, 16384, 32768]
    prefills = [128, 512] if small else [1024, 4096, 16384]
    copy_bw = bl.copy_bandwidth(1 << 28 if not small else 1 << 24, dev)
    rows = []
    grid = [(k, kv, b, c) for k in kernels for kv in ("auto", "fp8") for b in batches for c in ctxs
            if not (kv == "fp8" and k == "fa2")
            and not (dev.type == "cuda" and b * c > 256 * 16384)]  # keep the cache under ~70 GB
    for kernel, kv, b, c in tqdm(grid, desc="decode"):
        ours, bare, nbytes = measure(kernel, kv, b, c, 1, dev, dtype)
        rows.append(dict(mode="decode", kernel=kernel, kv=kv, batch=b, ctx=c, ours_us=ours * 1e6,
                         bare_us=bare and bare * 1e6, ours_GBps=nbytes / ours / 1e9,
                         bare_GBps=bare and nbytes / bare / 1e9, copy_GBps=copy_bw / 1e9,
                         frac_of_copy=nbytes / ours / copy_bw,
                         overhead_pct=bare and 100 * (ours / bare - 1)))
    # Page size: FA3 takes any, and short pages mean more page-table reads and shorter
    # contiguous runs per KV row.  Is 16 (the engine's default) leaving bandwidth behind?
    sweep = [int(x) for x in args.block_sweep.split(",") if x] if "fa3" in kernels and not small else []
    for b, c in tqdm([(b, c) for b in (64, 256) for c in (1024, 4096, 16384)] if sweep else [], desc="pages"):
        for block in sweep:
            ours, bare, nbytes = measure("fa3", "auto", b, c, 1, dev, dtype, block=block)
            rows.append(dict(mode="decode-pages", kernel="fa3", kv="auto", batch=b, ctx=c, block=block,
                             ours_us=ours * 1e6, bare_us=bare * 1e6, ours_GBps=nbytes / ours / 1e9,
                             frac_of_copy=nbytes / ours / copy_bw, bare_frac_of_copy=nbytes / bare / copy_bw))
    for kernel in tqdm(kernels, desc="prefill"):
        for n in prefills:
            ours, bare, _ = measure(kernel, "auto", 1, n, n, dev, dtype)
            flops = 4 * n * n * D * H / 2  # causal: half of QK^T and PV
            rows.append(dict(mode="prefill", kernel=kernel, kv="auto", batch=1, ctx=n,
                             ours_us=ours * 1e6, bare_us=bare and bare * 1e6,
                             ours_TFLOPs=flops / ours / 1e12, bare_TFLOPs=bare and flops / bare / 1e12,
                             overhead_pct=bare and 100 * (ours / bare - 1)))
    path = bl.save("bench_attention", rows, copy_GBps=copy_bw / 1e9, heads=[H, HK, D])
    dec = [r for r in rows if r["mode"] == "decode"]
    bl.print_table(dec, ["kernel", "kv", "batch", "ctx", "ours_us", "bare_us", "overhead_pct",
                         "ours_GBps", "copy_GBps", "frac_of_copy"], "decode (KV read)")
    bl.print_table([r for r in rows if r["mode"] == "prefill"],
                   ["kernel", "ctx", "ours_us", "bare_us", "overhead_pct", "ours_TFLOPs", "bare_TFLOPs"],
                   "causal prefill")
    if sweep:
        bl.print_table([r for r in rows if r["mode"] == "decode-pages"],
                       ["batch", "ctx", "block", "ours_us", "bare_us", "frac_of_copy", "bare_frac_of_copy"],
                       "FA3 decode by page size (bf16)")
    series = {}
    for kernel in kernels:
        for kv in ("auto", "fp8"):
            for b in batches:
                pts = [r for r in dec if r["kernel"] == kernel and r["kv"] == kv and r["batch"] == b]
                if pts:
                    series[f"{kernel} {kv} batch {b}"] = ([r["ctx"] for r in pts], [r["ours_GBps"] for r in pts])
    bl.plot(path.with_suffix(".png"), series, "context (tokens)", "KV read GB/s",
            f"Paged decode through FlashAttentionImpl.forward ({bl.machine().get('gpu') or 'CPU'})",
            hline=copy_bw / 1e9, hline_label="device copy")
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
