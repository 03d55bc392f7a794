"""Structured outputs' cost per decode step: the token bitmask on the device, its fill on rank 0,
and the whole engine step, at batch 64 and 256 with all rows constrained, half, and none.

- device: ``SamplingTensors.stage`` (the bitmask's pinned, non-blocking copy) + ``sample_on_device``
  over [batch, vocab] float32 logits, greedy and sampled (on a GPU the mask is one Triton kernel);
  the cost is the time above the same step with no constrained row.
- compile and fill, per grammar backend (``--backends``: xgrammar, guidance): the schema's compile
  on a fresh compiler, and ``structured_output.fill_bitmask`` for the constrained rows (one batch
  call into the backend, what rank 0 runs while the step's forward is on the GPU), JSON-schema
  matchers on a synthetic 128k vocabulary, in the states a short JSON object passes through.
- engine: ``LLMEngine.step`` in one process (``--model``, Llama-3-8B shape on a GPU) decoding
  ``batch`` requests, the constrained ones under a JSON schema (an array of at least 50 objects,
  so that they keep going), with async scheduling: the step time against the same batch unconstrained,
  and the tokens each step gave (every row, every step).

The device and fill parts are also put against a decode step of Llama-3-8B shape at batch 64 (5.59
ms on the H200 with async scheduling: benchmarks/results/bench_step_overhead_8b.json).

    python scripts/bench_structured.py                 # GPU for the device part, CPU otherwise
    python scripts/bench_structured.py --vocab 32000 --batches 8,64 --model one-layer

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

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402
from ray_attn.runtime import InProcessExecutor  # noqa: E402
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


def device_cost(batch: int, vocab: int, frac: float, temperature: float, dev: torch.device) -> tuple[float, float]:
    """(GPU seconds of ``sample_on_device``, host seconds of staging the bitmask): the first with
    the inputs already on the device, calls back to back as in a decode loop; the second is the
    pinned copy rank 0 makes once the mask is filled (it runs while the forward is on the GPU)."""
    g = int(batch * frac)
    words = (vocab + 31) // 32
    rng = np.random.default_rng(0)
    logits = torch.randn(batch, vocab, device=dev)
    bitmask = rng.integers(-2**31, 2**31, size=(g, words), dtype=np.int64).astype(np.int32)
    inputs = SamplingInputs(grammar_rows=np.arange(g, dtype=np.int32), grammar_bitmask=bitmask) if g else None
    temps = np.full(batch, temperature, np.float32)
    seeds, index = np.full(batch, -1, np.int64), np.zeros(batch, np.int32)
    buf = StepBuffers(dev)
    st = SamplingTensors.stage(temps, seeds, index, dev, buf.put, inputs)
    gpu = bl.timeit(lambda: sample_on_device(logits, st), iters=20)

    def put():
        buf.begin()
        buf.put("grammar_bitmask", bitmask)
        buf.end()

    return gpu, (bl.host_timeit(put) if g else 0.0)


def tekken_vocab(path: str) -> list[bytes]:
    """A real 131k BPE vocabulary: Mistral's Tekken tokenizer file (``tekken_240911.json`` in the
    mistral_common package, or a gzip of it), its 1,000 special tokens as empty strings (what
    xgrammar takes for special)."""
    import base64
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        d = json.load(f)
    c = d["config"]
    n = c["default_vocab_size"] - c["default_num_special_tokens"]
    return [b""] * c["default_num_special_tokens"] + [base64.b64decode(t["token_bytes"]) for t in d["vocab"][:n]]


def synthetic_vocab(vocab: int) -> list[bytes]:
    """Byte strings like a BPE vocabulary's: the 256 bytes, then 2-8 character pieces of JSON-ish text."""
    return hf.byte_vocab(vocab, alphabet='abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 {}[]":,._-', longest=8)


def _compiler(vocab: int, pieces: list[bytes], backend: str):
    import xgrammar as xgr

    from ray_attn.structured_output import GrammarCompiler

    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[0])
    return GrammarCompiler(None, vocab, tokenizer_info=info, backend=backend)


def driver_costs(batches: list[int], vocab: int, pieces: list[bytes], backend: str) -> list[dict]:
    """Compiling SCHEMA (a fresh compiler: the vocabulary's tables, then the grammar) and
    ``fill_bitmask`` over rows in the states of its first object, for one backend."""
    from ray_attn.grammar_backends import _ByteVocab
    from ray_attn.structured_output import StructuredOutputsParams, fill_bitmask

    t0 = time.perf_counter()
    compiler = _compiler(vocab, pieces, backend)
    tables_s = time.perf_counter() - t0
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    compile_s = time.perf_counter() - t0
    encode = _ByteVocab(pieces, [0], [])  # PREFIX's bytes as tokens, accepted by either backend
    rows = [dict(part="compile", backend=backend, us=compile_s * 1e6, tables_s=round(tables_s, 2), vocab=vocab)]
    for batch in batches:
        for frac in (0.5, 1.0):
            g = int(batch * frac)
            states = []
            for i in range(g):  # rows spread over the states of one object
                s = compiler.matcher(compiled, spec)
                assert all(s.accept(t) for t in encode(PREFIX[: (i * 7) % len(PREFIX)]))
                states.append(s)
            us = bl.host_timeit(lambda: fill_bitmask(states)) * 1e6
            rows.append(dict(part="rank 0 fill", backend=backend, batch=batch, constrained=g, temperature=None,
                             us=us, vocab=vocab))
    return rows


# Objects in an array of at least 50: no row can finish within the timed steps, so the batch
# stays whole (an open array would let the random model close it and leave the batch)
ENGINE_SCHEMA = {"type": "object", "required": ["notes"], "properties": {"notes": {
    "type": "array", "minItems": 50, "items": {
        "type": "object", "required": ["title", "score"],
        "properties": {"title": {"type": "string"}, "score": {"type": "integer"}}}}}}


def engine_costs(batches: list[int], vocab: int, pieces: list[bytes], model: str, steps: int,
                 dev: torch.device, executor: str, backend: str) -> list[dict]:
    """Median ``LLMEngine.step`` time decoding each batch with none, half and all rows
    constrained (async scheduling; the rank in this process, or a Ray actor as deployments run
    it, where rank 0's fill runs beside the driver's planning), and the tokens a step gave per row."""
    from ray_attn.structured_output import StructuredOutputsParams

    mc = ModelConfig.from_name(model, vocab_size=vocab, dtype="bfloat16" if dev.type == "cuda" else "float32")
    cfg = EngineConfig(model=mc, cache=CacheConfig(num_blocks=max(batches) * 8 + 64, block_size=64),
                       parallel=ParallelConfig(device=dev.type), max_num_seqs=max(batches),
                       max_num_batched_tokens=16384, async_scheduling=True)
    if executor == "ray":
        import ray

        ray.init(address="local", num_gpus=1 if dev.type == "cuda" else 0, include_dashboard=False)
    eng = LLMEngine(cfg, InProcessExecutor(cfg) if executor == "inprocess" else None)
    eng.grammar_compiler = _compiler(vocab, pieces, backend)
    spec = StructuredOutputsParams(json=json.dumps(ENGINE_SCHEMA))
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        base = None
        for frac in (0.0, 0.5, 1.0):
            g = int(batch * frac)
            params = [SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=1.0, seed=i,
                                     structured_outputs=spec if i < g else None) for i in range(batch)]
            ids = bl.start_decoding(eng, [rng.integers(1, vocab, 64).tolist() for _ in range(batch)], params)
            for _ in range(5):  # warm-up
                eng.step()
            times, tokens, parts = [], 0, {"call": [], "worker": [], "grammar": []}
            call = eng.executor.step

            def timed_call(s):  # the rank's answer carries its own times (worker_s, grammar_s)
                t0 = time.perf_counter()
                out = call(s)
                parts["call"].append(time.perf_counter() - t0)
                for k in ("worker", "grammar"):
                    parts[k].append(out.timings.get(f"{k}_s", 0.0) if out is not None else 0.0)
                return out

            eng.executor.step = timed_call
            for _ in range(steps):
                t0 = time.perf_counter()
                tokens += len(eng.step())
                times.append(time.perf_counter() - t0)
            eng.executor.step = call
            bl.end_requests(eng, ids)
            us = float(np.median(times) * 1e6)
            med = {f"{k}_us": round(float(np.median(v)) * 1e6, 1) for k, v in parts.items()}
            base = us if base is None else base
            rows.append(dict(part="engine step", batch=batch, constrained=g, temperature=1.0, us=us,
                             added_us=us - base, pct_of_own_step=round(100 * (us - base) / base, 2),
                             tokens_per_row_step=round(tokens / (steps * batch), 3), vocab=vocab, model=model,
                             executor=executor, backend=backend, **med))
    eng.shutdown()
    if executor == "ray":
        ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--model", default=None, help="engine part: a preset (default llama-3-8b on a GPU, "
                    "one-layer on CPU); 'none' skips it")
    ap.add_argument("--steps", type=int, default=50, help="engine part: timed steps per point")
    ap.add_argument("--name", default="bench_structured", help="result file name in benchmarks/results")
    ap.add_argument("--executor", default="inprocess,ray", help="engine part: inprocess, ray or both")
    ap.add_argument("--backends", default="xgrammar,guidance", help="grammar backends of the fill, "
                    "compile and engine parts")
    ap.add_argument("--tekken", default=None, help="Mistral's tekken_240911.json (or .json.gz) for a real "
                    "131k vocabulary; default: a synthetic JSON-ish one of --vocab pieces")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    dev = bl.device()
    ref = step_reference_us()
    rows = []
    pieces = tekken_vocab(args.tekken) if args.tekken else synthetic_vocab(args.vocab)
    vocab = len(pieces)
    for batch in batches:
        for temperature in (0.0, 1.0):
            base = device_cost(batch, vocab, 0.0, temperature, dev)[0] * 1e6
            for frac in (0.0, 0.5, 1.0):
                gpu, put = device_cost(batch, vocab, frac, temperature, dev) if frac else (base / 1e6, 0.0)
                rows.append(dict(part="device sample", batch=batch, constrained=int(batch * frac),
                                 temperature=temperature, us=gpu * 1e6, added_us=gpu * 1e6 - base, vocab=vocab))
                if frac and temperature == 0:
                    rows.append(dict(part="bitmask put", batch=batch, constrained=int(batch * frac),
                                     temperature=None, us=put * 1e6, vocab=vocab))
    backends = args.backends.split(",")
    for backend in backends:
        rows += driver_costs(batches, vocab, pieces, backend)
    model = args.model or ("llama-3-8b" if dev.type == "cuda" else "one-layer")
    if model != "none":
        for executor in args.executor.split(","):
            for backend in backends:
                rows += engine_costs(batches, vocab, pieces, model, args.steps, dev, executor, backend)
    for r in rows:
        cost = r.get("added_us", r["us"])
        if r["part"] != "engine step":
            r["pct_of_8b_step_b64"] = None if ref is None else round(100 * cost / ref, 2)
    bl.print_table(rows, ["part", "backend", "executor", "batch", "constrained", "temperature", "us", "added_us",
                          "pct_of_8b_step_b64", "pct_of_own_step", "tokens_per_row_step", "call_us", "worker_us",
                          "grammar_us"],
                   title=f"structured outputs per step ({dev}, vocab {vocab}; 8B step at b64: {ref} us)")
    print("saved", bl.save(args.name, rows, step_reference_us=ref, device=str(dev),
                           vocabulary="tekken_240911" if args.tekken else "synthetic"))


if __name__ == "__main__":
    main()
