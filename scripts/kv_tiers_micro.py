"""``bench_kv_tiers.py``'s two measurements below the workload: ``copy`` (the tiers' block
gathers and scatters against a bare copy of the same bytes) and ``breakeven`` (from how many tokens
fetching a shared prefix beats computing it), and the share window that breakeven's figures give
the share part on a GPU (``measured_window``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from kv_tiers_setup import clear_store, engine_config, free, make_engine, model_config, start_ray  # noqa: E402

from ray_attn.engine import SamplingParams  # noqa: E402


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def part_copy(a):
    from ray_attn.model import build_model
    from ray_attn.planner.tiers import KVTransfers
    from ray_attn.runtime.kv_tiers import RankKVTiers

    dev = torch.device(a.device)
    ns = [int(x) for x in a.copy_blocks.split(",")]
    mc = model_config(a)
    model = build_model(mc, device=dev, block_size=a.block_size, kernel="torch" if a.device == "cpu" else "auto")
    model.allocate_kv_cache(max(ns) + 8)
    for c in model.kv_caches:
        c.view(torch.uint8).random_(0, 256)
    tiers = RankKVTiers(model, 1.05 * max(ns) * model.kv_cache_bytes_per_block() / (1 << 30), 0, 1, dev)
    pin = dev.type == "cuda"
    rng = np.random.default_rng(0)
    rows = []
    for n in ns:
        blocks = np.sort(rng.choice(max(ns) + 8, n, replace=False)).astype(np.int32)
        slots = np.arange(n, dtype=np.int32)
        host = torch.empty((n,) + tiers.block_shape, dtype=torch.uint8, pin_memory=pin)
        host_flat = torch.empty(n * tiers.block_bytes, dtype=torch.uint8, pin_memory=pin)
        dev_flat = torch.empty(n * tiers.block_bytes, dtype=torch.uint8, device=dev)
        host.copy_(tiers.gather(blocks))
        t = dict(
            gather_s=bl.synced_timeit(lambda: tiers.gather(blocks), dev, a.iters),
            bare_out_s=bl.synced_timeit(lambda: host_flat.copy_(dev_flat), dev, a.iters),
            scatter_s=bl.synced_timeit(lambda: tiers.scatter(blocks, host), dev, a.iters),
            bare_in_s=bl.synced_timeit(lambda: dev_flat.copy_(host_flat), dev, a.iters),
            offload_s=bl.synced_timeit(lambda: tiers.apply(KVTransfers(offload_blocks=blocks, offload_slots=slots)), dev, a.iters),
            onload_s=bl.synced_timeit(lambda: tiers.apply(KVTransfers(onload_slots=slots, onload_blocks=blocks)), dev, a.iters))
        nbytes = n * tiers.block_bytes
        row = dict(part="copy", blocks=n, bytes=nbytes, **t)
        for k in ("gather", "scatter", "offload", "onload", "bare_out", "bare_in"):
            row[f"{k}_GBps"] = nbytes / t[f"{k}_s"] / 1e9
        for k, bare in (("gather", "out"), ("offload", "out"), ("scatter", "in"), ("onload", "in")):
            row[f"{k}_frac_of_bare"] = t[f"bare_{bare}_s"] / t[f"{k}_s"]
        if dev.type == "cuda":  # the same copies' device time, issued ahead of the GPU as a step's are
            d = dict(offload=device_span(lambda: tiers.apply(KVTransfers(offload_blocks=blocks, offload_slots=slots)),
                                         tiers, a.iters),
                     bare_out=device_span(lambda: host_flat.copy_(dev_flat, non_blocking=True), tiers, a.iters),
                     onload=device_span(lambda: tiers.apply(KVTransfers(onload_slots=slots, onload_blocks=blocks)),
                                        tiers, a.iters),
                     bare_in=device_span(lambda: dev_flat.copy_(host_flat, non_blocking=True), tiers, a.iters))
            row.update({f"{k}_device_s": v for k, v in d.items()})
            row["offload_device_frac_of_bare"] = d["bare_out"] / d["offload"]
            row["onload_device_frac_of_bare"] = d["bare_in"] / d["onload"]
        rows.append(row)
    meta = dict(block_bytes=tiers.block_bytes, pinned=pin, device=a.device)
    return rows, meta


def device_span(fn, tiers, iters: int, lead_cycles: int = 5_000_000) -> float:
    """Median device seconds from the start of ``fn``'s first kernel or copy to the end of its
    last transfer.  The GPU first spins ``lead_cycles`` (a few ms), so that the host has issued
    all of ``fn`` before the GPU reaches it -- as in the engine, where a step's copies are issued
    while the step before computes -- and the span holds no host time."""
    samples = []
    for _ in range(iters + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(lead_cycles)
        start.record()
        tiers.fence()  # every transfer starts after ``start``
        fn()
        tiers.barrier()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return float(np.median(samples[1:]))


def _ttft(eng, prompt) -> float:
    """Seconds from submitting ``prompt`` to its first token (it runs on to a second token, so
    that the step after its prefill publishes its blocks)."""
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    first = None
    while not eng.requests[rid].finished:
        eng.step()
        if first is None and eng.requests[rid].num_output_tokens:
            first = time.perf_counter() - t0
    eng.release(rid)
    eng.flush()
    return first


def _wait_published(store, client, hashes, deadline_s: float = 30.0) -> None:
    """Until the store holds all of ``hashes``: on a GPU a rank's thread puts its blocks once their
    bytes reach the host, after the step that published them (on CPU the put is already queued, and
    the store answers its one caller in order)."""
    import ray

    end = time.monotonic() + deadline_s
    while True:
        ray.get(store.stats.remote())
        got, name, lease = client.lookup(hashes)
        if got:
            client.release(name, lease)
        if got == len(hashes) or time.monotonic() > end:
            return
        time.sleep(0.01)


def part_breakeven(a):
    from ray_attn.planner.block_pool import prompt_hashes
    from ray_attn.runtime.kv_store import node_store

    start_ray(a)
    clear_store(a)
    bs, ns = a.block_size, [int(x) for x in a.breakeven_blocks.split(",")]
    need = (sum(ns) + 2) * a.reps + 64
    # A computes and publishes (and never looks the store up: its prefill is pure); B fetches
    # whatever the store holds (no minimum).  Same layout, so B reads A's blocks.
    A = make_engine(a, engine_config(a, need, sharing=True, min_share_tokens=10 ** 9))
    B = make_engine(a, engine_config(a, need, sharing=True, min_share_tokens=0))
    client, rank_tiers = A.planner.kv.tiers.shared, A.executor.worker.tiers
    store = node_store(capacity_bytes=int(a.store_gib * (1 << 30)))
    vocab = A.config.model.vocab_size
    rng = np.random.default_rng(a.seed + 1)
    dev = torch.device(a.device)
    samples = {n: [] for n in ns}
    base = []
    from tqdm.auto import tqdm

    for _ in tqdm(range(a.reps), desc="breakeven", disable=a.quiet, leave=False):
        base.append(_ttft(A, rng.integers(0, vocab, 1).tolist()))
        for n in ns:
            prompt = rng.integers(0, vocab, n * bs + 1).tolist()
            prefill = _ttft(A, prompt)
            hashes = [int(h) for h in prompt_hashes(prompt, n, bs)]
            _wait_published(store, client, hashes)
            blocks = A.planner.pool.cached_blocks(hashes)  # A's own copies: the scatter rewrites their bytes
            assert None not in blocks, "A's blocks of the prompt were evicted"
            t0 = time.perf_counter()
            got, name, lease = client.lookup(hashes)
            t1 = time.perf_counter()
            if got != n:
                raise RuntimeError(f"the store holds {got} of the {n} blocks just published")
            data = rank_tiers.fetched(name, client.layout, hashes)  # the rank's own fetch path
            t2 = time.perf_counter()
            rank_tiers.scatter(np.array(blocks, np.int32), data)
            _sync(dev)
            t3 = time.perf_counter()
            client.release(name, lease)
            hit0 = B.planner.stats()["shared_hit_blocks"]
            fetched = _ttft(B, prompt)
            if B.planner.stats()["shared_hit_blocks"] - hit0 != n:
                raise RuntimeError(f"replica B fetched {B.planner.stats()['shared_hit_blocks'] - hit0} of {n} blocks")
            samples[n].append(dict(prefill_ttft_s=prefill, lookup_s=t1 - t0, get_s=t2 - t1, scatter_s=t3 - t2,
                                   fetch_s=t3 - t0, fetched_ttft_s=fetched))
    free(A, B)
    clear_store(a)
    base_s = float(np.median(base))
    rows = []
    for n in ns:
        med = {k: float(np.median([s[k] for s in samples[n]])) for k in samples[n][0]}
        prefill_s = max(med["prefill_ttft_s"] - base_s, 0.0)
        rows.append(dict(part="breakeven", blocks=n, tokens=n * bs, **med, prefill_s=prefill_s,
                         fetch_wins=med["fetch_s"] < prefill_s,
                         fetched_ttft_wins=med["fetched_ttft_s"] < med["prefill_ttft_s"]))

    def from_on(key):  # the smallest prefix from which fetching wins at every size measured
        first = None
        for r in reversed(rows):
            if not r[key]:
                break
            first = r["tokens"]
        return first

    def up_to(key):  # the largest prefix up to which fetching wins at every size measured
        last = None
        for r in rows:
            if not r[key]:
                break
            last = r["tokens"]
        return last

    meta = dict(block_size=bs, reps=a.reps, base_ttft_s=base_s, block_bytes=rank_tiers.block_bytes,
                measured_kv_share_min_tokens=from_on("fetch_wins"),
                measured_kv_share_min_tokens_end_to_end=from_on("fetched_ttft_wins"),
                measured_kv_share_max_tokens=up_to("fetch_wins") if from_on("fetch_wins") is None else None)
    print(f"[breakeven] fetching wins from {meta['measured_kv_share_min_tokens']} tokens (lookup + get + scatter "
          f"vs prefill: TTFT - a 1-token prompt's); end to end (TTFT fetched vs computed) from "
          f"{meta['measured_kv_share_min_tokens_end_to_end']} tokens")
    return rows, meta


def measured_window(a, breakeven: dict | None) -> None:
    """On a GPU the share part fetches what breakeven measured to pay, unless told otherwise: from
    ``measured_kv_share_min_tokens`` on, or (where fetching wins only up to some length) from one
    block up to ``measured_kv_share_max_tokens``.  The run records the window it used."""
    if not breakeven or a.share_min_tokens is not None or a.share_max_tokens is not None:
        return
    lo, hi = breakeven.get("measured_kv_share_min_tokens"), breakeven.get("measured_kv_share_max_tokens")
    if lo is not None:
        a.share_min_tokens = lo
    elif hi is not None:
        a.share_min_tokens, a.share_max_tokens = a.block_size, hi
    print(f"[share] the window breakeven measured: kv_share_min_tokens={a.share_min_tokens}, "
          f"kv_share_max_tokens={a.share_max_tokens}")
