"""CPU decode speed of our engine against HF transformers' own ``generate`` on the same model:
the embedded SmolLM2-135M-Instruct GGUF (or any ``--checkpoint``), both in float32 on the same
dequantized weights, greedy, ``--max-tokens`` new tokens per request (no early stop), at each
``--batch`` (a batch of distinct chat prompts; HF's left-padded in one ``generate`` call).

    python scripts/bench_cpu_vs_hf.py [--batch 1 8] [--max-tokens 256] [--tp 1] [--executor in_process]
                                      [--repeats 3] [--our-threads 1] [--profile TOKENS]

tokens/s = batch * max_tokens / wall time of the whole call (prefill included, which is a few
percent of it here), the best of ``--repeats`` runs of each side, taken in turn (the machine is
shared: a run beside another process's burst is slower, and best-of compares both sides at
their unloaded speed); the median is reported too.  ``--our-threads`` sets RAY_ATTN_CPU_THREADS
for our ranks (torch threads per rank; default: the cores over the ranks); HF keeps torch's
default (all cores) unless ``--threads``.  ``--executor ray`` runs the ranks as Ray actors (``--tp`` of them); the
default runs one rank in this process, as ``executor: in_process`` serves.  The two runs' tokens
are compared too: in float32 they agree but for rare forks at near-ties (reported).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: nothing reaches the hub
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import torch  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "Why is the sky blue?", "What does a CPU do?", "Give me a tip for learning to cook.",
             "Explain photosynthesis in one sentence.", "What is the tallest mountain on Earth?"]


def chat_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def make_engine(path: str, tp: int, executor: str, batch: int, dtype: str = "float32",
                quantization: str | None = None):
    from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    # No prefix caching: the repeats send the same prompts, and a cached prefill is not HF's work.
    cfg = EngineConfig(checkpoint=path, model={"dtype": dtype, "quantization": quantization},
                       cache=CacheConfig(num_blocks=256, enable_prefix_caching=False),
                       parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
                       max_num_seqs=max(8, batch), max_num_batched_tokens=1024)
    eng = LLMEngine(cfg, InProcessExecutor(cfg) if executor == "in_process" else None)
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    return eng


def run_ours(eng, prompts, max_tokens: int) -> tuple[float, list]:
    from ray_attn.engine import SamplingParams

    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t0, [o.output_token_ids for o in outs]


def run_hf(model, tok, prompts, max_tokens: int) -> tuple[float, list]:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding, as HF generates
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad)
        wall = time.perf_counter() - t0
    return wall, [row[width:].tolist() for row in out]


def agreement(ours, hf) -> str:
    same = sum(a == b for a, b in zip(ours, hf))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, hf)]
    forks = [f for f in firsts if f is not None]
    return f"{same}/{len(ours)} identical" + (f" (first forks at tokens {forks})" if forks else "")


def profile_ours(eng, prompts, max_tokens: int) -> None:
    """Where our CPU step goes: the ops of a ``generate`` by self CPU time (the linears, the LM
    head, and the many small ops around them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_ours(eng, prompts, max_tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv=None):
    from ray_attn.gguf_file import gguf_path, hf_causal_lm, load_tokenizer
    from ray_attn.presets import default_gguf

    a = argparse.ArgumentParser()
    a.add_argument("--checkpoint", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    a.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    a.add_argument("--max-tokens", type=int, default=256)
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--executor", choices=["in_process", "ray"], default="in_process")
    a.add_argument("--threads", type=int, default=None, help="torch threads for HF (default: torch's own)")
    a.add_argument("--our-threads", type=int, default=None, help="RAY_ATTN_CPU_THREADS for our ranks")
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="both sides' weights and compute (default float32: the dequantized weights exactly)")
    a.add_argument("--quantization", choices=["gguf"], default=None,
                   help="ours only: 'gguf' runs the file's 4-bit blocks as stored (bfloat16 matmuls; "
                        "ray_attn/model/gguf_q4.py); HF keeps its dequantized weights")
    a.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="after the timings, profile our generate of TOKENS tokens at the largest --batch "
                        "(torch.profiler, in-process executor): the ops by self CPU time")
    args = a.parse_args(argv)
    if args.our_threads:
        os.environ["RAY_ATTN_CPU_THREADS"] = str(args.our_threads)
    path = gguf_path(args.checkpoint) if args.checkpoint else default_gguf()
    if path is None:
        raise SystemExit("--checkpoint must name a GGUF file")
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(path)
    hf_threads = torch.get_num_threads()
    hf = hf_causal_lm(path, getattr(torch, args.dtype))
    hf.generation_config.eos_token_id = None  # no early stop: every request makes max_tokens, as ours (ignore_eos)
    import statistics

    rows = []
    eng = make_engine(path, args.tp, args.executor, max(args.batch), args.dtype, args.quantization)
    our_threads = torch.get_num_threads()  # what the in-process rank set (RAY_ATTN_CPU_THREADS or its share)
    try:
        for batch in args.batch:
            prompts = chat_prompts(tok, batch)
            ours, theirs = [], []
            for _ in range(args.repeats):  # in turn, so that a burst of load hits both sides alike
                torch.set_num_threads(hf_threads)  # one process: each side runs on its own thread count
                theirs.append(run_hf(hf, tok, prompts, args.max_tokens))
                torch.set_num_threads(our_threads)
                ours.append(run_ours(eng, prompts, args.max_tokens))
            n = batch * args.max_tokens
            best_ours, best_hf = min(w for w, _ in ours), min(w for w, _ in theirs)
            med_ours, med_hf = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in theirs)
            rows.append(dict(batch=batch, max_tokens=args.max_tokens, ours_tok_s=n / best_ours, hf_tok_s=n / best_hf,
                             speedup=best_hf / best_ours, ours_median_tok_s=n / med_ours, hf_median_tok_s=n / med_hf,
                             median_speedup=med_hf / med_ours, tokens=agreement(ours[0][1], theirs[0][1])))
            print(rows[-1], flush=True)
        if args.profile and args.executor == "in_process":
            profile_ours(eng, chat_prompts(tok, max(args.batch)), args.profile)
    finally:
        eng.shutdown()
    meta = dict(checkpoint=os.path.basename(path), dtype=args.dtype, quantization=args.quantization, tp=args.tp,
                executor=args.executor, hf_threads=hf_threads,
                our_threads=our_threads if args.executor == "in_process" else os.environ.get("RAY_ATTN_CPU_THREADS"),
                repeats=args.repeats,
                cpu_count=os.cpu_count(), torch=torch.__version__, transformers=transformers.__version__)
    out = bl.save("bench_cpu_vs_hf" + ("" if args.dtype == "float32" else "_bf16")
                  + (f"_{args.quantization}" if args.quantization else ""), rows, **meta)
    bl.print_table(rows, ["batch", "max_tokens", "ours_tok_s", "hf_tok_s", "speedup", "median_speedup", "tokens"],
                   f"CPU greedy decode, {meta['checkpoint']} {args.dtype} (ours: TP={args.tp}, {args.executor}"
                   + (f", quantization={args.quantization})" if args.quantization else ")"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
