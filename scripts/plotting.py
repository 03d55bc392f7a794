"""matplotlib for the benchmark scripts' plots, which is all that uses it: it comes with the
``bench`` extra (``pip install 'ray_attn[bench]'``; ``make install`` includes it), not with the
library, so a serving install lacks it and a plot says so instead of a bare ModuleNotFoundError."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (the scripts run headless)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("plots need matplotlib, which comes with the bench extra: "
                         "pip install 'ray_attn[bench]' (or: pip install 'matplotlib>=3.8')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
