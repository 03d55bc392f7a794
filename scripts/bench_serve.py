#!/usr/bin/env python
"""Serving benchmark with the flags, metrics and JSON keys of ``vllm bench serve``.

Two backends drive the same workload (``scripts/servebench``):

  --backend openai  (default) POST /v1/completions with streaming to a running server -- our Serve
                    app or vLLM -- prompts sent as token-id lists, so no tokenizer is needed.
  --backend engine  an LLMEngine in this process behind the Serve app's EngineLoop, from
                    --engine-config (a JSON/YAML EngineConfig or Serve config, or a model preset
                    name): the engine's own timing, without HTTP (gpu_serving.py; on the
                    H200 box, gpu_http_serving.py measures the same workloads over HTTP).

Examples::

    serve run deploy/serve_config.yaml &
    python scripts/bench_serve.py --dataset-name random --random-input-len 256 \\
        --random-output-len 64 --num-prompts 200 --request-rate 8 --save-result
    vllm serve meta-llama/Meta-Llama-3-8B &        # the same workload against vLLM
    python scripts/bench_serve.py --model meta-llama/Meta-Llama-3-8B --vocab-size 128256 ...
    python scripts/bench_serve.py --backend engine --engine-config llama-3-8b --num-prompts 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ray_attn, from a checkout

import numpy as np  # noqa: E402

from servebench.datasets import add_dataset_args, check_dataset_args, get_samples  # noqa: E402
from servebench.driver import run_requests, warmup  # noqa: E402
from servebench.engine_transport import add_engine_args  # noqa: E402
from servebench.metrics import (  # noqa: E402
    benchmark_result,
    calculate_metrics,
    parse_goodput,
    parse_percentile_args,
)


class ReadyCheckFailed(RuntimeError):
    """The server never answered the first request successfully."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["openai", "engine"], default="openai",
                   help="openai: HTTP /v1/completions streaming; engine: LLMEngine in this process")
    p.add_argument("--label", default=None, help="prefix of the result file name (default: the backend)")
    g = p.add_argument_group("server (--backend openai)")
    g.add_argument("--base-url", default=None, help="server base URL (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="completions path")
    g.add_argument("--model", default=None, help=(
        "model name sent in each request (default: the first of GET /v1/models); with --backend "
        "engine and no --engine-config, a model preset name"))
    g.add_argument("--vocab-size", type=int, default=None, help=(
        "prompt token ids are drawn below it (default: vocab_size from GET /v1/models, else "
        "from our app's GET /stats; for the engine backend, the model config's)"))
    g.add_argument("--ready-check-timeout-sec", type=float, default=600,
                   help="send the first request until it succeeds, for at most this long; 0 skips")
    g.add_argument("--header", nargs="*", metavar="KEY=VALUE", default=None, help="extra HTTP headers")
    g.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body")
    g = p.add_argument_group("engine (--backend engine)")
    g.add_argument("--engine-config", default=None,
                   help="EngineConfig JSON/YAML, Serve config YAML, or a model preset name")
    add_engine_args(g)
    add_dataset_args(p)
    g = p.add_argument_group("traffic and report")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s; inf sends all at once, else Poisson (gamma with --burstiness)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 more uniform")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate to max_tokens past EOS (always on for --dataset-name random, as in vLLM)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:2000 (milliseconds)")
    g.add_argument("--percentile-metrics", default=None,
                   help="comma-separated of ttft,tpot,itl,e2el (default: all four)")
    g.add_argument("--metric-percentiles", default="99", help='comma-separated, e.g. "50,90,99"')
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=None, help="folder of the result JSON (default: .)")
    g.add_argument("--result-filename", default=None,
                   help="default: {label}-{rate}qps[-concurrency{n}]-{model}-{date}.json")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def check_args(args) -> list[str]:
    errs = check_dataset_args(args)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        errs.append(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        errs.append(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        errs.append(f"--burstiness must be > 0, got {args.burstiness}")
    if args.num_warmups < 0:
        errs.append(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.vocab_size is not None and args.vocab_size < 1:
        errs.append(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        errs.append("--extra-body must be a JSON object")
    for item in args.header or []:
        if "=" not in item:
            errs.append(f"--header: {item!r} is not KEY=VALUE")
    if args.backend == "engine" and not (args.engine_config or args.model):
        errs.append("--backend engine needs --engine-config (a file or a model preset) or --model PRESET")
    return errs


async def _open_http(args, run: dict):
    from servebench.openai_client import OpenAICompletionsTransport, server_info

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    info = await server_info(base) if args.model is None or args.vocab_size is None else {}
    model = args.model or info.get("id")
    vocab = args.vocab_size or info.get("vocab_size")
    if model is None:
        raise ValueError(f"--model: not given and GET {base}/v1/models named none")
    if vocab is None:
        raise ValueError(f"--vocab-size: not given and neither GET {base}/v1/models nor /stats has vocab_size")
    headers = dict(h.split("=", 1) for h in args.header or [])
    transport = OpenAICompletionsTransport(base + args.endpoint, model, args.ignore_eos, args.extra_body,
                                           headers)
    run.update(backend="openai", endpoint_type="openai", transport="http", base_url=base,
               endpoint=args.endpoint, model_id=model, server_info=info)
    return transport, int(vocab)


def _open_engine(args, run: dict, num_prompts: int, engine=None):
    from servebench.engine_transport import EngineTransport, engine_overrides, load_engine_config, make_engine

    spec = args.engine_config or args.model
    executor = args.executor
    cfg = load_engine_config(spec, engine_overrides(args)) if engine is None else engine.config
    if args.vocab_size is not None and args.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size} exceeds the model's {cfg.model.vocab_size}")
    engine = engine if engine is not None else make_engine(cfg, executor)
    transport = EngineTransport(engine, max(num_prompts, args.num_warmups, 1), args.ignore_eos)
    run.update(backend="engine", endpoint_type="engine", transport="in_process", executor=executor,
               model_id=args.model or Path(spec).stem, engine_config=cfg.model_dump(mode="json"))
    return transport, args.vocab_size or cfg.model.vocab_size


async def benchmark(args, engine=None) -> dict:
    """Run the benchmark; returns the result dict (vLLM's keys), printed and saved as asked.
    ``engine``: with ``--backend engine``, serve through this running engine instead of building
    one, and leave it running afterwards (``gpu_serving.py`` runs every workload through one)."""
    if engine is not None and args.backend != "engine":
        raise ValueError("an engine can be given with --backend engine only")
    errs = check_args(args)
    if errs:
        raise ValueError("; ".join(errs))
    goodput = parse_goodput(args.goodput)
    selected, percentiles = parse_percentile_args(args.percentile_metrics, args.metric_percentiles)
    if args.dataset_name == "random":
        args.ignore_eos = True  # random prompts would otherwise stop at whatever EOS they hit (vLLM does this too)
    run: dict = {}
    if args.backend == "openai":
        transport, vocab = await _open_http(args, run)
    else:
        transport, vocab = _open_engine(args, run, args.num_prompts, engine)
    engine_stats = None
    try:
        requests = get_samples(args, vocab)
        if args.backend == "engine":
            from servebench.engine_transport import check_fits

            check_fits(transport.engine.config, requests)
        elif args.ready_check_timeout_sec > 0:
            print("Starting initial single prompt test run...")
            first = await transport.ready(requests[0], args.ready_check_timeout_sec)
            if not first.success:
                raise ReadyCheckFailed(f"initial test run failed: {first.error}")
        if args.num_warmups:
            print(f"Warming up with {args.num_warmups} requests...")
            await warmup(transport.send, requests[0], args.num_warmups, args.max_concurrency)
        print(f"Traffic request rate: {args.request_rate}")
        dist = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {args.burstiness} ({dist})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        rng = np.random.default_rng([args.seed, 1])  # arrivals: apart from the prompts' stream
        outputs, duration = await run_requests(transport.send, requests, args.request_rate,
                                               args.burstiness, args.max_concurrency, rng,
                                               args.disable_tqdm)
        if args.backend == "engine":
            engine_stats = transport.stats()
    finally:
        if args.backend == "engine":
            transport.close(shutdown_engine=engine is None)
        else:
            await transport.close()
    metrics, output_lens = calculate_metrics(outputs, duration, percentiles, goodput)
    header = f"{run['backend']} ({run['transport']})"
    bench, table = benchmark_result(metrics, output_lens, outputs, duration, selected, goodput,
                                    args.request_rate, args.max_concurrency, header)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0]}")
    print(table)
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **run,
              "label": args.label, "tokenizer_id": None, "num_prompts": args.num_prompts,
              "dataset_name": args.dataset_name, "vocab_size": vocab,
              "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "goodput": goodput or None, **bench}
    if engine_stats is not None:
        result["engine_stats"] = engine_stats
    result["args"] = {k: (v if v != float("inf") else "inf") for k, v in vars(args).items()}
    if args.save_result:
        result["result_file"] = str(save(args, result))
        print(f"wrote {result['result_file']}")
    return result


def save(args, result: dict) -> Path:
    label = args.label or result["backend"]
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    model = str(result["model_id"]).split("/")[-1]
    name = args.result_filename or f"{label}-{args.request_rate}qps{conc}-{model}-{result['date']}.json"
    path = Path(args.result_dir or ".") / name
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result, default=float) + "\n")
    return path


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        asyncio.run(benchmark(args))
    except ValueError as e:
        p.error(str(e))
    except ReadyCheckFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
