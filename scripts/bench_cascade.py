"""Cascade attention against plain paged attention on decode batches with shared prefixes.

Grid: shared prefix x batch, one group (vLLM's case) and 16 groups (e.g. 16 prompts x N samples).
For every point it records both times and what the planner's heuristic
(``multi_group_cascade_verdict``, = vLLM's ``use_cascade_attention`` for one group) would pick,
then reports how often the pick is the faster path and the worst slowdown where it picks cascade.
It also times ``merge_attn_states`` in torch against the fused Triton kernel.

Each path is timed three ways: eager back-to-back calls (what the engine's eager steps see; bound
by host launches when the host is slower than the GPU), replays of a CUDA graph of one call (GPU
time alone, what a graph-captured decode step sees) and host submission time.  The policies are
scored on both.  The cascade path is also timed at each FA3 prefix-pass split count
(``--prefix-splits``; 0 = FA3's heuristic), and the best is recorded.

    python scripts/bench_cascade.py                    # GPU: full grid; CPU: a small grid
    python scripts/bench_cascade.py --prefixes 8192,32768 --batches 128 --groups 1 --prefix-splits 0,2,4,8,16
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.backend import AttentionLayer, FlashAttentionImpl  # noqa: E402
from ray_attn.backend.cache import reshape_and_cache_flash  # noqa: E402
from ray_attn.backend.flash_attn import cascade_attention  # noqa: E402
from ray_attn.backend.merge import merge_attn_states, merge_attn_states_torch  # noqa: E402
from ray_attn.planner import measured_cascade_verdict, multi_group_cascade_verdict  # noqa: E402

H, HK, D = 32, 8, 128
SUFFIX = 65  # each request's own tokens after the shared prefix (64 generated + this step's)


def cascade_meta(meta, shared_blocks: int, groups: int, block_size: int):
    B = meta.num_reqs
    per = -(-B // groups)
    g_of = np.arange(B) // per
    G = int(g_of.max()) + 1
    counts = np.bincount(g_of, minlength=G)
    q_lens = np.diff(meta.query_start_loc)
    toks = np.bincount(g_of, weights=q_lens, minlength=G).astype(np.int64)
    suffix_lens = meta.seq_lens - shared_blocks * block_size
    width = int(-(-suffix_lens.max() // block_size))
    return dataclasses.replace(
        meta, use_cascade=True, common_prefix_len=shared_blocks * block_size,
        cu_prefix_query_lens=np.concatenate([[0], np.cumsum(toks)]).astype(np.int32),
        prefix_kv_lens=np.full(G, shared_blocks * block_size, np.int32),
        prefix_block_table=meta.block_table[np.searchsorted(g_of, np.arange(G)), :shared_blocks],
        suffix_kv_lens=suffix_lens.astype(np.int32),
        suffix_block_table=np.ascontiguousarray(meta.block_table[:, shared_blocks:shared_blocks + width]),
        max_suffix_kv_len=int(suffix_lens.max())), counts, toks


def cascade_step(impl, q, k, v, cache, meta, out, splits: int):
    """What ``impl.forward`` runs on a cascade step (cache write, then ``cascade_attention``),
    with the prefix pass's split count exposed, which ``forward`` does not take."""
    n = meta.num_actual_tokens
    kc, vc = cache.unbind(0)
    reshape_and_cache_flash(k[:n], v[:n], kc, vc, meta.slot_mapping[:n], impl.kv_cache_dtype)
    cascade_attention(out[:n], q[:n], kc, vc, kernel=impl.kernel, attn_metadata=meta,
                      scale=impl.scale, alibi_slopes=None, sliding_window=impl.sliding_window,
                      softcap=impl.logits_soft_cap, prefix_num_splits=splits)


def time_three_ways(fn, iters: int, cuda: bool) -> tuple:
    """(eager, graph, host) microseconds per call; graph is None on CPU."""
    g = bl.graph_timeit(fn, iters=iters)
    host = bl.host_timeit(fn) if cuda else bl.host_timeit(fn, burst=1, reps=2)
    return bl.timeit(fn, iters=iters) * 1e6, None if g is None else g * 1e6, host * 1e6


def score(rows: list[dict], sfx: str = "") -> tuple:
    """How often each policy picks the faster path, and its worst slowdown where it picks cascade:
    vLLM's cost model (recorded per row) and the measured byte threshold (recomputed here, a pure
    function of the row's shape, so it can be re-scored from a saved JSON).  ``sfx`` "" scores
    the eager times, "_graph" the CUDA-graph ones; all None when no row has those."""
    from ray_attn.engine import CASCADE_BREAK_EVEN_BYTES, CASCADE_BREAK_EVEN_BYTES_GRAPHED

    rows = [r for r in rows if r.get(f"speedup{sfx}") is not None]
    if not rows:
        return None, None, None, None
    # The engine's threshold for each way of running: eager steps, and decode steps from graphs.
    budget = CASCADE_BREAK_EVEN_BYTES_GRAPHED if sfx == "_graph" else CASCADE_BREAK_EVEN_BYTES
    threshold = budget // (2 * HK * D * 2)
    for r in rows:
        per = -(-r["batch"] // r["groups"])
        sizes = np.bincount(np.arange(r["batch"]) // per)
        pick, _ = measured_cascade_verdict(np.full(len(sizes), r["prefix"]), sizes, threshold)
        faster = r[f"speedup{sfx}"] > 1
        r[f"measured_policy{sfx}"] = bool(pick)
        r[f"right{sfx}"] = bool(r["heuristic"] == faster)
        r[f"measured_right{sfx}"] = bool(pick == faster)

    def stats(pick_key, right_key):
        slow = [1 / r[f"speedup{sfx}"] for r in rows if r[pick_key]]
        return float(np.mean([r[right_key] for r in rows])), (max(slow) if slow else None)
    return (*stats("heuristic", f"right{sfx}"), *stats(f"measured_policy{sfx}", f"measured_right{sfx}"))


def summarize(rows: list[dict]) -> tuple[dict, str]:
    """Both policies scored on eager and on graph times: the JSON fields and a printable line each."""
    fields, lines = {}, []
    for sfx, what in (("", "eager"), ("_graph", "CUDA graph")):
        right, worst, m_right, m_worst = score(rows, sfx)
        if right is None:
            continue
        fields.update({f"heuristic_right{sfx}": right, f"worst_slowdown_when_picked{sfx}": worst,
                       f"measured_policy_right{sfx}": m_right,
                       f"measured_worst_slowdown_when_picked{sfx}": m_worst})
        lines.append(f"{what} times, {len(rows)} points: vLLM heuristic right {right:.0%} (worst "
                     f"{_x(worst)} when picked); measured policy right {m_right:.0%} (worst "
                     f"{_x(m_worst)} when picked)")
    return fields, "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def bench_point(impl, layer, P, B, G, block, dtype, dev, splits, iters, num_sms) -> dict:
    cuda = dev.type == "cuda"
    nshared = P // block
    meta, cache, q, k, v = bl.paged_decode_inputs(B, P + SUFFIX, block, HK, D, dtype, dev,
                                                  num_q_heads=H, shared_blocks=nshared, groups=G)
    cmeta, counts, toks = cascade_meta(meta, nshared, G, block)
    out = torch.empty_like(q)
    dm, dc = meta.to_device(dev), cmeta.to_device(dev)
    plain = time_three_ways(lambda: impl.forward(layer, q, k, v, cache, dm, out), iters, cuda)
    casc = time_three_ways(lambda: impl.forward(layer, q, k, v, cache, dc, out), iters, cuda)
    r = dict(prefix=P, batch=B, groups=G)
    for name, (eager, graph, host) in (("plain", plain), ("cascade", casc)):
        r.update({f"{name}_us": eager, f"{name}_graph_us": graph, f"{name}_host_us": host})
    r["speedup"] = plain[0] / casc[0]
    r["speedup_graph"] = None if None in (plain[1], casc[1]) else plain[1] / casc[1]
    # The split sweep is judged on graph time where there is one: eagerly the host hides it.
    by_eager, by_graph = {}, {}
    for s in splits:
        e, g, _ = time_three_ways(lambda: cascade_step(impl, q, k, v, cache, dc, out, s), iters, cuda)
        by_eager[str(s)], by_graph[str(s)] = e, g
    use_graph = plain[1] is not None and None not in by_graph.values()
    ranked = by_graph if use_graph else by_eager
    if ranked:
        best = min(ranked, key=ranked.get)
        plain_t = plain[1] if use_graph else plain[0]
        r.update(best_splits=int(best), cascade_best_us=ranked[best], speedup_best=plain_t / ranked[best],
                 best_by="graph" if use_graph else "eager")
    r.update(cascade_us_by_splits=by_eager, cascade_graph_us_by_splits=by_graph)
    pick, why = multi_group_cascade_verdict(
        np.full(len(counts), P), counts, toks, np.ones(B, np.int64), H, HK, False, False, num_sms)
    r.update(heuristic=pick, slowdown_if_picked=(1 / r["speedup"]) if pick else None, reason=why)
    return r


def bench_merge(small: bool, dtype, dev) -> list[dict]:
    rows = []
    for T in ([8, 64] if small else [8, 128, 1024, 8192]):
        a, b = torch.randn(2, T, H, D, dtype=dtype, device=dev)
        la, lb = torch.randn(2, H, T, device=dev)
        o = torch.empty_like(a)
        fused = lambda: merge_attn_states(o, a, la, b, lb)
        t_graph = bl.graph_timeit(fused)
        rows.append(dict(tokens=T, torch_us=bl.timeit(lambda: merge_attn_states_torch(o, a, la, b, lb)) * 1e6,
                         dispatched_us=bl.timeit(fused) * 1e6,
                         dispatched_graph_us=None if t_graph is None else t_graph * 1e6,
                         fused=dev.type == "cuda"))
    return rows


def plot(path, rows: list[dict], kernel: str) -> None:
    panels = []
    for key, title in (("speedup", "eager back-to-back"), ("speedup_graph", "CUDA graph (GPU time)"),
                       ("speedup_best", "best prefix splits")):
        series = {}
        for G in sorted({r["groups"] for r in rows}):
            for B in sorted({r["batch"] for r in rows}):
                pts = [r for r in rows if r["groups"] == G and r["batch"] == B and r.get(key) is not None]
                if pts:
                    series[f"batch {B}, {G} group(s)"] = ([r["prefix"] for r in pts], [r[key] for r in pts])
        if series:
            panels.append((f"{title} ({kernel})", series))
    bl.plot_panels(path, panels, "shared prefix (tokens)", "plain / cascade time", hline=1.0,
                   hline_label="break-even")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rescore", metavar="JSON", help="re-score the policies on a saved run (no timing)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--num-sms", type=int, default=None, help="SMs for the heuristic (default: this GPU's, else 132)")
    p.add_argument("--prefixes", type=ints, default=None, help="comma list (default: the grid)")
    p.add_argument("--batches", type=ints, default=None, help="comma list (default: the grid)")
    p.add_argument("--groups", type=ints, default=[1, 16], help="comma list of group counts")
    p.add_argument("--prefix-splits", type=ints, default=[0, 4, 16],
                   help="FA3 prefix-pass split counts to sweep (0 = FA3's heuristic; empty: no sweep)")
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args(argv)
    if args.rescore:
        import json

        saved = json.loads(Path(args.rescore).read_text())
        fields, text = summarize(saved["rows"])
        saved.update(fields)
        Path(args.rescore).write_text(json.dumps(saved, indent=1, default=float))
        print(text)
        return
    dev = bl.device()
    small = args.small or dev.type == "cpu"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernel = "fa3" if dev.type == "cuda" else "torch"
    block = 16
    num_sms = args.num_sms or bl.machine().get("sms") or 132
    prefixes = args.prefixes or ([256, 1024] if small else [256, 1024, 4096, 8192, 16384, 32768])
    batches = args.batches or ([8, 16] if small else [8, 32, 128, 256])
    iters = args.iters or (2 if dev.type == "cpu" else 20)
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "auto", dtype=dtype,
                              block_size=block, device=dev, kernel=kernel)
    layer = AttentionLayer(device=dev)
    grid = [(P, B, G) for P in prefixes for B in batches for G in args.groups if B >= 2 * G or G == 1]
    rows = []
    for P, B, G in tqdm(grid, desc="cascade"):
        rows.append(bench_point(impl, layer, P, B, G, block, dtype, dev, args.prefix_splits, iters, num_sms))
    fields, text = summarize(rows)
    merge_rows = bench_merge(small, dtype, dev)
    path = bl.save("bench_cascade", rows, merge=merge_rows, num_sms=num_sms, kernel=kernel,
                   prefix_splits=args.prefix_splits, **fields)
    bl.print_table(rows, ["prefix", "batch", "groups", "plain_us", "cascade_us", "speedup",
                          "plain_graph_us", "cascade_graph_us", "speedup_graph", "plain_host_us",
                          "cascade_host_us", "best_splits", "cascade_best_us", "speedup_best",
                          "heuristic", "right", "right_graph"], f"cascade vs plain ({kernel})", width=280)
    bl.print_table(merge_rows, ["tokens", "torch_us", "dispatched_us", "dispatched_graph_us", "fused"],
                   "merge_attn_states")
    print(text)
    for r in rows:
        if (r["prefix"], r["batch"], r["groups"]) in ((8192, 128, 1), (32768, 128, 1)):
            print(f"{r['prefix']} x {r['batch']}: eager {r['speedup']:.2f}x, graph "
                  f"{_x(r['speedup_graph'])}, best splits {r.get('best_splits')} "
                  f"{_x(r.get('speedup_best'))} (goal: 8x at 8192 x 128)")
    plot(path.with_suffix(".png"), rows, kernel)
    print(f"wrote {path}")


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


if __name__ == "__main__":
    main()
