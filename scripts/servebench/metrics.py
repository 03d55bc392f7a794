"""vLLM's serving metrics, computed from what each request recorded, with its key names.

Definitions follow ``vllm bench serve``: TTFT is the first token chunk's arrival after the request
was sent; ITL the gaps between token chunks; TPOT a request's ``(e2el - ttft) / (output - 1)``;
E2EL the last token chunk's arrival.  Output tokens come from the server's ``usage`` (a chunk
may carry several tokens).  Goodput counts requests within every SLO given; a request of one
output token has TPOT 0 for it, as in vLLM.  Times are kept in seconds and reported in ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = ("ttft", "tpot", "e2el")
HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass
class RequestFuncOutput:
    """What one request recorded (vLLM's name and fields; ``output_token_ids`` is ours)."""

    success: bool = False
    latency: float = 0.0  # e2el, seconds
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    output_token_ids: list[int] | None = None


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    # per metric name: mean, median, std and [(percentile, value)], all in ms
    stats_ms: dict[str, dict] = field(default_factory=dict)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None:
            raise ValueError(f"--goodput: {pair!r} is not KEY:VALUE with VALUE a number of milliseconds")
        if name not in GOODPUT_NAMES:
            raise ValueError(f"--goodput: unknown metric {name!r}; choose from {list(GOODPUT_NAMES)}")
        if ms < 0:
            raise ValueError(f"--goodput: {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def parse_percentile_args(metrics: str | None, percentiles: str) -> tuple[list[str], list[float]]:
    names = [m.strip() for m in (metrics or ",".join(METRIC_NAMES)).split(",") if m.strip()]
    bad = [m for m in names if m not in METRIC_NAMES]
    if bad or not names:
        raise ValueError(f"--percentile-metrics: unknown metric {bad[0] if bad else ''!r}; "
                         f"choose from {list(METRIC_NAMES)}")
    try:
        ps = [float(p) for p in percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: {percentiles!r} is not a comma-separated list "
                         "of numbers") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles: each percentile must be in (0, 100], got {percentiles!r}")
    return names, ps


def _stats_ms(xs: list[float], percentiles: list[float]) -> dict:
    a = np.asarray(xs or [0.0], np.float64) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "percentiles": [(p, float(np.percentile(a, p))) for p in percentiles]}


def _peak_rates(ok: list[RequestFuncOutput]) -> tuple[float, int]:
    """Most output token chunks in one second of the run, and most requests active in a second
    (vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``)."""
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    n = int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for o in ok:
        times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        np.add.at(tokens, np.clip((times - t0).astype(int), 0, n - 1), 1)
        active[int(o.start_time - t0): int(o.start_time + o.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(outputs: list[RequestFuncOutput], dur_s: float, percentiles: list[float],
                      goodput: dict[str, float]) -> tuple[BenchmarkMetrics, list[int]]:
    """The run's metrics and each request's output length (0 for a failed one)."""
    if dur_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {dur_s}")
    output_lens, total_input, completed, good = [], 0, 0, 0
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or len(o.itl) + 1  # no usage: one token per chunk
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(completed):
            good += all(per_metric[k][i] <= ms / 1000 for k, ms in goodput.items())
    total_output = sum(output_lens)
    peak_tokens, peak_requests = _peak_rates([o for o in outputs if o.success])
    m = BenchmarkMetrics(
        completed=completed, failed=len(outputs) - completed, total_input=total_input,
        total_output=total_output, request_throughput=completed / dur_s,
        request_goodput=good / dur_s, output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_requests)
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.stats_ms[name] = _stats_ms(xs, percentiles)
    return m, output_lens


def _line(label: str, value, fmt: str = "") -> str:
    return f"{label:<40} {format(value, fmt):<10}"


def benchmark_result(m: BenchmarkMetrics, output_lens: list[int], outputs: list[RequestFuncOutput],
                     duration: float, selected_metrics: list[str], goodput: dict[str, float],
                     request_rate: float, max_concurrency: int | None, header: str = "") -> tuple[dict, str]:
    """vLLM's result keys and its summary table (returned as text)."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    if header:
        lines.append(_line("Backend:", header))
    lines += [_line("Successful requests:", m.completed), _line("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [_line("Benchmark duration (s):", duration, ".2f"),
              _line("Total input tokens:", m.total_input),
              _line("Total generated tokens:", m.total_output),
              _line("Request throughput (req/s):", m.request_throughput, ".2f")]
    if goodput:
        lines.append(_line("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [_line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              _line("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
              _line("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")]
    result = {
        "duration": duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if goodput else None,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in METRIC_NAMES:
        if name not in selected_metrics:
            continue
        short, title = HEADERS[name]
        s = m.stats_ms[name]
        lines += [f"{title:-^50}", _line(f"Mean {short} (ms):", s["mean"], ".2f"),
                  _line(f"Median {short} (ms):", s["median"], ".2f")]
        result.update({f"mean_{name}_ms": s["mean"], f"median_{name}_ms": s["median"],
                       f"std_{name}_ms": s["std"]})
        for p, value in s["percentiles"]:
            word = str(int(p)) if int(p) == p else str(p)
            lines.append(_line(f"P{word} {short} (ms):", value, ".2f"))
            result[f"p{word}_{name}_ms"] = value
    lines.append("=" * 50)
    return result, "\n".join(lines)
