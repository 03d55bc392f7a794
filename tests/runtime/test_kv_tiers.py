"""KV tiers on the ranks (ray_attn/runtime/kv_tiers.py) and through the engine: the host tier's
copies are byte-identical both ways (fp8 caches too), bad copies are refused by name, and a
multi-turn workload whose prefixes no longer fit the device cache gets the same greedy tokens
with the host tier on as off -- having taken hits from it -- in sync and async scheduling and at
TP=2.  The shared tier's own tests are in test_kv_store.py and tests/serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.model import build_model
from ray_attn.planner.tiers import KVTransfers
from ray_attn.runtime import AttentionCluster, InProcessExecutor
from ray_attn.runtime.kv_tiers import RankKVTiers
from tests.runtime.test_engine_tp import config as base_config
from tests.timescale import scaled


@pytest.fixture(autouse=True)
def patient_lookups(monkeypatch):
    """The engines' shared-store clients wait for the stores' answers as long as a busy machine
    needs: with the library's 3 s, a store that answers late counts as holding nothing, and a
    test that expects a hit from another replica sees a miss."""
    from ray_attn.runtime import kv_store

    monkeypatch.setattr(kv_store, "LOOKUP_TIMEOUT_S", scaled(30))


def rank_tiers(kv_cache_dtype="auto", num_blocks=12, host_gib=0.002, device="cpu"):
    cfg = base_config()
    dev = torch.device(device)
    with dev:
        model = build_model(cfg.model, block_size=16, kv_cache_dtype=kv_cache_dtype, kernel="torch", device=dev)
    model.allocate_kv_cache(num_blocks)
    g = torch.Generator().manual_seed(0)
    for c in model.kv_caches:  # random bytes, fp8 or not: copies must not care what they mean
        v = c.view(torch.uint8)
        v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8).to(dev))
    return model, RankKVTiers(model, host_gib, 0, 1, dev)


def block_bytes(model, b):
    return torch.stack([c.view(torch.uint8)[:, b] for c in model.kv_caches]).clone()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_offload_then_onload_is_byte_identical(kv_cache_dtype, device):
    model, tiers = rank_tiers(kv_cache_dtype, device=device)
    assert tiers.num_host_slots >= 4 and tiers.host.is_pinned() == (device == "cuda")
    before = {b: block_bytes(model, b) for b in (2, 5, 7)}
    i32 = lambda *x: np.array(x, np.int32)  # noqa: E731
    # the host slot layout, [n, layers, 2, block_size, kv_heads, head bytes], read one layer at a time
    assert torch.equal(tiers.gather(i32(7, 2)).cpu(), torch.stack([before[7], before[2]]).cpu())
    # offload 2, 5, 7 to slots 3, 0, 1 and, in the same step, copy slot 3 back into block 5: the
    # offloads read first, so block 5 ends up holding what block 2 held
    tiers.apply(KVTransfers(offload_blocks=i32(2, 5, 7), offload_slots=i32(3, 0, 1),
                            onload_slots=i32(3), onload_blocks=i32(5)))
    assert torch.equal(block_bytes(model, 5), before[2])
    tiers.apply(KVTransfers(onload_slots=i32(0, 1), onload_blocks=i32(9, 10)))
    assert torch.equal(block_bytes(model, 9), before[5]) and torch.equal(block_bytes(model, 10), before[7])
    assert torch.equal(block_bytes(model, 7), before[7])  # a source block is left as it was
    assert tiers.moved["offload_bytes"] == 3 * tiers.block_bytes == 3 * model.kv_cache_bytes_per_block()


@pytest.mark.gpu
def test_gpu_copies_overlap_compute_and_stay_byte_identical():
    """On a GPU the transfers run on copy streams: ``apply`` returns while the compute stream is
    still busy (it never waits for the step before), the forward may overwrite offloaded blocks
    at once (they were gathered first), and what comes back is still byte-identical."""
    model, tiers = rank_tiers(num_blocks=96, host_gib=100 * 0.002 / 4, device="cuda")
    n = 48
    assert tiers.num_host_slots >= n
    src, dst = np.arange(n, dtype=np.int32), np.arange(n, 2 * n, dtype=np.int32)
    slots = np.arange(n, dtype=np.int32)[::-1].copy()  # runs of one slot: many transfers
    before = block_bytes(model, slice(0, n))
    warm = KVTransfers(offload_blocks=src, offload_slots=slots)  # first-use allocations may sync
    tiers.apply(warm), tiers.apply(KVTransfers(onload_slots=slots, onload_blocks=src))
    torch.cuda.synchronize()
    a, b = torch.randn(4096, 4096, device="cuda"), torch.empty(4096, 4096, device="cuda")

    def busy_work():  # the step before, still computing: float32 GEMMs, a good part of a second
        for _ in range(60):
            torch.mm(a, a, out=b)

    busy_work()
    tiers.apply(KVTransfers(offload_blocks=src, offload_slots=slots))
    busy = not torch.cuda.current_stream().query()
    for c in model.kv_caches:  # the forward reuses the evicted blocks at once
        c.view(torch.uint8)[:, :n].fill_(0)
    tiers.apply(KVTransfers(onload_slots=slots, onload_blocks=dst))
    assert busy, "apply waited for the compute stream"
    torch.cuda.synchronize()
    assert torch.equal(block_bytes(model, slice(n, 2 * n)), before)
    assert tiers.copy_seconds() > 0


@pytest.mark.parametrize("field,value,match", [
    ("offload_blocks", [12], r"offload_blocks must lie in \[0, 12\)"),
    ("onload_slots", [10**6], r"onload_slots must lie in"),
    ("publish_blocks", [-1], r"publish_blocks must lie in"),
])
def test_bad_copies_are_refused_by_name(field, value, match):
    model, tiers = rank_tiers()
    t = KVTransfers()
    setattr(t, field, np.array(value, np.int32))
    pair = {"offload_blocks": "offload_slots", "onload_slots": "onload_blocks", "publish_blocks": "publish_hashes"}
    setattr(t, pair[field], np.zeros(1, np.int32) if field != "publish_blocks" else [1])
    with pytest.raises(ValueError, match=match):
        tiers.check(t, 12)


def test_no_host_tier_refuses_host_copies():
    model, tiers = rank_tiers(host_gib=0)
    t = KVTransfers(offload_blocks=np.array([1], np.int32), offload_slots=np.array([0], np.int32))
    with pytest.raises(ValueError, match="no host tier"):
        tiers.check(t, 12)


# -- through the engine --------------------------------------------------------------------------
def conversations(users=6, turns=3, doc_len=96, vocab=384, seed=11):
    """Each user's turns: a long document, then a question per turn (answers appended later)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, doc_len).tolist() for _ in range(users)]
    questions = [[rng.integers(0, vocab, 10).tolist() for _ in range(turns)] for _ in range(users)]
    return docs, questions


def run_turns(engine, users=6, turns=3, max_tokens=6):
    docs, questions = conversations(users, turns)
    history = [list(d) for d in docs]
    answers = []
    for t in range(turns):
        prompts = [h + questions[u][t] for u, h in enumerate(history)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
        for u, o in enumerate(outs):
            history[u] = prompts[u] + o.output_token_ids
        answers.append([o.output_token_ids for o in outs])
    return answers


def tier_config(host_gib, tp=1, asyn=False, num_blocks=40):
    cfg = base_config(tp=tp, num_blocks=num_blocks)
    return cfg.model_copy(update={"cache": CacheConfig(num_blocks=num_blocks, host_cache_gib=host_gib),
                                  "async_scheduling": asyn})


@pytest.fixture(scope="module")
def reference_answers():
    cfg = tier_config(0.0, num_blocks=400)  # everything fits: no eviction, no tiers
    return run_turns(LLMEngine(cfg, InProcessExecutor(cfg)))


@pytest.mark.parametrize("asyn", [False, True])
def test_host_tier_hits_give_the_same_tokens(reference_answers, asyn):
    cfg = tier_config(0.02, asyn=asyn)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    assert run_turns(eng) == reference_answers
    st = eng.planner.stats()
    # the later turns found their documents in the host tier, not recomputed them
    assert st["host_hit_blocks"] >= 10 and st["onloaded_blocks"] == st["host_hit_blocks"]
    assert st["offloaded_blocks"] > 0 and eng.stats.kv_copy_s > 0
    off = LLMEngine(tier_config(0.0), InProcessExecutor(tier_config(0.0)))
    assert run_turns(off) == reference_answers
    assert off.planner.stats()["prefix_cache_hits"] < st["prefix_cache_hits"]


def test_a_full_host_tier_evicts_and_never_refuses(reference_answers):
    cfg = tier_config(0.0008)  # a handful of slots for 6 documents of 6 blocks
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    assert 0 < eng.executor.infos[0]["host_slots"] < 20
    assert run_turns(eng) == reference_answers
    assert eng.planner.kv.tiers.host.num_evictions > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_prefix_back_from_the_host_is_a_cascade_prefix(kv_cache_dtype):
    """A shared prefix evicted to the host tier and copied back serves a batch of requests as
    one cascade prefix (the rows after the first share the blocks the first copies in), with the
    tokens of an engine where it never left the device -- also in an fp8 cache."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 384, 256).tolist()  # 16 blocks: vLLM's rules want 256 tokens and 8 rows
    fillers = [rng.integers(0, 384, 120).tolist() for _ in range(5)]
    batch = [prefix + rng.integers(0, 384, 5).tolist() for _ in range(8)]

    def run(host_gib, num_blocks):
        cfg = base_config(num_blocks=num_blocks)
        cfg = cfg.model_copy(update={
            "cache": CacheConfig(num_blocks=num_blocks, host_cache_gib=host_gib, kv_cache_dtype=kv_cache_dtype),
            "cascade_min_saved_kv_tokens": 0})
        eng = LLMEngine(cfg, InProcessExecutor(cfg))
        eng.generate([prefix + [1]], SamplingParams(max_tokens=1))
        for f in fillers:  # one at a time (no preemption): they push the prefix out of a small cache
            eng.generate([f], SamplingParams(max_tokens=2))
        before = eng.stats.cascade_steps
        outs = eng.generate(batch, SamplingParams(max_tokens=6))
        return [o.output_token_ids for o in outs], eng.stats.cascade_steps - before, eng.planner.stats()

    want, ref_cascade, ref = run(0.0, 400)
    assert ref["num_evictions"] == 0 and ref_cascade > 0
    got, cascade_steps, st = run(0.02, 40)
    assert got == want
    # most of the prefix came back from the host (blocks the fillers did not reach stay on the device)
    assert st["num_evictions"] > 0 and st["host_hit_blocks"] >= 8
    assert cascade_steps > 0


@pytest.mark.slow
def test_host_tier_at_tp2(ray_local, reference_answers):
    cfg = tier_config(0.02, tp=2)
    cluster = AttentionCluster(cfg)
    try:
        eng = LLMEngine(cfg, cluster)
        assert run_turns(eng) == reference_answers
        assert eng.planner.stats()["host_hit_blocks"] >= 10
    finally:
        cluster.shutdown()


def test_config_refuses_tiers_without_prefix_caching():
    with pytest.raises(ValueError, match="host_cache_gib needs enable_prefix_caching"):
        EngineConfig(cache=CacheConfig(host_cache_gib=1, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="kv_sharing needs enable_prefix_caching"):
        EngineConfig(cache=CacheConfig(kv_sharing=True, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="kv_share_max_tokens=32 is below kv_share_min_tokens=64"):
        CacheConfig(kv_sharing=True, kv_share_max_tokens=32)
    assert CacheConfig(kv_sharing=True, kv_share_min_tokens=16, kv_share_max_tokens=128).kv_share_max_tokens == 128


# -- the shared tier: replicas of one model fetch what another computed ---------------------------
def sharing_config(tp=1, seed=7, num_blocks=40):
    cfg = base_config(tp=tp, num_blocks=num_blocks, seed=seed)
    cache = CacheConfig(num_blocks=num_blocks, kv_sharing=True, kv_store_gib=0.05, kv_share_min_tokens=16)
    return cfg.model_copy(update={"cache": cache})


@pytest.fixture
def clean_store(ray_local):
    import ray

    from ray_attn.runtime.kv_store import node_store

    store = node_store()
    ray.get(store.clear.remote())
    yield store
    ray.get(store.clear.remote())


def test_a_prefix_computed_by_one_replica_is_a_hit_on_another(clean_store, reference_answers):
    import ray

    a_cfg = sharing_config()
    a = LLMEngine(a_cfg, InProcessExecutor(a_cfg))
    assert run_turns(a) == reference_answers
    assert a.planner.stats()["published_blocks"] > 0
    assert ray.get(clean_store.stats.remote())["complete"] > 0
    b = LLMEngine(a_cfg, InProcessExecutor(a_cfg))
    assert run_turns(b) == reference_answers
    st = b.planner.stats()
    assert st["shared_hit_blocks"] >= 6 * 5 and st["fetched_blocks"] == st["shared_hit_blocks"]
    # another model (another seed: other weights) shares nothing with these
    c_cfg = sharing_config(seed=8)
    c = LLMEngine(c_cfg, InProcessExecutor(c_cfg))
    c.generate([conversations()[0][0] + [1]], SamplingParams(max_tokens=2))
    assert c.planner.stats()["shared_hit_blocks"] == 0


@pytest.mark.slow
def test_shared_blocks_outlive_the_replica_that_computed_them_tp2(clean_store, reference_answers):
    """Replica A (two Ray ranks) computes and publishes, then is shut down (its actors killed);
    replica B, on ranks of its own, fetches A's blocks and gets the same tokens."""
    cfg = sharing_config(tp=2)
    a = AttentionCluster(cfg)
    try:
        assert run_turns(LLMEngine(cfg, a)) == reference_answers
    finally:
        a.shutdown()
    b = AttentionCluster(cfg)
    try:
        eng = LLMEngine(cfg, b)
        assert run_turns(eng) == reference_answers
        assert eng.planner.stats()["shared_hit_blocks"] >= 6 * 5
    finally:
        b.shutdown()


def gpu_engine(**cache):
    cfg = base_config(num_blocks=40, dtype="bfloat16")
    cfg = cfg.model_copy(update={"cache": CacheConfig(num_blocks=40, **cache),
                                 "parallel": cfg.parallel.model_copy(update={"device": "cuda"})})
    return LLMEngine(cfg, InProcessExecutor(cfg))


@pytest.mark.gpu
def test_host_tier_on_a_gpu_gives_the_tokens_of_no_tier():
    """On CUDA (bf16, the auto kernel, CUDA graphs, async scheduling): the same multi-turn workload
    with the host tier on (pinned slots) and off gives the same greedy tokens, with host hits."""
    off = run_turns(gpu_engine())
    eng = gpu_engine(host_cache_gib=0.02)
    assert run_turns(eng) == off
    assert eng.planner.stats()["host_hit_blocks"] >= 10


@pytest.mark.gpu
def test_shared_tier_on_a_gpu_gives_the_tokens_of_no_tier(clean_store):
    """On CUDA the published bytes reach the store from pinned memory on a thread (no sync in the
    step); a second replica fetches them and gets the tokens of a run without sharing."""
    off = run_turns(gpu_engine())
    share = dict(kv_sharing=True, kv_store_gib=0.05, kv_share_min_tokens=16)
    assert run_turns(gpu_engine(**share)) == off
    eng = gpu_engine(**share)
    assert run_turns(eng) == off
    assert eng.planner.stats()["shared_hit_blocks"] >= 6 * 5


def test_sharing_without_ray_is_refused_by_name(monkeypatch):
    import ray

    from ray_attn.runtime.kv_tiers import planner_tiers

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="kv_sharing needs a Ray cluster"):
        planner_tiers(sharing_config(), None)
