"""scripts/sim_offline_schedule.py: the engine's own scheduler runs the offline workload with an
instant executor; every token of the workload is scheduled once, decode rows never exceed
max_num_seqs, and more sequences a step take fewer steps and less estimated time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import sim_offline_schedule as sim  # noqa: E402

from ray_attn.config import MODEL_PRESETS, ModelConfig  # noqa: E402


def test_every_token_is_scheduled_once_within_the_limits():
    m = ModelConfig(**MODEL_PRESETS["tiny"])
    n, inp, out = 6, 40, 5
    for seqs, tokens in ((2, 64), (8, 64), (8, 128)):
        steps = sim.schedule(m, seqs, tokens, 256, 16, n, inp, out)
        assert steps[:, 0].sum() == n * inp + n * (out - 1)  # the first output token comes with the prefill
        assert steps[:, 0].max() <= tokens and steps[:, 1].max() <= seqs
        assert steps[:, 1].sum() == n * (out - 1)  # every decode row is one output token after the first
        # a decode row reads its whole KV: prompt + outputs so far, + 1 for the token it writes
        assert steps[:, 2].sum() == n * sum(inp + j for j in range(1, out))


def test_more_sequences_a_step_take_fewer_steps_and_less_time(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"device_rates": {"copy_Bps": 1e12, "gemm_flops": 1e14, "gpu": "test"}}))
    out = tmp_path / "sim.json"
    assert sim.main(["--preset", "tiny", "--configs", "2x64,8x64", "--num-prompts", "8", "--input-len", "40",
                     "--output-len", "6", "--num-blocks", "256", "--rates", str(rates), "--json", str(out)]) == 0
    small, big = json.loads(out.read_text())["rows"]
    assert big["steps"] < small["steps"] and big["est_s"] < small["est_s"]
    assert small["max_decode_rows"] == 2 < big["max_decode_rows"] <= 8
