"""Tune the batched LoRA kernels' launch settings on this GPU, inside CUDA graphs, and write them
where ``ray_attn/lora/tuning.py`` reads them (``--write``).

For each projection of the model (fused q/k/v, o, fused gate/up, down) and each step size, a graph
of ``--layers`` layers runs the base GEMM and the LoRA update per layer, as a decode step does, and
the adapter's cost is that graph's replay time less the same graph without the LoRA call.  The base
GEMMs between the layers evict the previous layer's adapter from L2, as in a real step.  Steps of T
tokens spread over ``min(T, adapters)`` slots (batch 1: one adapter; batch 64 over 8 adapters: 8
tokens each).  A coordinate descent from the defaults and from a fused start varies one setting at a
time (``tuning.KernelConfig``) and keeps what is faster, until ``--budget-s`` is spent.  It also
reports each winner's cost when every token is the base model's (the empty programs a replay still
launches).

    python scripts/bench_lora_kernels.py --write                 # H200: llama-3-8b, rank 16, 8 slots
    python scripts/bench_lora_kernels.py --preset tiny --layers 2 --tokens 1 4 --budget-s 5   # CPU (interpreter)

On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1`` is set before Triton loads),
eagerly and without graphs: the test's path, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: the kernels run interpreted on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_attn.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from ray_attn.lora import punica, tuning  # noqa: E402
from ray_attn.lora.tuning import KernelConfig  # noqa: E402

# the values each setting may take (a config the kernels cannot run is skipped)
SPACE = dict(fused=[False, True], block_k=[64, 128, 256, 512], block_n=[32, 64, 128, 256, 512],
             num_warps=[1, 2, 4, 8], num_stages=[1, 2, 3, 4], expand_warps=[1, 2, 4, 8],
             split_min_k=[128, 256, 512, 1024], max_split=[8, 16, 32, 64])
STARTS = [tuning.DEFAULT, KernelConfig(fused=True, block_k=256, block_n=128)]


def projections(model: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (K, the parts' output rows), as TP=1 LoRALinear sees them."""
    H, I, D = model.hidden_size, model.intermediate_size, model.head_size
    q, kv = model.num_attention_heads * D, model.num_key_value_heads * D
    return {"qkv": (H, (q, kv, kv)), "o": (q, (H,)), "gate_up": (H, (I, I)), "down": (I, (H,))}


class Case:
    """One projection at one step size: its layers' weights, adapters and step metadata."""

    def __init__(self, K, rows, T, adapters, rank, layers, dtype, device, empty=False):
        g = torch.Generator(device=device).manual_seed(T * 7 + K)
        self.T, self.K, self.N, self.rank = T, K, sum(rows), rank
        self.offsets = tuple(int(sum(rows[:i])) for i in range(len(rows)))
        P = len(rows)
        mk = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)  # noqa: E731
        self.x = mk(T, K)
        self.y = torch.empty(T, self.N, dtype=dtype, device=device)
        self.w = [mk(self.N, K, scale=K ** -0.5) for _ in range(layers)]
        self.a = [mk(adapters, P * rank, K, scale=K ** -0.5) for _ in range(layers)]
        self.b = [mk(adapters, self.N, rank, scale=0.01) for _ in range(layers)]
        slots = torch.full((T,), -1) if empty else torch.arange(T) % min(T, adapters)
        order, start = punica.step_meta(slots.numpy(), adapters)
        padded = torch.zeros(T, dtype=torch.int32)  # a fixed-size buffer, as the engine's (never empty)
        padded[:len(order)] = torch.from_numpy(order)
        self.sorted = padded.to(device)
        self.start = torch.from_numpy(start).to(device)
        self.scratch = torch.empty(punica.scratch_elems(T, P * rank), dtype=torch.float32, device=device)

    def step(self, cfg: KernelConfig | None) -> None:
        for w, a, b in zip(self.w, self.a, self.b):
            torch.mm(self.x, w.t(), out=self.y)
            if cfg is not None:
                punica.lora_triton(self.x, self.y, a, b, self.offsets, self.rank, self.sorted, self.start,
                                   self.scratch, config=cfg)


def time_step(case: Case, cfg: KernelConfig | None, reps: int, rounds: int = 3) -> float:
    """Microseconds of one replay of the case's layers (eager on CPU)."""
    if not case.x.is_cuda:
        t0 = time.perf_counter()
        case.step(cfg)
        return (time.perf_counter() - t0) * 1e6
    case.step(cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.step(cfg)
    for _ in range(3):
        graph.replay()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    best = []
    for _ in range(rounds):
        ev[0].record()
        for _ in range(reps):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        best.append(ev[0].elapsed_time(ev[1]) * 1e3 / reps)
    del graph
    return min(best)


def valid(cfg: dict) -> KernelConfig | None:
    """``cfg`` as a config, the settings a fused kernel ignores at their defaults (so two fused
    configs that differ only there are one); None where the kernels cannot run it."""
    if cfg["fused"]:
        cfg = cfg | {k: getattr(tuning.DEFAULT, k) for k in ("expand_warps", "split_min_k", "max_split")}
        cfg["split_min_k"] = max(cfg["split_min_k"], cfg["block_k"])
    try:
        return KernelConfig(**cfg)
    except ValueError:
        return None


def descend(case: Case, base_us: float, reps: int, deadline: float, log) -> tuple[KernelConfig, float, int]:
    """Coordinate descent over ``SPACE`` from each of ``STARTS``: (best config, its LoRA us a layer, evals)."""
    seen: dict[KernelConfig, float] = {}
    layers = len(case.w)

    def cost(cfg: KernelConfig) -> float:
        if cfg not in seen:
            try:
                seen[cfg] = (time_step(case, cfg, reps) - base_us) / layers
            except Exception as e:  # a setting this Triton or GPU cannot compile: out of the race
                log(f"    {cfg}: {type(e).__name__}: {str(e)[:120]}")
                seen[cfg] = float("inf")
        return seen[cfg]

    curs = list(STARTS)
    for _ in range(2):  # two passes: a setting may pay only once another has moved
        for j in range(len(curs)):  # each start in turn, so a short budget still tries both
            for name, values in SPACE.items():
                if time.monotonic() > deadline:
                    break
                for v in values:
                    c = valid(dataclasses.asdict(curs[j]) | {name: v})
                    if c is not None and cost(c) < cost(curs[j]):
                        curs[j] = c
    best = min(seen, key=seen.get)
    return best, seen[best], len(seen)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 16, 4], help="step sizes, most wanted first")
    ap.add_argument("--adapters", type=int, default=8, help="max_loras: the slots stacked in A and B")
    ap.add_argument("--rank", type=int, default=16, help="the padded rank (max_lora_rank up to 16s)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing (3 timings, the best kept)")
    ap.add_argument("--budget-s", type=float, default=420, help="the whole sweep's time; split over the cases")
    ap.add_argument("--only", nargs="*", default=None, help="projections to tune (default: all)")
    ap.add_argument("--write", action="store_true", help="write the table for this device")
    ap.add_argument("--config-dir", default=str(tuning.CONFIG_DIR), help="where --write puts it")
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = ModelConfig(**MODEL_PRESETS[args.preset])
    dtype = torch.bfloat16 if cuda else torch.float32
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    projs = {k: v for k, v in projections(model).items() if args.only is None or k in args.only}
    log = lambda s: print(s, flush=True)  # noqa: E731
    cases = [(t, name) for t in args.tokens for name in projs]
    t_end = time.monotonic() + args.budget_s
    shapes: dict[str, dict[int, KernelConfig]] = {}
    rows = []
    for i, (T, name) in enumerate(cases):
        K, parts = projs[name]
        # what is left of the budget, shared by the cases still to run
        deadline = time.monotonic() + max(1.0, (t_end - time.monotonic()) / (len(cases) - i))
        case = Case(K, parts, T, args.adapters, args.rank, args.layers, dtype, device)
        base = time_step(case, None, args.reps)
        default_us = (time_step(case, tuning.DEFAULT, args.reps) - base) / args.layers
        best, best_us, evals = descend(case, base, args.reps, deadline, log)
        empty = Case(K, parts, T, args.adapters, args.rank, args.layers, dtype, device, empty=True)
        empty_base = time_step(empty, None, args.reps)
        empty_us = (time_step(empty, best, args.reps) - empty_base) / args.layers
        empty_default_us = (time_step(empty, tuning.DEFAULT, args.reps) - empty_base) / args.layers
        del case, empty
        if cuda:
            torch.cuda.empty_cache()
        key = tuning.shape_key(K, sum(parts), len(parts), args.rank)
        shapes.setdefault(key, {})[T] = best
        row = dict(proj=name, tokens=T, K=K, N=sum(parts), base_gemm_us=round(base / args.layers, 2),
                   default_us=round(default_us, 2), tuned_us=round(best_us, 2),
                   speedup=round(default_us / best_us, 2) if best_us > 0 else None,
                   empty_default_us=round(empty_default_us, 2), empty_tuned_us=round(empty_us, 2),
                   evals=evals, config=best.to_json())
        rows.append(row)
        log(f"{name:>8} T={T:<3} gemm {row['base_gemm_us']:7.2f} us/layer | LoRA default {default_us:6.2f} -> tuned "
            f"{best_us:6.2f} us/layer ({evals} settings) | all-base {empty_default_us:5.2f} -> {empty_us:5.2f} | "
            f"{'fused' if best.fused else 'shrink+expand'} {best.to_json()}")
    out = dict(device=device_name, preset=args.preset, rank=args.rank, adapters=args.adapters, layers=args.layers,
               rows=rows)
    for T in args.tokens:
        d = sum(r["default_us"] for r in rows if r["tokens"] == T)
        t = sum(r["tuned_us"] for r in rows if r["tokens"] == T)
        e = sum(r["empty_tuned_us"] for r in rows if r["tokens"] == T)
        ed = sum(r["empty_default_us"] for r in rows if r["tokens"] == T)
        log(f"T={T}: the adapter's kernels a layer {d:.1f} -> {t:.1f} us "
            f"({args.layers} layers: {d * args.layers / 1e3:.2f} -> {t * args.layers / 1e3:.2f} ms); "
            f"all-base {ed:.1f} -> {e:.1f} us")
    if args.write:
        path = tuning.write_table(device_name, shapes, dict(preset=args.preset, adapters=args.adapters,
                                                            layers=args.layers, tuned=time.strftime("%Y-%m-%d")),
                                  folder=Path(args.config_dir))
        log(f"wrote {path}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
