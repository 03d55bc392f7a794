"""The decode GEMVs' tuned tables (ray_attn/model/kernel_configs.py): written and read back, looked
up by the smallest tuned row count at or above a step's, nothing past the largest (the tiles grow
with the rows there), and a table that sets what it may not refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from ray_attn.model import kernel_configs as KC


def test_write_then_lookup(tmp_path):
    cfg1 = dict(BLOCK_N=32, BLOCK_K=512, num_stages=5)
    cfg16 = dict(BLOCK_N=64, BLOCK_K=256, num_stages=3)
    path = KC.write_table("NVIDIA Test-GPU 80GB", {"fp8_skinny": {KC.shape_key(4096, 4096): {1: cfg1, 16: cfg16}}},
                          dict(source="test"), folder=tmp_path)
    assert path.name == "NVIDIA_Test_GPU_80GB.json"
    table = KC.device_table("NVIDIA Test-GPU 80GB", folder=tmp_path)
    assert KC.lookup(table, "fp8_skinny", 1, 4096, 4096) == cfg1
    assert KC.lookup(table, "fp8_skinny", 2, 4096, 4096) == cfg16  # the next tuned size up
    assert KC.lookup(table, "fp8_skinny", 16, 4096, 4096) == cfg16
    assert KC.lookup(table, "fp8_skinny", 17, 4096, 4096) == {}  # past the largest: the kernel's rule
    assert KC.lookup(table, "fp8_skinny", 1, 4096, 14336) == {}  # untuned shape
    assert KC.lookup(table, "gemv", 1, 4096, 4096) == {}
    assert KC.device_table("no such GPU", folder=tmp_path) == {}


def test_a_table_may_not_set_the_rows_tile(tmp_path):
    body = {"device": "X", "kernels": {"gemv": {KC.shape_key(8, 8): {"1": {"BLOCK_M": 16, "num_stages": 2}}}}}
    (tmp_path / KC.file_name("X")).write_text(json.dumps(body))
    with pytest.raises(ValueError, match="BLOCK_M"):
        KC.device_table("X", folder=tmp_path)


def test_cpu_tensors_get_no_table():
    assert KC.tuned("gemv", 1, 4096, 4096, torch.device("cpu")) == {}


def test_shipped_tables_read():
    """Every table in the package parses, and sets only what a table may."""
    for path in KC.CONFIG_DIR.glob("*.json"):
        name = json.loads(path.read_text())["device"]
        assert KC.file_name(name) == path.name
        assert set(KC.device_table(name)) <= set(KC.KERNELS)
