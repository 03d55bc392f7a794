#!/usr/bin/env python
"""Offline throughput, like ``vllm bench throughput``: every request given to the engine at once.

The engine runs in this process (TP ranks as Ray actors by default, ``--executor in_process``
for TP=1 without Ray); all requests are added, then the engine steps until each has finished --
``LLMEngine.generate``'s loop, stepped here so that the peak number of running requests can be
read between steps.  Generation ignores EOS (as vLLM's throughput benchmark does), so each
request makes exactly its output length.  Reports vLLM's keys (``elapsed_time``,
``num_requests``, ``total_num_tokens``, ``requests_per_second``, ``tokens_per_second``) plus
output tokens/s and the engine's counters: prefix-cache hits, cascade steps, preemptions.

    python scripts/bench_throughput.py --model-preset llama-3-8b --input-len 1024 --output-len 128 \\
        --num-prompts 1000 --output-json benchmarks/results/throughput.json
    python scripts/bench_throughput.py --model-preset llama-3-8b --dataset-name prefix_repetition \\
        --prefix-repetition-prefix-len 2048 --prefix-repetition-num-prefixes 8 --num-prompts 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ray_attn, from a checkout

from servebench.datasets import add_dataset_args, check_dataset_args, get_samples  # noqa: E402
from servebench.engine_transport import (  # noqa: E402
    add_engine_args,
    check_fits,
    engine_overrides,
    engine_stats,
    load_engine_config,
    make_engine,
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("engine")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-config", default=None,
                     help="EngineConfig JSON/YAML, Serve config YAML, or a model preset name")
    src.add_argument("--model-preset", default=None, help="a model preset (ray_attn.config.MODEL_PRESETS)")
    add_engine_args(g)
    add_dataset_args(p, names=("random", "prefix_repetition"))
    p.add_argument("--input-len", type=int, default=None, help="random: input tokens (= --random-input-len)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request, any dataset (sets --random-output-len and "
                        "--prefix-repetition-output-len)")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def resolve_lengths(args) -> None:
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.output_len


def run_engine(engine, requests, disable_tqdm: bool = False) -> dict:
    """Add every request, step until all have finished; the timings and what came back."""
    from tqdm.auto import tqdm

    from ray_attn.request import SamplingParams

    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")
    start = time.perf_counter()
    ids = [engine.add_request(r.prompt, SamplingParams(max_tokens=r.expected_output_len, temperature=0.0))
           for r in requests]
    live, peak_running, outputs = set(ids), 0, {}
    while live:
        engine.step()
        peak_running = max(peak_running, len(engine.running))
        done = [i for i in live if engine.requests[i].finished]
        for i in done:
            outputs[i] = engine.output(i)
            engine.release(i)
        live.difference_update(done)
        bar.update(len(done))
    engine.flush()  # the step still out under async scheduling belongs to this run's work
    elapsed = time.perf_counter() - start
    bar.close()
    return {"elapsed": elapsed, "outputs": [outputs[i] for i in ids], "peak_running": peak_running}


def throughput_result(requests, run: dict, stats: dict) -> dict:
    """vLLM's throughput keys (and ours) for a ``run_engine`` run, printed as vLLM prints them."""
    elapsed, outs = run["elapsed"], run["outputs"]
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(len(o.output_token_ids) for o in outs)
    errors = [o.error or o.finish_reason for o in outs if o.finish_reason not in ("length", "stop")]
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(requests) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    print(f"Peak running requests: {run['peak_running']}; preemptions: {stats['preemptions']}; "
          f"cascade steps: {stats['cascade_steps']} of {stats['steps']}; prefix-cache hit tokens: "
          f"{stats['prefix_cache_hit_tokens']}")
    if errors:
        print(f"{len(errors)} requests did not finish cleanly; first: {errors[0]}")
    return {
        "elapsed_time": elapsed, "num_requests": len(requests), "total_num_tokens": total,
        "requests_per_second": len(requests) / elapsed, "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "errors": errors, "peak_running_requests": run["peak_running"], "engine_stats": stats,
    }


def benchmark(args) -> dict:
    errs = check_dataset_args(args)
    for name in ("input_len", "output_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            errs.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if errs:
        raise ValueError("; ".join(errs))
    resolve_lengths(args)
    cfg = load_engine_config(args.engine_config or args.model_preset, engine_overrides(args))
    requests = get_samples(args, cfg.model.vocab_size)
    check_fits(cfg, requests)
    engine = make_engine(cfg, args.executor)
    try:
        run = run_engine(engine, requests, args.disable_tqdm)
        stats = engine_stats(engine)
    finally:
        engine.shutdown()
    result = throughput_result(requests, run, stats)
    result.update(backend="engine", executor=args.executor, dataset_name=args.dataset_name,
                  engine_config=cfg.model_dump(mode="json"), args=vars(args))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=float) + "\n")
        print(f"wrote {path}")
    return result


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        result = benchmark(args)
    except ValueError as e:
        p.error(str(e))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
