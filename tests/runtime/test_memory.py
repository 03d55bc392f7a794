"""KV-cache sizing like vLLM's profiling run (ray_attn/runtime/memory.py): the arithmetic against an
exact reference, its refusals, the profile step on CPU, and on a GPU the breakdown a worker
reports and a cache that leaves room for the largest step."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from ray_attn.backend.flash_attn import FlashAttentionImpl
from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.model import build_model
from ray_attn.runtime import memory
from ray_attn.runtime.memory import kv_cache_budget, profile_prompt_lens, profile_run

GIB = 1 << 30


def _reference_blocks(total, fraction, weights, peak, non_torch, reserve, per_block) -> int:
    """Exact rational arithmetic: floor((floor(total * fraction) - non-KV) / bytes per block)."""
    allowed = int(Fraction(total) * Fraction(fraction))  # fraction is a float: its exact value
    return (allowed - weights - peak - non_torch - reserve) // per_block


@pytest.mark.parametrize("total", [80 * GIB, 143_771 * (1 << 20)])
@pytest.mark.parametrize("fraction", [0.5, 0.85, 0.9, 1.0])
@pytest.mark.parametrize("reserve", [0, memory.GRAPH_POOL_RESERVE_BYTES])
def test_budget_matches_exact_reference(total, fraction, reserve):
    rng = np.random.default_rng([int(total % 997), int(fraction * 100), reserve % 13])
    weights = int(rng.integers(1, 20)) * GIB + int(rng.integers(0, 1 << 20))
    peak, non_torch = int(rng.integers(0, 3 * GIB)), int(rng.integers(0, GIB))
    per_block = int(rng.choice([16, 32])) * 131072
    p = kv_cache_budget(total_bytes=total, memory_fraction=fraction, weights_bytes=weights,
                        peak_activation_bytes=peak, non_torch_bytes=non_torch,
                        graph_pool_reserve_bytes=reserve, bytes_per_block=per_block)
    assert p.num_blocks == _reference_blocks(total, fraction, weights, peak, non_torch, reserve, per_block)
    assert p.kv_bytes == int(total * fraction) - weights - peak - non_torch - reserve
    assert p.num_blocks * per_block <= p.kv_bytes < (p.num_blocks + 1) * per_block
    d = p.as_dict()
    assert d["weights_bytes"] == weights and d["graph_pool_reserve_bytes"] == reserve


def test_budget_is_a_share_of_total_memory_not_of_free():
    # Llama-3-8B on an H200: 16 GB of weights, 0.85 of the device.  The old sizing took 0.85 of the
    # memory free after the weights (and whatever the allocator still cached); vLLM's takes 0.85 of
    # the device, less what the engine itself uses: what is free does not enter.
    total, weights, peak = 150_754_820_096, 16_060_522_496, 2 * GIB
    kw = dict(total_bytes=total, memory_fraction=0.85, weights_bytes=weights, peak_activation_bytes=peak,
              non_torch_bytes=GIB // 2, graph_pool_reserve_bytes=memory.GRAPH_POOL_RESERVE_BYTES,
              bytes_per_block=16 * 131072)
    a = kv_cache_budget(**kw, free_after_weights_bytes=130 * GIB, allocator_cache_bytes=2 * GIB)
    b = kv_cache_budget(**kw, free_after_weights_bytes=60 * GIB, allocator_cache_bytes=40 * GIB)
    assert a.num_blocks == b.num_blocks and b.free_after_weights_bytes == 60 * GIB
    # 0.85 x 150.75 GB - 16.06 - 2.15 - 0.54 - 0.54 = 108.86 GB: 196 requests of 4096 + 128
    # tokens at 128 KiB a token
    assert a.kv_bytes // (4224 * 131072) == 196


@pytest.mark.parametrize("field,value,needle", [
    ("memory_fraction", 0.0, "cache.memory_fraction must be in (0, 1]"),
    ("memory_fraction", 1.5, "cache.memory_fraction must be in (0, 1]"),
    ("weights_bytes", -1, "weights_bytes must be >= 0"),
    ("peak_activation_bytes", -5, "peak_activation_bytes must be >= 0"),
    ("non_torch_bytes", -5, "non_torch_bytes must be >= 0"),
    ("graph_pool_reserve_bytes", -5, "graph_pool_reserve_bytes must be >= 0"),
    ("bytes_per_block", 0, "bytes_per_block must be > 0"),
])
def test_budget_refuses_bad_inputs_naming_them(field, value, needle):
    kw = dict(total_bytes=80 * GIB, memory_fraction=0.9, weights_bytes=GIB, peak_activation_bytes=GIB,
              non_torch_bytes=0, graph_pool_reserve_bytes=0, bytes_per_block=1 << 21)
    kw[field] = value
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("]", r"\]")):
        kv_cache_budget(**kw)


def test_budget_without_room_for_a_block_says_what_took_the_memory():
    with pytest.raises(ValueError, match=r"memory_fraction=0\.2 allows 16\.00 GiB.*weights \(15\.00 GiB\)"
                                         r".*peak activations \(1\.00 GiB\).*cache\.num_blocks"):
        kv_cache_budget(total_bytes=80 * GIB, memory_fraction=0.2, weights_bytes=15 * GIB,
                        peak_activation_bytes=GIB, non_torch_bytes=0, graph_pool_reserve_bytes=0,
                        bytes_per_block=1 << 21)


@pytest.mark.parametrize("tokens,max_len,want", [(8192, 16384, [8192]), (8192, 4096, [4096, 4096]),
                                                  (5000, 2048, [2048, 2048, 904]), (1, 7, [1])])
def test_profile_prompts_cover_the_budget_at_the_longest_context(tokens, max_len, want):
    assert profile_prompt_lens(tokens, max_len) == want


def _tiny_model(kv_cache_dtype="auto"):
    m = ModelConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, dtype="float32")
    model = build_model(m, block_size=16, kv_cache_dtype=kv_cache_dtype, device="cpu")
    model.init_random_weights(3)
    return model


@pytest.mark.parametrize("tokens,seqs", [(600, 4), (64, 100)])
def test_profile_run_attends_over_every_token_and_leaves_no_cache(tokens, seqs, monkeypatch):
    """The profile step runs real attention (not the attention-free profiling forward), over
    ``tokens`` tokens in prompts of the model's context, then samples ``seqs`` rows."""
    model = _tiny_model()
    seen = []
    real = FlashAttentionImpl.forward

    def spy(self, layer, q, k, v, kv_cache, m, output=None):
        seen.append((m.num_actual_tokens, m.seq_lens.tolist(), kv_cache.shape[1]))
        return real(self, layer, q, k, v, kv_cache, m, output)

    monkeypatch.setattr(FlashAttentionImpl, "forward", spy)
    nbytes = profile_run(model, tokens, seqs, 256)
    lens = profile_prompt_lens(tokens, 256)
    blocks = sum(-(-n // 16) for n in lens)
    assert seen == [(tokens, lens, blocks)] * 2  # both layers, the whole step
    assert nbytes == 2 * blocks * 16 * 2 * 32 * 4  # one layer's K and V, float32
    assert model.kv_caches is None


def test_profile_run_refuses_a_model_with_a_cache():
    model = _tiny_model()
    model.allocate_kv_cache(4)
    with pytest.raises(RuntimeError, match="without a KV cache"):
        profile_run(model, 32, 2, 256)


def test_profile_run_leaves_the_workers_random_stream_alone():
    model = _tiny_model()
    torch.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    profile_run(model, 40, 3, 256)
    assert torch.equal(torch.rand(3), a)


# ------------------------------------------------------------------------------------- GPU
def _size_a_worker(kv_cache_dtype: str) -> dict:
    """Load one worker and report its sizing, the bytes its parameters take, and the device
    memory in use afterwards -- in a process of its own (see the test)."""
    from ray_attn.runtime.worker import AttentionWorker

    m = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, dtype="bfloat16")
    cfg = EngineConfig(model=m, cache=CacheConfig(memory_fraction=0.3, kv_cache_dtype=kv_cache_dtype),
                       parallel=ParallelConfig(device="cuda"), max_num_seqs=128, max_num_batched_tokens=8192)
    w = AttentionWorker(cfg)
    info = w.load_model()
    free, total = torch.cuda.mem_get_info()
    return dict(info=info, params=sum(p.numel() * p.element_size() for p in w.model.parameters()),
                used=total - free, total=total)


def _size_a_llama4_worker() -> dict:
    """Issue 37.1's model: chunk 512 < max_num_batched_tokens 4096, head size 128, 8 experts
    top-1 on every 2nd layer -- the engine could not start on a GPU."""
    from ray_attn.runtime.worker import AttentionWorker

    m = ModelConfig(architecture="Llama4ForCausalLM", vocab_size=8192, hidden_size=1024, intermediate_size=2048,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                    attention_chunk_size=512, layer_types=["chunked_attention"] * 3 + ["full_attention"],
                    no_rope_layers=[1, 1, 1, 0], num_local_experts=8, num_experts_per_tok=1,
                    moe_intermediate_size=1024, moe_layers=[1, 3], max_position_embeddings=8192, dtype="bfloat16")
    cfg = EngineConfig(model=m, cache=CacheConfig(memory_fraction=0.3), parallel=ParallelConfig(device="cuda"),
                       max_num_seqs=64, max_num_batched_tokens=4096)
    return AttentionWorker(cfg).load_model()


@pytest.mark.gpu
def test_a_chunked_local_model_sizes_its_cache_when_a_step_is_longer_than_a_chunk():
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        info = pool.apply(_size_a_llama4_worker)
    assert info["num_blocks"] == info["memory"]["num_blocks"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_worker_sizes_its_cache_from_a_profile_step(kv_cache_dtype):
    # A fresh process, as a rank is: tensors and caches that earlier tests left in this one would
    # count as the worker's own weights and activations.
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        r = pool.apply(_size_a_worker, (kv_cache_dtype,))
    info, params = r["info"], r["params"]
    mem = info["memory"]
    assert info["num_blocks"] == mem["num_blocks"] > 0
    assert mem["num_blocks"] * mem["bytes_per_block"] <= mem["kv_bytes"]
    non_kv = mem["weights_bytes"] + mem["peak_activation_bytes"] + mem["non_torch_bytes"] + mem["graph_pool_reserve_bytes"]
    assert mem["kv_bytes"] == int(mem["total_bytes"] * 0.3) - non_kv
    assert params <= mem["weights_bytes"] < params + (256 << 20)  # weights and a few buffers
    # logits of 128 rows x 32000 float32 (16 MB) at least, and far less than a GiB here
    assert 128 * 32000 * 4 <= mem["peak_activation_bytes"] < (1 << 30)
    assert mem["graph_pool_bytes"] is not None and mem["graph_pool_bytes"] <= mem["graph_pool_reserve_bytes"]
    # the budget holds: nothing beyond total * fraction is in use once the cache exists (memory
    # other processes held at sizing time is in non_torch_bytes, so inside the budget too)
    assert r["used"] <= int(r["total"] * 0.3) + mem["graph_pool_reserve_bytes"]


# ------------------------------------------------- the profile step on a GPU, CUDA calls mocked
def _llama4_model(chunk: int = 64, max_len: int = 512):
    """Llama-4-style: chunked-local layers (chunk < the profile step), NoPE full layer, MoE."""
    m = ModelConfig(architecture="Llama4ForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    attention_chunk_size=chunk, layer_types=["chunked_attention", "full_attention"],
                    no_rope_layers=[1, 0], num_local_experts=4, num_experts_per_tok=1, moe_intermediate_size=64,
                    moe_layers=[1], max_position_embeddings=max_len, dtype="float32")
    model = build_model(m, block_size=16, device="cpu")
    model.init_random_weights(7)
    return model


class FakeCuda:
    """The torch.cuda memory calls ``profile_cuda_memory`` makes, over a ledger the test sets:
    weights allocated before, a profile whose peak is weights + activations + its temporary KV."""

    def __init__(self, total, weights, activations, non_torch=0):
        self.total, self.weights, self.activations, self.non_torch = total, weights, activations, non_torch
        self.tmp_kv = 0  # set once the profile ran

    def install(self, monkeypatch):
        c = torch.cuda
        monkeypatch.setattr(c, "mem_get_info", lambda d=None: (self.total - self.weights - self.non_torch, self.total))
        monkeypatch.setattr(c, "memory_reserved", lambda d=None: self.weights)
        monkeypatch.setattr(c, "memory_allocated", lambda d=None: self.weights)
        monkeypatch.setattr(c, "max_memory_allocated", lambda d=None: self.weights + self.activations + self.tmp_kv)
        for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
            monkeypatch.setattr(c, name, lambda d=None: None)


def _engine_config(model, tokens: int, seqs: int = 4):
    return EngineConfig(model=model.config, cache=CacheConfig(block_size=16, memory_fraction=0.5),
                        max_num_batched_tokens=tokens, max_num_seqs=seqs)


def test_profile_step_of_a_chunked_local_model_longer_than_a_chunk_runs_local_attention(monkeypatch):
    """Issue 37.1: the profile step of ``max_num_batched_tokens`` tokens (more than the chunk) is
    planned as a real step, local virtual batches included; before, the model refused it (no
    ``local_attn_metadata``) and a Llama 4 engine could not start on a GPU."""
    model = _llama4_model(chunk=64, max_len=512)
    seen = []
    real = FlashAttentionImpl.forward

    def spy(self, layer, q, k, v, kv_cache, m, output=None):
        loc = m.local_attn_metadata
        seen.append((self.use_irope, None if loc is None else loc.local_seqused_k.tolist()))
        return real(self, layer, q, k, v, kv_cache, m, output)

    monkeypatch.setattr(FlashAttentionImpl, "forward", spy)
    fake = FakeCuda(total=1 << 30, weights=10 << 20, activations=3 << 20)
    fake.install(monkeypatch)
    real_profile = memory.profile_run

    def counted(*a, **kw):
        fake.tmp_kv = real_profile(*a, **kw)
        return fake.tmp_kv

    monkeypatch.setattr(memory, "profile_run", counted)
    prof = memory.profile_cuda_memory(model, _engine_config(model, 600), torch.device("cpu"), 4096, False)
    # prompts [512, 88]: 8 full chunks of the first, then a chunk of 64 and one of 24 of the second
    assert seen[0] == (True, [64] * 8 + [64, 24])
    assert prof.peak_activation_bytes == 3 << 20 and prof.num_blocks > 0


def test_profile_plan_splits_a_prompt_longer_than_a_chunk_into_virtual_batches():
    """The planner's own local virtual batches: one per chunk the prompt touches."""
    from ray_attn.runtime.memory import profile_plan

    model = _llama4_model(chunk=64, max_len=512)
    plan, nblk = profile_plan([200], model.config, 16, 300)
    loc = plan.attn.local_attn_metadata
    assert loc is not None and loc.local_seqused_k.tolist() == [64, 64, 64, 8]
    assert loc.local_query_start_loc.tolist() == [0, 64, 128, 192, 200]
    assert plan.positions.tolist() == list(range(200)) and nblk == 13


def test_kv_sizing_leaves_the_profiles_temporary_kv_out_of_the_peak(monkeypatch):
    """Issue 37.7: the temporary KV of the profile step is freed before the real cache exists, so
    the peak activation memory is the measured peak less the weights less that KV."""
    model = _tiny_model()
    fake = FakeCuda(total=8 << 30, weights=100 << 20, activations=40 << 20, non_torch=200 << 20)
    fake.install(monkeypatch)
    tmp = 7 << 20
    monkeypatch.setattr(memory, "profile_run", lambda *a, **kw: tmp)
    fake.tmp_kv = tmp
    prof = memory.profile_cuda_memory(model, _engine_config(model, 256), torch.device("cpu"), 1 << 16, True)
    assert prof.weights_bytes == 100 << 20
    assert prof.peak_activation_bytes == 40 << 20
    assert prof.non_torch_bytes == 200 << 20
    want = int((8 << 30) * 0.5) - (100 << 20) - (40 << 20) - (200 << 20) - memory.GRAPH_POOL_RESERVE_BYTES
    assert prof.kv_bytes == want and prof.num_blocks == want // (1 << 16)
