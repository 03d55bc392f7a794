"""Host time of one engine decode step without any model: scheduling, planning and output
bookkeeping, with an executor that answers instantly.  This is the driver-side floor under every
decode step of ``bench_e2e.py``.

    python scripts/bench_engine_overhead.py [--batch 256] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from ray_attn.config import EngineConfig, ModelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402
from ray_attn.runtime.messages import StepOutput  # noqa: E402


class InstantExecutor:
    """Samples token 1 for everyone at once: the engine's own cost is all that is left."""

    num_blocks, num_sms, kernel_name, compiled = 1 << 17, 132, "fa3", False

    def step(self, step):
        return StepOutput(token_ids=np.ones(step.plan.num_reqs, np.int32), step_id=step.step_id)

    def shutdown(self):
        pass


def main(argv=None):
    a = argparse.ArgumentParser()
    a.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    a.add_argument("--ctx", type=int, default=1024)
    a.add_argument("--steps", type=int, default=100)
    args = a.parse_args(argv)
    rows = []
    for batch in args.batch:
        model = ModelConfig(vocab_size=1000, hidden_size=4096, num_attention_heads=32,
                            num_key_value_heads=8, intermediate_size=512, max_position_embeddings=16384)
        eng = LLMEngine(EngineConfig(model=model, max_num_seqs=batch, max_num_batched_tokens=8192),
                        InstantExecutor())
        rng = np.random.default_rng(0)
        bl.start_decoding(eng, [rng.integers(0, 1000, args.ctx).tolist() for _ in range(batch)],
                          [SamplingParams(max_tokens=args.steps + 10)] * batch)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        rows.append(dict(batch=batch, ctx=args.ctx, step_us=statistics.median(times) * 1e6,
                         p90_us=float(np.percentile(times, 90) * 1e6)))
    path = bl.save("bench_engine_overhead", rows)
    bl.print_table(rows, ["batch", "ctx", "step_us", "p90_us"], "engine host time per decode step")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
