"""The fusions of issue 39 against what they replace: RMSNorm (+ residual add) and SiLU-mul that
also quantize their output for the FP8 linear after them, Qwen3's per-head q/k RMSNorm with RoPE
in one kernel, SiLU-mul inside down_proj's one-row GEMV, the residual add carried into the next
layer's norm, and the model plumbing that hands the quantized activation to the linear.

The kernels run compiled on a GPU; without one ``test_kernels_under_the_interpreter`` runs this
module again with TRITON_INTERPRET=1, where they run on CPU tensors.  The codes are held exactly
to the standalone quantizer's (``fp8.quantize_per_token`` of the kernel's own bf16 output): the
fusion must not change a single code.  The q/k kernel is held to the float32 formula within the
ulps ``test_fused.py`` states for the kernels it replaces (RMSNorm's 2, then RoPE's rounding).
"""

from __future__ import annotations

import pytest
import torch

from ray_attn.model import fp8 as F8
from ray_attn.model import fused
from tests.interpreter import INTERPRETED, interpreter_test, kernels_mark
from tests.model.test_fused import EPS, cos_sin, qk_view, rand, ref_rms_norm, ref_rope, ref_silu_mul, ulp_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = kernels_mark(fused.triton)


def test_kernels_under_the_interpreter():
    interpreter_test(__file__, min_passed=20)


def assert_codes(qa: F8.QuantizedActivation, y: torch.Tensor):
    """qa holds y and exactly the reference quantizer's codes and scales of y."""
    assert isinstance(qa, F8.QuantizedActivation) and qa.x is y or torch.equal(qa.x, y)
    q0, s0 = F8.quantize_per_token(y.reshape(-1, y.shape[-1]).float().cpu())
    assert qa.xq.dtype == F8.FP8_DTYPE and qa.xs.shape == s0.shape
    assert torch.equal(qa.xs.cpu(), s0), (qa.xs.flatten()[:4], s0.flatten()[:4])
    assert torch.equal(qa.xq.cpu().float(), q0.float())


# -- the torch paths (CPU): the reference quantizer on the unfused output ---------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_outputs_on_the_torch_path(dtype, rng):
    x, d = rand(rng, 5, 96, dtype=dtype, scale=3.0), rand(rng, 5, 96, dtype=dtype)
    w = rand(rng, 96, dtype=dtype) + 1
    y = fused.rms_norm(x, w, EPS)
    qa = fused.rms_norm(x, w, EPS, quant=True)
    assert torch.equal(qa.x, y)
    assert_codes(qa, y)
    s, qa = fused.add_rms_norm(x, d, w, EPS, quant=True)
    assert torch.equal(s, x + d) and torch.equal(qa.x, fused.rms_norm(x + d, w, EPS))
    assert_codes(qa, qa.x)
    gu = rand(rng, 5, 2 * 80, dtype=dtype, scale=3.0)
    qa = fused.silu_mul(gu, quant=True)
    assert torch.equal(qa.x, fused.silu_mul(gu))
    assert_codes(qa, qa.x)


# -- the kernels -----------------------------------------------------------------------------------
# bf16 on the GPU only: Triton's interpreter rounds float32 -> bf16 by truncation, not to nearest.
DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float32]


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1000, 4096])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("add", [False, True])
def test_norm_quant_kernel(add, T, hidden, dtype, rng):
    x, d = rand(rng, T, hidden, dtype=dtype, device=DEVICE, scale=3.0), rand(rng, T, hidden, dtype=dtype, device=DEVICE)
    w = rand(rng, hidden, dtype=dtype, device=DEVICE, scale=0.2) + 1
    x[0, 3] = 40.0  # one large value: the row's scale is set by it, the rest quantize coarsely
    s, y, q, scale = fused._rms_norm_launch(x, d if add else None, w, EPS, quant=True)
    ref = ref_rms_norm(x + d if add else x, w)
    if add:
        assert torch.equal(s, x + d)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:
        ulp_close(y, ref, ulps=2)
    assert_codes(F8.QuantizedActivation(y, q, scale), y)
    _, y2, q2, _ = fused._rms_norm_launch(x, d if add else None, w, EPS, quant=False)
    assert q2 is None and torch.equal(y2, y)  # quantizing does not change the norm's own output


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [80, 1500, 3000])
@pytest.mark.parametrize("T", [1, 4])
def test_silu_mul_quant_kernel(T, n, dtype, rng):
    gu = rand(rng, T, 2 * n, dtype=dtype, device=DEVICE, scale=3.0)
    qa = fused.silu_mul_launch(gu, quant=True)
    plain = fused.silu_mul_launch(gu, quant=False)
    assert torch.equal(qa.x, plain)  # the same products as the unquantized kernel
    if dtype == torch.float32:
        torch.testing.assert_close(qa.x, ref_silu_mul(gu), rtol=1e-5, atol=1e-5)
    else:
        ulp_close(qa.x, ref_silu_mul(gu), ulps=2)
    assert_codes(qa, qa.x)
    # codes only (what down_proj reads without an adapter): the same codes and scales, and the
    # product, never written, stands in as NaNs of its shape and dtype
    qc = fused.silu_mul_launch(gu, quant=True, value=False)
    assert torch.equal(qc.xq.float(), qa.xq.float()) and torch.equal(qc.xs, qa.xs)
    assert qc.x.shape == qa.x.shape and qc.x.dtype == dtype and torch.isnan(qc.x).all()


@pytest.mark.skipif(DEVICE == "cuda" or INTERPRETED or fused.triton is None,
                    reason="a CPU check of the compiled kernel; on a GPU the kernel tests run it")
def test_the_codes_only_kernel_compiles_for_hopper_without_the_products_stores():
    """Triton compiles ``_silu_mul_quant_kernel`` for sm_90 here too (its wheel ships ptxas): both
    variants build, and the codes-only one (``STORE_VALUE=False``) has none of the product's
    stores left -- the bytes it exists to save (the 8B's 14,336 columns at 16 warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "x_stride": "i64",
           **{n: "constexpr" for n in ("N", "BLOCK", "STORE_VALUE", "INTERPRET", "USE_PDL")}}
    stores = {}
    for store in (True, False):
        const = {"N": 14336, "BLOCK": 16384, "STORE_VALUE": store, "INTERPRET": False, "USE_PDL": True}
        src = ASTSource(fn=fused._silu_mul_quant_kernel, signature=sig,
                        constexprs={(list(sig).index(n),): v for n, v in const.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16}).asm["ptx"]
        stores[store] = [line for line in ptx.splitlines() if "st.global" in line]
    # (compiled without the launch's pointer alignment, so one store an element: b16 the bf16
    # product, b8 the e4m3 codes, b32 the scale) the codes and the scale stay, the product goes
    width = {store: {line.split("st.global.")[1].split()[0] for line in lines} for store, lines in stores.items()}
    assert width == {True: {"b16", "b8", "b32"}, False: {"b8", "b32"}}, width


def ref_qk_norm_rope(qk, qw, kw, cos, sin, nq):
    q, k = qk[:, :nq], qk[:, nq:]
    q, k = ref_rms_norm(q, qw), ref_rms_norm(k, kw)
    if cos is not None:
        q, k = ref_rope(q, cos, sin), ref_rope(k, cos, sin)
    return q, k


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (5, 1), (16, 16)])
@pytest.mark.parametrize("rope", [True, False])
def test_qk_norm_rope_kernel(rope, heads, D, dtype, rng):
    nq, nk = heads
    T = 3
    qkv, qk = qk_view(rng, T, nq, nk, D, dtype, device=DEVICE)
    cos, sin = cos_sin(rng, T, D, dtype, device=DEVICE) if rope else (None, None)
    qw = rand(rng, D, dtype=dtype, device=DEVICE, scale=0.3) + 1
    kw = rand(rng, D, dtype=dtype, device=DEVICE, scale=0.3) + 1
    before = qkv.clone()
    q, k = fused.qk_norm_rope_launch(qk, qw, kw, EPS, cos, sin, nq)
    assert torch.equal(qkv, before)  # the qkv output (v too) is left alone
    rq, rk = ref_qk_norm_rope(qk, qw, kw, cos, sin, nq)
    assert q.shape == (T, nq, D) and k.shape == (T, nk, D)
    for out, ref in ((q, rq), (k, rk)):
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:  # the norm's 2 ulps, carried through the rotation, plus its own rounding
            ulp_close(out, ref, ulps=3, exact_frac=0.97)
    if DEVICE == "cuda":  # the same as the kernels it replaces, run apart: but for a rare flip
        uq, uk = fused.rms_norm(qk[:, :nq], qw, EPS), fused.rms_norm(qk[:, nq:], kw, EPS)
        if rope:
            uq, uk = fused.apply_rope(uq, cos, sin), fused.apply_rope(uk, cos, sin)
        ulp_close(q, uq, ulps=1, exact_frac=0.99)
        ulp_close(k, uk, ulps=1, exact_frac=0.99)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
# 4096 x 1536 is a real down_proj; under the interpreter (CPU) 300 x 1536 takes the same paths
# (several programs, whole BLOCK_K steps) in a twentieth of the time
@pytest.mark.parametrize("n,k", [(37, 1000), (130, 264), (4096 if DEVICE == "cuda" else 300, 1536)])
def test_gemv_silu_mul_kernel(n, k, dtype, rng):
    """down(silu(gate) * up) in one GEMV: the same products (silu_mul's roundings) and the same
    summation as the two kernels apart, so equal to the bit; and within float64's reach."""
    from ray_attn.model import gemv as G

    gu = rand(rng, 1, 2 * k, dtype=dtype, device=DEVICE, scale=2.0)
    w = rand(rng, n, k, dtype=dtype, device=DEVICE, scale=k ** -0.5)
    cfg = dict(BLOCK_K=256) if DEVICE == "cpu" else {}
    y = G.gemv(gu, w, silu_mul=True, **cfg)
    apart = G.gemv(fused.silu_mul_launch(gu), w, **cfg)
    assert torch.equal(y, apart)
    want = ref_silu_mul(gu).double() @ w.double().T
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-4 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError, match="gate and up"):
        G.gemv(gu[:, :-2], w, silu_mul=True)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (5, 1)])
@pytest.mark.parametrize("kind", ["rope_l2", "rope", "temperature", "none"])
def test_llama4_qk_kernel(kind, heads, D, dtype, rng):
    """Llama 4's q/k work in one kernel against model/llama4.py's torch functions: RoPE layers
    (interleaved pairs, then the L2 norm when use_qk_norm), NoPE layers (q scaled by the
    temperature), on the strided q/k view of the qkv output."""
    from ray_attn.model import llama4 as L4
    from ray_attn.model.fused_llama4 import llama4_qk_launch

    nq, nk = heads
    T = 3
    qkv, qk = qk_view(rng, T, nq, nk, D, dtype, device=DEVICE)
    pos = torch.randint(0, 100_000, (T,), generator=rng).float()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = (pos[:, None, None] * inv).to(DEVICE)
    cos, sin = (freqs.cos(), freqs.sin()) if kind.startswith("rope") else (None, None)
    eps = 1e-5 if kind == "rope_l2" else None
    temp = (torch.rand(T, 1, 1, generator=rng) + 1.0).to(DEVICE) if kind == "temperature" else None
    before = qkv.clone()
    q, k = llama4_qk_launch(qk, nq, cos, sin, eps, temp)
    assert torch.equal(qkv, before)
    rq, rk = qk[:, :nq], qk[:, nq:]
    if cos is not None:
        rq, rk = L4.rope_interleaved(rq, cos, sin), L4.rope_interleaved(rk, cos, sin)
    if eps is not None:
        rq, rk = L4.l2_norm(rq, eps), L4.l2_norm(rk, eps)
    if temp is not None:
        rq = (rq * temp).to(dtype)
    for out, ref in ((q, rq), (k, rk)):
        assert out.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:  # RoPE's rounding, then the norm's: a flip in the first moves the second by an ulp
            ulp_close(out, ref, ulps=2, exact_frac=0.97)


# -- the plumbing in a model: the linear gets the codes of exactly its own input ---------------------
def test_layers_hand_the_quantized_input_to_the_fp8_linears(monkeypatch):
    """A Llama and a Qwen3 model with FP8 weights on CPU, with the fusion forced on (on CPU the
    linears run the reference path, which uses the codes it is handed): the logits equal the
    unfused model's, and every linear that got a QuantizedActivation got the reference codes of
    the very tensor it would have quantized itself (a norm or SiLU-mul that quantized the wrong
    tensor -- the pre-norm residual, the gate half -- fails it)."""
    from ray_attn.config import ModelConfig
    from ray_attn.model.parallel_linear import Fp8Linear
    from ray_attn.model.registry import build_model
    from tests.model.steps import SCHEDULE, random_tokens, run_schedule

    got = {}
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        cfg = ModelConfig(architecture=arch, vocab_size=96, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          dtype="float32", quantization="fp8")
        outs = {}
        for force in (False, True):
            monkeypatch.setattr(F8, "wants_quantized_input", lambda x, w, s: force and s is not None)
            model = build_model(cfg, device="cpu", block_size=16, kernel="torch")
            model.init_random_weights(0)
            seen = []
            for mod in model.modules():
                if isinstance(mod, Fp8Linear) and mod.scheme is not None:
                    mod.register_forward_hook(lambda m, a, y: seen.append((m, a[0])))
            outs[force] = torch.cat(run_schedule(model, random_tokens(cfg.vocab_size), SCHEDULE))
            quantized = [a for _, a in seen if isinstance(a, F8.QuantizedActivation)]
            for a in quantized:
                assert_codes(a, a.x)
            got[arch, force] = len(quantized)
        assert torch.equal(outs[True], outs[False]), arch
    # qkv, gate_up and down of each layer, every step; o_proj quantizes itself
    n = 3 * cfg.num_hidden_layers * len(SCHEDULE)
    assert got == {("LlamaForCausalLM", False): 0, ("LlamaForCausalLM", True): n,
                   ("Qwen3ForCausalLM", False): 0, ("Qwen3ForCausalLM", True): n}, got


def test_the_mlp_asks_silu_mul_for_the_product_only_for_an_adapter(monkeypatch):
    """down_proj with FP8 weights reads only the codes of the quantized SiLU-mul, so the kernel
    skips writing the product -- unless down has a LoRA adapter, which takes the product."""
    from ray_attn.model import mlp as L
    from ray_attn.model.tp import TPGroup

    asked = []
    real = L.silu_mul
    monkeypatch.setattr(L, "silu_mul", lambda h, quant=False, value=True: asked.append((quant, value)) or real(h, quant))
    monkeypatch.setattr(F8, "wants_quantized_input", lambda x, w, s: True)  # as FP8 weights on a GPU would
    mlp = L.MLP(64, 128, TPGroup(0, 1, group=None), dtype=torch.float32, device="cpu")
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(3, 64)
    y = mlp(x)
    mlp.down.lora = lambda xp, base: base() + 0 * xp.sum()  # an adapter: it reads the product
    assert torch.equal(mlp(x), y)
    assert asked == [(True, False), (True, True)], asked


def test_a_quantized_input_is_refused_by_a_static_scheme():
    from ray_attn.model.quantization import parse_quantization

    static = parse_quantization({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}})
    x = torch.randn(2, 32)
    wq, ws = F8.quantize_per_row(torch.randn(16, 32))
    with pytest.raises(ValueError, match="per-token quantized input"):
        F8.apply_fp8_linear(F8.QuantizedActivation(x, *F8.quantize_per_token(x)), wq, ws, static,
                            torch.ones(1))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_one_row_decode_with_the_fusions_equals_it_without(arch, monkeypatch):
    """A bf16 model on CUDA decoding one sequence (one-row steps: down_proj's GEMV makes the SiLU
    product itself): the logits equal, to the bit, those with SiLU-mul a kernel of its own."""
    from ray_attn.config import ModelConfig
    from ray_attn.model import gemv as G
    from ray_attn.model.registry import build_model
    from tests.model.steps import random_tokens, run_schedule

    cfg = ModelConfig(architecture=arch, vocab_size=256, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      dtype="bfloat16")
    tokens = random_tokens(cfg.vocab_size)[:1]
    out = {}
    for fuse in (True, False):
        monkeypatch.setattr(G, "FUSE_SILU", fuse)
        model = build_model(cfg, device="cuda", block_size=16, kernel="torch")
        model.init_random_weights(3)
        assert G.use_gemv_silu_mul(torch.zeros(1, 3072, dtype=torch.bfloat16, device="cuda"),
                                   model.layers[0].mlp.down.weight) == fuse
        out[fuse] = torch.cat(run_schedule(model, tokens, [[12], [1], [1], [1]], device="cuda"))
    assert out[True].isfinite().all() and torch.equal(out[True], out[False])
