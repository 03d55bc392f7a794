"""Issue 39: fuse a decoder layer's elementwise work into its neighbours -- Inductor or our Triton?

The issue asks for an honest comparison on the same layers, keeping the faster: torch.compile
(Inductor) over the layer's non-attention ops, inside our CUDA graphs, with FA3 left opaque, against
the hand-written kernels of ``ray_attn/model/fused.py`` (and ``gemv.linear``).  This script builds
the non-attention part of a decoder layer with random bf16 weights -- input RMSNorm, qkv
projection, (Qwen3's per-head q/k RMSNorm), RoPE, an opaque attention stand-in, o_proj, residual
add + RMSNorm, gate_up, SiLU-and-mul, down_proj, residual add -- and times it three ways, each
captured in one CUDA graph and replayed (what a decode step pays):

  eager    plain torch ops, as the CPU reference computes them (the model's torch fallbacks)
  compile  the same function through torch.compile(fullgraph=True, dynamic=False), then captured
  triton   the project's fused ops and gemv.linear

``--layers`` layers with their own weights run in one graph (the time is reported per layer), so
one layer's ~436 MB of 8B weights is never served from the 60 MB L2.  Per point: us per layer,
kernels per layer (torch.profiler over one direct call), the linears' weight-read roofline at the
copy rate, and each variant's max |diff| against eager relative to max |eager|; a variant past
``--tol`` (or a triton/eager failure) makes the script fail after writing the JSON.  A
torch.compile failure is recorded as that row's ``error`` and the other variants go on.

    python3 scripts/bench_fusion.py --json benchmarks/results/bench_fusion.json       # H200
    python3 scripts/bench_fusion.py --compile-mode max-autotune-no-cudagraphs --rows 1 8
    python scripts/bench_fusion.py --device cpu --preset tiny tiny-qknorm --variants eager,triton  # its test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import benchlib as bl  # noqa: E402
from ray_attn.model import fused, gemv  # noqa: E402
from ray_attn.model.layers import RotaryEmbedding  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # progress is only a nicety
    tqdm = None


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head: int
    inter: int
    qk_norm: bool
    eps: float = 1e-5
    theta: float = 500000.0


PRESETS = {
    "llama-3-8b": Shape(4096, 32, 8, 128, 14336, False),
    "qwen3-8b": Shape(4096, 32, 8, 128, 12288, True, eps=1e-6, theta=1000000.0),
    "tiny": Shape(64, 4, 2, 16, 128, False),
    "tiny-qknorm": Shape(64, 4, 2, 16, 128, True, eps=1e-6),
}
VARIANTS = ("eager", "compile", "triton")


# The attention stand-in: a custom op is a black box to Dynamo and Inductor, as FA3 is in the
# model, so no fusion crosses it (an aten clone would be traced and fused away).  It takes k and v
# too, so the work that produces them (k's norm and RoPE) stays live, as the KV-cache write keeps
# it in the model; its one copy kernel is in every variant's count alike.
@torch.library.custom_op("bench_fusion::attn_standin", mutates_args=())
def attn_standin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    out.view(q.shape).copy_(q)
    return out


@attn_standin.register_fake
def _(q, k, v):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def make_weights(s: Shape, layers: int, dev) -> list[dict]:
    """Random bf16 weights, linears scaled by 1/sqrt(K) so activations stay O(1) down the chain."""
    def lin(n, k):
        return (torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, device=dev)).to(torch.bfloat16)

    qkv = (s.heads + 2 * s.kv_heads) * s.head
    return [dict(ln1=norm(s.hidden), qkv=lin(qkv, s.hidden), qn=norm(s.head), kn=norm(s.head),
                 o=lin(s.hidden, s.heads * s.head), ln2=norm(s.hidden), gu=lin(2 * s.inter, s.hidden),
                 down=lin(s.hidden, s.inter)) for _ in range(layers)]


def _rms(x, w, eps):
    # HF's rounding order: normalise in float32, cast back, then scale.
    return w * F.rms_norm(x.float(), w.shape, eps=eps).to(x.dtype)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def eager_layer(s: Shape, h, w, cos, sin):
    T, D, nq, nk = h.shape[0], s.head, s.heads, s.kv_heads
    x = _rms(h, w["ln1"], s.eps)
    qk, v = F.linear(x, w["qkv"]).split([(nq + nk) * D, nk * D], dim=-1)
    qk = qk.view(T, nq + nk, D)
    if s.qk_norm:
        q, k = qk.split([nq, nk], dim=1)
        q, k = _rope(_rms(q, w["qn"], s.eps), cos, sin), _rope(_rms(k, w["kn"], s.eps), cos, sin)
    else:  # the model's torch path rotates q and k heads in one pass
        q, k = _rope(qk, cos, sin).split([nq, nk], dim=1)
    a = F.linear(attn_standin(q, k, v.view(T, nk, D)), w["o"])
    h = h + a
    g, u = F.linear(_rms(h, w["ln2"], s.eps), w["gu"]).chunk(2, dim=-1)
    return h + F.linear(F.silu(g) * u, w["down"])


def triton_layer(s: Shape, h, delta, w, cos, sin):
    """The model's CUDA path (model/llama.py ``forward_residual``): takes the layer before's MLP
    output ``delta`` into its first norm's kernel and hands its own on; at one row the SiLU
    product is made inside down_proj's GEMV."""
    T, D, nq, nk = h.shape[0], s.head, s.heads, s.kv_heads
    if delta is None:
        x = fused.rms_norm(h, w["ln1"], s.eps)
    else:
        h, x = fused.add_rms_norm(h, delta, w["ln1"], s.eps)
    qk, v = gemv.linear(x, w["qkv"]).split([(nq + nk) * D, nk * D], dim=-1)
    qk = qk.view(T, nq + nk, D)
    if s.qk_norm:
        q, k = fused.qk_norm_rope(qk, w["qn"], w["kn"], s.eps, cos, sin, nq)
    else:
        q, k = fused.apply_rope(qk, cos, sin).split([nq, nk], dim=1)
    a = gemv.linear(attn_standin(q, k, v.view(T, nk, D)), w["o"])
    h, x = fused.add_rms_norm(h, a, w["ln2"], s.eps)
    gu = gemv.linear(x, w["gu"])
    if gemv.use_gemv_silu_mul(gu, w["down"]):
        return h, gemv.gemv(gu, w["down"], silu_mul=True)
    return h, gemv.linear(fused.silu_mul(gu), w["down"])


def chain(layer, s: Shape):
    """All layers in one call: what one graph replays.  Compiled whole, so Inductor may also fuse
    a layer's last residual add into the next layer's norm, as it would over a whole model (and
    the triton chain does it by hand, as the model does)."""
    def run(h, cos, sin, weights):
        if layer is triton_layer:
            delta = None
            for w in weights:
                h, delta = triton_layer(s, h, delta, w, cos, sin)
            return h + delta
        for w in weights:
            h = layer(s, h, w, cos, sin)
        return h
    return run


def cuda_graph_us(fn, iters: int, batches: int) -> tuple[float, torch.Tensor]:
    """Median us per replay of ``fn`` captured in a CUDA graph, over ``batches`` event-timed runs
    of ``iters`` back-to-back replays; and the graph's output (a copy)."""
    side = torch.cuda.Stream()  # warm-up (Triton JIT, cuBLAS handles) off the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    out = out.clone()
    del graph  # its memory pool goes before the next point allocates
    return statistics.median(samples), out


def cpu_us(fn, iters: int, batches: int) -> tuple[float, torch.Tensor]:
    out = fn()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(samples), out


def kernels(fn) -> int:
    """GPU activities (kernels, memsets, copies) of one direct call of ``fn``: a graph's nodes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one cycle is all we ask
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def run_variant(variant, s, h, cos, sin, weights, args, cuda) -> tuple[dict, torch.Tensor]:
    fn = chain(triton_layer if variant == "triton" else eager_layer, s)
    row = {}
    if variant == "compile":
        torch._dynamo.reset()  # a fresh compile per point: no recompile limit, no stale graphs
        fn = torch.compile(fn, fullgraph=True, dynamic=False,
                           mode=None if args.compile_mode == "default" else args.compile_mode)
        t0 = time.perf_counter()
        fn(h, cos, sin, weights)  # compiles (and autotunes) here, outside the graph and timing
        if cuda:
            torch.cuda.synchronize()
        row["compile_s"] = round(time.perf_counter() - t0, 1)
    call = lambda: fn(h, cos, sin, weights)  # noqa: E731
    us, out = cuda_graph_us(call, args.iters, args.batches) if cuda else cpu_us(call, args.iters, args.batches)
    row.update(us_per_layer=us / len(weights), call_us=us)  # call: one graph replay on CUDA
    row["kernels_per_layer"] = round(kernels(call) / len(weights), 2) if cuda else None
    return row, out


def fmt(v, nd=3):
    if v is None:
        return "-"
    return f"{v:.{nd}g}" if isinstance(v, float) and abs(v) < 1 else f"{v:,.1f}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict]) -> None:
    cols = [("preset", 12), ("rows", 5), ("variant", 8), ("us_per_layer", 13), ("vs_eager", 9),
            ("kernels_per_layer", 18), ("roofline_us", 12), ("frac_of_roofline", 17), ("rel_diff", 10)]
    print("  ".join(f"{c:>{w}}" for c, w in cols) + "  error")
    for r in rows:
        print("  ".join(f"{fmt(r.get(c)):>{w}}" for c, w in cols) + f"  {r.get('error') or ''}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["llama-3-8b", "qwen3-8b"], choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="tokens per step (decode batch)")
    ap.add_argument("--layers", type=int, default=4, help="layers with their own weights in one graph")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                    help="torch.compile mode; modes with Inductor's own CUDA graphs would clash with ours")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--copy-gbps", type=float, default=None, help="copy rate for the roofline (default: measure)")
    ap.add_argument("--iters", type=int, default=20, help="graph replays per timed batch")
    ap.add_argument("--batches", type=int, default=7, help="timed batches (the median is reported)")
    ap.add_argument("--tol", type=float, default=5e-2, help="max |diff| / max |eager| allowed")
    ap.add_argument("--json", default=str(bl.RESULTS / "bench_fusion.json"))
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}")
    variants = ["eager"] + [v for v in VARIANTS[1:] if v in variants]  # eager is the reference
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda" if cuda else "cpu")
    # A big device-to-device copy (bytes read + written per second): the rate a weight stream reaches.
    copy_bps = args.copy_gbps * 1e9 if args.copy_gbps else bl.copy_bandwidth(1 << 30 if cuda else 1 << 24, dev)
    points = [(p, t, v) for p in args.preset for t in args.rows for v in variants]
    bar = tqdm(total=len(points), desc="bench_fusion") if tqdm is not None else None
    say = bar.write if bar is not None else print
    say(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, copy {copy_bps / 1e9:,.0f} GB/s, "
        f"{args.layers} layers a graph, compile mode {args.compile_mode}")
    rows = []
    torch.set_grad_enabled(False)
    for preset in args.preset:
        s = PRESETS[preset]
        torch.manual_seed(0)
        weights = make_weights(s, args.layers, dev)
        wbytes = sum(weights[0][k].numel() * weights[0][k].element_size() for k in ("qkv", "o", "gu", "down"))
        rope = RotaryEmbedding(s.head, 4096, s.theta, device=dev)
        for T in args.rows:
            h = torch.randn(T, s.hidden, device=dev).to(torch.bfloat16)
            cos, sin = rope.cos_sin(torch.randint(0, 4096, (T,), device=dev), torch.bfloat16)
            ref = chain(eager_layer, s)(h, cos, sin, weights)  # direct, no graph: the reference
            scale = ref.float().abs().max().item() or 1.0
            for variant in variants:
                row = dict(preset=preset, rows=T, layers=args.layers, variant=variant, graphed=cuda,
                           weight_bytes_per_layer=wbytes, roofline_us=wbytes / copy_bps * 1e6)
                if bar is not None:
                    bar.set_postfix_str(f"{preset} rows={T} {variant}")
                try:
                    r, out = run_variant(variant, s, h, cos, sin, weights, args, cuda)
                    row.update(r, rel_diff=(out.float() - ref.float()).abs().max().item() / scale)
                    eager = row if variant == "eager" else next(x for x in rows if x["preset"] == preset
                                                                   and x["rows"] == T and x["variant"] == "eager")
                    row.update(frac_of_roofline=row["roofline_us"] / row["us_per_layer"],
                               vs_eager=eager["us_per_layer"] / row["us_per_layer"])
                except Exception as e:  # noqa: BLE001 -- a failing variant must not stop the others
                    if variant == "eager":
                        raise
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                    what = "torch.compile" if variant == "compile" else "the run"
                    say(f"NOTE: {preset} rows={T} {variant} failed ({what}): {row['error']}")
                    if cuda:  # a broken capture may leave an error pending: drain it, go on
                        with contextlib.suppress(Exception):
                            torch.cuda.synchronize()
                rows.append(row)
                if bar is not None:
                    bar.update()
        del weights
        if cuda:
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    print_table(rows)
    for preset in args.preset:  # the question: which fusion to keep, point by point
        for T in args.rows:
            by = {r["variant"]: r for r in rows if r["preset"] == preset and r["rows"] == T and r.get("us_per_layer")}
            if "compile" in by and "triton" in by:
                c, t = by["compile"]["us_per_layer"], by["triton"]["us_per_layer"]
                print(f"{preset} rows={T}: {'triton' if t <= c else 'compile'} faster "
                      f"({max(c, t) / min(c, t):.2f}x; compile {c:.1f} us, triton {t:.1f} us a layer)")
    bad = [r for r in rows if (r.get("rel_diff") or 0) > args.tol or (r.get("error") and r["variant"] != "compile")]
    for r in rows:
        r["numerics_ok"] = r.get("rel_diff") is not None and r["rel_diff"] <= args.tol
    out = dict(device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
               torch=torch.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
               machine=bl.machine(), copy_GBps=copy_bps / 1e9, compile_mode=args.compile_mode, tol=args.tol,
               fused_qk_norm_rope=hasattr(fused, "qk_norm_rope"), gemv_enabled=gemv.ENABLED, rows=rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if bad:
        raise RuntimeError("numerics check failed: " + "; ".join(
            f"{r['preset']} rows={r['rows']} {r['variant']}: "
            + (r.get("error") or f"rel diff {r['rel_diff']:.3g} > {args.tol}") for r in bad))
    return out


if __name__ == "__main__":
    main()
