"""Programmatic dependent launch (ray_attn/backend/pdl.py): the decode kernels launched with it compute
what they compute without it, to the bit -- a kernel that read an activation before its wait would
see the previous step's values (or a half-written tensor) and differ, most visibly under a CUDA
graph replayed many times with fresh inputs."""

from __future__ import annotations

import pytest
import torch

from ray_attn.backend import pdl


def test_off_on_cpu_and_by_the_switch(monkeypatch):
    assert pdl.launch(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch(torch.device("cuda", 0)) == {"USE_PDL": False}


def _model(quantization):
    from ray_attn.config import ModelConfig
    from ray_attn.model.registry import build_model

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=1024, intermediate_size=3072,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                      dtype="bfloat16", quantization=quantization)
    model = build_model(cfg, device="cuda", block_size=16, kernel="torch")
    model.init_random_weights(5)
    model.process_weights_after_loading()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_gpu_decode_with_pdl_equals_it_without(quantization, monkeypatch):
    """A bf16 (and an online-FP8) Llama decoding one sequence eagerly: the logits of every step
    equal those with PDL off, to the bit."""
    from tests.model.steps import random_tokens, run_schedule

    if not pdl.launch(torch.device("cuda"))["USE_PDL"]:
        pytest.skip("PDL needs Hopper or later and a Triton with griddepcontrol")
    tokens = random_tokens(256)[:1]
    out = {}
    for on in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", on)
        out[on] = torch.cat(run_schedule(_model(quantization), tokens, [[12], [1], [1], [1], [1]], device="cuda"))
    assert out[True].isfinite().all() and torch.equal(out[True], out[False])


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_gpu_layer_chain_in_a_graph_replayed_with_new_inputs(quantization, monkeypatch):
    """One-row layer chains (norm, the GEMVs or the FP8 kernels, SiLU-mul, the residual add) captured
    with PDL, replayed 100 times on new inputs: each replay equals the same chain run eagerly
    without PDL.  A kernel whose reads ran ahead of its wait would read the last replay's values."""
    if not pdl.launch(torch.device("cuda"))["USE_PDL"]:
        pytest.skip("PDL needs Hopper or later and a Triton with griddepcontrol")
    from ray_attn.model import fused

    model = _model(quantization)
    layers = model.layers

    quant = quantization == "fp8"

    def chain(x):
        res, h = x, None
        for layer in layers:
            norm = layer.input_layernorm
            if h is None:
                n = fused.rms_norm(res, norm.weight, norm.eps, quant=quant)
            else:
                res, n = fused.add_rms_norm(res, h, norm.weight, norm.eps, quant=quant)
            attn = layer.self_attn
            qkv = attn.qkv_proj(n)
            h = attn.o_proj(qkv[:, :attn.o_proj.weight.shape[-1]].contiguous())
            norm = layer.post_attention_layernorm
            res, n = fused.add_rms_norm(res, h, norm.weight, norm.eps, quant=quant)
            h = layer.mlp(n)
        return res + h

    g = torch.Generator(device="cuda").manual_seed(0)
    static = torch.randn(1, 1024, device="cuda", generator=g).to(torch.bfloat16)
    monkeypatch.setattr(pdl, "ENABLED", True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    inputs = [torch.randn(1, 1024, device="cuda", generator=g).to(torch.bfloat16) for _ in range(100)]
    got = []
    for x in inputs:
        static.copy_(x)
        graph.replay()
        got.append(out.clone())
    monkeypatch.setattr(pdl, "ENABLED", False)
    bad = [i for i, (x, y) in enumerate(zip(inputs, got)) if not torch.equal(chain(x), y)]
    assert not bad, bad
