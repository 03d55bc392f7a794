"""Shared helpers of the benchmark scripts: timing, bandwidth baselines, results and plots."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

try:  # the scripts import it from here too; as ``scripts.benchlib`` the folder is not on sys.path
    from stretch import stretched  # noqa: F401
except ImportError:
    from scripts.stretch import stretched  # noqa: F401

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def timeit(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call.  On CUDA, back-to-back calls between two events, so that host
    launch overhead overlaps with GPU work as it does in a real decode loop."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        samples = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(samples)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def graph_timeit(fn, iters: int = 20, warmup: int = 3) -> float | None:
    """Median seconds per replay of one call of ``fn`` captured in a CUDA graph: the GPU time alone,
    which is what a CUDA-graph decode loop pays, while ``timeit`` also pays any host launch cost
    the GPU outruns.  None on CPU (there is no launch cost to remove: use ``timeit``) and when
    ``fn`` cannot be captured (it syncs with the host, say); a warning then says why."""
    if not torch.cuda.is_available():
        return None
    # Lazy work (Triton JIT, library handles, first-call allocations) must not land in the graph,
    # and torch wants that warm-up off the default stream.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        torch.cuda.synchronize()
        warnings.warn(f"graph_timeit: capture failed, no graph time ({e})")
        return None
    try:
        return timeit(graph.replay, iters=iters, warmup=1)
    finally:
        del graph  # its private memory pool goes with it, before the next point allocates


def synced_timeit(fn, dev: torch.device, iters: int) -> float:
    """Median wall seconds of one call of ``fn`` and the device work it queued (synchronised after
    each call), after one warm-up call: what a caller that waits for the result pays."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def host_timeit(fn, burst: int = 4, reps: int = 5) -> float:
    """Median host seconds to submit one call of ``fn``: Python, argument checks, allocations and
    kernel launches, without waiting for the GPU.  Each sample is ``burst`` calls issued on an idle
    GPU, divided by ``burst``; the burst is short so that the launch queue (about a thousand
    kernels) never fills and blocks the host, which would count GPU time.  If host > GPU time
    (``graph_timeit``), eager back-to-back calls are host-bound.  On CPU the work runs on the host,
    so this is simply the wall time of a call."""
    fn()
    samples = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        samples.append((time.perf_counter() - t0) / burst)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(samples)


def copy_bandwidth(nbytes: int, dev: torch.device) -> float:
    """Bytes per second of a device-to-device copy, counting what it reads plus what it writes."""
    n = max(nbytes // 2, 1 << 20)
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() * src.element_size() / t


def gpu_and_copy_rate(script: str) -> tuple[torch.device, float] | None:
    """A tuning script's GPU and its copy rate (over 1 GB); None, said, where there is no GPU."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a GPU; nothing to tune here")
        return None
    dev = torch.device("cuda")
    return dev, copy_bandwidth(1 << 30, dev)


def matmul_flops(dev: torch.device, n: int = 8192) -> float:
    """FLOP/s of a large square GEMM (bf16 on GPU, float32 on CPU): the compute ceiling."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = n if dev.type == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    return 2 * n ** 3 / timeit(lambda: a @ b, iters=10)


def start_decoding(engine, prompts, params) -> list:
    """Add the requests and step the engine until each one has its first token: what follows
    is decode.  Returns their ids."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    budget = engine.config.max_num_batched_tokens
    # Prefill chunks, plus slack: a batch the KV cache cannot hold preempts and recomputes for ever
    # (a 256 x 1k point at half of an 80 GB card's memory), which a bound turns into an error.
    limit = 2 * sum(len(p) for p in prompts) // max(budget, 1) + 2 * len(ids) + 16
    steps = 0
    while any(not engine.requests[i].num_output_tokens for i in ids):
        engine.step()
        steps += 1
        if steps > limit:
            raise RuntimeError(f"{len(ids)} requests of up to {max(map(len, prompts))} tokens did not all start "
                               f"decoding in {limit} steps: the KV cache holds fewer (raise the memory fraction "
                               f"or lower the batch)")
    return ids


def end_requests(engine, ids) -> None:
    """Abort and forget the requests, and collect the step still out under async scheduling,
    so that the engine is idle for the next point."""
    for i in ids:
        engine.abort_request(i)
        engine.release(i)
    engine.flush()


def machine() -> dict:
    info = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_memory_gb=round(p.total_memory / 2**30, 1))
    else:
        info.update(gpu=None)
    return info


def write_json(path, obj) -> Path:
    """``obj`` as indented JSON at ``path`` (its folder made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=float))
    return path


def save(name: str, rows: list[dict], **meta) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **meta, "rows": rows}, indent=1, default=float))
    return path


def print_table(rows: list[dict], cols: list[str], title: str = "", width: int = 200) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[_fmt(r.get(c)) for c in cols])
    Console(width=width).print(t)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def paged_decode_inputs(batch: int, ctx, block_size: int, num_kv_heads: int, head_size: int,
                        dtype, dev, q_per_seq: int = 1, num_q_heads: int = 32, cache_dtype=None,
                        shared_blocks: int = 0, groups: int = 1):
    """A paged cache holding ``batch`` sequences of ``ctx`` tokens (int or per-sequence list) and
    the metadata for ``q_per_seq`` new tokens each.  With ``shared_blocks``, the sequences of each
    of ``groups`` groups share their first blocks, as prompts with common prefixes do."""
    from ray_attn.metadata import FlashAttentionMetadata

    ctx = np.full(batch, ctx, np.int64) if np.isscalar(ctx) else np.asarray(ctx, np.int64)
    nblk = -(-ctx // block_size)
    per_group = -(-batch // groups)
    own = nblk - shared_blocks
    total = int(own.sum()) + groups * shared_blocks + 1
    table = np.zeros((batch, int(nblk.max())), np.int32)
    nxt = groups * shared_blocks
    for b in range(batch):
        g = b // per_group
        table[b, :shared_blocks] = np.arange(g * shared_blocks, (g + 1) * shared_blocks)
        table[b, shared_blocks:nblk[b]] = np.arange(nxt, nxt + own[b])
        nxt += own[b]
    q_lens = np.full(batch, q_per_seq, np.int64)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(c - q_per_seq, c) for c in ctx])
    rows = np.repeat(np.arange(batch), q_per_seq)
    slots = (table[rows, pos // block_size].astype(np.int64) * block_size + pos % block_size).astype(np.int32)
    meta = FlashAttentionMetadata(
        num_actual_tokens=int(q_lens.sum()), max_query_len=q_per_seq, query_start_loc=qsl,
        max_seq_len=int(ctx.max()), seq_lens=ctx.astype(np.int32), block_table=table,
        slot_mapping=slots)
    T = int(q_lens.sum())
    cache = torch.empty(2, total, block_size, num_kv_heads, head_size, dtype=dtype, device=dev).normal_()
    if cache_dtype is not None:
        cache = cache.to(cache_dtype)
    q = torch.randn(T, num_q_heads, head_size, dtype=dtype, device=dev)
    k = torch.randn(T, num_kv_heads, head_size, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    return meta, cache, q, k, v


def plot(path_png, series: dict, xlabel: str, ylabel: str, title: str, logx=True, hline=None,
         hline_label=None):
    plot_panels(path_png, [(title, series)], xlabel, ylabel, logx=logx, hline=hline,
                hline_label=hline_label)


def plot_panels(path_png, panels: list, xlabel: str, ylabel: str, logx=True, hline=None,
                hline_label=None, logy=False):
    """Side-by-side plots sharing the y axis; ``panels`` is [(title, {label: (xs, ys)})]."""
    from plotting import pyplot  # scripts/ is on sys.path wherever a script plots

    plt = pyplot()

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.2), sharey=True,
                             squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        if hline is not None:
            ax.axhline(hline, color="grey", ls="--", label=hline_label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
