"""``ray-attn``: the main job (``demo``) and small utilities.

``ray-attn serve`` is the deployment layer's own command (``ray_attn.serve.cli``): this module,
the entry point, is the one library module that reaches into ``ray_attn.serve``."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ray_attn.serve import cli as serve_cli


def demo_config(tp: int, device: str, compiled: bool, num_blocks: int | None):
    from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    # A small Llama 4 (random weights): chunked-local and NoPE layers, MoE on alternate layers.
    model = ModelConfig.from_name("demo-llama4")
    return EngineConfig(model=model, cache=CacheConfig(num_blocks=num_blocks, block_size=16),
                        parallel=ParallelConfig(tensor_parallel_size=tp, device=device,
                                                use_compiled_graph=compiled),
                        max_num_seqs=64, max_num_batched_tokens=1024)


def demo_workload(num_groups: int, samples: int, prefix_len: int, num_long: int, long_len: int,
                  max_tokens: int, vocab: int, seed: int = 0):
    """Shared prompts (groups x samples, as in RL rollouts) plus a few prompts longer than a chunk.

    The long prompts stop early: while they run, chunked layers need virtual batches (local
    attention) and cascade is refused; once they finish, every request sits in one chunk and the
    shared prefixes can cascade."""
    from ray_attn.engine import SamplingParams

    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for g in range(num_groups):
        prefix = rng.integers(0, vocab, prefix_len).tolist()
        for s in range(samples):
            prompts.append(prefix + [int(rng.integers(0, vocab))])
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 * g + s))
    for _ in range(num_long):
        prompts.append(rng.integers(0, vocab, long_len).tolist())
        params.append(SamplingParams(max_tokens=max(2, max_tokens // 6)))
    return prompts, params


def run_demo(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    console = Console()
    cfg = demo_config(args.tp, args.device, args.compiled, args.num_blocks)
    prompts, params = demo_workload(args.groups, args.samples, args.prefix_len, args.long, 1100,
                                    args.max_tokens, cfg.model.vocab_size)
    console.print(f"[bold]ray_attn demo[/]: {len(prompts)} requests, TP={args.tp}, "
                  f"{cfg.model.num_hidden_layers} layers {cfg.model.layer_kinds()}")
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    stats, pstats = engine.stats, engine.planner.stats()
    kernel, infos = engine.executor.kernel_name, engine.executor.infos
    engine.shutdown()

    console.print("checking against a single-process (no Ray, TP=1) run ...")
    single_cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
        update={"tensor_parallel_size": 1, "use_compiled_graph": False})})
    ref_engine = LLMEngine(single_cfg, InProcessExecutor(single_cfg))
    ref = ref_engine.generate(prompts, params)
    ref_engine.shutdown()
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(outs, ref))

    table = Table(title="ray_attn demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    gen = stats.tokens_generated
    rows = [
        ("device / kernel", f"{infos[0]['name']} / {kernel}"),
        ("tensor-parallel ranks", str(args.tp)),
        ("step path", "compiled graph" if args.compiled else "actor call"),
        ("requests", str(len(prompts))),
        ("tokens generated", str(gen)),
        ("tokens computed (prefill + decode)", str(stats.tokens_computed)),
        ("decode tokens/s", f"{gen / wall:,.1f}"),
        ("engine steps", str(stats.steps)),
        ("prefix-cache hit tokens", f"{pstats['prefix_cache_hits']} / {pstats['prefix_cache_queries']}"),
        ("steps with cascade attention", f"{stats.cascade_steps} ({stats.cascade_steps / max(stats.steps, 1):.0%})"),
        ("steps with local attention", f"{stats.local_steps} ({stats.local_steps / max(stats.steps, 1):.0%})"),
        ("preemptions", str(stats.preemptions)),
        ("cluster start-up", f"{startup:.1f} s"),
        ("matches single-process run", f"{same}/{len(prompts)} requests"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows), f, indent=2)
    if same != len(prompts):
        console.print("[red]outputs differ from the single-process run[/]")
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ray-attn")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="serve shared-prompt requests through TP workers and check them")
    d.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    d.add_argument("--compiled", action="store_true", help="drive steps through a Ray compiled graph")
    d.add_argument("--groups", type=int, default=8, help="distinct shared prompts")
    d.add_argument("--samples", type=int, default=4, help="samples per shared prompt")
    d.add_argument("--prefix-len", type=int, default=320, help="tokens in each shared prompt")
    d.add_argument("--long", type=int, default=2, help="prompts longer than an attention chunk")
    d.add_argument("--max-tokens", type=int, default=24)
    d.add_argument("--num-blocks", type=int, default=None, help="KV blocks per rank (default: from memory)")
    d.add_argument("--json", default=None, help="also write the table as JSON here")
    s = sub.add_parser("serve", help="serve a checkpoint folder with the OpenAI API on Ray Serve")
    serve_cli.add_arguments(s)
    args = p.parse_args(argv)
    try:
        if args.cmd == "demo":
            return run_demo(args)
        if args.cmd == "serve":
            return serve_cli.run(args)
    except (ValueError, RuntimeError, OSError) as e:  # bad arguments or an unusable cluster: one line
        p.error(one_line(e))
    return 2


def one_line(e: Exception) -> str:
    """A config error as the user should read it: the field and why, not a pydantic traceback."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        return f"{where}: {msg}" if where else msg
    return str(e).splitlines()[0]


if __name__ == "__main__":
    sys.exit(main())
