"""Structured outputs' cost per decode step: the token bitmask on the device, and its fill on the
driver, at batch 64 and 256 with all rows constrained, half, and none.

- device: ``SamplingTensors.stage`` (the bitmask's pinned, non-blocking copy, as the worker stages
  it) + ``sample_on_device`` over [batch, vocab] float32 logits, greedy and sampled; the cost is
  the time above the same step with no constrained row.
- driver: ``structured_output.fill_bitmask`` for the constrained rows (one xgrammar batch call),
  JSON-schema matchers on a synthetic 128k vocabulary, in the states a short JSON object passes
  through.

Both against a decode step of Llama-3-8B shape at batch 64 (5.59 ms on the H200 with async
scheduling: benchmarks/results/bench_step_overhead_8b.json, `scripts/bench_step_overhead.py`) --
the step the mask would ride on.

    python scripts/bench_structured.py                 # GPU for the device part, CPU otherwise
    python scripts/bench_structured.py --vocab 32000 --batches 8,64

Writes benchmarks/results/bench_structured.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import hf_reference as hf  # noqa: E402

from ray_attn.runtime.buffers import StepBuffers  # noqa: E402
from ray_attn.runtime.messages import SamplingInputs  # noqa: E402
from ray_attn.runtime.sampling import SamplingTensors, sample_on_device  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
PREFIX = '{"name": "Ada Lovelace", "age": 36, "tags": ["math'  # the states a row walks through


def step_reference_us() -> float | None:
    path = bl.RESULTS / "bench_step_overhead_8b.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    r = [x for x in rows if x["path"].startswith("in-process") and x["async_scheduling"]]
    return r[0]["step_us"] if r else None


def device_cost(batch: int, vocab: int, frac: float, temperature: float, dev: torch.device) -> float:
    g = int(batch * frac)
    words = (vocab + 31) // 32
    rng = np.random.default_rng(0)
    logits = torch.randn(batch, vocab, device=dev)
    bitmask = rng.integers(-2**31, 2**31, size=(g, words), dtype=np.int64).astype(np.int32)
    inputs = SamplingInputs(grammar_rows=np.arange(g, dtype=np.int32), grammar_bitmask=bitmask) if g else None
    temps = np.full(batch, temperature, np.float32)
    seeds, index = np.full(batch, -1, np.int64), np.zeros(batch, np.int32)
    buf = StepBuffers(dev)

    def one():
        buf.begin()
        st = SamplingTensors.stage(temps, seeds, index, dev, buf.put, inputs)
        buf.end()
        sample_on_device(logits, st)

    return bl.timeit(one, iters=20) * 1e6


def synthetic_vocab(vocab: int) -> list[bytes]:
    """Byte strings like a BPE vocabulary's: the 256 bytes, then 2-8 character pieces of JSON-ish text."""
    return hf.byte_vocab(vocab, alphabet='abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 {}[]":,._-', longest=8)


def driver_costs(batches: list[int], vocab: int) -> list[dict]:
    import xgrammar as xgr

    from ray_attn.structured_output import GrammarState, fill_bitmask

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(synthetic_vocab(vocab), xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    setup_s = time.perf_counter() - t0
    rows = []
    for batch in batches:
        for frac in (0.5, 1.0):
            g = int(batch * frac)
            states = []
            for i in range(g):  # rows spread over the states of one object
                s = GrammarState(xgr.GrammarMatcher(compiled), vocab)
                assert s.matcher.accept_string(PREFIX[: (i * 7) % len(PREFIX)])
                states.append(s)
            us = bl.host_timeit(lambda: fill_bitmask(states)) * 1e6
            rows.append(dict(part="driver fill", batch=batch, constrained=g, temperature=None, us=us,
                             vocab=vocab, setup_s=round(setup_s, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="64,256")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    dev = bl.device()
    ref = step_reference_us()
    rows = []
    for batch in batches:
        for temperature in (0.0, 1.0):
            base = device_cost(batch, args.vocab, 0.0, temperature, dev)
            for frac in (0.0, 0.5, 1.0):
                us = base if frac == 0 else device_cost(batch, args.vocab, frac, temperature, dev)
                rows.append(dict(part="device sample", batch=batch, constrained=int(batch * frac),
                                 temperature=temperature, us=us, added_us=us - base, vocab=args.vocab))
    try:
        rows += driver_costs(batches, args.vocab)
    except ImportError:
        print("xgrammar is not installed: the driver part is skipped")
    for r in rows:
        cost = r.get("added_us", r["us"])
        r["pct_of_8b_step_b64"] = None if ref is None else round(100 * cost / ref, 2)
    bl.print_table(rows, ["part", "batch", "constrained", "temperature", "us", "added_us", "pct_of_8b_step_b64"],
                   title=f"structured outputs per step ({dev}, vocab {args.vocab}; 8B step at b64: {ref} us)")
    print("saved", bl.save("bench_structured", rows, step_reference_us=ref, device=str(dev)))


if __name__ == "__main__":
    main()
