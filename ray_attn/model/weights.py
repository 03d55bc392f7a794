"""HF-format safetensors in and out (GGUF files in, through ``gguf_weights``), and the seeded
random weights the tests run on.

A checkpoint is read tensor by tensor through ``safe_open(...).get_slice``, so a rank reads only
its own slice of each sharded weight from disk, never the whole model.  Everything here works on
a model's ``weight_shards()`` (checkpoint name -> where this rank's piece sits), so it knows no
model family; ``registry.save_random_checkpoint`` builds the model that describes one.
"""

from __future__ import annotations

import json
import os
import zlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ray_attn import gguf_file
from ray_attn.hf_export import hf_config_dict  # noqa: F401 -- its home before the families
from ray_attn.model import gguf_weights
from ray_attn.model.layers import FusedShard, Init, Shard

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoint tensors HF writes but no computation reads (old Llama checkpoints carry inv_freq).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def random_full_tensor(name: str, shape, seed: int, *, init: Init = "matrix", std: float | None = None,
                       tied: bool = False, device="cpu") -> torch.Tensor:
    """The full float32 tensor ``name`` of the seeded random model; ``init`` is its ``Shard.init``.

    Seeded per name, so it does not depend on the order tensors are made in, nor on the TP size.
    The numbers depend on the device's generator: CPU and CUDA give different (equally valid) models.
    Default scales: 1/sqrt(fan_in) for every matrix (~0.016 at Llama-3-8B's width, close to
    Llama's 0.02, but scaled so small test models keep peaked attention and logits of order 1),
    and std 1 for an untied embedding, so that each position's own token stays visible in the
    residual stream; with a flat 0.02 a tiny model's attention is near-uniform and greedy decoding
    repeats one token whatever the prompt.  ``std`` overrides the scale of every matrix.
    """
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    t = torch.randn(tuple(shape), generator=g, dtype=torch.float32, device=device)
    if init == "norm":
        return t.mul_(0.05).add_(1.0)  # near 1, but not exactly, so a skipped or misplaced norm shows
    if init == "norm_offset":
        return t.mul_(0.05)  # the norm scales by 1 + weight: near 1 again
    if init == "bias":
        return t.mul_(0.5)  # half the projections' unit scale: a dropped or misplaced bias shows
    if std is None:
        fan_in = shape[-2] if init == "matrix_t" else shape[-1]
        std = 1.0 if init == "embedding" and not tied else fan_in ** -0.5
    return t.mul_(std)


def checkpoint_shapes(model) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of every tensor in a checkpoint of ``model`` (any rank, any
    device, ``meta`` included: only its ``weight_shards()`` are read)."""
    return {name: s.full_shape for name, s in model.weight_shards().items()}


def write_random_checkpoint(shards: dict[str, Shard | FusedShard], folder: str, seed: int, *, dtype: str,
                            std: float | None = None, tied: bool = False, num_shards: int = 1) -> None:
    """The full tensors of ``shards`` (a model's ``weight_shards()``, on any device: only names,
    shapes and inits are read) as seeded random safetensors, sharded with an index file when
    ``num_shards > 1``."""
    fixed = [n for n, s in shards.items() if s.dtype is not None]
    if fixed:
        raise ValueError(f"random weights cannot fill a checkpoint of stored FP8 tensors ({fixed[0]}, ...): "
                         "write the full-precision model and use quantization='fp8', or quantize it with "
                         "its tool")
    os.makedirs(folder, exist_ok=True)
    names = list(shards.items())
    per = -(-len(names) // num_shards)
    weight_map = {}
    for i in range(num_shards):
        fname = SINGLE_FILE if num_shards == 1 else f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: random_full_tensor(n, s.full_shape, seed, init=s.init, std=std, tied=tied).to(getattr(torch, dtype))
                for n, s in names[i * per:(i + 1) * per]}
        save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    if num_shards > 1:
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def checkpoint_names(folder: str) -> list[str]:
    """Every tensor name a checkpoint folder (or GGUF file) holds, by HF name."""
    path = gguf_file.gguf_path(folder)
    if path is not None:
        return gguf_weights.checkpoint_names(path)
    return list(_weight_map(folder))


def _weight_map(folder: str) -> dict[str, str]:
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not files:
        raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or other .safetensors file in {folder!r}")
    wm = {}
    for fname in files:
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            wm.update(dict.fromkeys(f.keys(), fname))
    return wm


def load_checkpoint(shards: dict[str, Shard | FusedShard], folder: str, *, tied: bool = False,
                    architecture: str = "model", prefix: str = "", ignored_prefixes: tuple[str, ...] = ()) -> None:
    """Copy each shard's slice of its checkpoint tensor in; every check runs before any copy.
    ``architecture`` names the model in errors; ``prefix`` is the one ``shards``' names carry (a
    multimodal checkpoint's ``language_model.``), ``ignored_prefixes`` those of tensors the text
    model does not read (its vision tower).  A GGUF checkpoint is dequantized as it loads
    (``gguf_weights``)."""
    path = gguf_file.gguf_path(folder)
    if path is not None:
        return gguf_weights.load_gguf(shards, path, tied=tied, architecture=architecture)
    wm = _weight_map(folder)
    missing = [n for n in shards if n not in wm]
    if missing:
        raise ValueError(f"checkpoint {folder!r} lacks {len(missing)} tensor(s) the model needs: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    benign = lambda n: (n.endswith(IGNORED_SUFFIXES) or (tied and n == prefix + "lm_head.weight")
                        or (bool(ignored_prefixes) and n.startswith(ignored_prefixes)))
    extra = [n for n in wm if n not in shards and not benign(n)]
    if extra:
        raise ValueError(f"checkpoint {folder!r} has {len(extra)} tensor(s) this {architecture} does not "
                         f"use (a different architecture?): {', '.join(extra[:8])}")
    by_file: dict[str, list[str]] = {}
    for n in shards:
        by_file.setdefault(wm[n], []).append(n)
    for fname in by_file:  # shapes first, so a bad checkpoint leaves the model untouched
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            for n in by_file[fname]:
                got = tuple(f.get_slice(n).get_shape())
                if got != tuple(shards[n].full_shape):
                    raise ValueError(f"checkpoint tensor {n!r} has shape {got}, but the model config "
                                     f"expects {tuple(shards[n].full_shape)}")
                # A stored FP8 weight must be one: a bf16 tensor copied into an fp8 one would be
                # cast without its scale, and a float8_e5m2 one would be read as e4m3.
                want, dtype = shards[n].dtype, f.get_slice(n).get_dtype()
                if want is not None and dtype != want:
                    raise ValueError(f"checkpoint tensor {n!r} has dtype {dtype}, but the model's quantization "
                                     f"expects {want}")
    for fname, names in by_file.items():
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            for n in names:
                tensor = f.get_slice(n)
                for piece in shards[n].pieces():
                    piece.dest.copy_(tensor[piece.index()])
