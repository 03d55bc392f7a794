"""The adapter reader process (ray_attn/lora/reader.py) writes the same images as the rank's own
``fill_images``, bit for bit, names a bad adapter as the in-process read does, and leaves no
process behind."""

from __future__ import annotations

import pytest
import torch

from ray_attn.engine import LLMEngine
from ray_attn.lora import LoRAAdapterError
from ray_attn.lora.reader import ReaderProcess, fill_images
from ray_attn.runtime import InProcessExecutor
from tests.lora.peft_fixture import engine_config


def test_the_reader_process_writes_the_rank_images_and_names_a_bad_adapter(lora_models, tmp_path):
    base, adapters = lora_models
    cfg = engine_config(base, max_loras=2, max_lora_rank=8)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    spec = eng.executor.worker.lora.spec
    reader = ReaderProcess(spec, threads=1)
    try:
        for name in ("attn", "mlp"):
            want = torch.full((spec.elems,), float("nan"), dtype=spec.dtype)
            got = torch.full((spec.elems,), float("nan"), dtype=spec.dtype)
            touched = fill_images(spec, adapters[name], name, want)
            assert reader.read(adapters[name], name, got) == touched and touched
            assert torch.equal(got, want)
        bad = tmp_path / "bad"
        bad.mkdir()
        with pytest.raises(LoRAAdapterError, match="'bad'.*does not exist"):
            reader.read(str(bad), "bad", got)
        assert reader.proc.poll() is None  # an adapter's error does not end the reader
    finally:
        reader.close()
        eng.executor.shutdown()
    assert reader.proc.poll() == 0  # ended on its stdin's EOF (its staging file was unlinked once mapped)
