"""Where Llama 4's MoE layers depart from HF on a GPU: layer by layer, on identical inputs.

Issue 37.2: with MoE every 2nd layer (8 experts, sigmoid top-1, shared expert, routing weight on
the input), the engine's teacher-forced agreement with HF float32 fell below HF's own bf16 run,
while the same model with dense MLPs did not.  This probe takes the accuracy gate's Llama 4
checkpoint (``hf_reference.write_checkpoint``, chunk 512 as in the issue) and one prompt of
prefix + suffix tokens, and reports:

1. **Whole model, layer by layer.** HF float32, HF bf16 and our model (bf16, one process, the
   default kernel; the prompt planned by the planner's own code as one prefill) on the same
   tokens; after each decoder layer, the relative error of bf16 HF and of ours against float32
   (``||h - h32|| / ||h32||`` over the tokens), and the argmax agreement of the final logits.
2. **Each MoE block on identical inputs.** The float32 reference's input to the block, rounded to
   bf16, through HF's bf16 block and through ours -- every implementation we have
   (``grouped``: the grouped GEMM that prefill and large decode batches run; ``small``: the
   Triton GEMV kernels of decode steps up to 8 tokens, here one row at a time; ``loop``: the
   torch reference) -- against HF's float32 block on the float32 input.  Errors per token
   (relative), how often each picks another expert than float32 does, and the float32 router
   margin (top-1 minus top-2 logit) where it does: a flip at a margin of the order of bf16's
   rounding of the logits is a near tie, not a defect.

    python scripts/probe_llama4_moe.py --device cuda            # on the H200
    python scripts/probe_llama4_moe.py                          # CPU: tiny shapes, loop only

Writes ``benchmarks/results/probe_llama4_moe.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_reference as hf  # noqa: E402

from ray_attn.config import ModelConfig  # noqa: E402
from ray_attn.model import build_model  # noqa: E402
from ray_attn.model.moe import SparseMoeBlock  # noqa: E402
from ray_attn.runtime.memory import profile_plan  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative error of ``a`` against the reference ``b`` (float64)."""
    a, b = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def summary(e: torch.Tensor) -> dict:
    e = e.float().cpu()
    return dict(mean=float(e.mean()), p99=float(e.quantile(0.99)), max=float(e.max()))


def hook_layers(layers, store: dict, inputs_of: str | None = None):
    """Forward hooks keeping each layer's output (and its ``inputs_of`` child's input and output)."""
    hooks = []
    for i, layer in enumerate(layers):
        def out_hook(mod, args, out, i=i):
            store.setdefault("out", {})[i] = (out[0] if isinstance(out, tuple) else out).detach()
        hooks.append(layer.register_forward_hook(out_hook))
        if inputs_of is not None:
            child = getattr(layer, inputs_of)

            def in_hook(mod, args, out, i=i):
                store.setdefault("mlp_in", {})[i] = args[0].detach()
                store.setdefault("mlp_out", {})[i] = (out[0] if isinstance(out, tuple) else out).detach()
            hooks.append(child.register_forward_hook(in_hook))
    return hooks


@torch.no_grad()
def our_forward(model, tokens: list[int], dev) -> tuple[torch.Tensor, dict]:
    """Our model over ``tokens`` as one prefill, planned by the planner (local batches included)."""
    cfg = model.config
    plan, nblk = profile_plan([len(tokens)], cfg, model.block_size, cfg.vocab_size)
    model.allocate_kv_cache(nblk)
    store: dict = {}
    hooks = hook_layers(model.layers, store, "mlp")
    try:
        ids = torch.tensor(tokens, device=dev)
        pos = torch.from_numpy(plan.positions.astype(np.int64)).to(dev)
        hidden = model(ids, pos, plan.attn.to_device(dev))
        logits = model.compute_logits(hidden, torch.arange(len(tokens), device=dev))
    finally:
        for h in hooks:
            h.remove()
        model.kv_caches = None
    return logits.float(), store


@torch.no_grad()
def hf_forward(model, tokens: list[int]) -> tuple[torch.Tensor, dict]:
    store: dict = {}
    hooks = hook_layers(model.model.layers, store, "feed_forward")
    try:
        logits = model(torch.tensor([tokens], device=model.device)).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return logits, store


@torch.no_grad()
def block_rows(block: SparseMoeBlock, x: torch.Tensor, impl: str, rows_per_call: int) -> torch.Tensor:
    old = block.experts.impl
    block.experts.impl = impl
    try:
        return torch.cat([block(x[i:i + rows_per_call]) for i in range(0, x.shape[0], rows_per_call)])
    finally:
        block.experts.impl = old


@torch.no_grad()
def moe_report(ours_block: SparseMoeBlock, hf32_block, hf16_block, x32: torch.Tensor, impls) -> dict:
    ref = hf32_block(x32)[0]
    xb = x32.to(torch.bfloat16)
    logits32 = hf32_block.router(x32)[1].float()
    top2 = logits32.topk(2, dim=-1)
    margin = (top2.values[:, 0] - top2.values[:, 1]).cpu()
    pick32 = top2.indices[:, 0].cpu()
    pick16 = hf16_block.router(xb)[1].float().argmax(-1).cpu()
    ours_pick = ours_block.route(xb)[1][:, 0].cpu()
    out = {"tokens": int(x32.shape[0]), "router_margin_p01": float(margin.quantile(0.01)),
           "hf_bf16": dict(rel=summary(rel(hf16_block(xb)[0], ref)), flips=int((pick16 != pick32).sum()),
                           flip_margins=margin[pick16 != pick32].tolist()[:20]),
           "ours_vs_hf_bf16_picks_differ": int((ours_pick != pick16).sum())}
    flips = ours_pick != pick32
    same = ~flips
    for impl, per_call in impls:
        y = block_rows(ours_block, xb, impl, per_call)
        e = rel(y, ref).cpu()
        out[f"ours_{impl}" + ("" if per_call >= x32.shape[0] else f"_{per_call}_rows")] = dict(rel=summary(e), rel_same_expert=summary(e[same]) if same.any() else None,
                                   flips=int(flips.sum()), flip_margins=margin[flips].tolist()[:20])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, default=None, help="attention_chunk_size (default 512 GPU, 32 CPU)")
    ap.add_argument("--prefix", type=int, default=None, help="prompt tokens (default 1200 + 500 on GPU)")
    ap.add_argument("--out", default="benchmarks/results/probe_llama4_moe.json")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    dev = torch.device(args.device)
    size = hf.GPU_SIZE if gpu else hf.CPU_SIZE
    chunk = args.chunk or (512 if gpu else 32)
    n = args.prefix or (1700 if gpu else 120)
    tokens = np.random.default_rng(0).integers(0, size["vocab"], n).tolist()
    report: dict = {"device": str(dev), "chunk": chunk, "tokens": n}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "llama4")
        hf.write_checkpoint("llama4", folder, size=size, seed=1, window=0, chunk=chunk,
                            dtype=torch.bfloat16 if gpu else torch.float32)
        hf32 = hf.load_hf(folder, torch.float32, dev, "eager")
        hf16 = hf.load_hf(folder, torch.bfloat16, dev, "eager")
        cfg = ModelConfig.from_pretrained(folder, dtype="bfloat16")
        ours = build_model(cfg, block_size=16, device=args.device)
        ours.load_weights(folder)
        l32, s32 = hf_forward(hf32, tokens)
        l16, s16 = hf_forward(hf16, tokens)
        lo, so = our_forward(ours, tokens, dev)
        want = l32.argmax(-1)
        report["argmax_agreement"] = {"hf_bf16": float((l16.argmax(-1) == want).float().mean()),
                                      "ours": float((lo.argmax(-1) == want).float().mean())}
        moe = set(cfg.moe_layer_ids)
        layers = []
        for i in range(cfg.num_hidden_layers):
            layers.append(dict(layer=i, moe=i in moe, hf_bf16=summary(rel(s16["out"][i], s32["out"][i])),
                               ours=summary(rel(so["out"][i], s32["out"][i])),
                               mlp_in_hf_bf16=summary(rel(s16["mlp_in"][i], s32["mlp_in"][i])),
                               mlp_in_ours=summary(rel(so["mlp_in"][i], s32["mlp_in"][i]))))
        report["layers"] = layers
        impls = [("loop", n)] + ([("grouped", n), ("small", 1), ("small", 8)] if gpu else [])
        report["moe_blocks"] = {i: moe_report(ours.layers[i].mlp, hf32.model.layers[i].feed_forward,
                                              hf16.model.layers[i].feed_forward, s32["mlp_in"][i].reshape(n, -1),
                                              impls) for i in sorted(moe)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("argmax_agreement",)}, indent=1))
    for r in report["layers"]:
        print(f"layer {r['layer']} {'moe  ' if r['moe'] else 'dense'} rel err mean: hf_bf16 {r['hf_bf16']['mean']:.2e} "
              f"ours {r['ours']['mean']:.2e} | mlp input: hf_bf16 {r['mlp_in_hf_bf16']['mean']:.2e} "
              f"ours {r['mlp_in_ours']['mean']:.2e}")
    for i, b in report["moe_blocks"].items():
        line = [f"moe layer {i}: hf_bf16 {b['hf_bf16']['rel']['mean']:.2e} ({b['hf_bf16']['flips']} flips)"]
        line += [f"{k} {v['rel']['mean']:.2e} ({v['flips']} flips)" for k, v in b.items() if k.startswith("ours_")
                 and isinstance(v, dict)]
        print("; ".join(line) + f"; picks ours!=hf_bf16: {b['ours_vs_hf_bf16_picks_differ']}")


if __name__ == "__main__":
    main()
