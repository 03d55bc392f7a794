#!/usr/bin/env python
"""Tune the decode GEMVs per weight shape on this GPU: the bf16 GEMV (``ray_attn/model/gemv.py``,
one row), the FP8 skinny kernel (``fp8_kernels.fp8_skinny``, 1-16 rows), the weight-only FP8
GEMV (``w8a16``: the GEMV on e4m3 weights, one row; forced by RAY_ATTN_FP8_KERNEL=w8a16) and the
bf16 skinny kernel (``skinny.py``, 2-16 rows: verifying drafts, small batches), each candidate
(BLOCK_N, BLOCK_K, the pipeline depth) replayed from a CUDA graph over 32 layers' distinct
weights, so nothing is served from L2, against the device's copy rate.

The shapes are the decode linears of the presets (``--presets``) at TP=1: q/k/v, o_proj,
gate_up and down_proj, the LM head, the MoE router, Llama 4's shared expert; bf16's beside
cuBLAS (``F.linear``) on the same weights.  ``--write`` stores the fastest config of each
(shape, rows) as this device's table (``ray_attn/model/configs/<device>.json``, read by
``kernel_configs.tuned``): above ``gemv.MAX_N`` (gate_up, the LM head) the GEMV then serves a
shape only where it beat cuBLAS, and the weight-only FP8 GEMV one where it beat the skinny kernel
(its entry is what makes ``fp8.select_fp8_kernel`` pick it), and the bf16 skinny kernel one only
where it beat cuBLAS.  The (kernel, shape) pairs a run tunes replace their own entries; other shapes and kernels stay.  A candidate is kept only if it agrees with the default config
to 1% of the output's scale.

    python scripts/tune_decode_gemv.py [--presets llama-3-8b,qwen3-30b-a3b,llama-4-scout] [--write]
Writes benchmarks/results/tune_decode_gemv.json (GPU only).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.config import MODEL_PRESETS  # noqa: E402
from ray_attn.model import fp8 as F8  # noqa: E402
from ray_attn.model import gemv as G  # noqa: E402
from ray_attn.model import kernel_configs  # noqa: E402
from ray_attn.model import skinny as S  # noqa: E402

LAYERS = 32
SPACE = {
    "gemv": dict(BLOCK_N=[4, 8, 16], BLOCK_K=[512, 1024], num_stages=[3]),
    "fp8_skinny": dict(BLOCK_N=[16, 32, 64], BLOCK_K=[128, 256, 512], num_stages=[3, 5]),
    "w8a16": dict(BLOCK_N=[4, 8, 16], BLOCK_K=[1024, 2048], num_stages=[3]),
    "skinny": dict(BLOCK_N=[16, 32, 64], BLOCK_K=[128, 256, 512], num_stages=[3, 5]),
}
ROWS = {"gemv": [1], "fp8_skinny": [1, 4, 16], "w8a16": [1], "skinny": [2, 4, 8, 16]}
FP8 = ("fp8_skinny", "w8a16")  # tuned on --fp8-presets' shapes only


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the preset's decode linears at TP=1 that the GEMVs serve."""
    p = MODEL_PRESETS[preset]
    h, heads, kv = p["hidden_size"], p["num_attention_heads"], p["num_key_value_heads"]
    d = p.get("head_dim", h // heads)
    out = {"qkv": ((heads + 2 * kv) * d, h), "o_proj": (h, heads * d), "lm_head": (p["vocab_size"], h)}
    if p.get("num_local_experts"):
        out["router"] = (p["num_local_experts"], h)
        if p.get("architecture") == "Llama4ForCausalLM":  # the shared expert's down_proj (its gate_up is cuBLAS)
            out["shared_down"] = (h, p["intermediate_size"])
    else:
        out["gate_up"] = (2 * p["intermediate_size"], h)
        out["down"] = (h, p["intermediate_size"])
    return out


def candidates(kernel: str):
    space = SPACE[kernel]
    for values in itertools.product(*space.values()):
        yield dict(zip(space, values))


def copies(n: int, k: int) -> int:
    """LAYERS distinct weights, or as many as 8 GB holds (an LM head is one per model)."""
    return max(2, min(LAYERS, (8 << 30) // (n * k * 2)))


def runner(kernel: str, m: int, n: int, k: int, dev):
    """(a function of a config that runs ``kernel`` over distinct weights, cuBLAS's bf16 F.linear
    over the same (gemv only), the weights' bytes, how many)."""
    c = copies(n, k)
    if kernel in ("gemv", "skinny"):
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(c)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        f = G.gemv if kernel == "gemv" else S.skinny
        return (lambda cfg: [f(x, w, **cfg) for w in ws]), (lambda: [F.linear(x, w) for w in ws]), n * k * 2, c
    ws = [F8.quantize_per_row(torch.randn(n, k, device=dev) * k ** -0.5) for _ in range(c)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if kernel == "w8a16":
        return (lambda cfg: [G.gemv(x, q, w_scale=s, **cfg) for q, s in ws]), None, n * k, c
    xq, xs = F8.quantize_per_token_triton(x)
    return (lambda cfg: [F8.fp8_skinny(xq, xs, q, s, torch.bfloat16, **cfg) for q, s in ws]), None, n * k, c


def tune(kernel: str, name: str, m: int, n: int, k: int, copy_bps: float, dev, defaults_only=False) -> dict:
    run, cublas, nbytes, layers = runner(kernel, m, n, k, dev)
    ref = run({})[0].float()
    scale = ref.abs().max().item()
    default_us = bl.graph_timeit(lambda: run({}), iters=10) * 1e6 / layers
    cublas_us = bl.graph_timeit(cublas, iters=10) * 1e6 / layers if cublas else None
    best, tried = None, 0
    for c in ([{}] if defaults_only else candidates(kernel)):
        try:
            y = run(c)[0].float()
            us = bl.graph_timeit(lambda: run(c), iters=10)
        except Exception as e:  # a config Triton cannot build (shared memory, say): skip it, say so
            print(f"  {kernel} {name} m={m} {c}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        tried += 1
        if us is None or (y - ref).abs().max().item() > 1e-2 * scale:
            continue
        us = us * 1e6 / layers
        if best is None or us < best[0]:
            best = (us, c)
    row = dict(kernel=kernel, shape=name, n=n, k=k, rows=m, tried=tried, default_us=default_us,
               default_frac_of_copy=nbytes / (default_us * 1e-6) / copy_bps,
               best_us=best[0], best_cfg=best[1], best_frac_of_copy=nbytes / (best[0] * 1e-6) / copy_bps,
               speedup=default_us / best[0], cublas_us=cublas_us,
               best_over_cublas=best[0] / cublas_us if cublas_us else None)
    print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="llama-3-8b,qwen3-30b-a3b,llama-4-scout")
    ap.add_argument("--kernels", default="gemv,fp8_skinny,w8a16,skinny")
    ap.add_argument("--fp8-presets", default="llama-3-8b", help="the presets whose shapes the FP8 kernel is tuned for")
    ap.add_argument("--write", action="store_true", help="store the winners as this device's table")
    ap.add_argument("--defaults-only", action="store_true",
                    help="time each kernel's default config only (an A/B of an env switch, say)")
    ap.add_argument("--name", default="tune_decode_gemv", help="result file name")
    ap.add_argument("--skinny-margin", type=float, default=1.0,
                    help="--write gives the bf16 skinny kernel a (shape, rows) where its best time is within this "
                         "factor of cuBLAS's (1.0: only where it won).  Alone, each kernel is timed in a graph of "
                         "its own; in the decode step cuBLAS's small-M kernels take no part in the PDL chain "
                         "(pdl.py), so a tie alone can be a gain there: measure it with bench_spec_verify.py")
    a = ap.parse_args(argv)
    gpu = bl.gpu_and_copy_rate("tune_decode_gemv")
    if gpu is None:
        return 0
    dev, copy_bps = gpu
    # the defaults are what is measured against: a table already written must not stand in for them
    kernel_configs.ENABLED = False
    rows, seen = [], set()
    for preset in a.presets.split(","):
        for name, (n, k) in shapes(preset).items():
            for kernel in a.kernels.split(","):
                if kernel in FP8 and (preset not in a.fp8_presets.split(",") or name == "lm_head") or (
                        (n, k, kernel) in seen):
                    continue
                seen.add((n, k, kernel))
                for m in ROWS[kernel]:
                    rows.append(dict(preset=preset, **tune(kernel, name, m, n, k, copy_bps, dev, a.defaults_only)))
                torch.cuda.empty_cache()
    cols = ["preset", "kernel", "shape", "rows", "default_us", "best_us", "speedup", "cublas_us", "best_over_cublas",
            "best_frac_of_copy", "best_cfg"]
    bl.print_table(rows, cols, "decode GEMVs: default config vs the best candidate (us per layer)")
    path = bl.save(a.name, rows, copy_Bps=copy_bps)
    print(f"wrote {path}")
    if a.write and not a.defaults_only:
        # the (kernel, shape) pairs this run tuned replace their entries, a row count the kernel
        # lost here included; the shapes of presets it did not tune (other models) stay
        name = torch.cuda.get_device_name(dev)
        tuned = {(r["kernel"], kernel_configs.shape_key(r["n"], r["k"])) for r in rows}
        table = {kern: {s: cfg for s, cfg in shapes.items() if (kern, s) not in tuned}
                 for kern, shapes in kernel_configs.device_table(name).items()}
        for r in rows:
            if r["kernel"] == "gemv" and r["n"] > G.MAX_N and not r["best_over_cublas"] < 1:
                continue  # wider than MAX_N the GEMV serves only shapes where it beat cuBLAS here
            if r["kernel"] == "skinny" and not r["best_over_cublas"] < a.skinny_margin:
                continue  # the bf16 skinny kernel runs only where it beat cuBLAS here (or tied, by the margin)
            skinny = next((q["best_us"] for q in rows if q["kernel"] == "fp8_skinny" and (q["n"], q["k"], q["rows"])
                           == (r["n"], r["k"], r["rows"])), None)
            if r["kernel"] == "w8a16" and not (skinny and r["best_us"] < skinny):
                continue  # the weight-only GEMV runs a shape only where it beat the skinny kernel here
            table.setdefault(r["kernel"], {}).setdefault(kernel_configs.shape_key(r["n"], r["k"]), {})[r["rows"]] = \
                r["best_cfg"]
        print(f"wrote {kernel_configs.write_table(name, table, dict(source='scripts/tune_decode_gemv.py', date=bl.machine().get('date')))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
