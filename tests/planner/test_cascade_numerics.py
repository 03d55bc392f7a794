"""Planner-built plans run through the backend, against dense attention computed from the tokens.

A toy "model" gives every token K/V/Q that depend only on (token id, position), so a block's KV is
the same in every request that shares the prefix -- exactly what makes prefix caching and cascade
sharing correct.  Each step runs ``FlashAttentionImpl.forward`` on the step's plan (cache write,
then paged / cascade / local attention) and compares every output row with float64 dense causal
attention over the request's whole token sequence.  This covers slot mapping, block tables,
prefix-cache hits, deduplicated blocks, multi-group cascade and its fallbacks end to end.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
backend = pytest.importorskip("ray_attn.backend")

from ray_attn.planner import Planner, ScheduledRequest  # noqa: E402
from tests.backend.batch import dense_attention  # noqa: E402

S = ScheduledRequest
BS, H, D, VOCAB, MAXPOS = 16, 4, 32, 997, 2048
DT = torch.float64  # the torch kernel computes float64 inputs in float64
# Paged paths agree to ~1e-12; the cascade merge carries its log-sum-exp in float32 (~1e-8 here).
# A wrong block, slot or prefix would be off by O(1).
ATOL = 1e-6


class ToyModel:
    def __init__(self, Hk, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.Hk = Hk
        emb = lambda h: torch.randn(VOCAB, h, D, generator=g, dtype=DT)  # noqa: E731
        pos = lambda h: torch.randn(MAXPOS, h, D, generator=g, dtype=DT) * 0.5  # noqa: E731
        self.q_tok, self.q_pos = emb(H), pos(H)
        self.k_tok, self.k_pos = emb(Hk), pos(Hk)
        self.v_tok, self.v_pos = emb(Hk), pos(Hk)

    def qkv(self, tokens, positions, what="qkv"):
        t = torch.as_tensor(np.asarray(tokens) % VOCAB, dtype=torch.long)
        p = torch.as_tensor(np.asarray(positions), dtype=torch.long)
        tab = {"q": (self.q_tok, self.q_pos), "k": (self.k_tok, self.k_pos), "v": (self.v_tok, self.v_pos)}
        return tuple(tab[c][0][t] + tab[c][1][p] for c in what)


def dense(model, tokens, q_positions, window=None, chunk=None):
    """Causal attention of the queries at ``q_positions`` over every key of ``tokens``."""
    n = len(tokens)
    (q,) = model.qkv([tokens[p] for p in q_positions], q_positions, "q")
    k, v = model.qkv(tokens, np.arange(n), "kv")
    return dense_attention(q, k, v, q_positions, scale=D ** -0.5, window=window, chunk=chunk)


class Runner:
    """Drives planner + backend for one attention layer, checking every step."""

    def __init__(self, planner: Planner, Hk, window=None, chunk=None, irope=False):
        self.p, self.model, self.window, self.chunk = planner, ToyModel(Hk), window, chunk
        self.impl = backend.FlashAttentionImpl(H, D, D ** -0.5, Hk, None, window, "auto", use_irope=irope,
                                               dtype=DT, block_size=BS, device="cpu", kernel="torch")
        self.cache = torch.randn(2, planner.pool.num_blocks, BS, Hk, D, dtype=DT)
        self.layer = backend.AttentionLayer()
        self.tokens: dict = {}
        self.cascaded = 0
        self.groups = set()

    def step(self, sched):
        plan = self.p.plan(sched)
        a = plan.attn
        n = a.num_actual_tokens
        q, k, v = self.model.qkv(plan.input_token_ids, plan.positions)
        out = torch.full_like(q, float("nan"))
        self.impl.forward(self.layer, q, k, v, self.cache, a.to_device("cpu"), out)
        assert not torch.isnan(out[:n]).any()
        qsl = a.query_start_loc
        for i, r in enumerate(plan.req_ids):
            pos = plan.positions[qsl[i]:qsl[i + 1]].tolist()
            want = dense(self.model, self.tokens[r][: pos[-1] + 1], pos, self.window, self.chunk)
            torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], want, rtol=0, atol=ATOL)
        if a.use_cascade:
            self.cascaded += 1
            self.groups.add(plan.num_cascade_groups)
        return plan


def rollout(runner, num_prompts, samples, prompt_lens, decode_steps, rng, system=0, join_late=False):
    sys_toks = rng.integers(0, VOCAB, system).tolist()
    prompts = [sys_toks + rng.integers(0, VOCAB, n).tolist() for n in prompt_lens]
    t = runner.tokens
    # every sample is admitted at once: the same prompt prefilled side by side, deduplicated after
    first = samples - 1 if join_late else samples
    for k in range(num_prompts):
        for s in range(first):
            t[(k, s)] = list(prompts[k])
    plans = [runner.step([S(r, t[r]) for r in t])]
    for step in range(decode_steps):
        for r in t:
            t[r].append(int(rng.integers(0, VOCAB)))
        sched = [S(r, t[r], 1) for r in t]
        if join_late and step == 1:  # late samples: a prefix hit plus a chunk of prefill
            for k in range(num_prompts):
                r = (k, samples - 1)
                t[r] = list(prompts[k])
                sched.append(S(r, t[r], len(t[r]) - BS * 2 if len(t[r]) > 3 * BS else None))
        if join_late and step == 2:
            sched = [S(r, t[r], None) for r in t]
        order = rng.permutation(len(sched))
        plans.append(runner.step([sched[i] for i in order]))
    return plans


def planner(**kw):
    args = dict(num_blocks=600, block_size=BS, num_query_heads=H, num_kv_heads=H)
    args.update(kw)
    return Planner(**args)


@pytest.mark.parametrize("Hk", [4, 2])
def test_multi_group_cascade_matches_dense(Hk):
    rng = np.random.default_rng(Hk)
    run = Runner(planner(num_kv_heads=Hk, num_sms=4), Hk)  # few SMs: flash-decoding loses to cascade
    rollout(run, 3, 4, rng.integers(260, 330, 3).tolist(), 3, rng, join_late=True)
    assert run.cascaded >= 2 and 3 in run.groups


def test_multi_group_below_a_system_prompt_matches_dense():
    rng = np.random.default_rng(7)
    run = Runner(planner(), H)
    rollout(run, 3, 3, [260, 270, 280], 3, rng, system=40)
    assert run.cascaded >= 3 and run.groups == {3}


def test_single_group_vllm_cascade_matches_dense():
    rng = np.random.default_rng(3)
    run = Runner(planner(multi_group_cascade=False), H)
    rollout(run, 1, 8, [270], 3, rng)
    assert run.cascaded >= 3 and run.groups == {1}


def test_sliding_window_cascade_when_no_window_clips():
    rng = np.random.default_rng(4)
    run = Runner(planner(sliding_window=400), H, window=400)
    rollout(run, 2, 4, [280, 300], 3, rng)
    assert run.cascaded >= 3
    # and the fallback once the window clips
    run = Runner(planner(sliding_window=310), H, window=310)
    plans = rollout(run, 2, 4, [300, 320], 2, rng)
    assert "clips" in plans[-1].cascade_reason and not plans[-1].attn.use_cascade


def test_local_attention_cascade_within_one_chunk():
    rng = np.random.default_rng(5)
    run = Runner(planner(attention_chunk_size=512), H, chunk=512, irope=True)
    plans = rollout(run, 2, 4, [280, 300], 3, rng)
    assert run.cascaded >= 2 and all(p.attn.local_attn_metadata is None for p in plans)


def test_local_attention_across_chunks_falls_back_and_matches_dense():
    rng = np.random.default_rng(6)
    run = Runner(planner(attention_chunk_size=128), H, chunk=128, irope=True)
    plans = rollout(run, 2, 4, [280, 300], 2, rng)
    assert run.cascaded == 0 and "several chunks" in plans[-1].cascade_reason
    assert plans[-1].attn.local_attn_metadata is not None


def test_padded_plan_matches_dense():
    rng = np.random.default_rng(8)
    run = Runner(planner(token_buckets=[64, 512, 4096]), H)
    plans = rollout(run, 2, 4, [260, 270], 2, rng)
    assert plans[-1].num_tokens == 64 and plans[-1].attn.num_actual_tokens == 8
