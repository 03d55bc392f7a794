#!/usr/bin/env python
"""Batch generation: JSONL prompts in, JSONL results out, with a progress bar.

Each input line is a JSON object with the fields of ``POST /v1/generate`` (``prompt_token_ids`` or
``prompt``, ``max_tokens``, ``temperature``, ``seed``, ``stop``) plus an optional ``id``.  Every line
is validated before the engine starts; a bad line stops the run with exit code 2 and a message
naming the line and the field.  Each output line, in input order::

    {"index": 0, "id": "a", "token_ids": [...], "text": null, "finish_reason": "length",
     "error": null, "usage": {"prompt_tokens": 5, "completion_tokens": 16}}

The output is written to ``OUTPUT.partial`` and renamed to ``OUTPUT`` once complete.  At most
``--max-in-flight`` requests are in the engine at once, so memory stays bounded for any input size.

Runs on the embedded local Ray, or on the cluster in ``RAY_ADDRESS`` (as set under ``ray job
submit``); ``--executor in_process`` runs TP=1 without Ray.  Examples::

    python scripts/batch_generate.py --input prompts.jsonl --output results.jsonl
    python scripts/batch_generate.py --config deploy/serve_config.yaml --input p.jsonl --output r.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout (or working_dir)

from pydantic import ValidationError  # noqa: E402

from deploy.schemas import BatchRecord, default_engine_config, limit_errors, validation_errors  # noqa: E402
from ray_attn.config import EngineConfig  # noqa: E402

MAX_LINE_BYTES = 4 << 20


def load_engine_config(path: str | None) -> EngineConfig:
    """An EngineConfig from a JSON/YAML file: an engine config itself, a Serve app config's args
    (with an ``engine`` key), or a ``serve run`` config file (the first application's engine)."""
    if path is None:
        return default_engine_config()
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, dict) and "applications" in data:
        data = data["applications"][0].get("args", {})
    if isinstance(data, dict) and "engine" in data:
        data = data["engine"]
    return EngineConfig.model_validate(data or {})


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
    if not upd:
        return cfg
    # Re-validate: a TP size the model cannot split is rejected here, with the reason.
    return EngineConfig.model_validate({**cfg.model_dump(), **{k: v.model_dump() for k, v in upd.items()}})


class InputError(Exception):
    pass


def read_records(path: str, tokenizer, cfg: EngineConfig):
    """Yield (index, record, prompt ids) for each non-blank line; raise InputError naming the line."""
    vocab, ctx = cfg.model.vocab_size, cfg.model.max_position_embeddings
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
            yield index, rec, prompt
            index += 1


def make_engine(cfg: EngineConfig, executor: str):
    from ray_attn.engine import LLMEngine

    if executor == "in_process":
        from ray_attn.runtime import InProcessExecutor

        return LLMEngine(cfg, InProcessExecutor(cfg))
    return LLMEngine(cfg)  # AttentionCluster: joins RAY_ADDRESS, else starts a local Ray


def run(args) -> int:
    cfg = apply_overrides(load_engine_config(args.config), args)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True,
                                                  trust_remote_code=False)
    # Pass 1: validate every line before reserving any resources.
    n, total_tokens = 0, 0
    try:
        for _, rec, _ in read_records(args.input, tokenizer, cfg):
            n += 1
            total_tokens += rec.max_tokens
    except (InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from tqdm.auto import tqdm

    from ray_attn.engine import SamplingParams

    t0 = time.perf_counter()
    engine = make_engine(cfg, args.executor)
    startup = time.perf_counter() - t0
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    records = read_records(args.input, tokenizer, cfg)
    pending: dict[str, tuple[int, BatchRecord, int]] = {}  # engine id -> (index, record, prompt len)
    done: dict[int, dict] = {}  # finished, waiting for their turn in input order
    next_write, exhausted, errors, generated = 0, False, 0, 0
    bar = tqdm(total=total_tokens, desc="generate", unit="tok", disable=args.no_progress,
               file=sys.stderr, mininterval=0.5)
    t0 = time.perf_counter()
    try:
        with open(partial, "w") as out:
            while True:
                # Admit lines while the window (counted from the oldest unwritten line) has room.
                while not exhausted and len(pending) + len(done) < args.max_in_flight:
                    item = next(records, None)
                    if item is None:
                        exhausted = True
                        break
                    index, rec, prompt = item
                    sp = SamplingParams(max_tokens=rec.max_tokens, temperature=rec.temperature,
                                        seed=rec.seed, stop_token_ids=tuple(rec.stop))
                    rid = engine.add_request(prompt, sp, request_id=f"line-{index}")
                    pending[rid] = (index, rec, len(prompt))
                if not pending and exhausted and not done:
                    break
                if pending:
                    outs = engine.step()
                    bar.update(len(outs))
                    generated += len(outs)
                for rid in [r for r in pending if engine.requests[r].finished]:
                    index, rec, plen = pending.pop(rid)
                    o = engine.output(rid)
                    engine.release(rid)
                    errors += o.finish_reason == "error"
                    # Requests that stop early leave part of their max_tokens unused.
                    bar.total -= rec.max_tokens - len(o.output_token_ids)
                    done[index] = {
                        "index": index, "id": rec.id, "token_ids": o.output_token_ids,
                        "text": tokenizer.decode(o.output_token_ids, skip_special_tokens=True) if tokenizer else None,
                        "finish_reason": o.finish_reason, "error": o.error,
                        "usage": {"prompt_tokens": plen, "completion_tokens": len(o.output_token_ids)},
                    }
                while next_write in done:
                    out.write(json.dumps(done.pop(next_write)) + "\n")
                    next_write += 1
        os.replace(partial, out_path)
    finally:
        bar.close()
        engine.shutdown()
    wall = time.perf_counter() - t0
    summary = {"requests": n, "errors": errors, "tokens_generated": generated,
               "wall_s": round(wall, 3), "startup_s": round(startup, 3),
               "tokens_per_s": round(generated / wall, 1) if wall > 0 else 0.0,
               "steps": engine.stats.steps, "output": str(out_path)}
    print(json.dumps(summary), flush=True)
    return 1 if errors else 0


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
    p.add_argument("--max-in-flight", type=int, default=256, help="most requests in the engine at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.max_in_flight < 1:
        p.error("--max-in-flight must be >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
