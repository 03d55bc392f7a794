#!/usr/bin/env python
"""The serving suite: one engine per configuration, every workload through it, each against the
engine's own roofline for that workload (``servebench/roofline.py`` has the formula).

Per configuration (bf16 KV, fp8 KV; ``--tp 2`` on a two-GPU host) ONE engine is built -- Ray
actors, CUDA graphs, async scheduling, a compiled graph on GPUs, as the Serve app runs it,
``max_num_seqs=256``, ``max_num_batched_tokens=8192`` (``--max-num-seqs``,
``--max-num-batched-tokens``) -- and it runs, most wanted first (with ``--deadline-s`` the tail is
what gets skipped, marked so in the JSON):

  random_rate_inf            random 1024 in / 128 out x 1000, all at once (vllm bench serve)
  random_concurrency_1       random 1024/128 x 24, one in flight: ITL against the decode roofline
  offline                    random 1024/128 x 300 given to the engine at once (vllm bench throughput)
  chunked_prefill            4 prompts of 16000 tokens, 1 output token: prefill FLOP/s at 8k chunks
  decode_256x1k, decode_64x4k  16 decode steps at a fixed batch (bench_e2e's measure)
  kv_capacity                first TP=1 configuration only: 256 x (4096 + 128) (scripts/kv_capacity.py)
  random_rate_{4,16,64}      random 1024/128 at 4, 16, 64 req/s (Poisson), 10 s of arrivals
                             (40, 160 and, capped, 480 prompts: rate 64 saturates the engine)
  prefix_repetition_rate_inf 5 prefixes of 512 + 128-token suffixes, 128 out, x 300, at once
  random_rate_16_budget_B    first configuration only: random_rate_16 again with the scheduler's
                             token budget at each B of --budget-sweep (default 2048)
Every count scales with ``--scale``.
With ``--tp`` > 1, a TP=1 engine then runs decode_64x4k for the TP efficiency.

Before any engine starts, the device's copy rate and GEMM rate at the model's shapes are
measured in a child process (``servebench/device_rates.py``).  Serving workloads go through
``bench_serve.benchmark(args, engine=...)`` (the in-process engine transport: tokens timed as the
engine loop pushes them) and report vLLM's keys; the per-request lists are left out of the JSON.
Goals (each a ratio from this run): offline >= 85% of roofline; concurrency-1 median ITL within
10% of the batch-1 decode roofline; chunked prefill >= 70% of the GEMM rate; decode 256 x 1k >=
80% of the memory+compute roofline; TP=2 efficiency >= 85% at 64 x 4k.

    python scripts/gpu_serving.py                                  # one H200: bf16 and fp8 KV
    python scripts/gpu_serving.py --tp 2 --kv-dtypes auto          # two H200s
    python scripts/gpu_serving.py --preset tiny --device cpu --scale 0.01 --num-blocks 2048
    python scripts/gpu_serving.py --preset qwen3-30b-a3b       # MoE: the roofline counts the experts hit
Writes benchmarks/results/serving_h200{suffix}.json and .png (after every workload, so a run cut
short keeps what it measured; ``--mirror-dir`` copies them there too).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402
import bench_serve  # noqa: E402
from bench_throughput import run_engine, throughput_result  # noqa: E402
from kv_capacity import measure_capacity, print_capacity  # noqa: E402
from servebench import roofline as rl  # noqa: E402
from servebench.datasets import SampleRequest, get_samples  # noqa: E402
from servebench.device_rates import measure_in_child  # noqa: E402
from servebench.engine_transport import engine_stats, make_engine, stats_since  # noqa: E402
from servebench.serving_plot import plot_latency_vs_rate  # noqa: E402
from servebench.targets import GOALS, PUBLISHED, fp8_weights_goals, goals  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
RANDOM = ["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "128"]
PREFIX = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
          "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "5",
          "--prefix-repetition-output-len", "128"]
RATES = (4, 16, 64)
ARRIVAL_S = 10  # seconds of arrivals at each finite rate (rate 64 saturates the engine: capped at 480 prompts)
ENGINE_MIN_S = 120  # a later configuration starts only this long before the deadline: start-up + a workload
LISTS = ("input_lens", "output_lens", "ttfts", "itls", "errors")  # per-request: not kept


@dataclass
class Workload:
    name: str
    flags: list[str]
    num_prompts: int
    rate: float = float("inf")
    max_concurrency: int | None = None


def serving_workloads(scale: float) -> dict[str, Workload]:
    n = lambda k, least=2: max(least, round(k * scale))  # noqa: E731
    out = [Workload("random_rate_inf", RANDOM, n(1000)),
           Workload("random_concurrency_1", RANDOM, n(24), max_concurrency=1),
           Workload("prefix_repetition_rate_inf", PREFIX, n(300, 10))]
    out += [Workload(f"random_rate_{r}", RANDOM, n(min(r * ARRIVAL_S, 480)), r) for r in RATES]
    return {w.name: w for w in out}


def workload_seed(seed: int, key: str) -> int:
    """A seed of each workload's own: two workloads with the same prompts would find the first
    one's blocks in the prefix cache, and the second would be measured on cache hits.  The HTTP
    suite (``gpu_http_serving.py``) uses the same seeds, so both send the same prompts."""
    return seed * 1_000_003 + zlib.crc32(key.encode()) % 1_000_003


def args_for(w: Workload, preset: str, seed: int, backend: tuple[str, ...] = ("--backend", "engine")):
    argv = [*backend, "--model", preset, "--disable-tqdm", "--ignore-eos", "--seed", str(seed),
            "--num-prompts", str(w.num_prompts), "--request-rate", str(w.rate), *w.flags]
    if w.max_concurrency:
        argv += ["--max-concurrency", str(w.max_concurrency)]
    return bench_serve.parser().parse_args(argv)


class Suite:
    def __init__(self, args, rates: dict):
        self.args, self.rates = args, rates
        self.copy, self.gemm = rates["copy_Bps"], rates["gemm_flops"]
        self.path = Path(args.result_dir) / f"serving_h200{args.suffix}.json"
        # Not benchlib.machine(): it asks CUDA for the device's properties, and this process must
        # hold no CUDA context on the GPU its rank sizes the KV cache on (rates has the GPU's name).
        self.out = dict(date=datetime.date.today().isoformat(), host=platform.node(), cpus=os.cpu_count(),
                        preset=args.preset, tp=args.tp, scale=args.scale,
                        device_rates=rates, published=PUBLISHED, goals_wanted=GOALS, configs=[])
        self.t0 = time.perf_counter()

    def past_deadline(self, margin_s: float = 0.0) -> bool:
        """Whether ``--deadline-s`` (less ``margin_s``) has passed: later workloads are then marked
        skipped (in the JSON, never silently), so that a run with a hard time limit ends cleanly."""
        d = self.args.deadline_s
        return d is not None and time.perf_counter() - self.t0 > d - margin_s

    def save(self, final: bool = False) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.out, indent=1, default=float) + "\n")
        png = self.path.with_suffix(".png")
        if final or not self.args.final_plot_only:
            plot_latency_vs_rate(self.out["configs"], png, f"{self.args.preset}, TP={self.args.tp}")
        if self.args.mirror_dir:
            for p in (self.path, png):
                if p.exists():
                    shutil.copy(p, self.args.mirror_dir)

    # -- engines --------------------------------------------------------------------------------
    def engine(self, kv_dtype: str, tp: int, weights: str = "bf16"):
        from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

        a = self.args
        extra = dict(quantization="fp8") if weights == "fp8" else {}
        cfg = EngineConfig(model=ModelConfig.from_name(a.preset, **extra),
                           cache=CacheConfig(kv_cache_dtype=kv_dtype, num_blocks=a.num_blocks,
                                             block_size=a.block_size),
                           parallel=ParallelConfig(tensor_parallel_size=tp, device=a.device,
                                                   use_compiled_graph=a.device == "cuda" and a.executor == "ray",
                                                   cuda_graph_max_batch=a.cuda_graph_max_batch),
                           max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
        return make_engine(cfg, a.executor)

    def costs(self, engine) -> rl.ModelCosts:
        c = engine.config
        return rl.ModelCosts.from_config(c.model, c.parallel.tensor_parallel_size, c.cache.kv_cache_dtype)

    def gemm_rate(self, engine) -> float:
        """The GEMM rate the engine's weights can reach: FP8's (measured at the same shapes) for
        FP8 weights, where the device measured one."""
        fp8 = engine.config.model.quantization is not None and self.rates.get("fp8_gemm_flops")
        return self.rates["fp8_gemm_flops"] if fp8 else self.gemm

    # -- workloads --------------------------------------------------------------------------------
    def roofline(self, engine, prompts: list[list[int]], outs: list[int], concurrency=None, last_arrival=0.0):
        cfg = engine.config
        bs = cfg.cache.block_size
        longest = max(len(p) + o for p, o in zip(prompts, outs))
        kv_fit = engine.planner.pool.num_blocks // -(-longest // bs)
        batch = max(1, min(cfg.max_num_seqs, len(prompts), concurrency or len(prompts), kv_fit))
        return rl.workload_roofline(self.costs(engine), self.copy, self.gemm_rate(engine), [len(p) for p in prompts], outs,
                                    rl.computed_starts(prompts, bs), batch, last_arrival)

    def seed(self, key: str) -> int:
        return workload_seed(self.args.seed, key)

    def serve(self, engine, w: Workload, key: str | None = None) -> dict:
        args = args_for(w, self.args.preset, self.seed(key or w.name))
        r = asyncio.run(bench_serve.benchmark(args, engine=engine))
        samples = get_samples(args, engine.config.model.vocab_size)
        errors = [e for e in r["errors"] if e]
        rec = {k: v for k, v in r.items() if k not in LISTS + ("args", "engine_config")}
        rec.update(num_errors=len(errors), first_error=errors[0] if errors else None)
        last = w.num_prompts / w.rate if w.rate != float("inf") else 0.0
        # The workload's own lengths (EOS is ignored, so a request that completed made exactly
        # these; a failed one counts as asked, and its failure shows in num_errors).
        outs = [s.expected_output_len for s in samples]
        roof = self.roofline(engine, [s.prompt for s in samples], outs, w.max_concurrency, last)
        rec.update(roofline=roof, frac_of_roofline=roof["roofline_s"] / r["duration"])
        if w.max_concurrency == 1:
            c = self.costs(engine)
            itl = sum(rl.itl_roofline_s(c, self.copy, s.prompt_len, o) for s, o in zip(samples, outs))
            rec["itl_roofline_ms"] = itl / len(samples) * 1e3
            rec["median_itl_over_roofline"] = r["median_itl_ms"] / rec["itl_roofline_ms"]
            rec["ttft_roofline_ms"] = rl.prefill_flops(c, samples[0].prompt_len) / self.gemm_rate(engine) * 1e3
        return rec

    def offline(self, engine, w: Workload, name: str = "offline") -> dict:
        samples = get_samples(args_for(w, self.args.preset, self.seed(name)), engine.config.model.vocab_size)
        return self._offline(engine, samples, name)

    def _offline(self, engine, samples: list[SampleRequest], name: str) -> dict:
        base = engine_stats(engine)
        run = run_engine(engine, samples, disable_tqdm=True)
        r = throughput_result(samples, run, stats_since(engine_stats(engine), base))
        r["errors"] = len(r["errors"])
        roof = self.roofline(engine, [s.prompt for s in samples], [s.expected_output_len for s in samples])
        r.update(name=name, roofline=roof, frac_of_roofline=roof["roofline_s"] / r["elapsed_time"])
        return r

    def chunked_prefill(self, engine) -> dict:
        import numpy as np

        m = engine.config.model
        n, length = max(1, round(4 * self.args.scale)), min(16000, m.max_position_embeddings - 1)
        rng = np.random.default_rng(self.seed("chunked_prefill"))
        samples = [SampleRequest(rng.integers(0, m.vocab_size, length).tolist(), length, 1) for _ in range(n)]
        r = self._offline(engine, samples, "chunked_prefill")
        c = self.costs(engine)
        flops = sum(rl.prefill_flops(c, length) for _ in samples)
        st = r["engine_stats"]
        r.update(chunk_tokens=engine.config.max_num_batched_tokens, prompt_len=length,
                 prefill_flops=flops, achieved_flops=flops / r["elapsed_time"],
                 frac_of_gemm=flops / r["elapsed_time"] / self.gemm_rate(engine),
                 tokens_per_step=st["tokens_computed"] / max(st["steps"], 1))
        return r

    def decode(self, engine, batch: int, ctx: int, steps: int = 16) -> dict:
        import numpy as np

        from ray_attn.request import SamplingParams

        m = engine.config.model
        batch, ctx = max(2, round(batch * min(1.0, self.args.scale))), min(ctx, m.max_position_embeddings // 2)
        rng = np.random.default_rng(self.seed(f"decode_{batch}x{ctx}"))
        prompts = [rng.integers(0, m.vocab_size, ctx).tolist() for _ in range(batch)]
        sp = SamplingParams(max_tokens=min(2048, m.max_position_embeddings - ctx - 1), ignore_eos=True)
        ids = bl.start_decoding(engine, prompts, [sp] * batch)
        resident = len(engine.running)
        t0, n = time.perf_counter(), 0
        for _ in range(steps):
            n += len(engine.step())
        dt = time.perf_counter() - t0
        bl.end_requests(engine, ids)
        b = n / steps  # the batch that ran (fewer than asked when the cache holds fewer)
        c = self.costs(engine)
        kv = b * ctx * c.kv_bytes_per_token / self.copy
        mem = c.weight_bytes / self.copy + kv
        both = max(c.weight_bytes / self.copy, b * 2 * (c.layer_params + c.lm_head_params) / self.gemm_rate(engine)) + kv
        step = dt / steps
        return dict(batch=batch, ctx=ctx, resident=resident, decode_batch=b, tok_s=n / dt, step_ms=step * 1e3,
                    roofline_step_ms=mem * 1e3, frac_of_roofline=mem / step,
                    mem_compute_roofline_step_ms=both * 1e3, frac_of_mem_compute_roofline=both / step)

    # -- one configuration ------------------------------------------------------------------------
    def run_config(self, kv_dtype: str, first: bool, weights: str = "bf16") -> None:
        a = self.args
        name = ("fp8w_" if weights == "fp8" else "") + {"auto": "bf16"}.get(kv_dtype, kv_dtype) + \
            (f"_tp{a.tp}" if a.tp > 1 else "")
        if self.past_deadline(0.0 if first else ENGINE_MIN_S):
            self.out["configs"].append(dict(name=name, kv_cache_dtype=kv_dtype, tp=a.tp, workloads={},
                                            skipped=f"--deadline-s {a.deadline_s} passed"))
            self.save()
            print(f"=== {name}: skipped, past the deadline")
            return
        t0 = time.perf_counter()
        engine = self.engine(kv_dtype, a.tp, weights)
        conf = dict(name=name, kv_cache_dtype=kv_dtype, weights=weights, tp=a.tp, startup_s=time.perf_counter() - t0,
                    engine_config=engine.config.model_dump(mode="json"), device_info=engine.executor.infos,
                    num_blocks=engine.planner.pool.num_blocks, costs=self.costs(engine).as_dict(),
                    workloads={}, wall_s={})
        self.out["configs"].append(conf)
        self.save()
        print(f"=== {name}: engine up in {conf['startup_s']:.0f} s, {conf['num_blocks']} KV blocks")

        def step(key: str, fn):
            if a.only and key not in a.only:
                conf["workloads"][key] = dict(skipped="not in --only")
                return None
            if self.past_deadline():
                conf["workloads"][key] = dict(skipped=f"--deadline-s {a.deadline_s} passed")
                print(f"--- {name} {key}: skipped, past the deadline")
                return None
            t = time.perf_counter()
            res = fn()
            conf["workloads"][key] = res
            conf["wall_s"][key] = time.perf_counter() - t
            print(f"--- {name} {key}: {conf['wall_s'][key]:.1f} s")
            self.save()
            return res

        try:
            warm = Workload("warmup", RANDOM[:-1] + ["16"], max(2, round(32 * min(1.0, a.scale * 10))))
            asyncio.run(bench_serve.benchmark(args_for(warm, a.preset, self.seed("warmup")), engine=engine))
            # Most wanted first: under --deadline-s the tail is what gets skipped.
            works = serving_workloads(a.scale)
            for key in ("random_rate_inf", "random_concurrency_1"):
                step(key, lambda w=works[key]: self.serve(engine, w))
            step("offline", lambda: self.offline(engine, Workload("offline", RANDOM, max(2, round(300 * a.scale)))))
            step("chunked_prefill", lambda: self.chunked_prefill(engine))
            step("decode_256x1k", lambda: self.decode(engine, 256, 1024))
            step("decode_64x4k", lambda: self.decode(engine, 64, 4096))
            if first and a.tp == 1 and a.capacity:
                n_cap = max(2, round(256 * a.scale))
                out_len = a.capacity_output_len
                in_len = min(a.capacity_input_len, engine.config.model.max_position_embeddings - out_len - 1)
                step("kv_capacity", lambda: self.capacity(engine, n_cap, in_len, out_len))
            for key in [f"random_rate_{r}" for r in RATES] + ["prefix_repetition_rate_inf"]:
                step(key, lambda w=works[key]: self.serve(engine, w))
            if first and a.budget_sweep:
                sched = engine.scheduler
                full = sched.max_num_batched_tokens
                for budget in a.budget_sweep:
                    sched.max_num_batched_tokens = budget  # the scheduler reads it every step
                    try:
                        key = f"random_rate_16_budget_{budget}"
                        rec = step(key, lambda: self.serve(engine, works["random_rate_16"], key))
                    finally:
                        sched.max_num_batched_tokens = full
                    if rec:
                        rec["max_num_batched_tokens"] = budget
        finally:
            engine.shutdown()
        conf["goals"] = goals(conf["workloads"])
        if a.tp > 1 and a.tp1_baseline and "tok_s" in conf["workloads"].get("decode_64x4k", {}) \
                and not self.past_deadline(ENGINE_MIN_S / 2):
            base = self.engine(kv_dtype, 1)
            try:
                tp1 = self.decode(base, 64, 4096)
            finally:
                base.shutdown()
            eff = conf["workloads"]["decode_64x4k"]["tok_s"] / tp1["tok_s"] / a.tp
            conf["workloads"]["decode_64x4k_tp1"] = tp1
            conf["goals"]["tp_efficiency_64x4k"] = dict(value=eff, goal=GOALS["tp_efficiency_64x4k"],
                                                        met=eff >= GOALS["tp_efficiency_64x4k"])
        self.save()

    def capacity(self, engine, n: int, input_len: int, output_len: int = 128) -> dict:
        r = measure_capacity(engine, n, input_len, output_len, seed=self.seed("kv_capacity"))
        print_capacity(r)
        path = Path(self.args.result_dir) / "kv_capacity.json"
        path.write_text(json.dumps(r, indent=1, default=float) + "\n")
        if self.args.mirror_dir:
            shutil.copy(path, self.args.mirror_dir)
        return r


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help=(
        "model preset (default: llama-3-8b on GPU, tiny on CPU); MoE: qwen3-30b-a3b (one H200), llama-4-scout "
        "(--tp 4), and their CPU stand-ins tiny-qwen3-moe, tiny-llama4"))
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-dtypes", default="auto,fp8", help="comma-separated cache.kv_cache_dtype values, one engine each")
    p.add_argument("--weights", default="bf16", help="comma-separated bf16, fp8 (online FP8 weights, "
                   "quantization='fp8'): one engine per weights x KV dtype, in that order")
    p.add_argument("--executor", choices=["ray", "in_process"], default="ray")
    p.add_argument("--num-blocks", type=int, default=None, help="fix the KV cache (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=16, help="KV page size in tokens (FA3 takes any)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="the engine's max_num_seqs (vLLM's default on H100/H200-class GPUs is 1024)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the engine's token budget a step (vLLM's offline default on H100/H200-class GPUs is 16384)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=256,
                   help="the largest decode batch replayed from a CUDA graph (vLLM captures up to 512)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt count (and decode batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated workload names to run; the rest are marked skipped")
    p.add_argument("--no-capacity", dest="capacity", action="store_false", help="skip kv_capacity")
    p.add_argument("--capacity-input-len", type=int, default=4096,
                   help="kv_capacity's prompt length (at most the model's context less the output)")
    p.add_argument("--capacity-output-len", type=int, default=128, help="kv_capacity's output tokens")
    p.add_argument("--budget-sweep", default="2048",
                   help="token budgets for the random_rate_16 sweep on the first config ('' for none)")
    p.add_argument("--no-tp1-baseline", dest="tp1_baseline", action="store_false",
                   help="with --tp > 1: skip the TP=1 engine that decode_64x4k's efficiency needs")
    p.add_argument("--suffix", default=None, help="result file suffix (default: _tp{N} for TP > 1, _cpu on CPU, "
                   "after _{preset} for presets other than llama-3-8b / tiny)")
    p.add_argument("--result-dir", default=str(RESULTS))
    p.add_argument("--mirror-dir", default=None, help="also copy the results here after each workload ($OUT)")
    p.add_argument("--final-plot-only", action="store_true",
                   help="draw the .png once, at the end, not after every workload (the JSON is still saved after each)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no workload after this many seconds (the rest are marked skipped)")
    return p


def main(argv=None) -> int:
    import torch

    p = parser()
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.preset = a.preset or ("llama-3-8b" if a.device == "cuda" else "tiny")
    from ray_attn.config import MODEL_PRESETS

    if a.preset not in MODEL_PRESETS:
        p.error(f"--preset {a.preset!r}: choose one of {sorted(MODEL_PRESETS)}")
    a.only = set(a.only.split(",")) if a.only else None
    try:
        a.budget_sweep = [int(b) for b in a.budget_sweep.split(",") if b.strip()]
    except ValueError:
        p.error(f"--budget-sweep: {a.budget_sweep!r} is not a comma-separated list of integers")
    if a.suffix is None:
        a.suffix = f"_tp{a.tp}" if a.tp > 1 else ("_cpu" if a.device == "cpu" else "")
        if a.preset not in (None, "llama-3-8b", "tiny"):  # another model's run keeps the default's file
            a.suffix = f"_{a.preset}{a.suffix}"
    if a.tp < 1 or not a.scale > 0 or any(b < 1 for b in a.budget_sweep):
        p.error("--tp must be >= 1, --scale > 0 and every --budget-sweep value >= 1")
    if a.capacity_input_len < 1 or a.capacity_output_len < 1:
        p.error("--capacity-input-len and --capacity-output-len must be >= 1")
    if a.tp > 1 and a.executor != "ray":
        p.error("--tp > 1 needs --executor ray")
    dtypes = [d for d in a.kv_dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("auto", "fp8", "fp8_e4m3")]
    if bad or not dtypes:
        p.error(f"--kv-dtypes: {bad or a.kv_dtypes!r}; choose from auto, fp8, fp8_e4m3")
    weights = [w for w in a.weights.split(",") if w]
    if not weights or set(weights) - {"bf16", "fp8"}:
        p.error(f"--weights: {a.weights!r}; choose from bf16, fp8")
    from ray_attn.config import ModelConfig

    model = ModelConfig.from_name(a.preset)
    gpu = a.device == "cuda"
    shapes = rl.gemm_shapes(model, a.tp, 8192 if gpu else 1024)
    rates = measure_in_child(a.device, shapes, 1 << 30 if gpu else 1 << 24, model.dtype)
    print(f"copy {rates['copy_Bps'] / 1e9:,.0f} GB/s, GEMM {rates['gemm_flops'] / 1e12:,.1f} TFLOP/s at the "
          f"model's shapes (square: {rates['square_gemm_flops'] / 1e12:,.1f})")
    suite = Suite(a, rates)
    t0 = time.perf_counter()
    for i, (wt, d) in enumerate((wt, d) for wt in weights for d in dtypes):
        suite.run_config(d, first=i == 0, weights=wt)
    suite.out["fp8_weights_goals"] = fp8_weights_goals(suite.out["configs"])
    suite.out["total_s"] = time.perf_counter() - t0
    suite.save(final=True)
    for conf in suite.out["configs"]:
        for k, g in conf.get("goals", {}).items():
            print(f"{conf['name']:>10} {k:<45} {g['value']:.3f} (goal {g['goal']}) {'met' if g['met'] else 'MISSED'}")
    for name, gs in suite.out["fp8_weights_goals"].items():
        for k, g in gs.items():
            print(f"{name:>10} {k:<45} {g['value']:.3f} (goal {g['goal']}) {'met' if g['met'] else 'MISSED'}")
    print(f"wrote {suite.path} in {suite.out['total_s']:.0f} s")
    return 0 if all(not w.get("num_errors") for c in suite.out["configs"] for w in c["workloads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
