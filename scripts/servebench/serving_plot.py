"""The README's plot of serving latency against request rate: TTFT, TPOT and ITL (median and
P99) of the random 1024/128 workload at 4, 16, 64 req/s and at an infinite rate, one line per
engine configuration and percentile."""

from __future__ import annotations

RATE_KEYS = (("random_rate_4", 4), ("random_rate_16", 16), ("random_rate_64", 64), ("random_rate_inf", None))
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))


def rate_points(workloads: dict) -> list[tuple[float, dict]]:
    """(x, workload) of the rate runs that ran; an infinite rate is drawn at 4x the largest."""
    finite = [r for _, r in RATE_KEYS if r]
    pts = []
    for key, rate in RATE_KEYS:
        w = workloads.get(key) or {}
        if "median_ttft_ms" in w:
            pts.append((rate if rate else 4 * max(finite), w))
    return pts


def plot_latency_vs_rate(configs: list[dict], png, title: str) -> bool:
    """Write ``png``; False (and no file) when no configuration has a rate run yet."""
    series = [(c["name"], rate_points(c.get("workloads", {}))) for c in configs]
    if not any(pts for _, pts in series):
        return False
    from plotting import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 4.2), squeeze=False)
    finite = [r for _, r in RATE_KEYS if r]
    ticks = finite + [4 * max(finite)]
    for ax, (key, label) in zip(axes[0], METRICS):
        for name, pts in series:
            if not pts:
                continue
            xs = [x for x, _ in pts]
            for pct, style in (("median", "-o"), ("p99", "--s")):
                ax.plot(xs, [w[f"{pct}_{key}_ms"] for _, w in pts], style, label=f"{name} {pct}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [str(t) for t in finite] + ["inf"])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(f"{label} vs request rate")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"Serving latency, random 1024 in / 128 out ({title})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
