#!/usr/bin/env python
"""The offline workload's steps under other scheduler limits, without a GPU: what ``max_num_seqs``
and ``max_num_batched_tokens`` do to an offline run before a GPU call is spent measuring them.

The engine's own scheduler and planner run the workload (``gpu_serving.py``'s offline: N random
prompts given at once, a fixed output length each) with an executor that answers every step at
once.  Each step's shape is recorded -- new tokens, decode rows, the KV those rows read, the
prefill rows' attention pairs -- and given a time by the roofline's own terms
(``servebench/roofline.py``): the larger of reading the weights and the step's GEMM FLOPs, plus
the decode rows' KV over the copy rate, plus the prefill attention FLOPs, plus a fixed cost a step.
The rates come from a ``gpu_serving.py`` result (its ``device_rates``), so the estimate is of that
GPU.  It leaves out what the roofline does (norms, RoPE, sampling, GEMM efficiency below the
measured rate), so it is a lower bound; the differences between configurations are what it is for.

    python scripts/sim_offline_schedule.py                            # Llama-3-8B, H100 rates
    python scripts/sim_offline_schedule.py --configs 256x8192,512x8192,1024x16384 --quantization fp8

Writes benchmarks/results/sim_offline_schedule.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from servebench import roofline as rl  # noqa: E402

from bench_engine_overhead import InstantExecutor  # noqa: E402

from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402

RATES = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "serving_issue39_h100.json"


class ShapeRecorder(InstantExecutor):
    """``InstantExecutor`` (token 1 for every row at once) that keeps each step's shape."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.steps: list[tuple[int, int, int, int]] = []  # (tokens, decode rows, decode KV, prefill pairs)

    def step(self, step):
        a = step.plan.attn
        b = a.num_reqs
        q = np.diff(np.asarray(a.query_start_loc[:b + 1], np.int64))
        k = np.asarray(a.seq_lens[:b], np.int64)
        dec = q == 1
        # a prefill row's queries see (k - q + 1) ... k keys: sum over its q positions
        pairs = int((q[~dec] * (2 * k[~dec] - q[~dec] + 1) // 2).sum())
        self.steps.append((int(q.sum()), int(dec.sum()), int(k[dec].sum()), pairs))
        return super().step(step)


def schedule(m: ModelConfig, seqs: int, tokens: int, num_blocks: int, block_size: int, n: int, inp: int,
             out: int) -> np.ndarray:
    """Every step's (tokens, decode rows, decode KV tokens, prefill pairs) for the workload."""
    ex = ShapeRecorder(num_blocks)
    eng = LLMEngine(EngineConfig(model=m, cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
                                 max_num_seqs=seqs, max_num_batched_tokens=tokens, async_scheduling=False), ex)
    rng = np.random.default_rng(0)
    eng.generate([rng.integers(0, m.vocab_size, inp).tolist() for _ in range(n)],
                 SamplingParams(max_tokens=out, ignore_eos=True))
    return np.array(ex.steps, np.int64)


def step_seconds(steps: np.ndarray, c: rl.ModelCosts, copy: float, gemm: float, attn_flops: float,
                 overhead_s: float) -> np.ndarray:
    """Each step's time: weights or GEMM FLOPs (``gemm``: the weights' rate), decode KV reads,
    prefill attention FLOPs (``attn_flops``: attention stays in the model dtype), a fixed cost."""
    tok, dec, kv, pairs = steps.T.astype(float)
    gemm_s = np.maximum(c.weight_bytes / copy, 2.0 * c.layer_params * tok / gemm)
    return gemm_s + kv * c.kv_bytes_per_token / copy + pairs * c.attn_flops_per_pair / attn_flops + overhead_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3-8b", choices=sorted(MODEL_PRESETS))
    p.add_argument("--quantization", default=None, help="fp8: FP8 weights (the FP8 GEMM rate and a byte a weight)")
    p.add_argument("--configs", default="256x8192,512x8192,512x16384",
                   help="comma-separated max_num_seqs x max_num_batched_tokens")
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=25364, help="the KV cache (the H100's for the 8B in bf16)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rates", default=str(RATES), help="a gpu_serving.py result whose device_rates to use")
    p.add_argument("--step-overhead-ms", type=float, default=0.35, help="a fixed cost a step (launches, sampling)")
    p.add_argument("--json", default=None, help="write here (default benchmarks/results/sim_offline_schedule.json)")
    a = p.parse_args(argv)
    m = ModelConfig(**MODEL_PRESETS[a.preset], quantization=a.quantization)
    rates = json.loads(Path(a.rates).read_text())["device_rates"]
    copy = rates["copy_Bps"]
    gemm = rates.get("fp8_gemm_flops", rates["gemm_flops"]) if a.quantization else rates["gemm_flops"]
    c = rl.ModelCosts.from_config(m)
    rows = []
    for spec in a.configs.split(","):
        seqs, tokens = (int(x) for x in spec.split("x"))
        steps = schedule(m, seqs, tokens, a.num_blocks, a.block_size, a.num_prompts, a.input_len, a.output_len)
        est = step_seconds(steps, c, copy, gemm, rates["gemm_flops"], a.step_overhead_ms / 1e3)
        roof = rl.workload_roofline(c, copy, gemm, [a.input_len] * a.num_prompts, [a.output_len] * a.num_prompts,
                                    None, min(seqs, a.num_prompts))
        only_decode = steps[:, 0] == steps[:, 1]
        rows.append(dict(max_num_seqs=seqs, max_num_batched_tokens=tokens, steps=len(steps),
                         decode_only_steps=int(only_decode.sum()), max_decode_rows=int(steps[:, 1].max()),
                         mean_decode_rows=float(steps[only_decode, 1].mean()) if only_decode.any() else 0.0,
                         est_s=float(est.sum()), est_decode_only_s=float(est[only_decode].sum()),
                         roofline_s=roof["roofline_s"], roofline_over_est=roof["roofline_s"] / float(est.sum())))
    out = Path(a.json) if a.json else bl.RESULTS / "sim_offline_schedule.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(a), gpu=rates.get("gpu"), rows=rows), indent=1))
    bl.print_table(rows, list(rows[0]), f"{a.preset}{':' + a.quantization if a.quantization else ''} offline "
                   f"{a.num_prompts} x {a.input_len}/{a.output_len}, {rates.get('gpu')} rates")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
