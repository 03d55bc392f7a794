"""Cascade attention against plain paged attention on decode batches with shared prefixes.

Grid: shared prefix x batch, one group (vLLM's case) and 16 groups (e.g. 16 prompts x N samples).
For every point it records both times and what the planner's heuristic
(``multi_group_cascade_verdict``, = vLLM's ``use_cascade_attention`` for one group) would pick,
then reports how often the pick is the faster path and the worst slowdown where it picks cascade.
It also times ``merge_attn_states`` in torch against the fused Triton kernel.

    python scripts/bench_cascade.py       # GPU: full grid; CPU: a small grid
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


def score(rows: list[dict]) -> tuple:
    """How often each policy picks the faster path, and its worst slowdown where it picks cascade:
    vLLM's cost model (recorded per row) and the measured byte threshold (recomputed here, a pure
    function of the row's shape, so it can be re-scored from a saved JSON)."""
    from ray_attn.engine import CASCADE_BREAK_EVEN_BYTES

    threshold = CASCADE_BREAK_EVEN_BYTES // (2 * HK * D * 2)
    for r in rows:
        per = -(-r["batch"] // r["groups"])
        sizes = np.bincount(np.arange(r["batch"]) // per)
        pick, _ = measured_cascade_verdict(np.full(len(sizes), r["prefix"]), sizes, threshold)
        r["measured_policy"] = bool(pick)
        r["measured_right"] = bool(pick == (r["speedup"] > 1))
    def stats(pick_key, right_key):
        slow = [r["cascade_us"] / r["plain_us"] for r in rows if r[pick_key]]
        return float(np.mean([r[right_key] for r in rows])), (max(slow) if slow else None)
    return (*stats("heuristic", "right"), *stats("measured_policy", "measured_right"))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rescore", metavar="JSON", help="re-score the policies on a saved run (no timing)")
    p.add_argument("--small", action="store_true")
    p.add_argument("--num-sms", type=int, default=None, help="SMs for the heuristic (default: this GPU's, else 132)")
    args = p.parse_args(argv)
    if args.rescore:
        import json

        saved = json.loads(Path(args.rescore).read_text())
        right, worst, m_right, m_worst = score(saved["rows"])
        saved.update(heuristic_right=right, worst_slowdown_when_picked=worst,
                     measured_policy_right=m_right, measured_worst_slowdown_when_picked=m_worst)
        Path(args.rescore).write_text(json.dumps(saved, indent=1, default=float))
        print(f"vLLM heuristic right {right:.0%} (worst {worst:.2f}x when picked); "
              f"measured policy right {m_right:.0%} (worst {m_worst:.2f}x when picked)")
        return
    dev = bl.device()
    small = args.small or dev.type == "cpu"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernel = "fa3" if dev.type == "cuda" else "torch"
    block = 16
    num_sms = args.num_sms or bl.machine().get("sms") or 132
    prefixes = [256, 1024] if small else [256, 1024, 4096, 8192, 16384, 32768]
    batches = [8, 16] if small else [8, 32, 128, 256]
    impl = FlashAttentionImpl(H, D, D ** -0.5, HK, None, None, "auto", dtype=dtype,
                              block_size=block, device=dev, kernel=kernel)
    layer = AttentionLayer(device=dev)
    rows = []
    grid = [(P, B, G) for P in prefixes for B in batches for G in (1, 16) if B >= 2 * G or G == 1]
    for P, B, G in tqdm(grid, desc="cascade"):
        nshared = P // block
        meta, cache, q, k, v = bl.paged_decode_inputs(B, P + SUFFIX, block, HK, D, dtype, dev,
                                                      num_q_heads=H, shared_blocks=nshared, groups=G)
        cmeta, counts, toks = cascade_meta(meta, nshared, G, block)
        out = torch.empty_like(q)
        iters = 2 if dev.type == "cpu" else 20
        dm, dc = meta.to_device(dev), cmeta.to_device(dev)
        t_plain = bl.timeit(lambda: impl.forward(layer, q, k, v, cache, dm, out), iters=iters)
        t_casc = bl.timeit(lambda: impl.forward(layer, q, k, v, cache, dc, out), iters=iters)
        pick, why = multi_group_cascade_verdict(
            np.full(len(counts), P), counts, toks, np.ones(B, np.int64), H, HK, False, False, num_sms)
        faster = t_casc < t_plain
        rows.append(dict(prefix=P, batch=B, groups=G, plain_us=t_plain * 1e6,
                         cascade_us=t_casc * 1e6, speedup=t_plain / t_casc, heuristic=pick,
                         right=bool(pick == faster), slowdown_if_picked=(t_casc / t_plain) if pick else None,
                         reason=why))
        del cache
    right, worst, m_right, m_worst = score(rows)
    merge_rows = []
    for T in ([8, 64] if small else [8, 128, 1024, 8192]):
        a, b = torch.randn(2, T, H, D, dtype=dtype, device=dev)
        la, lb = torch.randn(2, H, T, device=dev)
        o = torch.empty_like(a)
        t_torch = bl.timeit(lambda: merge_attn_states_torch(o, a, la, b, lb))
        t_fused = bl.timeit(lambda: merge_attn_states(o, a, la, b, lb))
        merge_rows.append(dict(tokens=T, torch_us=t_torch * 1e6, dispatched_us=t_fused * 1e6,
                               fused=dev.type == "cuda"))
    path = bl.save("bench_cascade", rows, merge=merge_rows, heuristic_right=right,
                   worst_slowdown_when_picked=worst, measured_policy_right=m_right,
                   measured_worst_slowdown_when_picked=m_worst, num_sms=num_sms, kernel=kernel)
    bl.print_table(rows, ["prefix", "batch", "groups", "plain_us", "cascade_us", "speedup",
                          "heuristic", "right"], f"cascade vs plain ({kernel})")
    bl.print_table(merge_rows, ["tokens", "torch_us", "dispatched_us", "fused"], "merge_attn_states")
    print(f"vLLM heuristic picks the faster path in {right:.0%} of {len(rows)} points "
          f"(worst slowdown where it picks cascade: {worst}); the measured policy in {m_right:.0%} "
          f"(worst: {m_worst})")
    series = {}
    for G in sorted({r["groups"] for r in rows}):
        for B in batches:
            pts = [r for r in rows if r["groups"] == G and r["batch"] == B]
            if pts:
                series[f"batch {B}, {G} group(s)"] = ([r["prefix"] for r in pts], [r["speedup"] for r in pts])
    bl.plot(path.with_suffix(".png"), series, "shared prefix (tokens)", "plain / cascade time",
            f"Cascade speed-up ({kernel})", hline=1.0, hline_label="break-even")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
