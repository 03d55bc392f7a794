"""Launch settings of the decode GEMV kernels -- the bf16 GEMV (``gemv.py``), the FP8 skinny
kernel (``fp8_kernels.fp8_skinny``), the weight-only FP8 GEMV (``w8a16``) and the bf16 skinny
kernel for 2-16 rows (``skinny.py``) -- per GPU model and
weight shape, as vLLM keeps its fused-MoE configs: ``scripts/tune_decode_gemv.py`` times
candidates inside CUDA graphs over up to 32 layers' weights and writes the fastest to
``configs/<device name>.json``.

Why per shape: at decode sizes these kernels are weight streams, and how fast one streams depends
on how many programs share the matrix (N / BLOCK_N) against the SM count and how much each has in
flight (BLOCK_K, the pipeline depth): on an H100, 512-wide K steps read Qwen3-30B-A3B's qkv
1.10x faster than the default 1024, 4-row tiles Llama 4's shared down_proj 1.08x faster than 8,
and 32-row tiles three deep the FP8 qkv 1.11x (``benchmarks/results/tune_decode_gemv.json``).
A shape or device without an entry keeps the kernel's own rule (``gemv.config``,
``skinny_config``), as do row counts above the largest tuned one (their tiles grow with the
rows).  An entry also decides where a kernel runs at all:
the bf16 GEMV above ``gemv.MAX_N``, ``w8a16`` and the bf16 skinny kernel run only on shapes their
table holds (the tune writes those only where they beat cuBLAS, or the FP8 skinny kernel).
RAY_ATTN_KERNEL_CONFIGS=0 ignores the tables (an A/B switch; read at import).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
KERNELS = ("gemv", "fp8_skinny", "w8a16", "skinny")
ENABLED = os.environ.get("RAY_ATTN_KERNEL_CONFIGS", "1") != "0"
KEYS = frozenset({"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"})  # what a table may set


def file_name(device_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in device_name) + ".json"


def shape_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


@functools.lru_cache(maxsize=None)
def device_table(device_name: str, folder: Path = CONFIG_DIR) -> dict:
    """{kernel: {shape_key: {rows: config}}} of ``device_name``; {} where none was tuned.  A
    config key outside ``KEYS`` is refused by name: a table must not set the tile's rows."""
    path = folder / file_name(device_name)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    out = {}
    for kernel, shapes in raw.get("kernels", {}).items():
        for key, by_rows in shapes.items():
            for rows, cfg in by_rows.items():
                bad = set(cfg) - KEYS
                if bad:
                    raise ValueError(f"{path}: {kernel} {key} rows {rows} sets {sorted(bad)}; a table sets only "
                                     f"{sorted(KEYS)}")
            out.setdefault(kernel, {})[key] = {int(r): dict(c) for r, c in by_rows.items()}
    return out


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(table: dict, kernel: str, m: int, n: int, k: int) -> dict:
    """The tuned config of the smallest tuned row count >= m; {} past the largest or untuned."""
    by_rows = table.get(kernel, {}).get(shape_key(n, k))
    if not by_rows:
        return {}
    fits = [r for r in sorted(by_rows) if r >= m]
    return dict(by_rows[fits[0]]) if fits else {}


def tuned(kernel: str, m: int, n: int, k: int, device: torch.device) -> dict:
    """``kernel``'s tuned launch settings for an [m, k] x [n, k]^T product on ``device`` ({} on
    CPU, with the tables off, or where none was tuned)."""
    if not ENABLED or device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lookup(device_table(_device_name(index)), kernel, m, n, k)


def write_table(device_name: str, kernels: dict, meta: dict, folder: Path = CONFIG_DIR) -> Path:
    """Write ``kernels`` ({kernel: {shape_key: {rows: config}}}) as ``device_name``'s table."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(device_name)
    body = {"device": device_name, **meta,
            "kernels": {kern: {key: {str(r): c for r, c in sorted(by_rows.items())} for key, by_rows in shapes.items()}
                        for kern, shapes in kernels.items()}}
    path.write_text(json.dumps(body, indent=1) + "\n")
    device_table.cache_clear()
    return path
