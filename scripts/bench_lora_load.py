"""What loading an adapter costs the requests already streaming: their ITL p99 with and without loads.

Issue 41: loading an adapter while 32 clients stream adds no more than one step's delay to their
ITL p99.  ``--clients`` requests decode on one engine (base model), every step timed -- each step
is one token of every stream, so a step's time is their ITL.  Every ``--load-every`` steps a new
request arrives: in the control run under an adapter already in its slot (the same LoRA work, no
load), in the load run under an adapter the engine has never seen (its own folder, so it is read
from disk); a third run, arrivals under the base model, shows what the adapters' compute adds.  What the engine thread does for
it sits inside the timed step, as in the Serve loop: ``add_lora`` (a check the handler's thread
already made, as Serve's handler does), ``add_request``, and the steps: the one that asks the
ranks to read the adapter on their prefetch threads, and the one that copies it into a free slot
and runs the new request's prefill -- the same prefill the control run has.  The adapters are PEFT folders of
random A, B on all seven target modules (``bench_lora.write_adapter``).

Reported: the p50 and p99 of the streams' ITL in both runs, the step of the control run's median
as "one step", and whether p99(load) <= p99(control) + one step.

    python scripts/bench_lora_load.py --checkpoint smollm2 --device cpu     # SmolLM2 on CPU
    python scripts/bench_lora_load.py                                       # H200: llama-3-8b bf16
    python scripts/bench_lora_load.py --preset tiny --device cpu --clients 4 --steps 12 --load-every 3   # its test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import benchlib as bl  # noqa: E402
from bench_lora import write_adapter  # noqa: E402
from ray_attn.config import MODEL_PRESETS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from ray_attn.lora import LoRAConfig, LoRARequest  # noqa: E402
from ray_attn.lora.peft_format import check_adapter  # noqa: E402

WARMUP = 3  # steps before timing: the streams' prefill and the first decode steps


def streaming_run(engine, sync, clients: int, steps: int, load_every: int, arrivals: list, prompt_len: int,
                  rng) -> tuple[list[float], list[int]]:
    """Per-step seconds over ``steps`` decode steps of ``clients`` streams; every ``load_every``
    steps the next of ``arrivals`` (a LoRARequest, or None: the base model) comes in."""
    from ray_attn.engine import SamplingParams

    vocab = engine.config.model.vocab_size
    prompt = lambda: rng.integers(0, vocab, prompt_len).tolist()  # noqa: E731
    streams = [engine.add_request(prompt(), SamplingParams(max_tokens=steps + WARMUP + 2, ignore_eos=True))
               for _ in range(clients)]
    for _ in range(WARMUP):
        engine.step()
    times, arrived_at, pending = [], [], list(arrivals)
    starts = []  # perf_counter at each timed step's start (to place the ranks' adapter reads)
    # The Serve handler checks an arriving adapter's folder on its own thread before the request
    # reaches the engine thread (serve/lora_adapters.py), whose add_lora then finds it checked:
    # a checker thread plays the handler, from half an interval before the arrival (apart from
    # the steps where the ranks read and load the last adapter, so that ``slowest`` tells the
    # two apart; a check still running at the arrival is waited for outside the timed step).
    checker = ThreadPoolExecutor(1, thread_name_prefix="handler")
    checks = {}
    cfg = engine.config
    for i in range(steps):
        if load_every and i % load_every == load_every // 2 and pending and pending[0] is not None:
            lr = pending[0]
            checks[id(lr)] = checker.submit(check_adapter, lr.lora_path, lr.lora_name, cfg.model,
                                            cfg.lora_config.max_lora_rank)
        due = load_every and i % load_every == load_every - 1 and pending
        if due and pending[0] is not None:
            checks.pop(id(pending[0])).result()
        t0 = time.perf_counter()
        starts.append(t0)
        if due:
            lr = pending.pop(0)
            if lr is not None:
                engine.add_lora(lr)
            engine.add_request(prompt(), SamplingParams(max_tokens=2, ignore_eos=True), lora_request=lr)
            arrived_at.append(i)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    checker.shutdown()
    for rid in streams:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return times, arrived_at, starts


def summary(run: tuple[list[float], list[int], list[float]], reads=(), trace=()) -> dict:
    """p50/p99/max of a run's steps (``streaming_run``'s), and its three slowest with how many
    steps after the last arrival each came (0: the arrival's own step) -- where a load's cost
    lands -- which of ``reads`` (``RankLoRA.reads``) overlapped them, and what the step's own
    thread did for adapters in them (``RankLoRA.trace``: slot loads, waits for a read)."""
    times, arrived_at, starts = run
    ms = np.array(times) * 1e3

    def overlap(i, spans):  # [ms of the step inside each span, its label] for the spans within step i
        t0, t1 = starts[i], starts[i] + times[i]
        return [[round((min(t1, e) - max(t0, b)) * 1e3, 1), label] for label, b, e in spans if b < t1 and e > t0]

    read_spans = [(th, b, e) for _, th, b, e in reads]
    own_spans = [(f"{what} {list(ids)}", b, e) for what, ids, b, e in trace]
    slowest = [dict(step=int(i), ms=round(float(ms[i]), 2),
                    after_arrival=int(i - max((a for a in arrived_at if a <= i), default=-10 ** 6)),
                    reading=overlap(i, read_spans), rank_work=overlap(i, own_spans))
               for i in np.argsort(ms)[::-1][:5]]
    durations = [round((e - b) * 1e3, 1) for _, _, b, e in reads]
    return dict(steps=len(ms), p50_ms=round(float(np.percentile(ms, 50)), 3), p99_ms=round(float(np.percentile(ms, 99)), 3),
                max_ms=round(float(ms.max()), 3), arrivals=len(arrived_at), slowest=slowest,
                read_ms=dict(n=len(durations), p50=float(np.median(durations)), max=max(durations)) if durations else None)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3-8b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--checkpoint", default=None, help='a checkpoint instead of --preset ("smollm2": the embedded GGUF)')
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps a run")
    ap.add_argument("--load-every", type=int, default=10, help="steps between two arrivals (loads)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4, help="device slots (loads evict the least recent)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--json", default=str(bl.RESULTS / "bench_lora_load.json"))
    a = ap.parse_args(argv)
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.checkpoint:
        from ray_attn.presets import default_gguf

        source = dict(checkpoint=str(default_gguf()) if a.checkpoint == "smollm2" else a.checkpoint)
    else:
        source = dict(model=ModelConfig(**(MODEL_PRESETS[a.preset] | {"dtype": "bfloat16" if cuda else "float32"})))
    ctx = a.prompt_len + a.steps + WARMUP + 8
    cfg = EngineConfig(**source, cache=CacheConfig(num_blocks=(a.clients + 4) * -(-ctx // 16) + 64, enable_prefix_caching=False),
                       parallel=ParallelConfig(device="cuda" if cuda else "cpu", kernel="auto" if cuda else "torch"),
                       lora_config=LoRAConfig(max_loras=a.max_loras, max_lora_rank=a.rank, max_cpu_loras=a.max_loras),
                       max_num_seqs=a.clients + 4, max_num_batched_tokens=max(2048, a.prompt_len * 2))
    engine = LLMEngine(cfg, InProcessExecutor(cfg))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = engine.config.model
    n_loads = a.steps // max(a.load_every, 1)
    rng = np.random.default_rng(0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            adapters = [LoRARequest(f"load{i}", i + 1, write_adapter(f"{tmp}/a{i}", model, a.rank, i))
                        for i in range(n_loads)]
            streaming_run(engine, sync, min(a.clients, 4), 6, 0, [], a.prompt_len, rng)  # warm-up: compile, capture
            base = streaming_run(engine, sync, a.clients, a.steps, a.load_every, [None] * n_loads, a.prompt_len, rng)
            resident = LoRARequest("resident", n_loads + 1, write_adapter(f"{tmp}/resident", model, a.rank, 999))
            engine.add_lora(resident)  # read, and in its slot (from idle: in the step that admits it)
            engine.generate([rng.integers(0, model.vocab_size, a.prompt_len).tolist()],
                            SamplingParams(max_tokens=2, ignore_eos=True), lora_request=resident)
            loads0 = engine.lora.num_loads
            control = streaming_run(engine, sync, a.clients, a.steps, a.load_every, [resident] * n_loads,
                                       a.prompt_len, rng)
            if engine.lora.num_loads != loads0:
                raise RuntimeError("the resident adapter was loaded again: the control run is not load-free")
            rank = getattr(getattr(engine.executor, "worker", None), "lora", None)
            if rank is not None:
                rank.reads.clear()
                rank.trace.clear()
            loaded = streaming_run(engine, sync, a.clients, a.steps, a.load_every, adapters, a.prompt_len, rng)
            reads = list(rank.reads) if rank is not None else []
            trace = list(rank.trace) if rank is not None else []
            slot_loads = engine.lora.num_loads - loads0
    finally:
        info = engine.executor.infos[0]
        engine.shutdown()
    c, lo, b = summary(control), summary(loaded, reads, trace), summary(base)
    arrived = lo["arrivals"]
    one_step = c["p50_ms"]
    out = dict(machine=bl.machine(), preset=a.preset, checkpoint=a.checkpoint, kernel=info.get("kernel"),
               cuda_graphs=info.get("cuda_graphs"), clients=a.clients, steps=a.steps, load_every=a.load_every,
               rank=a.rank, max_loras=a.max_loras, adapters_loaded=arrived, slot_loads=slot_loads,
               base_model_arrivals=b, control=c, with_loads=lo, one_step_ms=one_step, p99_added_ms=round(lo["p99_ms"] - c["p99_ms"], 3),
               goal_met=bool(lo["p99_ms"] <= c["p99_ms"] + one_step))
    print(f"{a.clients} streams, {a.steps} steps, an arrival every {a.load_every}: ITL p50 / p99 {b['p50_ms']:.1f} / "
          f"{b['p99_ms']:.1f} ms with base-model arrivals, {c['p50_ms']:.1f} / {c['p99_ms']:.1f} ms with arrivals "
          f"under a resident adapter (no loads), {lo['p50_ms']:.1f} / {lo['p99_ms']:.1f} ms with {arrived} adapters "
          f"loaded ({slot_loads} slot loads); p99 +{out['p99_added_ms']:.1f} ms against one step of "
          f"{one_step:.1f} ms: goal {'met' if out['goal_met'] else 'NOT met'}")
    if a.json:
        bl.write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
