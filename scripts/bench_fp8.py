#!/usr/bin/env python
"""FP8 weight GEMMs against bf16 at the Llama-3-8B layer's shapes, each replayed from a CUDA graph
over 32 layers' worth of distinct weights (so nothing is served from L2), with the device's copy
rate and its FP8/bf16 GEMM rates measured beside them.

  kernels  per shape (qkv, o_proj, gate_up, down) and row count M: bf16 (our layer's dispatch:
           the Triton GEMV at one row, cuBLAS above), and every FP8 path that can run -- the skinny
           tensor-core kernel (per-row scales, decode sizes),
           ``torch._scaled_mm`` (cuBLASLt, row-wise scales, x quantized by our Triton kernel), the
           Triton block kernel (128 x 128 block scales) -- and which one ``select_fp8_kernel``
           picks.  Columns: microseconds per layer, the weight bytes' rate as a fraction of the
           copy rate, and TFLOP/s as a fraction of the FP8 GEMM rate.
  skinny, block   each decode kernel's block sizes swept at decode row counts (what
           ``fp8_kernels.skinny_config`` / ``block_config`` are set from).
  error    each CUDA path's error against the float32 reference of the same codes, as a
           fraction of sum |terms| (what tests/model/test_fp8_weights.py bounds), by K.

    python scripts/bench_fp8.py [--parts error,kernels,skinny,block] [--rows 1,2,4,...]
Writes benchmarks/results/bench_fp8.json and bench_fp8.png (GPU only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.model import fp8 as F8  # noqa: E402
from ray_attn.model.gemv import linear  # noqa: E402
from ray_attn.model.quantization import parse_quantization  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
CHANNEL = parse_quantization("fp8")
BLOCK = parse_quantization({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})


def skinny(x, q, s, **cfg):
    """The skinny path as a layer runs it: the Triton quantizer, then the kernel (``cfg`` overrides
    its block sizes)."""
    return F8.fp8_skinny(*F8.quantize_per_token_triton(x), q, s, x.dtype, **cfg)


def graph_us(fn, copies: int) -> float | None:
    t = bl.graph_timeit(fn, iters=10)
    return None if t is None else t * 1e6 / copies


def fp8_gemm_rate(dev, n: int = 8192) -> float:
    a = torch.randn(n, n, device=dev).to(F8.FP8_DTYPE)
    b = torch.randn(n, n, device=dev).to(F8.FP8_DTYPE)
    one = torch.ones(1, device=dev)
    t = bl.timeit(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters=10)
    return 2 * n ** 3 / t


def weights(n: int, k: int, copies: int, dev):
    """``copies`` distinct layers: bf16 [N, K], its per-row fp8 codes and scales, block scales."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        q, s = F8.quantize_per_row(w)
        bs = torch.rand(-(-n // 128), -(-k // 128), device=dev) * 1e-3 + 1e-3
        out.append((w, q, s, bs))
    return out


def kernel_rows(rows: list[int], rates: dict, dev) -> list[dict]:
    out = []
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k, LAYERS, dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            paths = {"bf16": lambda: [linear(x, w) for w, _, _, _ in ws]}
            if m <= 64:
                paths["fp8_skinny"] = lambda: [skinny(x, q, s) for _, q, s, _ in ws]
            paths["fp8_scaled_mm"] = lambda: [F8.apply_fp8_linear(x, q, s, CHANNEL, kernel="scaled_mm")
                                              for _, q, s, _ in ws]
            paths["fp8_block"] = lambda: [F8.fp8_block_matmul(x, q, bs) for _, q, _, bs in ws]
            row = dict(shape=name, n=n, k=k, rows=m, pick=F8.select_fp8_kernel(x, ws[0][1], CHANNEL))
            for p, fn in paths.items():
                us = graph_us(fn, LAYERS)
                row[f"{p}_us"] = us
                if us:
                    nbytes = n * k * (2 if p == "bf16" else 1)
                    row[f"{p}_frac_of_copy"] = nbytes / (us * 1e-6) / rates["copy_Bps"]
                    rate = rates["bf16_gemm_flops" if p == "bf16" else "fp8_gemm_flops"]
                    row[f"{p}_frac_of_gemm"] = 2 * m * n * k / (us * 1e-6) / rate
            pick = {"skinny": "fp8_skinny", "scaled_mm": "fp8_scaled_mm"}.get(row["pick"])
            if pick and row.get(f"{pick}_us"):
                row["fp8_pick_over_bf16"] = row[f"{pick}_us"] / row["bf16_us"]
            out.append(row)
            print({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in row.items()}, flush=True)
        ws = None  # noqa: F841 - freed before the next shape's weights
        torch.cuda.empty_cache()
    return out


def sweep_configs(kernel: str, m: int) -> list[dict]:
    if kernel == "skinny":
        return [dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st) for bn in (16, 32, 64) for bk in (128, 256, 512)
                for st in (3, 5)]
    return [dict(BLOCK_N=bn, num_stages=st) for bn in (16, 32, 64, 128) for st in (3, 5)]  # block


def sweep_rows(kernels: list[str], rows: list[int], rates: dict, dev) -> list[dict]:
    """Each decode kernel's block sizes at each shape and row count, against its default config."""
    out = []
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k, LAYERS, dev)
        for kernel in kernels:
            if kernel == "block":
                fn = lambda x, c: [F8.fp8_block_matmul(x, q, bs, **c) for _, q, _, bs in ws]  # noqa: E731
                default_cfg = F8.block_config
            else:
                fn = lambda x, c: [skinny(x, q, s, **c) for _, q, s, _ in ws]  # noqa: E731
                default_cfg = lambda m: F8.skinny_config(m, n)  # noqa: E731
            for m in [r for r in rows if r <= 64]:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = fn(x, {})[0].float()
                default, best = graph_us(lambda: fn(x, {}), LAYERS), None
                for c in sweep_configs(kernel, m):
                    try:
                        y = fn(x, c)[0].float()
                        us = graph_us(lambda: fn(x, c), LAYERS)
                    except Exception as e:  # a config Triton cannot build: skip it, say so
                        print(f"  {kernel} {name} m={m} {c}: {type(e).__name__}: {str(e)[:100]}")
                        continue
                    if us and (y - ref).abs().max() <= 1e-2 * ref.abs().max() and (best is None or us < best[0]):
                        best = (us, c)
                row = dict(kernel=kernel, shape=name, rows=m, default_us=default, default_cfg=default_cfg(m),
                           best_us=best[0] if best else None, best_cfg=best[1] if best else None,
                           default_frac_of_copy=n * k / (default * 1e-6) / rates["copy_Bps"],
                           best_frac_of_copy=n * k / (best[0] * 1e-6) / rates["copy_Bps"] if best else None)
                out.append(row)
                print(row, flush=True)
        ws = None  # noqa: F841 - freed before the next shape's weights
        torch.cuda.empty_cache()
    return out


def error_rows(dev) -> list[dict]:
    out = []
    for k in (512, 4096, 14336):
        for m in (1, 64, 300):
            g = torch.Generator().manual_seed(k + m)
            x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
            w = torch.randn(2048, k, generator=g) * k ** -0.5
            for scheme, name in ((CHANNEL, "channel"), (BLOCK, "block")):
                if name == "block":
                    q, _ = F8.quantize_per_row(w)
                    s = torch.rand(2048 // 128, -(-k // 128), generator=g) * 1e-3 + 1e-3
                else:
                    q, s = F8.quantize_per_row(w)
                ref = F8.apply_fp8_linear(x.float(), q, s, scheme, kernel="dequant").double()
                xd = F8.dequantize_activation(*F8.quantize_activation(x.float(), scheme, None), scheme.group_size)
                terms = (xd.abs() @ F8.dequantize_weight(q, s, scheme).abs().T).double()
                paths = ["block_triton", "block_dequant"] if name == "block" else ["skinny", "scaled_mm", "dequant"]
                for p in paths:
                    y = F8.apply_fp8_linear(x.to(dev), q.to(dev), s.to(dev), scheme, kernel=p).double().cpu()
                    err = (y - ref).abs() - 2 ** -8 * ref.abs()  # beyond one bf16 rounding of y
                    r = dict(k=k, rows=m, scheme=name, path=p,
                             max_err_over_terms=(err.clamp(min=0) / terms).max().item(),
                             mean_abs_err_over_terms=((y - ref).abs() / terms).mean().item())
                    if p == "scaled_mm":  # cuBLASLt's fast accumulation, for comparison
                        xq, xs = F8.quantize_activation(x.to(dev), scheme, None)
                        yf = torch._scaled_mm(xq, q.to(dev).t(), scale_a=xs, scale_b=s.to(dev).view(1, -1),
                                              out_dtype=torch.bfloat16, use_fast_accum=True).double().cpu()
                        r["fast_accum_max_err_over_terms"] = (((yf - ref).abs() - 2 ** -8 * ref.abs()).clamp(min=0)
                                                              / terms).max().item()
                    out.append(r)
                    print(r, flush=True)
    return out


def plot(rows: list[dict], path) -> None:
    panels = []
    for name in SHAPES:
        rs = [r for r in rows if r["shape"] == name]
        series = {p: ([r["rows"] for r in rs if r.get(f"{p}_us")], [r[f"{p}_us"] for r in rs if r.get(f"{p}_us")])
                  for p in ("bf16", "fp8_skinny", "fp8_scaled_mm", "fp8_block")}
        panels.append((f"{name} ({rs[0]['n']} x {rs[0]['k']})", series))
    bl.plot_panels(path, panels, "rows (tokens)", "microseconds per layer", logy=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="error,kernels,skinny,block")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--name", default="bench_fp8", help="result file name (a run of one part keeps the others')")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8: needs a GPU (the FP8 kernels are CUDA's); nothing to measure here")
        return 0
    dev = torch.device("cuda")
    rows = [int(r) for r in a.rows.split(",")]
    parts = set(a.parts.split(","))
    rates = dict(copy_Bps=bl.copy_bandwidth(1 << 30, dev), bf16_gemm_flops=bl.matmul_flops(dev),
                 fp8_gemm_flops=fp8_gemm_rate(dev))
    print({k: f"{v:.3g}" for k, v in rates.items()}, flush=True)
    out = dict(rates=rates)
    if "error" in parts:
        out["error"] = error_rows(dev)
    if "kernels" in parts:
        out["kernels"] = kernel_rows(rows, rates, dev)
        plot(out["kernels"], bl.RESULTS / f"{a.name}.png")
    sweep = [p for p in ("skinny", "block") if p in parts]
    if sweep:
        out["sweep"] = sweep_rows(sweep, rows, rates, dev)
    path = bl.save(a.name, out.pop("kernels", []), **out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
