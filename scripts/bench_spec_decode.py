"""n-gram speculative decoding on real text, on CPU: the embedded SmolLM2-135M-Instruct GGUF (or any
``--checkpoint``), greedy, the same engine with and without ``speculative_config`` (prompt lookup).

    python scripts/bench_spec_decode.py [--k 4] [--batch 1 2 4 8] [--max-tokens 160] [--repeats 2]
                                        [--json benchmarks/results/bench_spec_decode.json]

Two workloads, as chat prompts through the GGUF's chat template, each request to its end of
sequence (or ``--max-tokens``):
- ``edit``: "fix the spelling in this text" -- the answer repeats most of the prompt, which is
  what prompt lookup is for;
- ``chat``: free questions, whose answers rarely repeat anything.

At batch 1 the requests run one after another; tokens/s = tokens generated / wall time (prefill
included), the best of ``--repeats`` runs of each side taken in turn (the machine is shared).
Acceptance length = tokens a speculating request emitted per verifying step (vLLM's mean
acceptance length: 1 + accepted / drafts).  The outputs of the two sides are compared: greedy
with speculation is greedy without, but for float32 near-ties (a 1+k query sums in another order).

Per request, the steps speculation takes are also counted exactly, without a clock: greedy output
with speculation is the plain greedy output, so replaying the proposer over the plain output
(``replay``) gives each request's steps and tokens per step -- which requests the model copies
and which it rewrites.

``--batch`` sweeps the batch size (the edit and chat prompts mixed, repeated to fill the batch,
all at once) with speculation always on: the largest batch at which it still pays is what
``SpeculativeConfig.disable_by_batch_size`` defaults to on CPU (``spec_config.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import numpy as np  # noqa: E402

TEXTS = [
    "The city library opens at nine in the morning and closes at six in the evening. Visitors can borow up to "
    "five books at a time, and each loan lasts for three weeks. The reading room on the second floor is quiet "
    "and has large windows that look out over the park. On Saturdays there is a story hour for children, and "
    "on Wensdays a local historian gives a short talk about the history of the town.",
    "To make a simple tomato sauce, heat two spoons of olive oil in a pan and add one chopped onion. Cook it "
    "slowly until it is soft, then add two cloves of garlic and a can of tomatoes. Let the sauce simmer for "
    "twenty minutes, stiring from time to time, and season it with salt, pepper and a few leaves of basil.",
    "Our team meeting will take place on Tuesday at ten o'clock in the small conference room. Please bring "
    "your notes from last week and a short update on your project. If you cannot atend, send your update "
    "by email before the meeting so that we can discuss it with the rest of the group.",
]
# The edit asked after the text, word for word: with the instruction first ("Fix the spelling
# mistakes in the following text. Reply with the corrected text only."), SmolLM2-135M rewrote the
# first text in its own words and went on past the third (replayed at k=4: 1.7, 4.2 and 1.6
# tokens a step) -- not the edit this workload stands for, whose answer is the text again.
EDIT = "{text}\n\nRepeat the text above word for word, but fix the misspelled words."
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
             "Give me a tip for learning to cook."]


def chat_ids(tok, content: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def workloads(tok) -> dict[str, list[list[int]]]:
    return {"edit": [chat_ids(tok, EDIT.format(text=t)) for t in TEXTS], "chat": [chat_ids(tok, q) for q in QUESTIONS]}


def make_engine(path: str, spec: dict | None, max_num_seqs: int):
    from ray_attn.config import CacheConfig, EngineConfig, ParallelConfig
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    cfg = EngineConfig(checkpoint=path, cache=CacheConfig(num_blocks=64 + 24 * max_num_seqs, enable_prefix_caching=False),
                       parallel=ParallelConfig(tensor_parallel_size=1, device="cpu"), max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=2048, speculative_config=spec)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    return eng


def timed(eng, prompts, max_tokens: int, at_once: bool) -> tuple[float, list[list[int]], dict]:
    """Wall time, outputs and the speculation counters' growth of one run."""
    from ray_attn.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    s0 = eng.stats.spec_num_drafts, eng.stats.spec_num_accepted_tokens, eng.stats.spec_num_draft_tokens
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params) if at_once else [eng.generate([p], params)[0] for p in prompts]
    wall = time.perf_counter() - t0
    s = eng.stats
    grew = dict(drafts=s.spec_num_drafts - s0[0], accepted=s.spec_num_accepted_tokens - s0[1],
                draft_tokens=s.spec_num_draft_tokens - s0[2])
    return wall, [o.output_token_ids for o in outs], grew


def replay(prompt: list[int], output: list[int], k: int, min_n: int, max_n: int) -> dict:
    """The steps a speculating greedy request takes to emit ``output``: at each step the proposer
    drafts from the tokens so far, the longest prefix of the drafts that the output continues
    with is accepted, plus the step's own token (a request's last step drafts no further than
    its end)."""
    from ray_attn.spec.ngram import propose_ngram

    tokens = np.array(prompt + output)
    i = steps = drafted = 0
    while i < len(output):
        d = propose_ngram(tokens[:len(prompt) + i], min(k, len(output) - i - 1), min_n, max_n)
        a = 0
        while a < len(d) and d[a] == output[i + a]:
            a += 1
        i, steps, drafted = i + a + 1, steps + 1, drafted + bool(len(d))
    return dict(tokens=len(output), steps=steps, tokens_per_step=round(len(output) / max(steps, 1), 2),
                drafted_steps=drafted)


def compare(plain, spec, prompts, max_tokens: int, repeats: int, at_once: bool) -> dict:
    runs = {"plain": [], "spec": []}
    for _ in range(repeats):  # in turn, so that a burst of load hits both sides alike
        runs["plain"].append(timed(plain, prompts, max_tokens, at_once))
        runs["spec"].append(timed(spec, prompts, max_tokens, at_once))
    n_plain = sum(map(len, runs["plain"][0][1]))
    n_spec = sum(map(len, runs["spec"][0][1]))
    best = {side: min(w for w, _, _ in r) for side, r in runs.items()}
    g = runs["spec"][0][2]
    same = sum(a == b for a, b in zip(runs["plain"][0][1], runs["spec"][0][1]))
    prop = spec.spec.proposer  # the engine's NgramProposer: k and the n-gram range it resolved
    per_request = [] if at_once else [replay(list(p), o, prop.k, prop.min_n, prop.max_n)
                                      for p, o in zip(prompts, runs["plain"][0][1])]
    return dict(requests=len(prompts), tokens=n_plain, plain_tok_s=n_plain / best["plain"],
                spec_tok_s=n_spec / best["spec"], speedup=(n_spec / best["spec"]) / (n_plain / best["plain"]),
                acceptance_length=1 + g["accepted"] / g["drafts"] if g["drafts"] else 1.0,
                draft_acceptance_rate=g["accepted"] / g["draft_tokens"] if g["draft_tokens"] else 0.0,
                identical=f"{same}/{len(prompts)}", drafts=g["drafts"], accepted=g["accepted"],
                per_request=per_request)


def break_even(sweep: list[dict]) -> int | None:
    """The largest batch of the sweep up to which speculation paid at every size (None: not at batch 1)."""
    last = None
    for r in sorted(sweep, key=lambda r: r["batch"]):
        if r["speedup"] <= 1.0:
            break
        last = r["batch"]
    return last


def main(argv=None) -> dict:
    from ray_attn.gguf_file import gguf_path, load_tokenizer
    from ray_attn.presets import default_gguf

    a = argparse.ArgumentParser()
    a.add_argument("--checkpoint", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    a.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens to measure at batch 1")
    a.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                   help="prompt_lookup_min / prompt_lookup_max")
    a.add_argument("--batch", type=int, nargs="*", default=[1, 2, 4, 8], help="batch sizes of the sweep (k: the first --k)")
    a.add_argument("--max-tokens", type=int, default=160)
    a.add_argument("--repeats", type=int, default=2)
    a.add_argument("--prompts", type=int, default=None, help="use the first N prompts of each workload (tests)")
    a.add_argument("--json", default=None, help="where to write the results (default: benchmarks/results/)")
    args = a.parse_args(argv)
    path = gguf_path(args.checkpoint) if args.checkpoint else default_gguf()
    tok = load_tokenizer(path)
    loads = {name: ps[:args.prompts] for name, ps in workloads(tok).items()}
    spec_of = {k: dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=args.lookup[0],
                       prompt_lookup_max=args.lookup[1], disable_by_batch_size=None) for k in args.k}
    width = max([1, *args.batch])
    plain = make_engine(path, None, width)
    rows, sweep = [], []
    try:
        for k, spec in spec_of.items():
            eng = make_engine(path, spec, width)
            try:
                for name, prompts in loads.items():
                    rows.append(dict(workload=name, k=k, batch=1,
                                     **compare(plain, eng, prompts, args.max_tokens, args.repeats, at_once=False)))
                    print(rows[-1], flush=True)
                if k == args.k[0]:
                    mixed = [p for ps in loads.values() for p in ps]
                    for b in args.batch:
                        prompts = [mixed[i % len(mixed)] for i in range(b)]
                        sweep.append(dict(workload="edit+chat", k=k, batch=b,
                                          **compare(plain, eng, prompts, args.max_tokens, args.repeats, at_once=True)))
                        print(sweep[-1], flush=True)
            finally:
                eng.shutdown()
    finally:
        plain.shutdown()
    meta = dict(checkpoint=os.path.basename(path), lookup=args.lookup, max_tokens=args.max_tokens,
                repeats=args.repeats, cpu_count=os.cpu_count(), break_even_batch=break_even(sweep), sweep=sweep)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": bl.machine(), **meta, "rows": rows}, indent=1, default=float))
    else:
        out = bl.save("bench_spec_decode", rows, **meta)
    cols = ["workload", "k", "batch", "requests", "tokens", "acceptance_length", "plain_tok_s", "spec_tok_s",
            "speedup", "identical"]
    bl.print_table(rows, cols, f"n-gram speculation, {meta['checkpoint']} float32 on CPU, batch 1")
    if sweep:
        bl.print_table(sweep, cols, f"batch sweep (k={args.k[0]}); pays up to batch {meta['break_even_batch']}")
    print(f"wrote {out}")
    return {**meta, "rows": rows}


if __name__ == "__main__":
    main()
