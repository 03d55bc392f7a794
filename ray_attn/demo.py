"""``ray-attn demo``: a real model answering chat questions through TP workers, checked twice, then
the Llama-4-style shared-prompt workload that exercises cascade and chunked-local attention.

Part 1 serves the embedded SmolLM2-135M-Instruct GGUF (``presets.default_gguf``; its tokenizer and
chat template from the file) on ``--tp`` Ray ranks (3 divides its 9 query / 3 KV heads), and
checks every greedy answer against a single-process (no Ray, TP=1) run and against HF
transformers' own greedy ``generate`` on the same GGUF.  Part 2 is a small Llama 4 of random
weights: shared prompts (groups x samples, as in RL rollouts) plus prompts longer than an
attention chunk, checked against a single-process run.

Forks: every run computes the same float32 function, but in different summation orders (TP
all-reduces, paged vs dense attention), so logits differ by ~1e-6 and greedy picks may part at
an exact near-tie.  A difference counts as agreement only where HF's logits of the two tokens
lie within ``TIE`` of each other at the first differing token (reported); anything else fails.
"""

from __future__ import annotations

import os
import time

import numpy as np

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "What does a CPU do? Answer in one sentence."]
TIE = 1e-3  # nats between HF's logits of the two tokens at a fork: float32 noise is ~1e-5


def timed_run(cfg, prompts, params) -> dict:
    """Start an engine on ``cfg``'s ranks, generate, shut it down: the outputs and what the
    tables report (start-up and generation seconds, engine and planner stats, kernel, rank infos)."""
    from ray_attn.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    startup = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=True)
        return dict(outs=outs, startup=startup, wall=time.perf_counter() - t0, stats=engine.stats,
                    pstats=engine.planner.stats(), kernel=engine.executor.kernel_name, infos=engine.executor.infos)
    finally:
        engine.shutdown()


def single_process(cfg, prompts, params) -> list:
    """The same requests in one process (no Ray, TP=1): the reference every answer is checked against."""
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor

    single_cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
        update={"tensor_parallel_size": 1, "use_compiled_graph": False})})
    engine = LLMEngine(single_cfg, InProcessExecutor(single_cfg))
    try:
        return engine.generate(prompts, params)
    finally:
        engine.shutdown()


# -- part 1: the real model -------------------------------------------------------------------------
def real_config(path: str, tp: int, device: str, compiled: bool, num_blocks: int | None):
    from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig

    return EngineConfig(checkpoint=path, cache=CacheConfig(num_blocks=num_blocks or 256, block_size=16),
                        parallel=ParallelConfig(tensor_parallel_size=tp, device=device, use_compiled_graph=compiled),
                        max_num_seqs=16, max_num_batched_tokens=512)


def chat_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int):
    """HF transformers' greedy tokens (cut after the first end-of-sequence token, as ours stop)
    and its logits at each step, from the same GGUF in float32."""
    import torch

    from ray_attn.gguf_file import hf_causal_lm

    model = hf_causal_lm(path, torch.float32)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokens, scores = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=next(iter(eos), 0))
            t = out.sequences[0, len(p):].tolist()
            end = next((i + 1 for i, x in enumerate(t) if x in eos), len(t))
            tokens.append(t[:end])
            scores.append([s[0] for s in out.scores[:end]])
    return tokens, scores


def compare(got: list[int], want: list[int], scores) -> tuple[bool, str]:
    """Equal, or parted at a near-tie of HF's logits (``scores``: HF's per step, or None)."""
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        return len(got) == len(want), "same" if len(got) == len(want) else f"lengths {len(got)} != {len(want)}"
    if scores is not None and k < len(scores):
        gap = abs(float(scores[k][got[k]] - scores[k][want[k]]))
        if gap <= TIE:
            return True, f"same up to a near-tie at token {k} (HF logits {gap:.1e} apart)"
        return False, f"differs at token {k} (HF logits {gap:.2f} apart)"
    return False, f"differs at token {k}"


def run_real(args, console) -> tuple[list, bool]:
    from rich.table import Table

    from ray_attn.engine import SamplingParams
    from ray_attn.gguf_file import load_tokenizer
    from ray_attn.presets import default_gguf

    path = args.checkpoint or default_gguf()
    with console.status("reading the GGUF's config and tokenizer ..."):
        cfg = real_config(path, args.tp, args.device, args.compiled, args.num_blocks)
        tok = load_tokenizer(path)
    questions = QUESTIONS[:args.questions]
    prompts = [chat_ids(tok, q) for q in questions]
    params = SamplingParams(max_tokens=args.answer_tokens)
    m = cfg.model
    console.rule(f"[bold]part 1[/]: {os.path.basename(path)} ({m.architecture}, {m.num_hidden_layers} layers, "
                 f"{m.num_attention_heads} query / {m.num_key_value_heads} KV heads), TP={args.tp}")
    console.print(f"starting {args.tp} rank(s), each loading its shard of the GGUF ...")
    r = timed_run(cfg, prompts, params)
    outs, startup, wall, stats, pstats, kernel, infos = (r[k] for k in (
        "outs", "startup", "wall", "stats", "pstats", "kernel", "infos"))
    got = [o.output_token_ids for o in outs]

    with console.status("the same questions in a single process (no Ray, TP=1) ..."):
        single = [o.output_token_ids for o in single_process(cfg, prompts, params)]
    hf_tokens, hf_scores = None, None
    if not args.no_hf:
        console.print("HF transformers' greedy generate on the same GGUF (float32) ...")
        hf_tokens, hf_scores = hf_greedy(path, prompts, args.answer_tokens)

    ok = True
    for i, (q, g) in enumerate(zip(questions, got)):
        console.print(f"\n[bold cyan]Q:[/] {q}\n[bold green]A:[/] {tok.decode(g, skip_special_tokens=True).strip()}")
        s_ok, s_msg = compare(g, single[i], hf_scores[i] if hf_scores else None)
        line = f"   single process: {s_msg}"
        if hf_tokens is not None:
            h_ok, h_msg = compare(g, hf_tokens[i], hf_scores[i])
            line += f"; HF transformers: {h_msg}"
            s_ok = s_ok and h_ok
        ok = ok and s_ok
        console.print(("[dim]" if s_ok else "[red]") + line)
    table = Table(title="part 1: a real model through TP workers")
    table.add_column("metric")
    table.add_column("value", justify="right")
    gen = stats.tokens_generated
    rows = [("device / kernel", f"{infos[0]['name']} / {kernel}"), ("tensor-parallel ranks", str(args.tp)),
            ("questions", str(len(prompts))), ("tokens generated", str(gen)),
            ("decode tokens/s", f"{gen / wall:,.1f}"), ("engine steps", str(stats.steps)),
            ("prefix-cache hit tokens (the shared system prompt)",
             f"{pstats['prefix_cache_hits']} / {pstats['prefix_cache_queries']}"),
            ("steps with cascade attention", str(stats.cascade_steps)),
            ("cluster start-up (load included)", f"{startup:.1f} s"),
            ("answers checked", "single process" + ("" if args.no_hf else " + HF transformers")),
            ("all answers agree", "yes" if ok else "NO")]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    return rows, ok


# -- part 2: the Llama-4-style workload (random weights) -----------------------------------------------
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


def run_llama4(args, console) -> tuple[list, bool]:
    from rich.table import Table

    cfg = demo_config(args.llama4_tp, args.device, args.compiled, None)
    prompts, params = demo_workload(args.groups, args.samples, args.prefix_len, args.long, 1100,
                                    args.max_tokens, cfg.model.vocab_size)
    console.rule(f"[bold]part 2[/]: a Llama-4-style model (random weights), {len(prompts)} requests, "
                 f"TP={args.llama4_tp}, {cfg.model.num_hidden_layers} layers {cfg.model.layer_kinds()}")
    r = timed_run(cfg, prompts, params)
    outs, startup, wall, stats, pstats, kernel, infos = (r[k] for k in (
        "outs", "startup", "wall", "stats", "pstats", "kernel", "infos"))
    console.print("checking against a single-process (no Ray, TP=1) run ...")
    ref = single_process(cfg, prompts, params)
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(outs, ref))
    table = Table(title="part 2: shared prompts, cascade and chunked-local attention")
    table.add_column("metric")
    table.add_column("value", justify="right")
    gen = stats.tokens_generated
    rows = [
        ("device / kernel", f"{infos[0]['name']} / {kernel}"), ("tensor-parallel ranks", str(args.llama4_tp)),
        ("step path", "compiled graph" if args.compiled else "actor call"), ("requests", str(len(prompts))),
        ("tokens generated", str(gen)), ("tokens computed (prefill + decode)", str(stats.tokens_computed)),
        ("decode tokens/s", f"{gen / wall:,.1f}"), ("engine steps", str(stats.steps)),
        ("prefix-cache hit tokens", f"{pstats['prefix_cache_hits']} / {pstats['prefix_cache_queries']}"),
        ("steps with cascade attention", f"{stats.cascade_steps} ({stats.cascade_steps / max(stats.steps, 1):.0%})"),
        ("steps with local attention", f"{stats.local_steps} ({stats.local_steps / max(stats.steps, 1):.0%})"),
        ("preemptions", str(stats.preemptions)), ("cluster start-up", f"{startup:.1f} s"),
        ("matches single-process run", f"{same}/{len(prompts)} requests"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    return rows, same == len(prompts)


def run_demo(args) -> int:
    import json

    from rich.console import Console

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: nothing here reaches the hub
    console = Console()
    report, ok = {}, True
    if args.part in ("all", "real"):
        rows, good = run_real(args, console)
        report["real_model"], ok = dict(rows), ok and good
    if args.part in ("all", "llama4"):
        rows, good = run_llama4(args, console)
        report["llama4"], ok = dict(rows), ok and good
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not ok:
        console.print("[red]outputs differ from a reference run (see above)[/]")
    return 0 if ok else 1


def add_arguments(d) -> None:
    d.add_argument("--part", choices=["all", "real", "llama4"], default="all",
                   help="the real model (part 1), the Llama-4-style workload (part 2), or both")
    d.add_argument("--checkpoint", default=None, help="part 1's GGUF (default: the embedded SmolLM2-135M-Instruct)")
    d.add_argument("--tp", type=int, default=3, help="part 1's tensor-parallel ranks (default 3)")
    d.add_argument("--questions", type=int, default=len(QUESTIONS), help=f"chat questions (at most {len(QUESTIONS)})")
    d.add_argument("--answer-tokens", type=int, default=48, help="most tokens per answer")
    d.add_argument("--no-hf", action="store_true", help="skip the check against HF transformers")
    d.add_argument("--llama4-tp", type=int, default=2, help="part 2's tensor-parallel ranks (default 2)")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    d.add_argument("--compiled", action="store_true", help="drive steps through a Ray compiled graph")
    d.add_argument("--groups", type=int, default=8, help="part 2: distinct shared prompts")
    d.add_argument("--samples", type=int, default=4, help="part 2: samples per shared prompt")
    d.add_argument("--prefix-len", type=int, default=320, help="part 2: tokens in each shared prompt")
    d.add_argument("--long", type=int, default=2, help="part 2: prompts longer than an attention chunk")
    d.add_argument("--max-tokens", type=int, default=24, help="part 2: tokens per sample")
    d.add_argument("--num-blocks", type=int, default=None, help="part 1's KV blocks per rank (default 256)")
    d.add_argument("--json", default=None, help="also write the tables as JSON here")
