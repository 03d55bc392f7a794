"""Minimal repro for issue 13's fp8 KV-cache defect.

One mixed batch (a 300-token prefill row whose keys are all new, short prefill rows with a little
context, decode rows) through ``FlashAttentionImpl.forward`` with ``kv_cache_dtype="fp8"``; the
error per row is measured against a float64 dense reference over K/V and q *as the kernel sees
them* (rounded to e4m3), so fp8 rounding itself is not counted.

Rows:
  float8 cache      the cache allocated as float8_e4m3fn (how our model allocates it)
  uint8 cache       the cache allocated as uint8 (how vLLM allocates it, viewing it as float8
                    around each kernel)
  uint8, old write  (GPU only) what the code before the fix did with a uint8 cache: the Triton
                    cache kernel stored into the uint8 tensor, so ``value.to(uint8)`` converted
                    each scaled K/V to an *integer*.  Rows whose keys were all written in the
                    step come out wrong (relative error ~1), decode rows nearly right.

    python scripts/repro_fp8.py                 # GPU: FlashAttention 3; CPU: the torch kernel
    python scripts/repro_fp8.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_attn.backend import AttentionLayer, FlashAttentionImpl  # noqa: E402
from tests.backend.batch import dense_reference, make_batch  # noqa: E402
from tests.backend.test_fp8 import rounded, row_errors  # noqa: E402

Q_LENS = [300, 5, 17, 1, 1, 1]
KV_LENS = [300, 40, 17, 129, 700, 33]


def old_uint8_write(batch, cache, n, scale):
    """The pre-fix write into a uint8 cache: the Triton kernel's store converts to the cache's
    element type, uint8 -- an integer conversion, not an e4m3 rounding."""
    from ray_attn.backend import triton_ops

    kc, vc = cache.unbind(0)
    s = torch.tensor([scale], device=cache.device)
    k, v = batch.key[:n].to(cache.device), batch.value[:n].to(cache.device)
    slots = torch.from_numpy(batch.meta.slot_mapping[:n]).to(cache.device)
    N = k.shape[1] * k.shape[2]
    import triton
    triton_ops._cache_kernel[(n,)](k, v, kc, vc, slots, k.stride(0), v.stride(0), s, s, N=N,
                                   BLOCK=triton.next_power_of_2(N), FP8=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--scale", type=float, default=1.0, help="k/v/q scale (the engine's default is 1.0)")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    D, Hk, H, bs, s = args.head_size, 4, 16, args.block_size, args.scale
    batch = make_batch(Q_LENS, KV_LENS, H=H, Hk=Hk, D=D, block_size=bs, dtype=dtype,
                       gen=torch.Generator().manual_seed(0), cache_dtype=torch.float8_e4m3fn)
    n = batch.meta.num_actual_tokens
    results = {}
    for name in ["float8 cache", "uint8 cache"] + (["uint8, old write"] if cuda else []):
        impl = FlashAttentionImpl(H, D, D ** -0.5, Hk, None, None, "fp8", dtype=dtype, block_size=bs,
                                  device=device)
        q_seen = rounded(batch.query, s).to(dtype) if impl.kernel.quantizes_query else batch.query
        ref = dense_reference(replace(batch, query=q_seen), batch.kv_cache, scale=D ** -0.5, k_scale=s,
                              v_scale=s, new_kv_as_stored=(rounded(batch.key[:n], s), rounded(batch.value[:n], s)))
        layer = AttentionLayer(k_scale=s, v_scale=s, q_scale=s, device=device)
        cache = batch.kv_cache.to(device)
        if name.startswith("uint8"):
            cache = cache.view(torch.uint8)
        meta = batch.meta.to_device(device)
        out = torch.full_like(batch.query, float("nan"), device=device)
        if name == "uint8, old write":
            old_uint8_write(batch, cache, n, s)
            meta = replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))  # already written
        impl.forward(layer, batch.query.to(device), batch.key.to(device), batch.value.to(device), cache,
                     meta, out)
        errs = row_errors(out[:n].cpu(), ref, Q_LENS)
        results[name] = dict(kernel=impl.kernel.name, row_rel_err=errs)
        print(f"{name:17s} kernel={impl.kernel.name:5s} relative error per row (q_lens={Q_LENS}): "
              + " ".join(f"{e:.3f}" for e in errs))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(q_lens=Q_LENS, kv_lens=KV_LENS, results=results), indent=1))


if __name__ == "__main__":
    main()
