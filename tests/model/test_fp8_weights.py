"""FP8 weights (``ModelConfig.quantization``, ray_attn/model/quantization.py and fp8.py) on CPU,
and the CUDA paths (marked gpu).

Checkpoints are written by the real tools where there is one: compressed-tensors (llm-compressor's
library: its ``FP8_DYNAMIC`` and ``FP8`` presets, its ``calculate_qparams`` for the scales, its
``ModelCompressor`` for the stored format) over a model transformers writes; the block-wise fp8
one in the published layout (Qwen's / DeepSeek's FP8 releases: float8_e4m3fn weights, float32
``weight_scale_inv`` [ceil(N/128), ceil(K/128)], ``quant_method: fp8`` with
``weight_block_size: [128, 128]``), for which no CPU tool writes it.

The reference is transformers' own dequantized model of each checkpoint (``CompressedTensorsConfig
(dequantize=True)``; FineGrainedFP8 dequantizes by itself on CPU).  Both dequantize weights only,
so the activation quantization of each format is added to its linear layers here by forward hooks
(per token, per token and group of 128, or by the checkpoint's ``input_scale``), written from the
formats' definitions, not from our code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, check_runnable
from ray_attn.hf_export import hf_config_dict
from ray_attn.model import build_model
from ray_attn.model import fp8 as F8
from ray_attn.model import gemv as G
from ray_attn.model import kernel_configs
from ray_attn.model.quantization import parse_quantization
from tests.model.steps import BLOCK_SIZE, SCHEDULE, random_tokens, run_schedule
from tests.model.test_families import qwen_config, reinit
from tests.model.test_tensor_parallel import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from fp8_checkpoints import BLOCK_QCONFIG, act_round, block_quantize  # noqa: E402

transformers = pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
# Tiny shapes whose every projection is whole 128-blocks at TP=1 and TP=2 (q 512, k/v 256 rows).
SHAPES = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
# Parity: both sides compute the same quantized math in float32 with different summation orders
# (~1e-6 on logits of std ~1; the reference resolves the rare ambiguous roundings as ours did,
# see AMBIGUOUS); a real error moves them by the quantization noise or more (dropping the
# activation quantization: ~5e-2 mean, checked in each test; a scale on the wrong axis: O(1)).
ATOL = 1e-4
ATOL64 = 1e-4  # against float64: our float32 roundoff is ~1e-6 on these logits too


# -- checkpoints ----------------------------------------------------------------------------------
def hf_model(family: str, seed: int = 3):
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES)).eval()
    else:
        kw = {k: v for k, v in SHAPES.items() if k not in ("vocab_size", "max_position_embeddings")}
        hf = transformers.Qwen3ForCausalLM(qwen_config("qwen3", **kw)).eval()
    reinit(hf, seed)
    return hf


def write_compressed_tensors(hf, folder, preset: str) -> None:
    """``preset`` (FP8_DYNAMIC, FP8) applied the way llm-compressor does: scales from min/max
    (per channel or tensor; static input scales from a calibration batch), then compressed and
    saved with compressed-tensors' own config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    amax, hooks = {}, []  # calibration first, on the full-precision model (llm-compressor's order)
    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            def seen(mod, args, name=name):
                a = args[0].detach().abs().amax()
                amax[name] = torch.maximum(amax.get(name, a), a)
            hooks.append(mod.register_forward_pre_hook(seen))
    with torch.no_grad():
        hf(torch.randint(0, SHAPES["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(9)))
    for h in hooks:
        h.remove()
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]))
    for name, mod in hf.named_modules():
        if not hasattr(mod, "weight_scale"):
            continue
        w, args = mod.weight.data, mod.quantization_scheme.weights
        dims = dict(dim=1, keepdim=True) if args.strategy == "channel" else {}
        lo, hi = (w.amin(**dims), w.amax(**dims)) if dims else (w.amin().view(1), w.amax().view(1))
        mod.weight_scale.data.copy_(calculate_qparams(lo, hi, args)[0])
        if hasattr(mod, "input_scale"):
            a = amax[name].view(1)
            mod.input_scale.data.copy_(calculate_qparams(-a, a, mod.quantization_scheme.input_activations)[0])
    compressor = ModelCompressor.from_pretrained_model(hf, "float-quantized")
    compressor.compress_model(hf)
    hf.save_pretrained(str(folder))
    compressor.update_config(str(folder))


def write_block_fp8(hf, folder) -> None:
    hf.save_pretrained(str(folder))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name], tensors[name + "_scale_inv"] = block_quantize(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": BLOCK_QCONFIG}))


def write(kind: str, family: str, folder) -> str:
    hf = hf_model(family)
    if kind == "block":
        write_block_fp8(hf, folder)
    elif kind == "unquantized":
        hf.save_pretrained(str(folder))
    else:
        pytest.importorskip("compressed_tensors")
        write_compressed_tensors(hf, folder, {"ct_dynamic": "FP8_DYNAMIC", "ct_static": "FP8"}[kind])
    return str(folder)


# -- references -----------------------------------------------------------------------------------
# Where a linear's input v = x / s (|v| <= 448) lies within AMBIGUOUS * |v| + 1e-4 of an e4m3
# rounding midpoint, the two models' float32 roundoff (~1e-7 of the row's largest |x|) decides the
# code; the reference then takes ours there (both are right), so one such element cannot fork the
# rest of the sequence.  They are rare: asserted.
AMBIGUOUS = 1e-5
HF_OF_OURS = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
              "self_attn.v_proj": "self_attn.qkv_proj", "self_attn.o_proj": "self_attn.o_proj",
              "mlp.gate_proj": "mlp.gate_up", "mlp.up_proj": "mlp.gate_up", "mlp.down_proj": "mlp.down"}


def ambiguous(v: torch.Tensor) -> torch.Tensor:
    r = AMBIGUOUS * v.abs() + 1e-4
    return (v - r).clamp(-448, 448).to(FP8).float() != (v + r).clamp(-448, 448).to(FP8).float()


ACT = {"block": "group", "ct_dynamic": "token", "ct_static": "static"}


class Quantizer:
    """Forward pre-hooks for transformers' linears: the activation quantization of each format
    (per token, per token and group of 128, or the checkpoint's static input_scale), written from
    the formats' definitions, in the model's dtype (float32 or float64)."""

    def __init__(self, act: str | None, codes: dict | None = None):
        self.act, self.codes, self.seq = act, codes, 0
        self.seen = self.ambiguous = 0

    def hook(self, name: str, input_scale, module, args):
        if self.act is None:
            return None
        x = args[0]
        shape = x.shape
        v, s = act_round(x, self.act, input_scale)
        q = v.to(FP8).to(x.dtype)
        if self.codes is not None:
            amb = ambiguous(v)
            theirs = self.codes[name][self.seq].view(q.shape).to(x.dtype)
            q = torch.where(amb, theirs, q)
            self.seen, self.ambiguous = self.seen + amb.numel(), self.ambiguous + int(amb.sum())
        return ((q * s).view(shape),)


def our_codes(model, tokens) -> tuple[list[torch.Tensor], dict]:
    """Our logits and, per linear layer (by our module name) and sequence, the e4m3 codes our
    model gave its inputs (rows in position order)."""
    from ray_attn.model.parallel_linear import Fp8Linear

    seen: dict[str, list] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.setdefault(n, []).append(a[0].detach().clone()))
             for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    got = run_schedule(model, tokens, SCHEDULE)
    for h in hooks:
        h.remove()
    codes = {}
    for name, xs in seen.items():
        layer = model.get_submodule(name)
        per_seq = [[] for _ in tokens]
        for x, q_lens in zip(xs, SCHEDULE):
            q, _ = F8.quantize_activation(x, layer.scheme, getattr(layer, "input_scale", None))
            for b, part in zip([b for b, n in enumerate(q_lens) if n], q.float().split([n for n in q_lens if n])):
                per_seq[b].append(part)
        codes[name] = [torch.cat(p) for p in per_seq]
    return got, codes


def hf_reference(folder: str, tokens, act: str | None, codes=None, dtype=torch.float32, dequantize_online=False):
    """Logits of transformers' dequantized model of ``folder`` (``dequantize_online``: of its
    full-precision weights quantized per row), its linears' inputs quantized as ``act`` says
    (None: not at all), taking ``codes`` (ours) where a rounding is ambiguous."""
    cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    kw = {}
    if cfg.get("quantization_config", {}).get("quant_method") == "compressed-tensors":
        kw["quantization_config"] = transformers.utils.quantization_config.CompressedTensorsConfig(dequantize=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **kw).eval()
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        input_scales = {n[:-len(".input_scale")]: f.get_tensor(n).float() for n in f.keys() if n.endswith("input_scale")}
    quant = Quantizer(act, codes)
    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            assert mod.weight.dtype == dtype  # dequantized by transformers
            if dequantize_online:  # the e4m3 codes of float32 w / s, as every implementation rounds them
                with torch.no_grad():
                    w = mod.weight.float()
                    s = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
                    mod.weight.copy_((w / s).clamp(-448, 448).to(FP8).to(dtype) * s.to(dtype))
            ours_name = f"layers.{name.split('.')[2]}.{HF_OF_OURS['.'.join(name.split('.')[3:])]}"
            mod.register_forward_pre_hook(partial(quant.hook, ours_name, input_scales.get(name)))
    out = []
    with torch.no_grad():
        for b, t in enumerate(tokens):
            quant.seq = b
            out.append(hf(torch.tensor(t)[None]).logits[0].float())
    if codes is not None:
        assert quant.ambiguous <= 1e-3 * quant.seen, (quant.ambiguous, quant.seen)
    return out


def ours(folder: str, **overrides) -> tuple[object, list, list[torch.Tensor], dict]:
    config = ModelConfig.from_pretrained(folder, dtype="float32", **overrides)
    model = build_model(config, block_size=BLOCK_SIZE, kernel="torch")
    model.load_weights(folder)
    tokens = random_tokens(config.vocab_size)
    if model.quant_config is None:
        return model, tokens, run_schedule(model, tokens, SCHEDULE), {}
    return (model, tokens, *our_codes(model, tokens))


def max_diff(got, want) -> float:
    assert all(g.shape == w.shape for g, w in zip(got, want))
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def mean_diff(got, want) -> float:
    return torch.cat([(g - w).abs().flatten() for g, w in zip(got, want)]).mean().item()


# -- parity with transformers ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["block", "ct_dynamic", "ct_static"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_checkpoint_matches_hf_dequantized(kind, family, tmp_path):
    """Our FP8 model of each checkpoint format (TP=1, paged chunked prefill + decode) against
    transformers' dequantized model of the same checkpoint with the format's activation
    quantization hooked in: max |logit diff| < ATOL."""
    folder = write(kind, family, tmp_path)
    model, tokens, got, codes = ours(folder)
    scheme = model.quant_config
    assert scheme is not None and scheme.is_checkpoint_fp8_serialized
    assert {"block": "block", "ct_dynamic": "channel", "ct_static": "tensor"}[kind] == scheme.weight_strategy
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and model.lm_head.dtype == torch.float32 and model.embed_tokens.dtype == torch.float32
    want = hf_reference(folder, tokens, ACT[kind], codes)
    assert min(w.std().item() for w in want) > 0.3
    assert max_diff(got, want) < ATOL, max_diff(got, want)
    # The tolerance resolves the activation quantization: without it the reference is far off.
    assert mean_diff(got, hf_reference(folder, tokens, None)) > 5 * ATOL


def test_static_fused_scales_take_the_largest(tmp_path):
    """ct_static: q/k/v (and gate/up) keep each part's weight scale per row; their input scale is
    the largest of the parts' (the parts see the same input, so calibration gives them one scale;
    here k's is doubled and v's halved in the checkpoint to tell max from any other choice)."""
    folder = write("ct_static", "llama", tmp_path)
    path, p = os.path.join(folder, "model.safetensors"), "model.layers.1.self_attn."
    tensors = load_file(path)
    tensors[p + "k_proj.input_scale"] *= 2
    tensors[p + "v_proj.input_scale"] /= 2
    save_file(tensors, path, metadata={"format": "pt"})
    model, _, _, _ = ours(folder)
    qkv = model.layers[1].self_attn.qkv_proj
    ws = [tensors[p + n + "_proj.weight_scale"].float() for n in "qkv"]
    ins = [tensors[p + n + "_proj.input_scale"].float() for n in "qkv"]
    assert all(torch.isfinite(t).all() and (t > 0).all() for t in ws + ins)
    want = torch.cat([s.expand(rows) for s, rows in zip(ws, qkv.sizes)])
    assert torch.equal(qkv.weight_scale, want)
    assert torch.equal(qkv.input_scale, ins[1].view(1))


# -- online fp8 -----------------------------------------------------------------------------------
def e4m3_ambiguous(t: torch.Tensor) -> torch.Tensor:
    """Where float64 ``t`` lies within 1e-6 (relative) of an e4m3 rounding midpoint: there the
    float32 division may round either way, and both codes are right."""
    lo = (t * (1 - 1e-6)).clamp(-448, 448).to(FP8)
    hi = (t * (1 + 1e-6)).clamp(-448, 448).to(FP8)
    return lo.float() != hi.float()


def f64_quant(t: torch.Tensor, scale: torch.Tensor, ours_q: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of t / scale in float64 (ours where the rounding is ambiguous) as float64."""
    v = t.double() / scale
    q = v.clamp(-448, 448).to(FP8).double()
    amb = e4m3_ambiguous(v)
    assert amb.float().mean() < 1e-3
    return torch.where(amb, ours_q.double(), q)


@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (7, 200, 300), (33, 512, 128)])
def test_online_linear_matches_float64(m, n, k, rng):
    """One online-quantized linear (per-row weight scales, per-token activations) against the
    quantize-dequantize math in float64 on fresh random inputs: scales to float32 rounding (1e-6
    relative), codes equal up to ambiguous roundings, and y within 1e-5 of sum |terms| (float32
    accumulation of k products)."""
    x = torch.randn(m, k, generator=rng) * 3
    w = torch.randn(n, k, generator=rng) * k ** -0.5
    w[0] = 0.0  # an all-zero row: a finite scale, zero outputs
    wq, ws = F8.online_quantize(w)
    ws64 = (w.double().abs().amax(1) / 448).clamp(min=1 / (448 * 512))
    torch.testing.assert_close(ws.double(), ws64, rtol=1e-6, atol=0)
    wd = f64_quant(w, ws64[:, None], wq.float()) * ws64[:, None]
    xq, xs = F8.quantize_per_token(x)
    xs64 = x.double().abs().amax(1, keepdim=True) / 448
    torch.testing.assert_close(xs.double(), xs64, rtol=1e-6, atol=0)
    xd = f64_quant(x, xs64, xq.float()) * xs64
    ref = xd @ wd.T
    y = F8.apply_fp8_linear(x, wq, ws, parse_quantization("fp8"))
    bound = 1e-5 * (xd.abs() @ wd.abs().T) + 1e-7
    assert ((y.double() - ref).abs() <= bound).all()
    assert (y[:, 0] == 0).all()
    # and the kernel does quantize the activation: the unquantized x is off by far more
    assert ((x.double() @ wd.T - ref).abs() > bound).float().mean() > 0.5


def test_online_model_matches_float64_and_bounds_the_error(tmp_path):
    """quantization='fp8' on a float32 checkpoint against (a) transformers in float64 with each
    linear's weight quantize-dequantized per row (the e4m3 codes of float32 w / s, as every
    implementation rounds them; dequantized exactly) and its input per token in float64 (max
    |diff| < ATOL64), and
    (b) the unquantized model: e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4, RMS ~3.6%
    per weight and activation, so ~5% on each linear's output), which on these logits gives a
    mean |error| ~0.1 of their std: bound 0.15 std mean, 1.5 std max, and above 1e-3 (it did
    quantize)."""
    folder = write("unquantized", "llama", tmp_path)
    model, tokens, got, codes = ours(folder, quantization="fp8")
    assert model.layers[0].mlp.down.weight.dtype == FP8
    want = hf_reference(folder, tokens, "token", codes, dtype=torch.float64, dequantize_online=True)
    assert max_diff(got, want) < ATOL64, max_diff(got, want)
    _, _, full, _ = ours(folder)
    err, std = mean_diff(got, full), torch.cat(full).std().item()
    assert 1e-3 < err < 0.15 * std and max_diff(got, full) < 1.5 * std, (err, max_diff(got, full), std)


def test_online_random_weights_and_fp8_kv_cache():
    """quantization='fp8' on the seeded random weights, with an fp8 KV cache too: the two are
    independent (weights fp8 with float32 scales, cache fp8 with its own per-layer scales)."""
    cfg = ModelConfig(**{k: v for k, v in SHAPES.items() if k != "rope_parameters"}, quantization="fp8")
    EngineConfig(model=cfg, cache=CacheConfig(kv_cache_dtype="fp8"))  # validates together
    tokens = random_tokens(cfg.vocab_size)
    out = {}
    for cache in ("auto", "fp8"):
        model = build_model(cfg, block_size=BLOCK_SIZE, kernel="torch", kv_cache_dtype=cache)
        model.init_random_weights(5)
        assert model.layers[0].self_attn.o_proj.weight.dtype == FP8
        out[cache] = run_schedule(model, tokens, SCHEDULE)
    assert model.kv_caches[0].dtype == FP8
    # an fp8 KV cache (scales 1.0) adds its own rounding of K and V: small against logits of std ~1
    assert mean_diff(out["fp8"], out["auto"]) < 0.1 and torch.cat(out["fp8"]).isfinite().all()


# -- TP=2 equals TP=1 -----------------------------------------------------------------------------
TP_CASES = ["online", "block", "ct_static", "ct_dynamic"]
# Each rank's FP8 tensors are exactly its slice of TP=1's (checked below).  The logits then differ
# by the all-reduce's summation order, and an activation element on an e4m3 rounding boundary can
# take the neighbouring code at one position, which forks that position and, through attention,
# the later ones of its sequence by the quantization noise (observed: block 5e-3 mean).  Per-token
# dynamic scales of a row-parallel layer (o_proj, down_proj) are moreover each rank's slice's, as
# in vLLM (a full-row scale would cost an all-reduce per layer), so the quantization noise there is
# another draw of the same size: bounded as the quantization error itself (~0.1 of the logits'
# std, see the online test; observed 0.06).  Bounds: mean |diff| < 0.02 (block, static) and 0.1
# (dynamic per-token); max < 1 everywhere (a wrongly sliced scale moves logits by O(1) or more).
TP_MEAN = {"online": 0.1, "block": 0.02, "ct_static": 0.02, "ct_dynamic": 0.1}


def tp_model(case: str, folder: str, **tp):
    if case == "online":
        cfg = ModelConfig(**{k: v for k, v in SHAPES.items() if k != "rope_parameters"}, quantization="fp8")
        model = build_model(cfg, block_size=BLOCK_SIZE, kernel="torch", **tp)
        model.init_random_weights(5)
    else:
        cfg = ModelConfig.from_pretrained(folder, dtype="float32")
        model = build_model(cfg, block_size=BLOCK_SIZE, kernel="torch", **tp)
        model.load_weights(folder)
    return model, torch.cat(run_schedule(model, random_tokens(cfg.vocab_size), SCHEDULE))


def fp8_state(model) -> dict:
    from ray_attn.model.parallel_linear import ColumnParallelLinear, Fp8Linear

    return {n: dict(weight=m.weight.float(), scale=m.weight_scale.clone(), input_scale=getattr(m, "input_scale", None),
                    parts=m.parts if isinstance(m, ColumnParallelLinear) else None, start=getattr(m, "start", None))
            for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def expected_slice(full: dict, rank: dict, block: bool) -> dict:
    """The rank's FP8 tensors as slices of TP=1's: per-row scales follow column-parallel rows and
    are replicated for row-parallel layers; block scales follow both, in 128-blocks."""
    w, sc = full["weight"], full["scale"]
    if rank["parts"] is None:  # row-parallel: columns of the weight (and of the block scales)
        start, cols = rank["start"], rank["weight"].shape[1]
        return dict(weight=w[:, start:start + cols],
                    scale=sc[:, start // 128:start // 128 + -(-cols // 128)] if block else sc)
    weights, scales, offset = [], [], 0
    for full_rows, start, rows in rank["parts"]:
        weights.append(w[offset + start:offset + start + rows])
        b = (offset + start) // 128
        scales.append(sc[b:b + -(-rows // 128)] if block else sc[offset + start:offset + start + rows])
        offset += full_rows
    return dict(weight=torch.cat(weights), scale=torch.cat(scales))


def _rank(rank, world, port, folder):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for case in TP_CASES:
            model, logits = tp_model(case, os.path.join(folder, case), tp_rank=rank, tp_size=world,
                                     tp_group=dist.group.WORLD)
            torch.save(dict(logits=logits, state=fp8_state(model)), os.path.join(folder, f"{case}_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_matches_tp1(tmp_path):
    """Each format at TP=2 (gloo, one process per rank) against TP=1: every rank's FP8 weights
    and scales are exactly its slice of TP=1's (online scales are the full rows', reduced over the
    ranks), and its logits are TP=1's within the bounds above."""
    pytest.importorskip("compressed_tensors")
    for case in TP_CASES[1:]:
        os.makedirs(tmp_path / case)
        write(case, "llama", tmp_path / case)
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for case in TP_CASES:
        model, want = tp_model(case, str(tmp_path / case))
        full = fp8_state(model)
        for rank in range(2):
            got = torch.load(tmp_path / f"{case}_{rank}.pt", weights_only=False)
            for name, st in got["state"].items():
                exp = expected_slice(full[name], st, case == "block")
                assert torch.equal(st["weight"], exp["weight"]), (case, rank, name, "weight")
                assert torch.equal(st["scale"], exp["scale"]), (case, rank, name, "scale")
                if st["input_scale"] is not None:
                    assert torch.equal(st["input_scale"], full[name]["input_scale"]), (case, rank, name)
            d = (got["logits"] - want).abs()
            assert d.mean().item() < TP_MEAN[case] and d.max().item() < 1.0, (case, rank, d.max().item(), d.mean().item())


# Greedy decoding forks where TP=2's logits (above: a mean |diff| of 5e-3, up to ~1 at a forked
# position) swap a near-tie of TP=1's; the token after a fork has another context, so only the
# fork itself is compared: TP=2 took TP=1's runner-up there, and TP=1's top two were within
# FORK_MARGIN nats.  A wrongly sliced or scaled rank forks at confident positions instead.
FORK_MARGIN = 0.1


@pytest.mark.slow
def test_engine_tp2_greedy_tokens_match_single_process(tmp_path, shared_ray):
    """A block-fp8 checkpoint through the engine: TP=2 Ray actors give the in-process engine's
    greedy tokens, up to forks at near-ties (FORK_MARGIN), which are rare."""
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor
    from tests.runtime.test_engine_tp import GREEDY, workload

    folder = write("block", "llama", tmp_path)

    def cfg(tp):
        return EngineConfig(checkpoint=folder, model={"dtype": "float32"}, cache=CacheConfig(num_blocks=96),
                            parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu", num_cpus_per_worker=1),
                            max_num_batched_tokens=256, max_num_seqs=16)

    prompts = workload(vocab=SHAPES["vocab_size"])
    ref = LLMEngine(cfg(1), InProcessExecutor(cfg(1))).generate(
        prompts, SamplingParams(max_tokens=GREEDY.max_tokens, logprobs=2))
    single = [o.output_token_ids for o in ref]
    assert len({tuple(t) for t in single}) > 1
    eng = LLMEngine(cfg(2))
    try:
        got = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
    finally:
        eng.shutdown()
    forks = 0
    for g, want, r in zip(got, single, ref):
        k = next((i for i, (a, b) in enumerate(zip(g, want)) if a != b), None)
        if k is None:
            assert g == want
            continue
        forks += 1
        (first, lp1), (second, lp2) = r.logprobs[k].top[:2]
        assert g[k] == second and lp1 - lp2 < FORK_MARGIN, (k, g[k], r.logprobs[k].top, lp1 - lp2)
    assert forks <= 2, f"{forks} of {len(prompts)} sequences forked: more than near-ties"


# -- refusals -------------------------------------------------------------------------------------
def ct_config(**changes) -> dict:
    """compressed-tensors' own FP8_DYNAMIC quantization_config, with ``changes`` to its group."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    q = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                           ignore=["lm_head"], format="float-quantized").model_dump(mode="json")
    for path, value in changes.items():
        *keys, last = path.split(".")
        d = q
        for key in keys:
            d = d[key]
        d[last] = value
    return q | {"quant_method": "compressed-tensors"}


def int4_config() -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    return QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W4A16", ["Linear"])},
                              format="pack-quantized").model_dump(mode="json") | {"quant_method": "compressed-tensors"}


REFUSED = {
    "unknown_method": (lambda: {"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    "unknown_string": (lambda: "int8", "quantization='int8'"),
    "int4_pack_quantized": (int4_config, "format='pack-quantized'"),
    "int_weights": (lambda: ct_config(**{"config_groups.group_0.weights.type": "int"}), "weights.type='int'"),
    "4_bit_weights": (lambda: ct_config(**{"config_groups.group_0.weights.num_bits": 4}), "weights.num_bits=4"),
    "weight_only": (lambda: ct_config(**{"config_groups.group_0.input_activations": None}), "input_activations=None"),
    "group_weights": (lambda: ct_config(**{"config_groups.group_0.weights.strategy": "group"}), "weights.strategy='group'"),
    "block_64": (lambda: BLOCK_QCONFIG | {"weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\]"),
    "block_static": (lambda: BLOCK_QCONFIG | {"activation_scheme": "static"}, "activation_scheme='static'"),
    "per_tensor_fp8": (lambda: {"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_formats_are_refused_by_name(case, tmp_path):
    """A format or scheme we do not run is refused when the config is read, naming the field and
    value: as a ModelConfig field and from a checkpoint's config.json (EngineConfig, no actor)."""
    if case != "unknown_method" and "string" not in case and "block" not in case and "per_tensor" not in case:
        pytest.importorskip("compressed_tensors")
    make, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        ModelConfig(quantization=make())
    if case == "unknown_string":
        return
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", quantization_config=make(),
              **{k: v for k, v in SHAPES.items() if k != "rope_parameters"})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        EngineConfig(checkpoint=str(tmp_path))


def test_tp_split_off_block_boundaries_is_refused_by_layer():
    """Block weights: a TP slice must hold whole 128-blocks.  head_dim 64 at TP=2: each rank's k
    and v are 64 rows; intermediate 384 at TP=2: 192 rows of gate/up, 192 columns of down_proj.
    Refused on the driver (check_runnable, before any actor) and by the layer itself."""
    base = {k: v for k, v in SHAPES.items() if k != "rope_parameters"} | dict(quantization=BLOCK_QCONFIG)
    for changes, layer in ((dict(head_dim=64), r"self_attn.qkv_proj \(q, k, v\): part 1"),
                           (dict(intermediate_size=384), r"mlp.gate_up \(gate, up\): part 0")):
        cfg = ModelConfig(**(base | changes))
        with pytest.raises(ValueError, match=layer + r".*128-blocks"):
            check_runnable(cfg, CacheConfig(), ParallelConfig(tensor_parallel_size=2))
        with pytest.raises(ValueError, match=r"layers\.0\.(self_attn\.qkv_proj|mlp\.gate_up).*128-blocks"):
            build_model(cfg, tp_rank=1, tp_size=2, tp_group=object(), device="meta", kernel="torch")
        check_runnable(cfg, CacheConfig(), ParallelConfig(tensor_parallel_size=1))  # whole blocks at TP=1


def test_other_refusals(tmp_path):
    """MoE families; random weights for a stored scheme; a scheme that disagrees with the
    checkpoint's; a stored FP8 tensor that is not e4m3; writing a quantized config.json."""
    with pytest.raises(ValueError, match="MoE family MixtralForCausalLM"):
        ModelConfig(architecture="MixtralForCausalLM", num_local_experts=4, quantization="fp8")
    with pytest.raises(ValueError, match="no checkpoint is given"):
        EngineConfig(model=ModelConfig(quantization=BLOCK_QCONFIG))
    with pytest.raises(ValueError, match="cannot write quantization='fp8'"):
        hf_config_dict(ModelConfig(quantization=BLOCK_QCONFIG))
    block = write("block", "llama", tmp_path / "block")
    assert EngineConfig(checkpoint=block, model={"quantization": "fp8"}).model.quantization == BLOCK_QCONFIG
    plain = write("unquantized", "llama", tmp_path / "plain")
    with pytest.raises(ValueError, match="has no quantization_config"):
        EngineConfig(checkpoint=plain, model={"quantization": BLOCK_QCONFIG})
    with pytest.raises(ValueError, match="differs from checkpoint"):
        EngineConfig(checkpoint=block, model={"quantization": None})
    # a checkpoint that says block fp8 but holds a float32 q_proj is refused before any copy
    path = os.path.join(block, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    save_file(tensors, path)
    model = build_model(ModelConfig.from_pretrained(block, dtype="float32"), kernel="torch")
    with pytest.raises(ValueError, match="q_proj.weight' has dtype F32.*F8_E4M3"):
        model.load_weights(block)
    with pytest.raises(ValueError, match="random weights cannot stand for a quantized checkpoint"):
        model.init_random_weights(0)


# -- the GPU kernels, on CPU under Triton's interpreter ---------------------------------------------
INTERPRETED = r"""
import torch
from ray_attn.model import fp8 as F8
from ray_attn.model import gemv as G
from ray_attn.model import kernel_configs
from ray_attn.model.quantization import parse_quantization
g = torch.Generator().manual_seed(0)
static = parse_quantization({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}})
block = parse_quantization({"quant_method": "fp8", "weight_block_size": [128, 128]})
worst = 0.0
def check(y, ref, x, w):
    global worst
    bound = 1e-5 * (x.abs().float() @ w.abs().T) + 1e-6
    worst = max(worst, ((y - ref).abs() / bound).max().item())
for m, n, k in [(1, 40, 300), (3, 130, 264), (16, 64, 256)]:
    x = torch.randn(m, k, generator=g) * 2
    wq, ws = F8.quantize_per_row(torch.randn(n, k, generator=g) * k ** -0.5)
    wd = F8.dequantize_weight(wq, ws, static)
    ref = F8.apply_fp8_linear(x, wq, ws, parse_quantization("fp8"), kernel="dequant")
    q, s = F8.quantize_per_token_triton(x)
    q0, s0 = F8.quantize_per_token(x)
    assert torch.equal(s, s0) and torch.equal(q.float(), q0.float()), "quantize_per_token_triton"
    check(F8.fp8_skinny(q, s, wq, ws, x.dtype, BLOCK_N=16, BLOCK_K=128), ref, x, wd)
    s = torch.tensor([x.abs().max().item() / 448 * 0.7])  # some inputs clip
    check(F8.apply_fp8_linear(x, wq, ws, static, s, kernel="skinny"), F8.apply_fp8_linear(x, wq, ws, static, s, kernel="dequant"),
          x, wd)
for m, n, k in [(1, 256, 256), (5, 200, 300), (40, 384, 512)]:
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) * k ** -0.5
    wq, _ = F8.quantize_per_row(w)
    ws = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 1e-3
    wd = F8.dequantize_weight(wq, ws, block)
    ref = F8.apply_fp8_linear(x, wq, ws, block, kernel="dequant")
    for bn in (128, 64):
        check(F8.fp8_block_matmul(x, wq, ws, BLOCK_N=bn), ref, x, wd)
print("WORST", worst)
"""


def test_triton_kernels_match_the_reference_under_the_interpreter():
    """The skinny kernel (activations quantized per token by the quantizer kernel, or by a static
    scale), the quantizer and the block kernel, run by Triton's CPU
    interpreter (in a subprocess: TRITON_INTERPRET is read when the kernels are defined), against
    the CPU reference path on ragged shapes: within 1e-5 of sum |terms| -- only the float32
    summation order differs, the quantized codes are the same."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    worst = float(out.stdout.split("WORST")[1])
    assert worst <= 1.0, worst


def test_cpu_selects_the_reference_path():
    x = torch.randn(4, 256)
    w = torch.zeros(128, 256, dtype=FP8)
    for q in ("fp8", BLOCK_QCONFIG):
        assert F8.select_fp8_kernel(x, w, parse_quantization(q)) == "dequant"


# -- on the GPU (run on the H200) ---------------------------------------------------------------------
def _gpu_case(scheme_name: str, m: int, n: int, k: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    if scheme_name == "block":
        wq, ws = block_quantize(w)
        scheme = parse_quantization(BLOCK_QCONFIG)
    else:
        wq, ws = F8.quantize_per_row(w)
        scheme = parse_quantization("fp8")
    return x, wq, ws, scheme


# Hopper's FP8 tensor cores keep about 14 bits inside one MMA chain (DeepSeek-V3's report; seen
# here as up to 1.3e-4 of sum |terms| for 64-row tiles on the H200), so the tensor-core paths get
# 2^-12 of sum |terms| on top of one bf16 rounding of y.  A wrong code or scale is far outside it:
# dropping the activation quantization moves y by ~2^-5 / sqrt(K) of sum |terms| (5e-4 at K = 4096).
TC_BOUND = 2 ** -12


def path_excess(y: torch.Tensor, x: torch.Tensor, wq, ws, scheme, path: str, input_scale=None) -> tuple[float, float]:
    """(max of |y - ref| less its bound, worst |y - ref| / sum |terms|) of a CUDA path's output
    y against the CPU float32 reference on the same input x and quantized weight.  The bound:
    one bf16 rounding of y, plus ``TC_BOUND`` of sum |terms|; ``block_dequant`` multiplies bf16
    operands (w * scale and x rounded to bf16 first, 2^-9 of each term): 2^-8 of sum |terms|."""
    x, wq, ws = x.float().cpu(), wq.cpu(), ws.cpu()
    input_scale = None if input_scale is None else input_scale.cpu()
    ref = F8.apply_fp8_linear(x, wq, ws, scheme, input_scale, kernel="dequant").double()
    xq, xs = F8.quantize_activation(x.reshape(-1, x.shape[-1]), scheme, input_scale)
    terms = (F8.dequantize_activation(xq, xs, scheme.group_size).abs()
             @ F8.dequantize_weight(wq, ws, scheme).abs().T).double().view(ref.shape)
    err = (y.double().cpu() - ref).abs()
    bound = 2 ** -8 * ref.abs() + (2 ** -8 if path == "block_dequant" else TC_BOUND) * terms + 1e-6
    return (err - bound).max().item(), ((err - 2 ** -8 * ref.abs()).clamp(min=0) / terms.clamp(min=1e-30)).max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 16, 17, 64, 300])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336), (200, 304)])
@pytest.mark.parametrize("scheme_name", ["channel", "block"])
def test_gpu_paths_match_cpu_reference(scheme_name, m, n, k):
    """Every CUDA path that can run the case (the dispatch's pick and the others) against the CPU
    reference of the same quantized tensors: the same codes (IEEE division everywhere, the Triton
    quantizer in front of _scaled_mm), float32 accumulation but for the tensor cores' own
    (``TC_BOUND``), one bf16 rounding of y (``path_excess``)."""
    x, wq, ws, scheme = _gpu_case(scheme_name, m, n, k)
    xc, wc, sc = x.cuda(), wq.cuda(), ws.cuda()
    pick = F8.select_fp8_kernel(xc, wc, scheme)
    gemm = "scaled_mm" if F8._scaled_mm_ok(xc, n, k) else "dequant"
    tabled = m <= G.MAX_ROWS and kernel_configs.tuned("w8a16", m, n, k, xc.device)  # this GPU's table picks it
    assert pick == ("block_triton" if scheme_name == "block" else "w8a16" if tabled else
                    "skinny" if m <= F8.SKINNY_MAX_M else gemm)
    paths = ["block_triton", "block_dequant"] if scheme_name == "block" else ["skinny", "dequant"] + (
        ["scaled_mm"] if F8._scaled_mm_ok(xc, n, k) else [])
    excess = {}
    for path in paths:
        y = F8.apply_fp8_linear(xc, wc, sc, scheme, kernel=path)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        excess[path] = path_excess(y, x, wq, ws, scheme, path)
    assert all(e <= 0 for e, _ in excess.values()), excess  # (excess, worst error / sum |terms|) per path


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336), (200, 304)])
def test_gpu_weight_only_path_when_forced(n, k, monkeypatch):
    """``w8a16`` (forced; one row): the e4m3 weight times its row scales against x unquantized --
    within one bf16 rounding of y and float32 summation of the exact float64 product; the norm
    before it is not asked to quantize."""
    x, wq, ws, scheme = _gpu_case("channel", 1, n, k)
    xc, wc, sc = x.cuda(), wq.cuda(), ws.cuda()
    monkeypatch.setattr(F8, "FORCE", "w8a16")
    assert F8.select_fp8_kernel(xc, wc, scheme) == "w8a16"
    assert not F8.wants_quantized_input(xc, wc, scheme)
    assert F8.select_fp8_kernel(torch.cat([xc, xc]), wc, scheme) == "skinny"  # one row only
    y = F8.apply_fp8_linear(xc, wc, sc, scheme)
    w = wq.double() * ws.double()[:, None]
    ref = x.double() @ w.T
    bound = 2 ** -8 * ref.abs() + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((y.double().cpu() - ref).abs() <= bound).all()


@pytest.mark.gpu
def test_gpu_weight_only_picked_from_the_table_and_silu_mul_fused_into_down(tmp_path, monkeypatch):
    """A device table that holds ``w8a16`` for down_proj's shape makes the dispatch pick it at one
    row (and only there), the norm not quantize for it, and the MLP's down_proj take gate_up and
    make SiLU-mul itself: equal to the bit to SiLU-mul apart, then the same GEMV."""
    from ray_attn.model import fused
    from ray_attn.model.mlp import MLP

    mlp = _online_mlp(hidden=256, inter=512)
    down = mlp.down
    N, K = down.weight.shape
    name = torch.cuda.get_device_name(0)
    kernel_configs.write_table(name, {"w8a16": {kernel_configs.shape_key(N, K): {1: dict(BLOCK_N=8, BLOCK_K=256)}}},
                               {}, folder=tmp_path)
    table = kernel_configs.device_table
    monkeypatch.setattr(kernel_configs, "device_table", lambda dev, folder=None: table(dev, tmp_path))
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    h = mlp.gate_up(x)
    assert F8.select_fp8_kernel(h[:, :K], down.weight, down.scheme) == "w8a16"
    assert F8.select_fp8_kernel(torch.cat([h, h])[:, :K], down.weight, down.scheme) == "skinny"
    assert not down.wants_fp8_input(h[:, :K])
    fusedy = down.forward_silu_mul(h)
    assert fusedy is not None and torch.equal(fusedy, down(fused.silu_mul(h)))
    assert torch.equal(mlp(x), fusedy)
    assert isinstance(mlp, MLP)


def _online_mlp(hidden: int, inter: int):
    """The MLP of a one-layer Llama in bf16 on CUDA with its weights quantized online to FP8."""
    from ray_attn.config import ModelConfig
    from ray_attn.model.registry import build_model

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                      dtype="bfloat16", quantization="fp8")
    model = build_model(cfg, device="cuda", block_size=16, kernel="torch")
    model.init_random_weights(1)
    model.process_weights_after_loading()
    return model.layers[0].mlp


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["online", "block"])
def test_gpu_model_matches_cpu_float32(kind, tmp_path):
    """The quantized model in bf16 on CUDA (its dispatch: the skinny kernel at decode, _scaled_mm or
    the block kernel in prefill) against the float32 CPU model of the same checkpoint.
    - Every FP8 linear call the CUDA model makes, on the activations it really saw, is within
      ``path_excess``'s bound of the CPU reference: the kernels are right inside the model.
    - The logits: bf16 activations land on the other side of an e4m3 rounding midpoint now and
      then (bf16 moves a value by 2^-9, an e4m3 step is 2^-4), and each such code moves by a whole
      step, so the two models differ by part of what the quantization itself moves (measured
      against the same model unquantized): less than it, on average and at the worst."""
    from ray_attn.model.parallel_linear import Fp8Linear

    folder = write("unquantized" if kind == "online" else "block", "llama", tmp_path)
    extra = dict(quantization="fp8") if kind == "online" else {}
    tokens = random_tokens(SHAPES["vocab_size"])
    out, calls = {}, []

    def record(m, a, y):
        x = F8.plain(a[0])
        kept = a[0] if isinstance(a[0], F8.QuantizedActivation) else x.detach().clone()
        calls.append((m, kept, y.detach().clone(), F8.select_fp8_kernel(x.reshape(-1, x.shape[-1]), m.weight, m.scheme)))

    for device, dtype in (("cuda", "bfloat16"), ("cpu", "float32")):
        cfg = ModelConfig.from_pretrained(folder, dtype=dtype, **extra)
        model = build_model(cfg, device=device, block_size=BLOCK_SIZE, kernel="torch")
        model.load_weights(folder)
        if device == "cuda":
            for mod in model.modules():
                if isinstance(mod, Fp8Linear) and mod.scheme is not None:
                    mod.register_forward_hook(record)
        out[device] = torch.cat(run_schedule(model, tokens, SCHEDULE, device=device))
    worst, fused, outputs = {}, 0, {}
    for mod, x, y, path in calls:
        if isinstance(x, F8.QuantizedActivation):  # codes from the norm or SiLU-mul kernel before it
            if x.x.numel() > 1 and x.x.stride(-1) == 0:
                # down's codes alone (silu_mul(value=False): the product is a NaN stand-in): the same
                # kernel on the same gate_up output, the product written, gives the same codes and the
                # product they must quantize
                from ray_attn.model.fused import silu_mul

                whole = silu_mul(outputs[mod.name.rsplit(".", 1)[0] + ".gate_up"], quant=True)
                assert torch.equal(whole.xq, x.xq) and torch.equal(whole.xs, x.xs), mod.name
                x = whole
            q0, s0 = F8.quantize_per_token(x.x.reshape(-1, x.x.shape[-1]).float().cpu())
            assert torch.equal(x.xs.cpu(), s0) and torch.equal(x.xq.cpu().float(), q0.float()), mod.name
            fused, x = fused + 1, x.x
        e = path_excess(y, x, mod.weight, mod.weight_scale, mod.scheme, path, getattr(mod, "input_scale", None))
        worst[path] = max(worst.get(path, e), e)
        outputs[mod.name] = y
    assert calls and all(e <= 0 for e, _ in worst.values()), worst
    # Online per-channel weights: qkv, gate_up and down take their codes from the kernel before.
    assert (fused > 0) == (kind == "online" and F8.FUSED_QUANT), (kind, fused, len(calls))
    plain_dir = write("unquantized", "llama", tmp_path / "plain")  # the same model, not quantized
    model = build_model(ModelConfig.from_pretrained(plain_dir, dtype="float32"), device="cpu",
                        block_size=BLOCK_SIZE, kernel="torch")
    model.load_weights(plain_dir)
    plain = torch.cat(run_schedule(model, tokens, SCHEDULE, device="cpu"))
    diff = (out["cuda"] - out["cpu"]).abs()
    quant = (out["cpu"] - plain).abs()  # what the quantization itself moves
    info = dict(max=diff.max().item(), mean=diff.mean().item(), largest=out["cpu"].abs().max().item(),
                quant_max=quant.max().item(), quant_mean=quant.mean().item(), paths=sorted(worst))
    assert diff.mean() < quant.mean() and diff.max() < quant.max(), info
