#!/usr/bin/env python
"""Sweep the small-batch MoE kernels' tiles (``ray_attn/model/moe_small.py``) at the presets' expert
shapes: the gate_up kernel's BLOCK_N, and the down kernel's BLOCK_N and accumulator size
(``DOWN_TILE``, which sets its BLOCK_K from top-k).  Each candidate runs one token through
``LAYERS`` layers' distinct experts (so nothing is served from L2) in one CUDA graph, and is
reported in us per layer and as a fraction of the copy rate over the bytes of the experts hit.

    python scripts/tune_moe_small.py [--presets qwen3-30b-a3b,llama-4-scout] [--tokens 1,4]
Writes benchmarks/results/tune_moe_small.json (GPU only).
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

from ray_attn.config import MODEL_PRESETS  # noqa: E402
from ray_attn.model import moe_small  # noqa: E402

LAYERS = 6


def run(preset: str, T: int, copy_bps: float, dev) -> list[dict]:
    p = MODEL_PRESETS[preset]
    H, n, E, k = p["hidden_size"], p.get("moe_intermediate_size") or p["intermediate_size"], \
        p["num_local_experts"], p["num_experts_per_tok"]
    on_input = p.get("architecture") == "Llama4ForCausalLM"
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(LAYERS):  # distinct experts per layer, as a model's layers are
        w13 = torch.randn(E, 2 * n, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        w2 = torch.randn(E, H, n, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)]).to(torch.int32)
        layers.append((w13, w2, ids, torch.rand(T, k, device=dev, generator=g)))
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    hit_bytes = sum(3 * H * n * 2 * len(set(ids.flatten().tolist())) for _, _, ids, _ in layers) / LAYERS
    ref = None
    rows = []
    for bn, dbn, tile in itertools.product([4, 8, 16, 32], [1, 2, 4, 8], [2048, 4096, 8192]):
        def fn():
            return [moe_small.fused_moe_small(x, w13, w2, w, ids, on_input, block_n=bn, down_block_n=dbn,
                                              down_tile=tile) for w13, w2, ids, w in layers]
        out = torch.stack(fn())
        if ref is None:
            ref = out
        ok = (out.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item()
        s = bl.graph_timeit(fn, iters=20, warmup=2)
        us = s * 1e6 / LAYERS
        rows.append(dict(preset=preset, tokens=T, block_n=bn, down_block_n=dbn, down_tile=tile, us_per_layer=us,
                         frac_of_copy=hit_bytes / copy_bps / (us * 1e-6), agrees=ok))
    rows.sort(key=lambda r: r["us_per_layer"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen3-30b-a3b,llama-4-scout")
    ap.add_argument("--tokens", default="1,4")
    a = ap.parse_args(argv)
    gpu = bl.gpu_and_copy_rate("tune_moe_small")
    if gpu is None:
        return 0
    dev, copy_bps = gpu
    rows = []
    for preset in a.presets.split(","):
        for T in (int(t) for t in a.tokens.split(",")):
            got = run(preset, T, copy_bps, dev)
            default = next(r for r in got if (r["block_n"], r["down_block_n"], r["down_tile"])
                           == (moe_small.BLOCK_N, moe_small.DOWN_BLOCK_N, moe_small.DOWN_TILE))
            for r in got:
                r["vs_default"] = default["us_per_layer"] / r["us_per_layer"]
            rows += got
            bl.print_table(got[:6] + [default], ["preset", "tokens", "block_n", "down_block_n", "down_tile",
                                                 "us_per_layer", "frac_of_copy", "vs_default", "agrees"],
                           f"{preset}, {T} token(s): the 6 fastest and the default")
            torch.cuda.empty_cache()
    print(f"wrote {bl.save('tune_moe_small', rows, copy_Bps=copy_bps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
