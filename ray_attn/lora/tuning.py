"""Launch settings of the batched LoRA kernels (``punica.py``), per projection shape and step size,
tuned per GPU model as vLLM tunes its fused-MoE kernels: ``scripts/bench_lora_kernels.py`` times
candidate settings inside CUDA graphs on the device and writes the fastest to
``configs/<device name>.json``; a device without a file gets ``KernelConfig()``.

Why it matters: at decode sizes the adapter weights of a step are a few MB, so both kernels are
bound by latency, not bandwidth -- how many dependent loads each program makes (``block_k``, the
K-split), how many programs share the work, and whether the shrink and the expand are one kernel
(``fused``: each program recomputes its part's shrink, a few KB of x and A from L2, and saves a
launch) decide a kernel's microseconds, and 256 of them run in a Llama-3-8B decode step.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MAX_SPLIT = 64  # the K-split's most slices: bounds the shrink's scratch (punica.scratch_elems)
SPLIT_MAX_TOKENS = 64  # a step of more tokens than this fills the GPU without splitting K


@dataclass(frozen=True)
class KernelConfig:
    """``fused``: one kernel (shrink recomputed per column block) instead of shrink + expand.
    ``block_k``/``num_warps``/``num_stages``: the shrink's (or the fused kernel's) K tile and launch;
    ``block_n``: columns of y per expand (or fused) program, cut down to one that no part boundary
    crosses; ``expand_warps``: the expand's warps; ``split_min_k``/``max_split``: the shrink's
    K-split at decode sizes (each slice at least ``split_min_k`` wide, at most ``max_split`` of them)."""

    fused: bool = False
    block_k: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    expand_warps: int = 4
    split_min_k: int = 512
    max_split: int = 32

    def __post_init__(self):
        for name in ("block_k", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {v}")
        if not 1 <= self.max_split <= MAX_SPLIT:
            raise ValueError(f"KernelConfig.max_split must lie in [1, {MAX_SPLIT}], got {self.max_split}")
        if self.split_min_k < self.block_k:
            raise ValueError(f"KernelConfig.split_min_k ({self.split_min_k}) must be >= block_k ({self.block_k})")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "KernelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


DEFAULT = KernelConfig()


def shape_key(K: int, N: int, parts: int, rank: int) -> str:
    return f"K={K},N={N},P={parts},R={rank}"


def file_name(device_name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in device_name) + ".json"


@functools.lru_cache(maxsize=None)
def device_table(device_name: str) -> dict:
    """The tuned table of ``device_name`` ({shape_key: {tokens: config}}); {} where none was tuned."""
    path = CONFIG_DIR / file_name(device_name)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {key: {int(t): KernelConfig.from_json(c) for t, c in by_t.items()} for key, by_t in raw["shapes"].items()}


def lookup(table: dict, num_tokens: int, K: int, N: int, parts: int, rank: int) -> KernelConfig:
    """The tuned config of the smallest step size >= ``num_tokens`` (the largest tuned one past it)."""
    by_t = table.get(shape_key(K, N, parts, rank))
    if not by_t:
        return DEFAULT
    sizes = sorted(by_t)
    return by_t[next((t for t in sizes if t >= num_tokens), sizes[-1])]


def config_for(device_name: str | None, num_tokens: int, K: int, N: int, parts: int, rank: int) -> KernelConfig:
    return lookup(device_table(device_name), num_tokens, K, N, parts, rank) if device_name else DEFAULT


def write_table(device_name: str, shapes: dict, meta: dict, folder: Path = CONFIG_DIR) -> Path:
    """Write ``shapes`` ({shape_key: {tokens: KernelConfig}}) as ``device_name``'s table."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(device_name)
    body = {"device": device_name, **meta,
            "shapes": {k: {str(t): c.to_json() for t, c in sorted(v.items())} for k, v in shapes.items()}}
    path.write_text(json.dumps(body, indent=1) + "\n")
    device_table.cache_clear()
    return path
