"""MoE speed: decode steps of Qwen3-30B-A3B- and Llama-4-Scout-shaped models (random weights) against
the roofline of the weights each step actually reads, and the experts kernel alone.

Decode (the model's forward + logits of one step, replayed from a CUDA graph on GPUs, eager too):
at batch 1 a step reads the attention weights, the dense layers, the experts its token picks, the
shared experts, the LM head and its KV; at batch 64 and 256 the union of the experts its tokens
hit (counted from the routing of that very step, per layer).  Roofline = those bytes / the copy
bandwidth measured here (or the GEMM FLOPs / the GEMM rate, whichever is larger).

Kernel (one sparse layer's experts, the model's expert shapes): the grouped GEMM path
(``fused_moe_grouped``, what runs on CUDA) against the per-expert loop (``fused_moe_loop``), the
small-batch GEMV kernels (``moe_small.fused_moe_small``, up to ``--small-max-tokens`` tokens, on
GPUs) and one dense GEMM pair of the same FLOPs (every routed row through one expert's weights),
with the roofline of the experts hit.  Decode steps up to that batch run with the small kernels
too (``moe_impl`` "small" beside "auto"), which is the measurement ``moe_small.SMALL_MAX_TOKENS``
waits for.

    python scripts/bench_moe.py                      # GPU: qwen3-30b-a3b (48 layers), llama-4-scout (20 layers)
    python scripts/bench_moe.py --scout-layers 16 --batches 1,64,256 --ctx 1024
    python scripts/bench_moe.py                      # CPU: tiny stand-ins, tiny sizes

Writes benchmarks/results/bench_moe.json and bench_moe.png.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.config import ModelConfig  # noqa: E402
from ray_attn.model import build_model  # noqa: E402
from ray_attn.model.moe import (FusedMoE, SparseMoeBlock, fused_moe_grouped, fused_moe_loop,  # noqa: E402
                                grouped_mm_supported, select_experts)
from ray_attn.model.moe_small import fused_moe_small, small_supported  # noqa: E402

BLOCK = 16


def time_call(fn, iters: int) -> tuple[float, float | None]:
    """(eager seconds, CUDA-graph replay seconds or None)."""
    return bl.timeit(fn, iters=iters, warmup=2), bl.graph_timeit(fn, iters=iters, warmup=2)


def expert_bytes(m: ModelConfig, el: int) -> int:
    return 3 * m.hidden_size * m.expert_intermediate_size * el


def step_bytes(model, hits: list[int], batch: int, ctx: int) -> int:
    """Bytes a decode step reads: every weight but the embedding table and the routed experts, the
    experts hit (``hits``: distinct experts per sparse layer, this step), and each row's KV."""
    m, el = model.config, model.embed_tokens.element_size()
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts.w" in n)
    dense = sum(p.numel() for p in model.parameters()) - routed - model.embed_tokens.numel() + (
        model.lm_head.numel() if m.tie_word_embeddings else 0)
    kv = batch * ctx * model.kv_cache_bytes_per_block() // model.block_size
    return dense * el + sum(hits) * expert_bytes(m, el) + kv


def step_flops(model, batch: int) -> float:
    m = model.config
    active = sum(p.numel() for n, p in model.named_parameters() if ".experts.w" not in n and p.dim() >= 2)
    active += len(m.moe_layer_ids) * m.num_experts_per_tok * 3 * m.hidden_size * m.expert_intermediate_size
    return 2.0 * batch * (active - model.embed_tokens.numel() + model.lm_head.numel() * m.tie_word_embeddings)


def small_runs(x, w13, w2, dev, T: int, small_max: int) -> bool:
    """Whether the small-batch kernels are measured here: compiled Triton on a GPU, few tokens."""
    return dev.type == "cuda" and T <= small_max and small_supported(x, w13, w2)


def decode_rows(name: str, m: ModelConfig, batches: list[int], ctx: int, rates: dict, dev, iters: int,
                small_max: int = 0) -> list[dict]:
    model = build_model(m, device=dev, block_size=BLOCK, kernel="auto" if dev.type == "cuda" else "torch")
    model.init_random_weights(0)
    hits: list[torch.Tensor] = []
    route = SparseMoeBlock.route

    def counting_route(block, x):  # the experts this step's tokens hit, per sparse layer
        w, ids = route(block, x)
        hits.append(ids)
        return w, ids

    rows = []
    for batch in batches:
        meta, *_ = bl.paged_decode_inputs(batch, ctx, BLOCK, 1, 8, torch.float32, "cpu")
        model.allocate_kv_cache(int(meta.block_table.max()) + 2)
        ids = torch.randint(0, m.vocab_size, (batch,), device=dev, dtype=torch.int32)
        pos = torch.full((batch,), ctx - 1, device=dev, dtype=torch.int32)
        md = meta.to_device(dev)
        idx = torch.arange(batch, device=dev)
        step = lambda: model.compute_logits(model(ids, pos, md), idx)  # noqa: E731
        SparseMoeBlock.route = counting_route
        try:
            hits.clear()
            step()
            union = [int(torch.unique(i).numel()) for i in hits]
        finally:
            SparseMoeBlock.route = route
        nbytes = step_bytes(model, union, batch, ctx)
        roof = max(nbytes / rates["copy_Bps"], step_flops(model, batch) / rates["gemm_flops"])
        experts = [mod for mod in model.modules() if isinstance(mod, FusedMoE)]
        w13, w2 = experts[0].w13, experts[0].w2
        x0 = torch.zeros(batch, m.hidden_size, device=dev, dtype=w13.dtype)
        for impl in ["auto"] + (["small"] if small_runs(x0, w13, w2, dev, batch, small_max) else []):
            for mod in experts:
                mod.impl = impl
            eager, graph = time_call(step, iters)
            best = graph or eager
            rows.append(dict(kind="decode", model=name, moe_impl=impl, layers=m.num_hidden_layers, batch=batch,
                             ctx=ctx, experts_hit_per_layer=sum(union) / max(len(union), 1), step_ms=eager * 1e3,
                             graph_ms=None if graph is None else graph * 1e3, bytes_read=nbytes,
                             roofline_ms=roof * 1e3, frac_of_roofline=roof / best))
        for mod in experts:
            mod.impl = "auto"
        model.kv_caches = model.kv_cache_stack = None
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def kernel_rows(name: str, m: ModelConfig, tokens: list[int], rates: dict, dev, iters: int,
                small_max: int = 0) -> list[dict]:
    E, k, H, n = m.num_local_experts, m.num_experts_per_tok, m.hidden_size, m.expert_intermediate_size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * n, H, device=dev, dtype=dtype, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, n, device=dev, dtype=dtype, generator=g) * n ** -0.5
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
        w, ids = select_experts(torch.randn(T, E, device=dev, generator=g), k, "softmax", True)
        hit = int(torch.unique(ids).numel())
        # the same FLOPs through one expert's weights: every routed row, one GEMM per projection
        xd = x.repeat_interleave(k, 0)
        dense = lambda: torch.nn.functional.linear(  # noqa: E731
            torch.nn.functional.silu(torch.nn.functional.linear(xd, w13[0, :n])) *
            torch.nn.functional.linear(xd, w13[0, n:]), w2[0])
        grouped = lambda: fused_moe_grouped(x, w13, w2, w, ids)  # noqa: E731
        loop = lambda: fused_moe_loop(x, w13, w2, w, ids)  # noqa: E731
        small = lambda: fused_moe_small(x, w13, w2, w, ids)  # noqa: E731
        row = dict(kind="kernel", model=name, tokens=T, experts=E, top_k=k, hidden=H, expert_width=n,
                   experts_hit=hit, grouped_available=grouped_mm_supported(x, w13, w2) or dev.type == "cpu")
        fns = [("grouped", grouped), ("loop", loop), ("dense", dense)]
        if small_runs(x, w13, w2, dev, T, small_max):
            fns.append(("small", small))
        else:
            row["small_us"] = row["small_graph_us"] = None
        for label, fn in fns:
            try:
                eager, graph = time_call(fn, iters) if label != "loop" else (bl.timeit(fn, iters=iters), None)
            except RuntimeError as e:  # grouped_mm refused (alignment, dtype): recorded, not fatal
                row[f"{label}_error"] = str(e)[:200]
                eager = graph = None
            row[f"{label}_us"] = None if eager is None else eager * 1e6
            row[f"{label}_graph_us"] = None if graph is None else graph * 1e6
        nbytes = hit * expert_bytes(m, w13.element_size()) + 2 * T * H * w13.element_size()
        roof = max(nbytes / rates["copy_Bps"], 2.0 * T * k * 3 * H * n / rates["gemm_flops"])
        row["roofline_us"] = roof * 1e6
        best = row["grouped_graph_us"] or row["grouped_us"]
        row["grouped_frac_of_roofline"] = None if best is None else roof * 1e6 / best
        row["grouped_vs_loop"] = None if not (best and row["loop_us"]) else row["loop_us"] / best
        small_best = row["small_graph_us"] or row["small_us"]
        row["small_frac_of_roofline"] = None if small_best is None else roof * 1e6 / small_best
        row["small_vs_grouped"] = None if not (small_best and best) else best / small_best
        rows.append(row)
    return rows


def plot(rows: list[dict], path) -> None:
    """The kernel panels per model and the decode steps against their rooflines."""
    panels = []
    for name in dict.fromkeys(r["model"] for r in rows if r["kind"] == "kernel"):
        ks = [r for r in rows if r["kind"] == "kernel" and r["model"] == name]
        xs = [r["tokens"] for r in ks]
        series = {lbl: (xs, [r[f"{lbl}_graph_us"] or r[f"{lbl}_us"] for r in ks])
                  for lbl in ("grouped", "loop", "dense") if all(r[f"{lbl}_us"] for r in ks)}
        small = [r for r in ks if r["small_us"]]
        if small:
            series["small (GEMV kernels)"] = ([r["tokens"] for r in small],
                                              [r["small_graph_us"] or r["small_us"] for r in small])
        series["roofline (experts hit)"] = (xs, [r["roofline_us"] for r in ks])
        panels.append((f"{name}: one sparse layer's experts", series))
    dec = [r for r in rows if r["kind"] == "decode"]
    if dec:
        series = {}
        for name in dict.fromkeys(r["model"] for r in dec):
            d = [r for r in dec if r["model"] == name and r["moe_impl"] == "auto"]
            series[f"{name} step"] = ([r["batch"] for r in d], [(r["graph_ms"] or r["step_ms"]) * 1e3 for r in d])
            ds = [r for r in dec if r["model"] == name and r["moe_impl"] == "small"]
            if ds:
                series[f"{name} step, small MoE"] = ([r["batch"] for r in ds],
                                                     [(r["graph_ms"] or r["step_ms"]) * 1e3 for r in ds])
            series[f"{name} roofline"] = ([r["batch"] for r in d], [r["roofline_ms"] * 1e3 for r in d])
        panels.append(("decode step", series))
    # Log y: the per-expert loop is up to 50x the grouped kernel, which would flatten the rest.
    bl.plot_panels(path, panels, "tokens (batch)", "microseconds", logy=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="presets (default: qwen3-30b-a3b,llama-4-scout on GPU, tiny "
                    "stand-ins on CPU)")
    ap.add_argument("--scout-layers", type=int, default=20, help="llama-4-scout layers (48 do not fit one GPU)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,4,64,256; CPU 1,8)")
    ap.add_argument("--tokens", default=None, help="kernel token counts (default 1,2,4,8,64,256,1024; CPU 1,16)")
    ap.add_argument("--ctx", type=int, default=None, help="context per decoding sequence (default 1024; CPU 32)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--skip-decode", action="store_true", help="the kernel benchmark only")
    ap.add_argument("--small-max-tokens", type=int, default=8,
                    help="measure the small-batch MoE kernels up to this many tokens (GPU only)")
    a = ap.parse_args(argv)
    dev = bl.device()
    gpu = dev.type == "cuda"
    models = (a.models or ("qwen3-30b-a3b,llama-4-scout" if gpu else "tiny-qwen3-moe,tiny-llama4")).split(",")
    ints = lambda s, d: [int(v) for v in (s or d).split(",")]  # noqa: E731
    batches = ints(a.batches, "1,4,64,256" if gpu else "1,8")
    tokens = ints(a.tokens, "1,2,4,8,64,256,1024" if gpu else "1,16")
    ctx, iters = a.ctx or (1024 if gpu else 32), a.iters or (20 if gpu else 2)
    rates = dict(copy_Bps=bl.copy_bandwidth(1 << 30 if gpu else 1 << 24, dev), gemm_flops=bl.matmul_flops(dev))
    print(f"copy {rates['copy_Bps'] / 1e9:,.0f} GB/s, GEMM {rates['gemm_flops'] / 1e12:,.2f} TFLOP/s")
    rows = []
    for name in models:
        m = ModelConfig.from_name(name, **({"dtype": "float32"} if not gpu else {}))
        if name == "llama-4-scout":
            L = a.scout_layers
            m = m.model_copy(update=dict(num_hidden_layers=L, layer_types=m.layer_kinds()[:L],
                                         no_rope_layers=m.no_rope_layers[:L]))
        m = ModelConfig(**m.model_dump())  # validated again (the layer overrides)
        rows += kernel_rows(name, m, tokens, rates, dev, iters, a.small_max_tokens)
        if not a.skip_decode:
            rows += decode_rows(name, m, batches, ctx, rates, dev, iters, a.small_max_tokens)
    bl.print_table([r for r in rows if r["kind"] == "kernel"], ["model", "tokens", "experts_hit", "grouped_us",
                   "grouped_graph_us", "small_graph_us", "loop_us", "dense_us", "roofline_us",
                   "grouped_frac_of_roofline", "small_frac_of_roofline", "grouped_vs_loop"],
                   "experts of one sparse layer")
    if not a.skip_decode:
        bl.print_table([r for r in rows if r["kind"] == "decode"], ["model", "moe_impl", "layers", "batch", "ctx",
                       "experts_hit_per_layer", "step_ms", "graph_ms", "roofline_ms", "frac_of_roofline"],
                       "decode step")
    path = bl.save("bench_moe", rows, rates=rates, models=models)
    plot(rows, bl.RESULTS / "bench_moe.png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
