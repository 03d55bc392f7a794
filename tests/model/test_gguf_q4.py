"""``quantization='gguf'``: a GGUF's Q4_0 / Q4_1 weights packed as stored and run by torch's int4
CPU matmul (ray_attn/model/gguf_q4.py), on small GGUFs of random HF models (tests/model/gguf_fixture.py).

Tolerances: the blocks decode to gguf's own dequantized values within float32 rounding (1e-6 of
the largest: (q - 8) d + (m + 8 d) is q d + m summed in another order).  The packed linears
compute in bfloat16 (inputs and scales rounded to 8 significant bits), so against the float64
product of the same dense weights they are held to 2% of the output's largest value -- a
decoding fault (a nibble order, a zero without its 8 d, a column slice off by a block) is off
by the output's own size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig
from ray_attn.model import build_model, gguf_q4
from ray_attn.model.gemv import linear
from tests.model.gguf_fixture import tiny_hf, write_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gguf_q4.available(), reason="this torch has no int4 CPU matmul")

NO_COLLECTIVES = object()  # loading and slicing never all-reduce (tests/model/test_weights.py)


def write(tmp_path, model_type, qtype, seed=0):
    hf = tiny_hf(model_type, seed=seed)
    return write_gguf(hf, tmp_path / f"tiny-{model_type}-{qtype}.gguf", qtype, seed=seed)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_blocks_decode_to_what_gguf_dequantizes(tmp_path, qtype):
    path = write(tmp_path, "llama", qtype)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    rows = np.arange(int(t.shape[1]))
    codes, scale, zero = gguf_q4.q4_blocks(t, rows)
    assert codes.max() <= 15 and len(np.unique(codes)) > 8
    got = (codes.astype(np.float64).reshape(len(rows), -1, gguf_q4.GROUP) - 8) * scale[..., None] + zero[..., None]
    want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=1e-6 * np.abs(want).max())


def packed_weights(m):
    return [p for mod in m.modules() for p in mod.parameters(recurse=False) if gguf_q4.packed(p) is not None]


@pytest.mark.parametrize("model_type,qtype", [("llama", "Q4_1"), ("qwen2", "Q4_0"), ("qwen3", "Q4_1")])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_packs_its_slice_and_computes_the_dense_product(tmp_path, model_type, qtype, tp, rng):
    path = write(tmp_path, model_type, qtype)
    cfg = EngineConfig(checkpoint=str(path), model={"quantization": "gguf"}).model
    for rank in range(tp):
        m = build_model(cfg, tp_rank=rank, tp_size=tp, tp_group=NO_COLLECTIVES if tp > 1 else None, kernel="torch")
        m.load_weights(str(path))
        got = packed_weights(m)
        # qkv, o_proj, gate_up and down_proj of each layer and the (untied) LM head; the embedding
        # is only looked up
        assert len(got) == 4 * cfg.num_hidden_layers + 1 and any(w is m.lm_head for w in got), (tp, rank)
        assert not any(w is m.embed_tokens for w in got)
        for w in got:
            x = torch.randn(5, w.shape[1], generator=rng)
            want = x.double() @ w.detach().double().T  # the dense copy: gguf's own dequantized values
            y = linear(x, w)
            assert y.dtype == x.dtype and y.shape == want.shape
            assert (y.double() - want).abs().max() <= 0.02 * want.abs().max(), (tp, rank, tuple(w.shape))


def test_a_weight_changed_after_packing_runs_dense_again(tmp_path):
    path = write(tmp_path, "llama", "Q4_1")
    m = build_model(EngineConfig(checkpoint=str(path), model={"quantization": "gguf"}).model, kernel="torch")
    m.load_weights(str(path))
    w = packed_weights(m)[0]
    with torch.no_grad():
        w.mul_(2)  # e.g. a reload of other weights in place: the packed copy no longer holds w
    assert gguf_q4.packed(w) is None
    x = torch.randn(3, w.shape[1])
    # the dense path this machine takes for the same values (F.linear, or oneDNN's where it is the
    # faster CPU matmul: ``gemv.use_onednn``), on a copy that never had blocks packed beside it
    assert torch.equal(linear(x, w), linear(x, w.detach().clone()))


def test_other_tensor_types_stay_dense(tmp_path):
    path = write(tmp_path, "llama", "Q8_0")
    cfg = EngineConfig(checkpoint=str(path), model={"quantization": "gguf"}).model
    m = build_model(cfg, kernel="torch")
    m.load_weights(str(path))
    assert packed_weights(m) == []


def first_steps(path, quantization, prompts):
    """Each prompt's first greedy token and its top-2 logprobs."""
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    cfg = EngineConfig(checkpoint=str(path), model={"quantization": quantization}, cache=CacheConfig(num_blocks=64),
                       parallel=ParallelConfig(device="cpu", kernel="torch"), max_num_batched_tokens=64)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    try:
        outs = eng.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=2))
        return [(o.output_token_ids[0], dict(o.logprobs[0].top)) for o in outs]
    finally:
        eng.shutdown()


def test_engine_logprobs_move_by_bf16_rounding_and_clear_tokens_stay(tmp_path):
    path = write(tmp_path, "llama", "Q4_1", seed=3)
    gen = np.random.default_rng(5)
    prompts = [gen.integers(0, 256, int(gen.integers(5, 30))).tolist() for _ in range(8)]
    dense = first_steps(path, None, prompts)
    got = first_steps(path, "gguf", prompts)
    moved, clear = [], 0
    for (tok_d, lp_d), (tok_g, lp_g) in zip(dense, got):
        top = sorted(lp_d.values(), reverse=True)
        if top[0] - top[1] > 0.1:  # no near-tie: bf16's rounding cannot flip it
            assert tok_g == tok_d
            clear += 1
        if tok_d in lp_g:
            moved.append(abs(lp_g[tok_d] - lp_d[tok_d]))
    assert clear >= 3 and moved and 0 < max(moved) < 0.05  # computed apart, and close


def test_the_config_refuses_gguf_quantization_without_a_gguf(tmp_path):
    with pytest.raises(ValueError, match="quantization='gguf'.*not a GGUF"):
        EngineConfig(model={"quantization": "gguf"})
    with pytest.raises(ValueError, match="'gguf'"):
        EngineConfig(model={"quantization": "int4"})
