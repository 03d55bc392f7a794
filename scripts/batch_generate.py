#!/usr/bin/env python
"""Batch generation: JSONL prompts in, JSONL results out, with a progress bar.

Each input line is a JSON object with the fields of ``POST /v1/generate`` (``prompt_token_ids`` or
``prompt``, ``max_tokens``, ``temperature``, ``seed``, ``stop``) plus an optional ``id``.  Every line
is validated before the engine starts; a bad line stops the run with exit code 2 and a message
naming the line and the field.  Each output line, in input order::

    {"index": 0, "id": "a", "token_ids": [...], "text": null, "finish_reason": "length",
     "error": null, "usage": {"prompt_tokens": 5, "completion_tokens": 16}}

With one engine the output is written to ``OUTPUT.partial`` and renamed to ``OUTPUT`` once
complete.  ``--replicas N`` runs N engines (``ray_attn/serve/engine_pool.py``: a Ray actor each, in its own
placement group with its TP ranks); ``--replicas N`` or ``--resume`` write each line the moment it
finishes (completion order; sort by ``index``), so a crash loses no finished record, and
``--resume`` skips the records already in ``OUTPUT`` (by ``id``, else by line index;
``ray_attn/serve/batch_output.py``).  At most ``--max-in-flight`` requests are in each engine at once, so
memory stays bounded for any input size.

Runs on the embedded local Ray, or on the cluster in ``RAY_ADDRESS`` (as set under ``ray job
submit``); ``--executor in_process`` runs TP=1 without Ray (inside each replica actor with
``--replicas``).  Examples::

    python scripts/batch_generate.py --input prompts.jsonl --output results.jsonl
    python scripts/batch_generate.py --config deploy/serve_config.yaml --input p.jsonl --output r.jsonl
    python scripts/batch_generate.py --replicas 2 --resume --input p.jsonl --output r.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout (or working_dir)

from pydantic import ValidationError  # noqa: E402

from ray_attn.serve.batch_output import AppendOutput, OrderedOutput, record_key  # noqa: E402
from ray_attn.serve.schemas import (  # noqa: E402
    BatchRecord,
    default_engine_config,
    engine_config_from_file,
    limit_errors,
    validation_errors,
)
from ray_attn.config import EngineConfig  # noqa: E402

MAX_LINE_BYTES = 4 << 20


def load_engine_config(path: str | None) -> EngineConfig:
    """An EngineConfig from a JSON/YAML file: an engine config itself, a Serve app config's args
    (with an ``engine`` key), or a ``serve run`` config file (the first application's engine)."""
    return default_engine_config() if path is None else engine_config_from_file(path)


def apply_overrides(cfg: EngineConfig, args) -> EngineConfig:
    par = {}
    if args.tp is not None:
        par["tensor_parallel_size"] = args.tp
    if args.device is not None:
        par["device"] = args.device
    if args.executor == "in_process":
        par["tensor_parallel_size"] = 1
    upd = {}
    if par:
        upd["parallel"] = cfg.parallel.model_copy(update=par)
    if args.num_blocks is not None:
        upd["cache"] = cfg.cache.model_copy(update={"num_blocks": args.num_blocks})
    if args.max_loras is not None or args.max_lora_rank is not None:  # lines may name adapters
        from ray_attn.lora import LoRAConfig

        lora = {k: v for k, v in (("max_loras", args.max_loras), ("max_lora_rank", args.max_lora_rank)) if v is not None}
        upd["lora_config"] = LoRAConfig(**((cfg.lora_config.model_dump() if cfg.lora_config else {}) | lora))
    if not upd:
        return cfg
    # Re-validate: a TP size the model cannot split is rejected here, with the reason.
    return EngineConfig.model_validate({**cfg.model_dump(), **{k: v.model_dump() for k, v in upd.items()}})


class InputError(Exception):
    pass


def read_records(path: str, tokenizer, cfg: EngineConfig, unique_ids: bool = False):
    """Yield (index, record, prompt ids) for each non-blank line; raise InputError naming the line.
    With ``unique_ids`` (a resumable run keys records by id), a repeated id is an error too."""
    vocab, ctx = cfg.model.vocab_size, cfg.model.max_position_embeddings
    first_line: dict[str, int] = {}
    with open(path, "rb") as f:
        index = 0
        for lineno, line in enumerate(f, 1):
            if len(line) > MAX_LINE_BYTES:
                raise InputError(f"{path}:{lineno}: body: line longer than {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                rec = BatchRecord.model_validate_json(line)
            except ValidationError as e:
                raise InputError(f"{path}:{lineno}: " + "; ".join(m for _, m in validation_errors(e, BatchRecord))) from None
            if rec.prompt_token_ids is not None:
                prompt = rec.prompt_token_ids
            elif tokenizer is None:
                raise InputError(f"{path}:{lineno}: prompt: text prompts need --tokenizer; "
                                 f"give prompt_token_ids")
            else:
                prompt = list(tokenizer.encode(rec.prompt))
            errs = limit_errors(rec, prompt, vocab_size=vocab, max_model_len=ctx,
                                max_prompt_tokens=ctx, max_tokens_limit=ctx, max_stop_token_ids=1024)
            if errs:
                raise InputError(f"{path}:{lineno}: " + "; ".join(m for _, m in errs))
            if unique_ids and rec.id is not None:
                if rec.id in first_line:
                    raise InputError(f"{path}:{lineno}: id: {rec.id!r} repeats line "
                                     f"{first_line[rec.id]}; a resumed run needs unique ids")
                first_line[rec.id] = lineno
            yield index, rec, prompt
            index += 1


LORA_IDS: dict = {}  # (adapter name, folder) -> its LoRARequest, one id per adapter of the run


def make_engine(cfg: EngineConfig, executor: str):
    from ray_attn.engine import LLMEngine

    if executor == "in_process":
        from ray_attn.runtime import InProcessExecutor

        return LLMEngine(cfg, InProcessExecutor(cfg))
    return LLMEngine(cfg)  # AttentionCluster: joins RAY_ADDRESS, else starts a local Ray


def sampling_params(rec: BatchRecord):
    return rec.sampling_params()


def make_record(index: int, rec: BatchRecord, prompt_len: int, token_ids: list[int],
                finish_reason: str, error, tokenizer) -> dict:
    return {"index": index, "id": rec.id, "token_ids": token_ids,
            "text": tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer else None,
            "finish_reason": finish_reason, "error": error,
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(token_ids)}}


def generate_local(engine, items, output, window: int, finish) -> int:
    """One engine driven here, step by step; ``finish`` takes each finished request.  Returns the
    tokens generated."""
    pending: dict[str, tuple[int, BatchRecord, int]] = {}  # engine id -> (index, record, prompt len)
    exhausted, generated = False, 0
    while True:
        # Admit lines while the window (counting finished lines held back for order) has room.
        while not exhausted and len(pending) + output.waiting < window:
            item = next(items, None)
            if item is None:
                exhausted = True
                break
            index, rec, prompt = item
            try:
                rid = engine.add_request(prompt, sampling_params(rec), request_id=f"line-{index}",
                                         lora_request=rec.lora_request(LORA_IDS))
            except ValueError as e:  # a bad adapter fails its line only (the pool's lines too)
                finish(index, rec, len(prompt), [], "error", str(e))
                continue
            pending[rid] = (index, rec, len(prompt))
        if not pending:
            return generated
        outs = engine.step()
        generated += len(outs)
        finish.bar.update(len(outs))
        for rid in [r for r in pending if engine.requests[r].finished]:
            index, rec, plen = pending.pop(rid)
            o = engine.output(rid)
            engine.release(rid)
            finish(index, rec, plen, o.output_token_ids, o.finish_reason, o.error)


def start_pool(cfg: EngineConfig, args):
    """The engine replicas, on the cluster in RAY_ADDRESS or on a local Ray started here."""
    import ray

    from ray_attn.runtime.cluster import ensure_ray
    from ray_attn.serve.engine_pool import EnginePool

    if not ray.is_initialized() and not (cfg.parallel.ray_address or os.environ.get("RAY_ADDRESS")):
        # Workers of a local Ray import ray_attn from this checkout, as the driver does.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            x for x in [str(REPO), os.environ.get("PYTHONPATH", "")] if x)
    ranks = cfg.parallel.tensor_parallel_size if args.executor == "ray" else 0
    need = args.replicas * (args.replica_cpus + ranks * cfg.parallel.num_cpus_per_worker)
    ensure_ray(cfg.parallel.ray_address, min_cpus=int(need) + 1)
    return EnginePool(cfg, args.replicas, executor=args.executor, replica_num_cpus=args.replica_cpus,
                      max_in_flight=args.max_in_flight, replica_resource=args.replica_resource)


class Finisher:
    """Turns finished requests into output lines, the progress bar and the counts."""

    def __init__(self, output, bar, tokenizer):
        self.output, self.bar, self.tokenizer = output, bar, tokenizer
        self.errors = 0
        self.done = 0

    def __call__(self, index, rec, plen, token_ids, finish_reason, error) -> None:
        self.errors += finish_reason == "error"
        self.done += 1
        # Requests that stop early leave part of their max_tokens unused.
        self.bar.total -= rec.max_tokens - len(token_ids)
        self.output.write(make_record(index, rec, plen, token_ids, finish_reason, error, self.tokenizer))


def run(args) -> int:
    cfg = apply_overrides(load_engine_config(args.config), args)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True,
                                                  trust_remote_code=False)
    out_path = Path(args.output)
    stream = args.replicas > 1 or args.resume
    # Pass 1: validate every line (and what a resume would keep) before reserving any resources.
    n, todo, total_tokens = 0, 0, 0
    try:
        skip = AppendOutput.existing_keys(out_path) if args.resume else set()
        for index, rec, _ in read_records(args.input, tokenizer, cfg, unique_ids=args.resume):
            n += 1
            if record_key(index, rec.id) not in skip:
                todo += 1
                total_tokens += rec.max_tokens
    except (InputError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    pool = start_pool(cfg, args) if args.replicas > 1 else None
    engine = make_engine(cfg, args.executor) if pool is None else None
    startup = time.perf_counter() - t0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    output = AppendOutput(out_path, resume=args.resume) if stream else OrderedOutput(out_path)
    items = ((i, rec, prompt) for i, rec, prompt in read_records(args.input, tokenizer, cfg)
             if record_key(i, rec.id) not in skip)
    bar = tqdm(total=total_tokens, desc="generate", unit="tok", disable=args.no_progress,
               file=sys.stderr, mininterval=0.5)
    finish = Finisher(output, bar, tokenizer)
    t0 = time.perf_counter()
    complete, extra = False, {}
    try:
        if pool is None:
            generated = generate_local(engine, items, output, args.max_in_flight, finish)
            steps = engine.stats.steps
        else:
            prompts = {}

            def on_done(index, result):
                rec, plen = prompts.pop(index)
                bar.update(len(result["token_ids"]))
                finish(index, rec, plen, result["token_ids"], result["finish_reason"], result["error"])

            def feed():
                for index, rec, prompt in items:
                    prompts[index] = (rec, len(prompt))
                    yield index, prompt, sampling_params(rec), rec.lora_request(LORA_IDS)

            pool.run(feed(), on_done)
            per_replica = pool.stats()
            generated = sum(s["tokens_generated"] for s in per_replica)
            steps = sum(s["steps"] for s in per_replica)
            extra["requests_per_replica"] = [s["requests_finished"] for s in per_replica]
            if pool.lost:  # their unfinished requests ran on the others; their counts are gone
                extra["replicas_lost"] = pool.lost
        complete = True
    finally:
        bar.close()
        output.close(complete)
        (engine or pool).shutdown()
    wall = time.perf_counter() - t0
    summary = {"requests": n, "skipped": n - todo, "errors": finish.errors, "tokens_generated": generated,
               "wall_s": round(wall, 3), "startup_s": round(startup, 3),
               "tokens_per_s": round(generated / wall, 1) if wall > 0 else 0.0,
               "steps": steps, "replicas": args.replicas, **extra, "output": str(out_path)}
    print(json.dumps(summary), flush=True)
    return 1 if finish.errors else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one request per line")
    p.add_argument("--output", required=True, help="JSONL results, in input order")
    p.add_argument("--config", default=None,
                   help="engine config (JSON/YAML), or a Serve config such as deploy/serve_config.yaml")
    p.add_argument("--executor", choices=["ray", "in_process"], default="ray",
                   help="'ray': TP worker actors (default); 'in_process': TP=1, no Ray")
    p.add_argument("--tp", type=int, default=None, help="override tensor_parallel_size")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="override parallel.device")
    p.add_argument("--num-blocks", type=int, default=None, help="override KV blocks per rank")
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer folder (for text prompts)")
    p.add_argument("--max-loras", type=int, default=None, help="serve LoRA adapters (lines' lora_path): slots")
    p.add_argument("--max-lora-rank", type=int, default=None, help="serve LoRA adapters up to this rank")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="most requests in each engine at once")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas, each a Ray actor with its own TP placement group; above 1, "
                        "lines are written as they finish (completion order, each with its index)")
    p.add_argument("--replica-cpus", type=float, default=0.5,
                   help="CPUs of each replica's own bundle (its TP ranks get theirs)")
    p.add_argument("--replica-resource", default=None,
                   help="a custom node resource each replica takes one unit of: nodes started with "
                        "--resources '{\"NAME\": k}' hold at most k replicas, so replicas spread over "
                        "nodes (a replica lost with its node hands its requests to the others)")
    p.add_argument("--resume", action="store_true",
                   help="keep the records already in OUTPUT and generate only the others; lines are "
                        "appended as they finish")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.max_in_flight < 1:
        p.error("--max-in-flight must be >= 1")
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    if not args.replica_cpus > 0:
        p.error("--replica-cpus must be > 0")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
