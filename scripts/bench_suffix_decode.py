"""Suffix decoding on real text, on CPU: the embedded SmolLM2-135M-Instruct GGUF (or any
``--checkpoint``), greedy, batch 1, the same workloads as ``bench_spec_decode.py`` (edit, chat).

    python scripts/bench_suffix_decode.py [--k 4] [--max-tokens 160] [--json ...]

Each workload runs on three engines: plain, n-gram (prompt lookup 2..4) and suffix decoding.  The
speculating engines run it twice: the first pass drafts from each request's own tokens only
(and, for suffix, from the answers of the workload's requests before it); the second pass asks
the same requests again, as an agent or a retrying client does, and suffix decoding drafts
from the first pass's answers.  Reported per pass: tokens/s (tokens generated / wall time,
prefill included), acceptance length (vLLM's: 1 + accepted / drafts), and whether the outputs
are the plain ones.  One run of each; the machine is shared, so the ratios are the figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402
from bench_spec_decode import make_engine, timed, workloads  # noqa: E402


def main(argv=None) -> dict:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--checkpoint", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    a.add_argument("--k", type=int, default=4)
    a.add_argument("--max-tokens", type=int, default=160)
    a.add_argument("--prompts", type=int, default=None, help="the first N prompts of each workload (tests)")
    a.add_argument("--workloads", nargs="+", default=["edit", "chat"], choices=["edit", "chat"])
    a.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix"])
    a.add_argument("--json", default=str(bl.RESULTS / "bench_suffix_decode.json"))
    args = a.parse_args(argv)
    from ray_attn.gguf_file import gguf_path, load_tokenizer
    from ray_attn.presets import default_gguf

    path = str(gguf_path(args.checkpoint) if args.checkpoint else default_gguf())
    work = {name: ps[:args.prompts] for name, ps in workloads(load_tokenizer(path)).items() if name in args.workloads}
    specs = {"ngram": dict(method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=2, prompt_lookup_max=4,
                           disable_by_batch_size=None),
             "suffix": dict(method="suffix", num_speculative_tokens=args.k, disable_by_batch_size=None)}
    rows = []
    for name, prompts in work.items():
        plain = make_engine(path, None, 1)
        wall, want, _ = timed(plain, prompts, args.max_tokens, at_once=False)
        n = sum(map(len, want))
        base = n / wall
        rows.append(dict(workload=name, method="plain", run=1, tokens=n, tokens_per_s=round(base, 1)))
        print(f"{name:5s} plain          {base:6.1f} tok/s", flush=True)
        for method, spec in ((m, specs[m]) for m in args.methods):
            eng = make_engine(path, spec, 1)
            for run in (1, 2):
                wall, got, grew = timed(eng, prompts, args.max_tokens, at_once=False)
                m = sum(map(len, got))
                acc = 1 + grew["accepted"] / grew["drafts"] if grew["drafts"] else 0.0
                same = sum(g == w for g, w in zip(got, want))
                r = dict(workload=name, method=method, run=run, tokens=m, tokens_per_s=round(m / wall, 1),
                         speedup=round(m / wall / base, 2), acceptance_length=round(acc, 2),
                         identical=f"{same}/{len(want)}")
                rows.append(r)
                print(f"{name:5s} {method:6s} run {run}  {r['tokens_per_s']:6.1f} tok/s  {r['speedup']:.2f}x  "
                      f"acceptance {acc:.2f}  identical {same}/{len(want)}", flush=True)
            eng.shutdown()
        plain.shutdown()
    out = dict(machine=bl.machine(), checkpoint=path, k=args.k, max_tokens=args.max_tokens, rows=rows)
    if args.json:
        bl.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
