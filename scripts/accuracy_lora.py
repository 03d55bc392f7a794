"""The accuracy gate's LoRA row (``gpu_accuracy.py --rows lora``): four PEFT adapters on the gate's
checkpoint, written by ``peft`` itself, served in one batch with base-model requests.

Each prompt runs under one of the four adapters or the base model, in turn, so every step mixes
five weight sets through the punica kernels and their CUDA graphs.  The reference for
an adapter's prompts is HF float32 on peft's *merged* model (W + scaling B A, written as a
checkpoint of its own), the base prompts' is the base checkpoint; the control is HF bf16
``generate`` on the same merged checkpoints, scored the same way.  Agreement pools the groups.

Evidence that the adapters ran: on the adapters' prompts, HF's base model must agree with our
tokens at least ``MIN_SHIFT`` points less than their merged models do (a request served on the
base weights, or under the other adapter, agrees with the merged model no better than the base).
"""

from __future__ import annotations

import os

import torch

import hf_reference as hf

# (name, target modules, rank, lora_alpha): attention, MLP, all seven, a partial q/k/v set, at
# different ranks (below the slots' width too) and scalings
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [("attn", ALL[:4], 16, 32), ("mlp", ALL[4:], 8, 8), ("all", ALL, 16, 24), ("qv", ["q_proj", "v_proj"], 4, 8)]
GROUPS = ["attn", "mlp", None, "all", "qv"]  # prompt i runs under GROUPS[i % 5]
MIN_SHIFT = 20.0
# peft's init_lora_weights=False draws B like A (nn.Linear's uniform init): an update of the order
# of the base projection's output, which moves about half the argmaxes of the CPU gate's model
# (shift 49 points; 24 at half the B) without killing the model
B_SCALE = 1.0


def write_adapters(base: str, workdir: str) -> dict[str, dict[str, str]]:
    """Per adapter: its peft folder ("adapter") and the merged float32 checkpoint ("merged")."""
    import peft

    out = {}
    for i, (name, targets, r, alpha) in enumerate(ADAPTERS):
        adapter, merged = os.path.join(workdir, f"lora_{name}"), os.path.join(workdir, f"lora_{name}_merged")
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(hf.load_hf(base, torch.float32, "cpu"), peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(B_SCALE)
        model.save_pretrained(adapter)
        model.merge_and_unload().save_pretrained(merged)
        out[name] = dict(adapter=adapter, merged=merged)
        del model
    return out


def requests(adapters: dict[str, dict[str, str]], n: int) -> list:
    """The engine's per-prompt ``lora_request`` list (None: the base model)."""
    from ray_attn.lora import LoRARequest

    ids = {name: i + 1 for i, (name, *_) in enumerate(ADAPTERS)}
    return [None if g is None else LoRARequest(g, ids[g], adapters[g]["adapter"])
            for g in (GROUPS[i % len(GROUPS)] for i in range(n))]


def lora_config() -> dict:
    return dict(max_loras=len(ADAPTERS), max_lora_rank=max(r for _, _, r, _ in ADAPTERS))


def score(controls, base: str, attn: str, adapters, prompts_key: str, prompts, outs) -> tuple[float, float, float]:
    """(agreement, control, shift): pooled over the groups, each against its own HF model;
    ``shift`` = the adapters' prompts' agreement with their merged models minus with the base.
    The base group goes last, so that each float32 model is loaded once."""
    group = lambda g: ([prompts[i] for i in range(len(prompts)) if GROUPS[i % len(GROUPS)] == g],  # noqa: E731
                       [outs[i] for i in range(len(prompts)) if GROUPS[i % len(GROUPS)] == g])
    hits = ctrl = total = 0.0
    on_merged, adapted_p, adapted_o = 0.0, [], []
    for g in [g for g in GROUPS if g is not None] + [None]:
        ps, os_ = group(g)
        folder = base if g is None else adapters[g]["merged"]
        n = sum(len(o) for o in os_)
        a = hf.agreement(controls.fp32(folder, attn), ps, os_)
        hits, total = hits + a * n, total + n
        ctrl += controls.control(folder, attn, attn, f"{prompts_key}_lora_{g}", ps) / 100 * n
        if g is not None:
            on_merged += a * n
            adapted_p, adapted_o = adapted_p + ps, adapted_o + os_
    n_adapted = sum(len(o) for o in adapted_o)
    on_base = hf.agreement(controls.fp32(base, attn), adapted_p, adapted_o) * n_adapted
    return 100 * hits / total, 100 * ctrl / total, 100 * (on_merged - on_base) / max(n_adapted, 1)
