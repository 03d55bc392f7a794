"""profile_decode's kernel table: every kernel counted once, under the first kind its name matches."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import profile_decode as pd  # noqa: E402


def test_kernels_by_kind_count_each_kernel_once():
    ev = [SimpleNamespace(key=k, count=c, device_time_total=t) for k, c, t in [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 64, 320.0), ("flash_fwd_splitkv_kernel", 32, 640.0),
        ("_rms_norm_kernel", 65, 130.0), ("_fused_add_rms_norm", 64, 192.0), ("_rope_kernel", 32, 64.0),
        ("_gemv_kernel", 96, 2880.0), ("sm90_xmma_gemm_bf16bf16_bf16f32", 33, 990.0),
        ("_silu_mul_kernel", 32, 64.0), ("_moe_small_gate_up", 48, 480.0), ("void at::native::argmax", 1, 5.0),
        ("mystery", 2, 4.0)]]
    rows = {r["kind"]: r for r in pd.kernel_kinds(ev)}
    assert sum(r["kernels"] for r in rows.values()) == sum(e.count for e in ev)
    assert rows["norm"]["kernels"] == 129 and rows["gemm/gemv"]["kernels"] == 129
    assert rows["all-reduce"]["us"] == 320.0 and rows["moe"]["kernels"] == 48 and rows["other"]["kernels"] == 2
    assert rows["gemm/gemv"]["us_per_kernel"] == (2880.0 + 990.0) / 129
    assert abs(sum(r["share"] for r in rows.values()) - 1) < 1e-12
    assert list(rows)[0] == "gemm/gemv"  # largest first


def test_scout_is_cut_to_the_layers_one_gpu_holds():
    cfg = pd.preset_config("llama-4-scout", False, 16, 8)
    assert cfg.model.num_hidden_layers == 8 and len(cfg.model.layer_kinds()) == 8
    assert pd.preset_config("llama-3-8b:fp8", False, 16, 8).model.quantization == "fp8"


def test_the_batch_invariant_flag_reaches_the_engine_config():
    assert pd.preset_config("llama-3-8b", False, 16, 8, batch_invariant=True).parallel.batch_invariant
    assert not pd.preset_config("llama-3-8b", False, 16, 8).parallel.batch_invariant


def test_prefill_step_is_timed_against_its_flops(tmp_path):
    """``--prefill``: one step of fresh prompts (none served from the prefix cache), its FLOPs over
    the measured GEMM rate; a prefill larger than the engine's step budget is refused by name."""
    import json

    import pytest

    out = tmp_path / "p.json"
    pd.main(["--points", "", "--prefill", "128", "--prefill-len", "64", "--json", str(out)])
    [rec] = json.loads(out.read_text())["points"]
    assert (rec["prefill_tokens"], rec["prompt_len"]) == (128, 64)
    assert rec["step_ms"] > 0 and 0 < rec["frac_of_roofline"] == rec["roofline_ms"] / rec["step_ms"]
    with pytest.raises(SystemExit, match="max_num_batched_tokens=512"):
        pd.main(["--points", "", "--prefill", "1024", "--prefill-len", "64"])
