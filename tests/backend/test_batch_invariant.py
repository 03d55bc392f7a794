"""Batch-invariant mode (ray_attn/backend/batch_invariant.py): its GEMM against a float64 reference,
a row's bits alone and inside batches of other sizes, FlashAttention 3 with one split giving a
decode row's bits inside a verifying query, the dispatch, and the configs it refuses by name.

The GEMM's tests run on a GPU, or (CPU) in a subprocess under Triton's interpreter
(``test_kernels_under_the_interpreter``).  Tolerance against float64: the output's one rounding
to the half dtype (2^-8 relative in bf16, 2^-11 in fp16) plus float32 sums (1e-5 of sum |x||w|).
"""

from __future__ import annotations

import pytest
import torch

from ray_attn.backend import batch_invariant as BI
from ray_attn.config import EngineConfig, ModelConfig, ParallelConfig
from tests.interpreter import kernels_run_here, run_module_interpreted

DEV = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not kernels_run_here(), reason="CPU: run by test_kernels_under_the_interpreter")
needs_triton = pytest.mark.skipif(BI.triton is None, reason="triton is not installed")


@needs_triton
def test_kernels_under_the_interpreter():
    if kernels_run_here():
        pytest.skip("the kernels' tests run in this process")
    run_module_interpreted(__file__, min_passed=6)


def case(m, n, k, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    return x, w, b


@kernels
@needs_triton
@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)])
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 64, False), (5, 200, 130, True), (70, 64, 320, False),
                                        (3, 65, 1, True)])
def test_matmul_matches_float64(m, n, k, bias, dtype, rel):
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter gets bf16 tl.dot wrong (garbage of ~1e10); fp16 runs there")
    x, w, b = case(m, n, k, dtype, seed=m + n + k)
    y = BI.matmul(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    bound = rel * ref.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert y.shape == (m, n) and y.dtype == dtype
    assert ((y.double() - ref).abs() <= bound).all()
    assert ref.abs().max() > 100 * bound.max() / 2  # the bound is far below the values it checks


@kernels
@needs_triton
def test_a_row_has_the_same_bits_alone_and_in_any_batch():
    """The property the mode exists for: rows 0-4 of a 5-row verifying step, and row 0 of a
    1-row decode step, inside batches of 37 and 300 rows (more M-tiles than one)."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # the interpreter: see above
    x, w, b = case(300, 160, 192, dtype, seed=3, bias=True)
    full = BI.matmul(x, w, b)
    for rows in (1, 5, 37, 64, 65):
        assert torch.equal(BI.matmul(x[:rows], w, b), full[:rows]), rows
    assert torch.equal(BI.matmul(x[100:101], w, b), full[100:101])
    assert torch.equal(BI.matmul(x.view(3, 100, 192), w, b).view(300, 160), full)  # leading dims fold


@needs_triton
def test_bad_inputs_are_refused_by_name():
    x, w, _ = case(2, 8, 16, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="one half dtype"):
        BI.matmul(x.float(), w.float())
    with pytest.raises(ValueError, match="matching K"):
        BI.matmul(x[:, :8], w)
    with pytest.raises(ValueError, match="bias"):
        BI.matmul(x, w, torch.zeros(7, dtype=x.dtype, device=x.device))


def test_the_mode_takes_the_one_row_gemv_away_and_routes_linears_only_on_cuda():
    from ray_attn.model import gemv

    x, w, _ = case(1, 8, 16, torch.bfloat16, seed=0)
    try:
        BI.set_enabled(True)
        assert BI.enabled()
        assert not gemv.use_gemv(x, w)  # off in the mode, whatever the device
        assert BI.use(x, w) == (x.is_cuda and BI.available())
        xc, wc = x.cpu(), w.cpu()
        assert not BI.use(xc, wc)  # CPU: the torch path, float32 sums
        assert torch.equal(gemv.linear(xc, wc), torch.nn.functional.linear(xc, wc))
    finally:
        BI.set_enabled(False)
    assert not BI.use(x, w)


@pytest.mark.parametrize("update,why", [
    (dict(model=ModelConfig.from_name("tiny-qwen3-moe")), "MoE experts"),
    (dict(model=ModelConfig(quantization="fp8")), "quantized weights"),
    (dict(parallel=ParallelConfig(kernel="fa2", batch_invariant=True)), "FlashAttention 2"),
    (dict(lora_config=dict(max_loras=1, max_lora_rank=8)), "LoRA adapters"),
])
def test_configs_it_cannot_make_invariant_are_refused_by_name(update, why):
    kw = dict(parallel=ParallelConfig(batch_invariant=True)) | update
    with pytest.raises(ValueError, match=why):
        EngineConfig(**kw)
    if kw["parallel"].kernel == "auto":  # fine without it ('fa2' is checked against this machine)
        EngineConfig(**(kw | dict(parallel=ParallelConfig())))


def test_each_engine_sets_the_mode_on_its_ranks():
    """A rank in the driver's process (InProcessExecutor) sets it from its config, and the next
    engine's rank sets it back.  The planner's own cascade choice is off in the mode (a cascaded
    row's attention would depend on which other rows share its prefix in the step): it cascades
    on the fixed grid instead (tests/planner/test_invariant_cascade.py)."""
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    base = dict(model=ModelConfig.from_name("tiny"), cache=dict(num_blocks=16), max_num_seqs=2,
                max_num_batched_tokens=32)
    for on in (True, False):
        cfg = EngineConfig(**base, parallel=ParallelConfig(device="cpu", batch_invariant=on))
        engine = LLMEngine(cfg, InProcessExecutor(cfg))
        try:
            assert BI.enabled() is on
            assert engine.planner.enable_cascade is (not on)
            assert engine.planner.cascade_grid == (1024 if on else None)
        finally:
            engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("ctx", [37, 700])
def test_fa3_gives_a_decode_rows_bits_inside_a_verifying_query(k, ctx):
    """With the mode on, a query token attended alone (a plain decode step) and as the first
    token of a causal 1+k query (a verifying step) get the same bits from FA3, through the
    kernel wrapper's plan and call."""
    from ray_attn.backend.kernels import FlashAttn3Kernel, unsupported_reason, LayerKernelSpec

    if unsupported_reason("fa3", LayerKernelSpec(128, torch.bfloat16, "auto", 16, False), torch.device("cuda")):
        pytest.skip("no FlashAttention 3 here")
    g = torch.Generator(device="cuda").manual_seed(ctx + k)
    heads, kv_heads, d, page, blocks = 8, 2, 128, 16, 64
    kc = torch.randn(blocks, page, kv_heads, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(blocks, page, kv_heads, d, device="cuda", generator=g).bfloat16()
    table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)[None, :]
    q = torch.randn(1 + k, heads, d, device="cuda", generator=g).bfloat16()
    fa3 = FlashAttn3Kernel()

    def run(rows: int):
        out = torch.empty(rows, heads, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, rows], device="cuda", dtype=torch.int32)
        lens = torch.tensor([ctx - 1 + rows], device="cuda", dtype=torch.int32)
        plan = fa3.scheduler_metadata(batch_size=1, max_seqlen_q=rows, max_seqlen_k=int(lens), num_heads_q=heads,
                                      num_heads_kv=kv_heads, head_size=d, cache_seqlens=lens,
                                      qkv_dtype=torch.bfloat16, cu_seqlens_q=cu, page_size=page, causal=True,
                                      window_size=(-1, -1), has_softcap=False)
        fa3.varlen_paged(q[:rows], kc, vc, out, cu_seqlens_q=cu, max_seqlen_q=rows, seqused_k=lens,
                         max_seqlen_k=int(lens), block_table=table, scale=d ** -0.5, causal=True,
                         scheduler_metadata=plan)
        return out

    try:
        BI.set_enabled(True)
        assert torch.equal(run(1)[0], run(1 + k)[0])
    finally:
        BI.set_enabled(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_speculative_greedy_equals_plain_greedy_in_bf16_with_the_mode():
    """n-gram drafts verified in bf16 with CUDA graphs: the mode makes the tokens equal to a
    plain run's, token for token, on prompts that repeat (so drafts are proposed and accepted)."""
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                        dtype="bfloat16", seed=5)
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(0, 512, (n,), generator=g).tolist() * 4) for n in (24, 40, 57, 90)]
    spec = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
                disable_by_batch_size=None)
    outs = {}
    for name, extra in (("plain", {}), ("spec", dict(speculative_config=spec))):
        cfg = EngineConfig(model=model, parallel=ParallelConfig(device="cuda", batch_invariant=True),
                           cache=dict(num_blocks=256), max_num_seqs=8, max_num_batched_tokens=512, **extra)
        engine = LLMEngine(cfg, InProcessExecutor(cfg))
        try:
            outs[name] = [o.output_token_ids for o in engine.generate(
                prompts, SamplingParams(max_tokens=64, ignore_eos=True))]
            stats = engine.stats.as_dict()
        finally:
            engine.shutdown()
    assert stats["spec_num_accepted_tokens"] > 0
    assert outs["spec"] == outs["plain"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_grid_cascade_gives_a_tokens_bits_whatever_else_is_in_the_step():
    """The mode's cascade (planner/invariant.py) on FA3 in bf16: a token attended in a decode step
    alone (a prefix group of one) and as the first of a 1 + 3 query beside a request that shares
    its prefix (one group of two) and one below the first line (a group of prefix 0) gets the
    same bits; so does the one below the line, cascaded beside them or attended plainly alone.
    Q/K/V are functions of (token, position), so only the attention differs between the runs."""
    from ray_attn.backend import AttentionLayer, FlashAttentionImpl
    from ray_attn.backend.kernels import LayerKernelSpec, unsupported_reason
    from ray_attn.planner import Planner, ScheduledRequest

    heads, kv_heads, d, bs, grid, vocab = 8, 2, 128, 16, 256, 1000
    if unsupported_reason("fa3", LayerKernelSpec(d, torch.bfloat16, "auto", bs, False), torch.device("cuda")):
        pytest.skip("no FlashAttention 3 here")
    g = torch.Generator(device="cuda").manual_seed(0)
    emb = {c: torch.randn(n, h, d, device="cuda", generator=g) for c, n, h in (
        ("q", vocab, heads), ("qp", 1024, heads), ("k", vocab, kv_heads), ("kp", 1024, kv_heads),
        ("v", vocab, kv_heads), ("vp", 1024, kv_heads))}
    impl = FlashAttentionImpl(heads, d, d ** -0.5, kv_heads, None, None, "auto", dtype=torch.bfloat16,
                              block_size=bs, device="cuda", kernel="fa3")
    rng = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (280,), generator=rng).tolist()
    x = shared + torch.randint(0, vocab, (24,), generator=rng).tolist()  # 304 tokens
    y = shared + torch.randint(0, vocab, (10,), generator=rng).tolist()
    z = torch.randint(0, vocab, (30,), generator=rng).tolist()

    def run(steps):
        p = Planner(num_blocks=128, block_size=bs, num_query_heads=heads, num_kv_heads=kv_heads, cascade_grid=grid)
        cache = torch.zeros(2, 128, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda")
        outs, plans = {}, []
        for sched in steps:
            plan = p.plan([ScheduledRequest(*s) for s in sched])
            a, plans = plan.attn, plans + [plan]
            n = a.num_actual_tokens
            tok = torch.as_tensor(plan.input_token_ids[:n], device="cuda")
            pos = torch.as_tensor(plan.positions[:n], device="cuda")
            q, k, v = ((emb[c][tok] + emb[c + "p"][pos]).bfloat16() for c in "qkv")
            out = torch.empty_like(q)
            impl.forward(AttentionLayer(), q, k, v, cache, a.to_device("cuda"), out)
            for i, r in enumerate(plan.req_ids):
                lo = int(a.query_start_loc[i])
                for j in range(int(a.query_start_loc[i + 1]) - lo):
                    outs[r, int(plan.positions[lo + j])] = out[lo + j].clone()
        return outs, plans

    try:
        BI.set_enabled(True)
        alone, _ = run([[("x", x[:301], 256)], [("x", x[:301], 45)], [("x", x[:302], 1)]])
        z_alone, z_plans = run([[("z", z + [7], 31)]])
        together, plans = run([
            [("x", x, 256), ("z", z, 30)],
            [("x", x, 44), ("y", y, None), ("z", z + [7], 1)],  # y: a hit on x's first 16 blocks at least
            [("x", x, 4), ("y", y + [9], 1), ("z", z + [7, 8], 1)],  # x verifies 300..303
        ])
    finally:
        BI.set_enabled(False)
    assert not z_plans[0].attn.use_cascade
    for plan in plans[1:]:  # x and y past the first line over the same blocks, z below it
        assert plan.attn.use_cascade and sorted(plan.attn.prefix_kv_lens.tolist()) == [0, 256]
    for key in [("x", 300), ("x", 301), ("z", 30)]:
        ref = (z_alone if key[0] == "z" else alone)[key]
        assert torch.equal(together[key], ref), key
