"""The LoRA kernels' tuned launch settings (ray_attn/lora/tuning.py): a table written by the
tuner reads back as it was, a step takes the setting of the smallest tuned size that covers it,
and a device or shape never tuned gets the defaults."""

from __future__ import annotations

import json

import pytest

from ray_attn.lora import tuning
from ray_attn.lora.tuning import KernelConfig


def test_a_written_table_reads_back_and_covers_each_step_by_the_next_tuned_size(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    key = tuning.shape_key(4096, 6144, 3, 16)
    small, mid, big = KernelConfig(fused=True, block_k=256), KernelConfig(block_n=128), KernelConfig(max_split=8)
    path = tuning.write_table("NVIDIA H200", {key: {1: small, 16: mid, 64: big}}, {"layers": 32}, folder=tmp_path)
    assert path.name == "NVIDIA_H200.json" and json.loads(path.read_text())["layers"] == 32
    got = [tuning.config_for("NVIDIA H200", t, 4096, 6144, 3, 16) for t in (1, 2, 16, 17, 64, 500)]
    assert got == [small, mid, mid, big, big, big]
    # another shape, another rank or a device never tuned: the defaults
    assert tuning.config_for("NVIDIA H200", 1, 4096, 6144, 3, 32) == tuning.DEFAULT
    assert tuning.config_for("NVIDIA H100 80GB HBM3", 1, 4096, 6144, 3, 16) == tuning.DEFAULT
    assert tuning.config_for(None, 1, 4096, 6144, 3, 16) == tuning.DEFAULT
    tuning.device_table.cache_clear()


@pytest.mark.parametrize("bad", [dict(block_k=48), dict(block_n=8), dict(max_split=0), dict(max_split=65),
                                 dict(split_min_k=64, block_k=128)])
def test_a_config_the_kernels_cannot_run_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        KernelConfig(**bad)


def test_unknown_keys_in_a_table_are_ignored():
    assert KernelConfig.from_json({"fused": True, "future_knob": 3}) == KernelConfig(fused=True)


def test_every_shipped_table_loads_and_covers_the_llama_3_8b_projections():
    """The tables in ray_attn/lora/configs (written by scripts/bench_lora_kernels.py on a GPU):
    each setting valid, and the H200's covering the four projections it was tuned on."""
    paths = sorted(tuning.CONFIG_DIR.glob("*.json"))
    assert paths, "no tuned table is shipped"
    for path in paths:
        device = json.loads(path.read_text())["device"]
        assert tuning.file_name(device) == path.name
        table = tuning.device_table(device)
        assert table and all(isinstance(c, KernelConfig) for by_t in table.values() for c in by_t.values())
    h200 = tuning.device_table("NVIDIA H200")
    assert {tuning.shape_key(K, N, P, 16) for K, N, P in
            [(4096, 6144, 3), (4096, 4096, 1), (4096, 28672, 2), (14336, 4096, 1)]} <= set(h200)
