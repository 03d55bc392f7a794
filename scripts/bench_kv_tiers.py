#!/usr/bin/env python
"""KV tiers below the device cache (issue 26): the host tier, the shared store, their copies and
when a shared fetch pays.

- ``--part host``: ``--users`` conversations of ``--turns`` turns over long documents (turn t's
  prompt: the user's document, every earlier question and answer, a new question; greedy answers,
  ignore_eos), closed loop with ``--concurrency`` requests in flight: a user's next turn joins the
  back of the queue when its answer ends.  The device KV cache is capped below the working set
  (``--num-blocks``; the ratio is printed) and the same workload runs with the host tier off
  (recompute) and on; the greedy tokens must be identical.  Then the working set fits the
  device cache and the tier on vs off shows what it costs when it has nothing to do.
- ``--part share``: two replicas of one config, turn t of user u sent to replica (u + t) % 2 (a
  router without affinity), the shared store off vs on.  Each replica is driven by its own thread.
- ``--part copy``: ``RankKVTiers.gather``/``scatter`` (and the host tier's offload/onload) of n
  blocks against a bare copy of the same bytes (pinned host <-> device on CUDA; a tensor copy on
  CPU).
- ``--part breakeven``: fetching n blocks from the store (``SharedKVClient.lookup`` + the store's
  get + scatter) against prefilling them (the TTFT of n blocks + 1 token with nothing cached, less
  a 1-token prompt's: a request that fetches still computes its last token in a step); the
  smallest prefix from which the fetch wins is the machine's ``CacheConfig.kv_share_min_tokens``;
  where it wins only up to some length (a GPU: prefill costs nearly the same from 16 tokens to
  1,000), the largest such length is its ``kv_share_max_tokens``.
  Also end to end: a replica's TTFT on a prompt the store holds against computing it.

    python scripts/bench_kv_tiers.py                        # CPU: a small random model, every part
    python scripts/bench_kv_tiers.py --part host --users 24 --concurrency 4
    python scripts/bench_kv_tiers.py --device cuda --model llama-3-8b --part host,share
        # GPU defaults: 200 users x 8 turns over 8k-token documents, KV capped 3x below them

Writes benchmarks/results/bench_kv_tiers.json (a part run alone replaces only its own results)
and bench_kv_tiers.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from multiturn import Workload, counters, run_loop, same_tokens  # noqa: E402

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402

PARTS = ("host", "share", "copy", "breakeven")
# The CPU stand-in: wide enough that prefill costs something next to a step's fixed cost.
CPU_MODEL = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, seed=3)
DEFAULTS = {  # per device: users, turns, doc_tokens, question_tokens, answer_tokens, concurrency
    "cpu": dict(users=16, turns=3, doc_tokens=256, question_tokens=16, answer_tokens=16, concurrency=4),
    "cuda": dict(users=200, turns=8, doc_tokens=8192, question_tokens=64, answer_tokens=128, concurrency=32),
}


# ---------------------------------------------------------------------------- set-up
def model_config(a) -> ModelConfig:
    if a.model == "cpu":
        return ModelConfig(**CPU_MODEL)
    return ModelConfig.from_name(a.model, **({} if a.device == "cuda" else {"dtype": "float32"}))


def describe(a) -> str:
    m = model_config(a)
    name = "random weights" if a.model == "cpu" else f"{a.model} shape, random weights"
    return (f"{m.num_hidden_layers} layers x {m.hidden_size} wide, {m.num_key_value_heads} KV heads of "
            f"{m.head_size}, {m.dtype} ({name}), block {a.block_size}, TP={a.tp}")


def block_bytes(a) -> int:
    """One block of every layer, one rank's KV heads: what the tiers copy per block and rank."""
    m = model_config(a)
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[m.dtype]
    return m.num_hidden_layers * 2 * a.block_size * max(m.num_key_value_heads // a.tp, 1) * m.head_size * item


def engine_config(a, num_blocks: int, host_gib: float = 0.0, sharing: bool = False,
                  min_share_tokens: int | None = None, max_share_tokens: int | None = None) -> EngineConfig:
    cache = dict(block_size=a.block_size, num_blocks=num_blocks, host_cache_gib=host_gib, kv_sharing=sharing,
                 kv_store_gib=a.store_gib, kv_share_max_tokens=max_share_tokens)
    if min_share_tokens is not None:
        cache["kv_share_min_tokens"] = min_share_tokens
    return EngineConfig(model=model_config(a), cache=CacheConfig(**cache),
                        parallel=ParallelConfig(tensor_parallel_size=a.tp, device=a.device, num_cpus_per_worker=1),
                        max_num_seqs=max(64, a.concurrency), max_num_batched_tokens=a.max_batched_tokens)


def make_engine(a, cfg: EngineConfig, cluster: bool = False) -> LLMEngine:
    if cluster:
        from ray_attn.runtime import AttentionCluster

        executor = AttentionCluster(cfg)
    else:
        from ray_attn.runtime import InProcessExecutor

        executor = InProcessExecutor(cfg)
    if a.device == "cpu":  # the rank set its own thread count; a loaded box runs far better on 1
        torch.set_num_threads(a.threads)
    eng = LLMEngine(cfg, executor)
    rng = np.random.default_rng(12345)  # warm-up, shorter than a block: nothing cached or published
    eng.generate([rng.integers(0, cfg.model.vocab_size, a.block_size // 2).tolist()], SamplingParams(max_tokens=2))
    eng.baseline = counters(eng)
    return eng


def capped_gib(nbytes: float, what: str) -> float:
    """``nbytes`` in GiB, at most 40% of this host's memory (the host tier is allocated up front)."""
    import os

    cap = 0.4 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > cap:
        print(f"note: the {what} would need {nbytes / (1 << 30):.1f} GiB for the whole working set; capped at "
              f"{cap / (1 << 30):.1f} GiB (40% of this host's memory)")
    return min(nbytes, cap) / (1 << 30)


def start_ray(a) -> None:
    """A Ray of our own (the stores are actors), never another cluster on this machine."""
    import ray

    from ray_attn.runtime.cluster import init_local_ray

    if not ray.is_initialized():
        init_local_ray(num_cpus=max(4, 2 * a.tp), include_dashboard=False, log_to_driver=False)


def clear_store(a) -> None:
    import ray

    from ray_attn.runtime.kv_store import node_store

    ray.get(node_store(capacity_bytes=int(a.store_gib * (1 << 30))).clear.remote())


def free(*engines) -> None:
    for e in engines:
        e.shutdown()
    gc.collect()


# ---------------------------------------------------------------------------- parts
def part_host(a):
    wl = Workload(a, model_config(a).vocab_size)
    nb = a.num_blocks or max(wl.working_blocks // 3, a.concurrency * (wl.request_blocks + 1))
    # where the working set fits: all of it on CPU; on a GPU the users that a cache like the capped
    # one holds (the whole working set is meant not to fit there)
    fit_users = a.fit_users or (a.users if a.device == "cpu" else
                                max(1, min(a.users, nb // wl.request_blocks - a.concurrency)))
    fwl = wl.subset(fit_users)
    fit = a.fit_num_blocks or fwl.working_blocks + a.concurrency * (wl.request_blocks + 1)
    host_gib = a.host_gib or capped_gib(1.25 * wl.working_blocks * block_bytes(a), "host tier")
    ratio = wl.working_blocks / nb
    print(f"[host] working set {wl.working_blocks} blocks ({a.users} users x {wl.request_blocks}); device cache "
          f"{nb} blocks: the working set is {ratio:.1f}x what it holds; host tier {host_gib:.3g} GiB")
    if not 2 <= ratio <= 4:
        print("[host] note: the ratio is outside 2-4 (raise --users or set --num-blocks)")
    if a.executor == "cluster":
        start_ray(a)
    rows, answers, ttfts, gaps = [], {}, {}, {}
    for run, blocks, gib in (("capped, tier off", nb, 0.0), ("capped, tier on", nb, host_gib)):
        eng = make_engine(a, engine_config(a, blocks, host_gib=gib), a.executor == "cluster")
        row, answers[run], ttfts[run], gaps[run] = run_loop(a, run, [eng], wl, lambda u, t: 0)
        rows.append(row | dict(tier="on" if gib else "off", fits=False))
        free(eng)
    base = "capped, tier off"
    check = same_tokens(answers[base], answers["capped, tier on"], "[host] capped, tier off vs on",
                        *tie_args(a, gaps[base], gaps["capped, tier on"]))
    fit_rows = {"off": [], "on": []}
    order = ["off", "on", "on", "off"] * a.fit_repeats
    for i, tier in enumerate(order[: 2 * a.fit_repeats]):
        run = f"fits, tier {tier}"
        eng = make_engine(a, engine_config(a, fit, host_gib=host_gib if tier == "on" else 0.0), a.executor == "cluster")
        row, ans, _, g = run_loop(a, run, [eng], fwl, lambda u, t: 0)
        free(eng)
        c = same_tokens(answers[base], ans, f"[host] capped, tier off vs {run}", *tie_args(a, gaps[base], g))
        for k in ("tokens_identical", "forks_at_near_ties"):
            check[k] &= c[k]
        for k in ("differing_requests", "forks", "fork_gaps"):
            check[k] += c[k]
        fit_rows[tier].append(row | dict(tier=tier, fits=True, repeat=i // 2))
    best = {t: max(rs, key=lambda r: r["out_tok_s"]) for t, rs in fit_rows.items()}
    fit_ratio = best["on"]["out_tok_s"] / best["off"]["out_tok_s"]
    # On a shared CPU the wall clock swings by several % between identical runs; the CPU time
    # the run took (ranks in this process) barely does.
    cpu_ratio = min(r["cpu_s"] for r in fit_rows["off"]) / min(r["cpu_s"] for r in fit_rows["on"])
    rows += fit_rows["off"] + fit_rows["on"]
    print(f"[host] working set fits ({fit_users} users, {fit} blocks): throughput tier on / off = {fit_ratio:.3f} "
          f"(best of {a.fit_repeats} each; goal >= 0.98); CPU time off / on = {cpu_ratio:.3f}")
    meta = dict(users=a.users, turns=a.turns, doc_tokens=a.doc_tokens, question_tokens=a.question_tokens,
                answer_tokens=a.answer_tokens, concurrency=a.concurrency, working_set_blocks=wl.working_blocks,
                num_blocks=nb, working_set_over_cache=ratio, fit_users=fit_users, fit_num_blocks=fit,
                host_cache_gib=host_gib,
                fit_throughput_ratio=fit_ratio, fit_repeats=a.fit_repeats,
                fit_cpu_time_ratio=cpu_ratio if a.executor != "cluster" else None, **check,
                ttft_s={k: [round(x, 5) for x in ttfts[k]] for k in ("capped, tier off", "capped, tier on")})
    return [r | {"part": "host"} for r in rows], meta


def tie_args(a, *gaps) -> tuple:
    """``same_tokens``'s near-tie arguments: both runs' gaps and the margin, or none (exact)."""
    return (gaps, a.tie_margin) if a.tie_margin else ()


def part_share(a):
    start_ray(a)
    wl = Workload(a, model_config(a).vocab_size)
    nb = a.num_blocks or max(wl.working_blocks // 3, a.concurrency * (wl.request_blocks + 1))
    print(f"[share] 2 replicas of {nb} blocks each, working set {wl.working_blocks} blocks; turn t of user u "
          "on replica (u + t) % 2")
    rows, answers, ttfts, gaps = [], {}, {}, {}
    for sharing in (False, True):
        run = f"sharing {'on' if sharing else 'off'}"
        clear_store(a)
        cfg = engine_config(a, nb, sharing=sharing, min_share_tokens=a.share_min_tokens,
                            max_share_tokens=a.share_max_tokens if sharing else None)
        engines = [make_engine(a, cfg, a.executor == "cluster" or (a.executor == "auto" and a.device == "cuda"))
                   for _ in range(2)]
        row, answers[run], ttfts[run], gaps[run] = run_loop(a, run, engines, wl, lambda u, t: (u + t) % 2)
        rows.append(row | dict(sharing=sharing))
        free(*engines)
    clear_store(a)
    check = same_tokens(answers["sharing off"], answers["sharing on"], "[share] sharing off vs on",
                        *tie_args(a, gaps["sharing off"], gaps["sharing on"]))
    meta = dict(users=a.users, turns=a.turns, doc_tokens=a.doc_tokens, concurrency_per_replica=a.concurrency,
                num_blocks=nb, working_set_blocks=wl.working_blocks,
                kv_share_min_tokens=a.share_min_tokens if a.share_min_tokens is not None
                else CacheConfig().kv_share_min_tokens, kv_share_max_tokens=a.share_max_tokens, **check,
                ttft_s={k: [round(x, 5) for x in v] for k, v in ttfts.items()})
    return [r | {"part": "share"} for r in rows], meta


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


# ---------------------------------------------------------------------------- output
HOST_COLS = ["run", "num_blocks", "requests", "out_tok_s", "req_s", "cpu_s", "ttft_p50_s", "ttft_p99_s",
             "ttft_p50_later_turns_s", "hit_rate", "hit_tokens_device", "hit_tokens_host", "offloaded_MB",
             "onloaded_MB", "blocks_per_onload", "blocks_per_offload", "copy_s"]
SHARE_COLS = ["run", "num_blocks", "requests", "out_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_p50_later_turns_s",
              "hit_rate", "hit_tokens_device", "hit_tokens_shared", "published_MB", "fetched_MB", "copy_s"]
COPY_COLS = ["blocks", "bytes", "gather_GBps", "bare_out_GBps", "gather_frac_of_bare", "offload_frac_of_bare",
             "offload_device_frac_of_bare", "scatter_GBps", "bare_in_GBps", "scatter_frac_of_bare",
             "onload_frac_of_bare", "onload_device_frac_of_bare"]
BREAKEVEN_COLS = ["blocks", "tokens", "lookup_s", "get_s", "scatter_s", "fetch_s", "prefill_s", "fetch_wins",
                  "prefill_ttft_s", "fetched_ttft_s", "fetched_ttft_wins"]
COLS = {"host": HOST_COLS, "share": SHARE_COLS, "copy": COPY_COLS, "breakeven": BREAKEVEN_COLS}


def plot(data: dict, path: Path) -> None:
    from plotting import pyplot

    plt = pyplot()
    parts, rows = data.get("parts", {}), data.get("rows", [])
    panels = [p for p in PARTS if p in parts]
    cols = min(2, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, p in zip(axes.flat, panels):
        if p in ("host", "share"):
            for run, xs in parts[p]["ttft_s"].items():
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post",
                        label=f"{run} (p50 {np.median(xs):.3g} s)")
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("fraction of requests")
            what = ("host tier, device KV 1/%.1f of the working set" % parts[p]["working_set_over_cache"]
                    if p == "host" else "two replicas, turns alternating")
            ax.set_title(f"TTFT CDF: {what}", fontsize=10)
        elif p == "copy":
            rs = [r for r in rows if r["part"] == "copy"]
            xs = [r["blocks"] for r in rs]
            # offload = gather + into host slots, onload = from host slots + scatter: what a step pays
            # (a GPU's gather alone is a device-to-device copy, far above the link)
            for k, style, label in (("offload", "-o", "offload (device -> host tier)"), ("bare_out", "--o", "bare out"),
                                    ("onload", "-s", "onload (host tier -> device)"), ("bare_in", "--s", "bare in")):
                ax.plot(xs, [r[f"{k}_GBps"] for r in rs], style, label=label)
            if rs and "onload_device_s" in rs[0]:  # device time: the host issued the copies ahead
                for k, style in (("offload", ":o"), ("onload", ":s")):
                    ax.plot(xs, [r["bytes"] / r[f"{k}_device_s"] / 1e9 for r in rs], style,
                            label=f"{k}, device time")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("blocks copied")
            ax.set_ylabel("GB/s")
            ax.set_title(f"Tier copies vs bare copy ({parts[p]['block_bytes'] / 1024:.0f} KiB blocks)", fontsize=10)
        else:
            rs = [r for r in rows if r["part"] == "breakeven"]
            xs = [r["tokens"] for r in rs]
            ax.plot(xs, [r["fetch_s"] for r in rs], "-o", label="fetch (lookup + get + scatter)")
            ax.plot(xs, [max(r["prefill_s"], 1e-6) for r in rs], "-s", label="prefill (TTFT - 1-token TTFT)")
            ax.plot(xs, [r["fetched_ttft_s"] for r in rs], ":o", label="TTFT, fetched")
            ax.plot(xs, [r["prefill_ttft_s"] for r in rs], ":s", label="TTFT, computed")
            m = parts[p].get("measured_kv_share_min_tokens")
            if m:
                ax.axvline(m, color="grey", ls="--", label=f"fetch wins from {m} tokens")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prefix tokens")
            ax.set_ylabel("seconds")
            ax.set_title("Shared fetch vs prefill", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    gpu = data.get("machine", {}).get("gpu") or f"{data.get('machine', {}).get('cpus')}-core CPU"
    fig.suptitle(f"KV tiers: {data.get('model_desc', data.get('model', ''))}, {gpu}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", help="comma-separated parts of " + ", ".join(PARTS) + " (default all)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=bl.device().type)
    ap.add_argument("--model", default=None, help="a preset (ray_attn/presets.py); default llama-3-8b on "
                    "cuda, else 'cpu' (a 4-layer 512-wide random model)")
    ap.add_argument("--tp", type=int, default=1, help="TP size (needs --executor cluster when > 1)")
    ap.add_argument("--executor", choices=["auto", "inprocess", "cluster"], default="auto",
                    help="auto: in the driver's process, except the share part on cuda (AttentionCluster, a "
                    "GPU per replica)")
    for k in DEFAULTS["cpu"]:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default: cpu "
                        f"{DEFAULTS['cpu'][k]}, cuda {DEFAULTS['cuda'][k]}")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="device KV blocks of the capped runs (default: "
                    "a third of the working set, at least what --concurrency requests need)")
    ap.add_argument("--fit-num-blocks", type=int, default=None, help="device KV blocks where the working set fits")
    ap.add_argument("--fit-users", type=int, default=None, help="users of the runs where the working set fits "
                    "(default: all on cpu; on cuda as many as the capped cache holds)")
    ap.add_argument("--fit-repeats", type=int, default=2, help="runs of each tier setting where it fits, in the "
                    "order off, on, on, off, ... (the best of each kept: a loaded box varies by several %%)")
    ap.add_argument("--host-gib", type=float, default=None, help="host tier per rank (default: 1.25x the working set)")
    ap.add_argument("--store-gib", type=float, default=None, help="each node's store (default: 1.25x the working set)")
    ap.add_argument("--share-min-tokens", type=int, default=None, help="kv_share_min_tokens of the share part "
                    "(default: CacheConfig's)")
    ap.add_argument("--share-max-tokens", type=int, default=None, help="kv_share_max_tokens of the share part "
                    "(default: none; on a GPU, breakeven's measured_kv_share_max_tokens)")
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="default 2048 (cpu), 8192 (cuda)")
    ap.add_argument("--copy-blocks", default=None, help="block counts of the copy part (default cpu 1,4,16,64,256; "
                    "cuda 1,16,64,256,1024)")
    ap.add_argument("--iters", type=int, default=5, help="timed repeats of each copy")
    ap.add_argument("--breakeven-blocks", default=None, help="block counts of the breakeven part (default cpu "
                    "1,2,4,8,16,32,64; cuda up to 256)")
    ap.add_argument("--reps", type=int, default=3, help="repeats of each breakeven point (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (cpu)")
    ap.add_argument("--tie-margin", type=float, default=None,
                    help="nats: runs may fork only where both runs' top two logprobs are closer than this "
                    "(default: cuda 0.1, where bf16 results depend on the batch; cpu 0: identical tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--output", default=str(bl.RESULTS / "bench_kv_tiers.json"))
    a = ap.parse_args(argv)
    parts = list(PARTS) if a.part == "all" else [p.strip() for p in a.part.split(",")]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--part: unknown {bad}; choose from {', '.join(PARTS)} or all")
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.model = a.model or ("llama-3-8b" if a.device == "cuda" else "cpu")
    a.tie_margin = (0.1 if a.device == "cuda" else 0.0) if a.tie_margin is None else a.tie_margin
    a.max_batched_tokens = a.max_batched_tokens or (8192 if a.device == "cuda" else 2048)
    a.copy_blocks = a.copy_blocks or ("1,16,64,256,1024" if a.device == "cuda" else "1,4,16,64,256")
    a.breakeven_blocks = a.breakeven_blocks or ("1,2,4,8,16,32,64" + (",128,256" if a.device == "cuda" else ""))
    if a.tp > 1 and a.executor != "cluster":
        ap.error("--tp > 1 needs --executor cluster")
    a.block_bytes = block_bytes(a)
    last = a.doc_tokens + a.turns * (a.question_tokens + a.answer_tokens)
    a.store_gib = a.store_gib or max(0.01, capped_gib(1.25 * a.users * math.ceil(last / a.block_size) * block_bytes(a),
                                                      "store"))

    if a.device == "cpu":  # OpenMP threads spin on a loaded box: 1 thread runs far faster there
        torch.set_num_threads(a.threads)
    out = Path(a.output)
    data = json.loads(out.read_text()) if out.exists() else {}
    if data.get("model") not in (None, a.model) or data.get("device") not in (None, a.device):
        data = {}  # another model's or device's results: start afresh
    data.update(machine=bl.machine(), model=a.model, device=a.device, model_desc=describe(a))
    data.setdefault("parts", {})
    runners = {"host": part_host, "share": part_share, "copy": part_copy, "breakeven": part_breakeven}
    for p in parts:
        if p == "share" and a.device == "cuda":
            measured_window(a, data["parts"].get("breakeven"))
        t0 = time.perf_counter()
        rows, meta = runners[p](a)
        meta["seconds"] = time.perf_counter() - t0
        data["parts"][p] = meta
        data["rows"] = [r for r in data.get("rows", []) if r["part"] != p] + rows
        bl.print_table(rows, COLS[p], title=f"{p} ({meta['seconds']:.0f} s)")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=float) + "\n")  # after each part: nothing lost
    plot(data, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    # exact on CPU (float32); on a GPU forks only where both runs were within --tie-margin
    key = "forks_at_near_ties" if a.tie_margin else "tokens_identical"
    failed = [p for p in parts if data["parts"][p].get(key) is False]
    assert not failed, f"greedy tokens differ between the runs of {failed}" + (
        f" at a fork where a run's top two were {a.tie_margin} nats or more apart" if a.tie_margin else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
