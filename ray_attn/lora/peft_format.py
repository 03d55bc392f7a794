"""Reading a LoRA adapter as HF ``peft`` saves it: ``adapter_config.json`` beside
``adapter_model.safetensors``.

peft names each tensor after the module it adapts, under the PeftModel's prefix and without the
adapter's name: ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]; the update is ``x A^T B^T * scaling`` with ``scaling = lora_alpha /
r`` (``lora_alpha / sqrt(r)`` under ``use_rslora``), ``r`` and ``lora_alpha`` per module when
``rank_pattern`` / ``alpha_pattern`` name it.  Everything an adapter could hold that we would not
compute -- DoRA, biases, modules saved whole, embeddings, a module the model lacks, a rank above
``max_lora_rank``, a shape that does not fit the base -- is refused here, by name, before any of
it reaches a rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ray_attn.lora.config import TARGET_MODULES, LoRAAdapterError  # noqa: F401 (its home is config)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>\w+)$")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass
class LoRAModule:
    """One adapted projection: A [r, in], B [out, r] (full, unsharded) and its scaling."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class PeftAdapter:
    path: str
    config: dict
    # checkpoint module path ("model.layers.3.self_attn.q_proj") -> its A, B and scaling
    modules: dict[str, LoRAModule] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def target_modules(self) -> list[str]:
        return sorted({p.rpartition(".")[2] for p in self.modules})


def base_shapes(model) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target, by its peft name, from a ModelConfig."""
    H, KV, D, E = model.num_attention_heads, model.num_key_value_heads, model.head_size, model.hidden_size
    I = model.intermediate_size
    return {"q_proj": (H * D, E), "k_proj": (KV * D, E), "v_proj": (KV * D, E), "o_proj": (E, H * D),
            "gate_proj": (I, E), "up_proj": (I, E), "down_proj": (E, I)}


def _pattern_value(patterns: dict, module: str, default):
    """peft's ``get_pattern_key``: a key matches a module whose path ends in it (as a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: str, name: str) -> dict:
    cfg_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"adapter {name!r}: lora_path {path!r} is not a folder")
    if not os.path.isfile(cfg_file):
        raise LoRAAdapterError(f"adapter {name!r}: {cfg_file!r} does not exist (a peft adapter folder holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    bad = {
        "peft_type": (cfg.get("peft_type", "LORA") != "LORA", "only LoRA adapters are served"),
        "use_dora": (bool(cfg.get("use_dora")), "DoRA is not served"),
        "bias": (cfg.get("bias", "none") != "none", "adapters with trained biases are not served"),
        "modules_to_save": (bool(cfg.get("modules_to_save")), "modules saved whole are not served"),
        "fan_in_fan_out": (bool(cfg.get("fan_in_fan_out")), "Conv1D (fan_in_fan_out) layers are not served"),
    }
    for key, (wrong, why) in bad.items():
        if wrong:
            raise LoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} {key}={cfg.get(key)!r}: {why}")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):  # a regex string is checked against the tensors instead
        extra = sorted(set(targets) - set(TARGET_MODULES))
        if extra:
            raise LoRAAdapterError(f"adapter {name!r}: target module {extra[0]!r} is not served "
                                   f"(targets: {', '.join(TARGET_MODULES)})")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise LoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} {key} must be a positive number, got {v!r}")
    return cfg


def warm_page_cache(path: str, chunk: int = 8 << 20) -> None:
    """Read the adapter's weights file once through the page cache, in chunks whose read()
    releases the GIL, so that the tensors' copies after it wait on no disk while holding it."""
    buf = bytearray(chunk)
    try:
        with open(os.path.join(path, WEIGHTS_FILE), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    except OSError:
        pass  # read_adapter names what is wrong


def read_adapter(path: str, name: str, model, max_lora_rank: int) -> PeftAdapter:
    """The adapter at ``path`` checked against ``model`` (a ModelConfig) and the rank limit."""
    cfg = read_config(path, name)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        extra = " (peft wrote a .bin: save with safe_serialization=True)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAAdapterError(f"adapter {name!r}: {weights!r} does not exist{extra}")
    from safetensors import safe_open

    try:
        # tensor by tensor: safetensors holds the GIL while it copies one, and a rank's prefetch
        # thread reads while the rank's steps run (a whole-file load held them up ~100 ms)
        with safe_open(weights, framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own types for a bad file
        raise LoRAAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file "
                               f"({type(e).__name__}: {e})") from None
    shapes = base_shapes(model)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a linear layer "
                                   f"(embeddings, DoRA magnitudes and saved modules are not served)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise LoRAAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    adapter = PeftAdapter(path, cfg)
    for module, ab in sorted(pairs.items()):
        mm = _MODULE.match(module)
        short = module.rpartition(".")[2]
        if mm is None or short not in TARGET_MODULES or _BLOCK[short] != mm["block"]:
            raise LoRAAdapterError(f"adapter {name!r}: target module {module!r} is not served "
                                   f"(targets: {', '.join(TARGET_MODULES)} of the decoder layers)")
        layer = int(mm["layer"])
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} is past the model's {model.num_hidden_layers} layers")
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} has lora_{'AB'.strip(''.join(ab))} missing")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[short]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)} are not [r, in] and [out, r] of one rank")
        if a.shape[1] != inp or b.shape[0] != out:
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} adapts a [{b.shape[0]}, {a.shape[1]}] (out, in) "
                                   f"projection, but the base model's {short} is [{out}, {inp}]: another base model")
        r = a.shape[0]
        if r > max_lora_rank:
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} has rank {r}, over max_lora_rank={max_lora_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} holds non-finite weights")
        cfg_r = _pattern_value(cfg.get("rank_pattern"), module, cfg["r"])
        if cfg_r != r:
            raise LoRAAdapterError(f"adapter {name!r}: {module!r} has rank {r} in {WEIGHTS_FILE} but r={cfg_r} "
                                   f"in {CONFIG_FILE}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg["lora_alpha"])
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        adapter.modules[module] = LoRAModule(a, b, float(scaling))
    return adapter


# What the check found (rank, target modules) per adapter folder as its files stand: the Serve
# handler checks an adapter off the engine thread, and the engine's own check of the same files
# (``LoRAManager.add``, on the loop thread, between two steps) is then a stat of each file
# instead of a second read of every tensor -- 23 ms of SmolLM2's rank-16 adapter that every
# stream would wait (scripts/bench_lora_load.py).  A changed file (mtime or size) is read again.
_CHECKED: dict[tuple, tuple[int, list[str]]] = {}
_CHECKED_MAX = 256


def _file_key(path: str) -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def check_adapter(path: str, name: str, model, max_lora_rank: int) -> tuple[int, list[str]]:
    """``read_adapter``'s check, remembered: the adapter's rank and target modules."""
    try:
        files = tuple(_file_key(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE))
    except OSError:
        files = None  # missing: read_adapter names what is wrong
    key = None if files is None else (os.path.realpath(path), files, repr(base_shapes(model)),
                                      model.num_hidden_layers, max_lora_rank)
    hit = _CHECKED.get(key) if key is not None else None
    if hit is not None:
        return hit
    adapter = read_adapter(path, name, model, max_lora_rank)
    found = (adapter.rank, adapter.target_modules)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = found
    return found
