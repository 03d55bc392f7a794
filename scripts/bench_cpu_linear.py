"""float32 CPU linears: oneDNN's matmul against F.linear's MKL sgemm, per row count, for a model's
decode shapes (default SmolLM2-135M's: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary
49,152, 30 layers), and what ``gemv.use_onednn`` picks for each.

Why: which library is faster depends on the CPU and on the rows. A plain decode step at batch 1
is one row; a step verifying k drafts is 1 + k rows. On 2 Intel Xeon cores MKL won up to 3 rows,
oneDNN from 4 (``gemv.CPU_MKL_MAX_ROWS``); on 2 AMD EPYC cores oneDNN won at every size. This
script is how to check that rule on another machine.

Each point times one pass over every layer's four linears (qkv, o, gate_up, down; distinct
weights per layer, as a decode step streams them) and, apart, the LM head; both libraries in
turn, ``--repeats`` times, the best of each.

    python scripts/bench_cpu_linear.py [--rows 1 2 3 4 5 8 16] [--repeats 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import benchlib as bl  # noqa: E402
from ray_attn.model import gemv  # noqa: E402


def onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def mkl(x, w):
    return F.linear(x, w)


def packed(lib: str, W: dict, head, m: int):
    """``lib`` with every weight packed ahead for ``m`` rows (what Inductor's CPU freezing
    does): MKL's ``cblas_sgemm_pack`` (``torch.ops.mkl._mkl_linear``) or oneDNN's blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight``).  Returns (the call, weights as it takes them)."""
    if lib == "mkl_packed":
        def pack(w):
            return (torch.ops.mkl._mkl_reorder_linear_weight(w, m), w)

        def call(x, pw):
            return torch.ops.mkl._mkl_linear(x, pw[0], pw[1], None, m)
    else:
        def pack(w):
            return torch.ops.mkldnn._reorder_linear_weight(w, m)

        def call(x, pw):
            return torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
    return call, {n: [pack(w) for w in ws] for n, ws in W.items()}, pack(head)


def shapes(a) -> dict[str, tuple[int, int]]:
    return {"qkv": ((a.heads + 2 * a.kv_heads) * a.head_dim, a.hidden), "o": (a.hidden, a.heads * a.head_dim),
            "gate_up": (2 * a.intermediate, a.hidden), "down": (a.hidden, a.intermediate)}


def best_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pick and pack their kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--packed", action="store_true",
                    help="also time the weights packed ahead for the rows (MKL's and oneDNN's own layouts)")
    ap.add_argument("--json", default=str(bl.RESULTS / "bench_cpu_linear.json"))
    a = ap.parse_args(argv)
    if not gemv.CPU_ONEDNN:
        raise SystemExit("oneDNN's _linear_pointwise is not available here (or RAY_ATTN_CPU_ONEDNN=0)")
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    W = {n: [torch.randn(N, K, generator=g) for _ in range(a.layers)] for n, (N, K) in shapes(a).items()}
    head = torch.randn(a.vocab, a.hidden, generator=g)
    rows = []
    for m in a.rows:
        xs = {n: torch.randn(m, K, generator=g) for n, (_, K) in shapes(a).items()}
        xh = torch.randn(m, a.hidden, generator=g)

        t = {}
        libs = [("onednn", onednn, W, head), ("mkl", mkl, W, head)]
        if a.packed:
            libs += [(lib, *packed(lib, W, head, m)) for lib in ("mkl_packed", "onednn_packed")]
        for _ in range(2):  # in turn, so that a neighbour's burst falls on both alike
            for lib, fn, ws, hw in libs:
                run = lambda fn=fn, ws=ws: [fn(xs[n], ws[n][i]) for i in range(a.layers) for n in ws]  # noqa: E731
                t[f"{lib}_layers_ms"] = min(t.get(f"{lib}_layers_ms", 1e9), best_ms(run, a.repeats))
                t[f"{lib}_head_ms"] = min(t.get(f"{lib}_head_ms", 1e9),
                                          best_ms(lambda fn=fn, hw=hw: fn(xh, hw), a.repeats))
        picked = "onednn" if gemv.use_onednn(xh, head) else "mkl"
        faster = "onednn" if t["onednn_layers_ms"] + t["onednn_head_ms"] < t["mkl_layers_ms"] + t["mkl_head_ms"] \
            else "mkl"
        rows.append(dict(rows=m, **{k: round(v, 4) for k, v in t.items()}, faster=faster, picked=picked))
        print(rows[-1], flush=True)
    meta = dict(shapes=shapes(a), vocab=a.vocab, layers=a.layers, threads=torch.get_num_threads(),
                vendor=gemv._cpu_vendor(), mkl_max_rows=gemv.CPU_MKL_MAX_ROWS)
    extra = ["mkl_packed_layers_ms", "onednn_packed_layers_ms", "mkl_packed_head_ms", "onednn_packed_head_ms"]
    bl.print_table(rows, ["rows", "mkl_layers_ms", "onednn_layers_ms", "mkl_head_ms", "onednn_head_ms",
                          *(extra if a.packed else []), "faster", "picked"], f"float32 linears on {meta['vendor'] or 'this CPU'}, {meta['threads']} threads")
    if a.json:
        bl.write_json(a.json, dict(machine=bl.machine(), **meta, rows=rows))
    return dict(meta, rows=rows)


if __name__ == "__main__":
    main()
