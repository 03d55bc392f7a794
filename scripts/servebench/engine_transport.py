"""The in-process transport: an ``LLMEngine`` in this process, driven by the Serve app's loop.

``ray_attn.serve.loop.EngineLoop`` is the thread the Serve replica runs: it batches every request in
flight into the same engine steps.  This transport submits each request to it and times the
events it pushes, with the HTTP transport's definitions: TTFT is the first event with tokens,
ITL the gaps between such events, E2EL the last one.  Events are timed on the engine thread as
they are pushed -- the moment a server would write the chunk -- so no HTTP, JSON or client
scheduling is counted.  The GPU machine has no HTTP stack for the Serve app; this gives it the
same metrics for the same workload.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from .datasets import SampleRequest
from .metrics import RequestFuncOutput


def load_engine_config(spec: str, overrides: dict | None = None):
    """An ``EngineConfig`` from ``spec``: a JSON/YAML file (an engine config, a Serve app's args,
    or a ``serve run`` config) or a model preset name (``ray_attn.config.MODEL_PRESETS``).
    ``overrides`` maps dotted field names (``parallel.tensor_parallel_size``) to values; the
    result is validated again, so a TP size the model cannot split is refused with the reason."""
    from ray_attn.config import MODEL_PRESETS, EngineConfig, ModelConfig

    if Path(spec).is_file():
        from ray_attn.serve.schemas import engine_config_from_file

        data = engine_config_from_file(spec).model_dump()
    elif spec in MODEL_PRESETS:
        data = EngineConfig(model=ModelConfig.from_name(spec)).model_dump()
    else:
        raise ValueError(f"--engine-config: {spec!r} is neither a file nor a model preset "
                         f"(presets: {sorted(MODEL_PRESETS)})")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        *path, leaf = dotted.split(".")
        node = data
        for part in path:
            node = node[part]
        node[leaf] = value
    return EngineConfig.model_validate(data)


def add_engine_args(g) -> None:
    """The engine flags both scripts take (an argparse group)."""
    g.add_argument("--executor", choices=["ray", "in_process"], default="ray",
                   help="ray: TP worker actors, as the Serve app runs them; in_process: TP=1, no Ray")
    g.add_argument("--tp", type=int, default=None, help="override parallel.tensor_parallel_size")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="override parallel.device")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=None,
                   help="override cache.kv_cache_dtype")
    g.add_argument("--num-blocks", type=int, default=None, help="override cache.num_blocks (per rank)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="override max_num_seqs")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="override max_num_batched_tokens")


def engine_overrides(args) -> dict:
    """The dotted EngineConfig fields the flags set; ``--executor in_process`` means TP=1."""
    if args.executor == "in_process" and args.tp not in (None, 1):
        raise ValueError(f"--tp {args.tp}: --executor in_process runs TP=1 only")
    return {"parallel.tensor_parallel_size": 1 if args.executor == "in_process" else args.tp,
            "parallel.device": args.device, "cache.kv_cache_dtype": args.kv_cache_dtype,
            "cache.num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens}


def make_engine(cfg, executor: str = "ray"):
    """``executor``: 'ray' (TP worker actors, as the Serve app runs) or 'in_process' (TP=1)."""
    from ray_attn.engine import LLMEngine

    if executor == "in_process":
        from ray_attn.runtime import InProcessExecutor

        return LLMEngine(cfg, InProcessExecutor(cfg))
    if executor != "ray":
        raise ValueError(f"--executor must be 'ray' or 'in_process', got {executor!r}")
    return LLMEngine(cfg)


def check_fits(cfg, requests: list[SampleRequest]) -> None:
    """Refuse, before anything runs, a workload the model's context cannot hold."""
    limit = cfg.model.max_position_embeddings
    worst = max(requests, key=lambda r: r.prompt_len + r.expected_output_len)
    if worst.prompt_len + worst.expected_output_len > limit:
        raise ValueError(f"a request of {worst.prompt_len} prompt + {worst.expected_output_len} output "
                         f"tokens exceeds the model's {limit}-token context "
                         "(max_position_embeddings); shorten the dataset's lengths")


COUNTERS = ("steps", "tokens_generated", "tokens_computed", "cascade_steps", "multi_group_cascade_steps",
            "local_steps", "preemptions", "prefix_cache_hit_tokens", "busy_s", "prefix_cache_hits",
            "prefix_cache_queries")


def stats_since(now: dict, base: dict) -> dict:
    """``engine_stats`` with its counters counted from ``base`` on: one run's share of an engine
    that served others before it."""
    return {k: (v - base[k] if k in COUNTERS else v) for k, v in now.items()}


def engine_stats(engine, loop=None) -> dict:
    """The engine's counters after the run (what ``bench_throughput`` and the JSON report)."""
    s = engine.stats.as_dict()
    ps = engine.planner.stats()
    out = {k: s[k] for k in ("steps", "tokens_generated", "tokens_computed", "cascade_steps",
                             "multi_group_cascade_steps", "local_steps", "preemptions",
                             "prefix_cache_hit_tokens", "busy_s")}
    out.update(prefix_cache_hits=ps["prefix_cache_hits"], prefix_cache_queries=ps["prefix_cache_queries"],
               kv_blocks_total=ps["num_free_blocks"] + ps["num_used_blocks"],
               kernel=getattr(engine.executor, "kernel_name", None),
               async_scheduling=engine.async_scheduling)
    if loop is not None:
        out["max_batch_size"] = loop.stats()["max_batch_size"]
    return out


class _TimedSink:
    """Stamps each event on the engine thread, then hands it to the request's coroutine."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, event) -> None:
        stamped = (time.perf_counter(), event)
        try:
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, stamped)
        except RuntimeError:  # the benchmark's loop is closed: nobody is listening any more
            pass


class EngineTransport:
    def __init__(self, engine, max_in_flight: int, ignore_eos: bool):
        from ray_attn.serve.loop import EngineLoop

        self.engine = engine
        self.ignore_eos = ignore_eos
        self.base_stats = engine_stats(engine)  # an engine may have served runs before this one
        self.loop = EngineLoop(engine, max_in_flight, request_id_prefix="bench").start()

    def params(self, req: SampleRequest):
        from ray_attn.request import SamplingParams

        eos = () if self.ignore_eos else tuple(self.engine.config.model.eos_token_ids)
        return SamplingParams(max_tokens=req.expected_output_len, temperature=0.0, stop_token_ids=eos)

    async def send(self, req: SampleRequest) -> RequestFuncOutput:
        out = RequestFuncOutput(prompt_len=req.prompt_len)
        sink = _TimedSink(asyncio.get_running_loop())
        st = out.start_time = time.perf_counter()
        try:
            self.loop.submit(req.prompt, self.params(req), sink)
        except Exception as e:  # noqa: BLE001 - QueueFull / LoopDead: a failed request, not a crash
            out.error = f"{type(e).__name__}: {e}"
            return out
        last, tokens = st, []
        while True:
            ts, ev = await sink.queue.get()
            if ev.kind in ("rejected", "failed"):
                out.error = f"{ev.kind}: {ev.error}"
                return out
            if ev.kind != "tokens":
                continue
            if ev.token_ids:
                if not tokens:
                    out.ttft = ts - st
                else:
                    out.itl.append(ts - last)
                last = ts
                tokens += ev.token_ids
            if ev.finished:
                break
        if ev.finish_reason in ("error", "abort") or ev.error:
            out.error = f"finish_reason={ev.finish_reason}: {ev.error}"
            return out
        if not tokens:
            out.error = "the request finished without a token"
            return out
        out.latency, out.output_tokens, out.output_token_ids = last - st, len(tokens), tokens
        out.success = True
        return out

    def stats(self) -> dict:
        """The engine's counters over this transport's run."""
        return stats_since(engine_stats(self.engine, self.loop), self.base_stats)

    def close(self, shutdown_engine: bool = True) -> None:
        """Stop the loop; then shut the engine down, or leave it idle for the next run (the step
        still out under async scheduling is collected first: it belongs to this run)."""
        self.loop.stop()
        if shutdown_engine:
            self.engine.shutdown()
        else:
            self.engine.flush()
