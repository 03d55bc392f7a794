"""lm-eval on SmolLM2-135M-Instruct, ours against HF: the README's "Real model" table.

Ours: lm-eval's ``local-completions`` against ``ray-attn serve``'s own app (no checkpoint: the
embedded GGUF, one rank on CPU) on a local Ray cluster.  HF: lm-eval's ``hf`` backend on HF
transformers' reading of the same GGUF, float32.  The tasks are the tests' own
(``tests/serve/real_model/lm_eval_tasks.py``, items in ``tests/data/smollm2_facts_*.jsonl``), and the
comparison is theirs: every choice's loglikelihood within 1e-3 nats and every item's score equal;
every greedy string equal, or parted at a near-tie of HF's logits.

    python scripts/lm_eval_real_model.py [--port 8000]

Prints the table (markdown), writes ``benchmarks/results/lm_eval_real_model.json``; exit status 1
when an item disagrees.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: nothing reaches the hub
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)

import benchlib as bl  # noqa: E402


def table(ours: dict, hf: dict, mc, gen) -> tuple[list[dict], str]:
    from tests.serve.real_model import lm_eval_tasks as T

    rows = [dict(task=T.MC, items=len(mc), metric="acc", ours=T.score(ours, T.MC), hf=T.score(hf, T.MC),
                 ours_norm=ours["results"][T.MC]["acc_norm,none"], hf_norm=hf["results"][T.MC]["acc_norm,none"],
                 items_equal=sum(r.ok for r in mc), max_ll_diff=max(r.max_diff for r in mc)),
            dict(task=T.GEN, items=len(gen), metric="exact_match (first word)", ours=T.score(ours, T.GEN),
                 hf=T.score(hf, T.GEN), items_equal=sum(r.ours == r.hf for r in gen),
                 near_ties=sum(r.near_tie for r in gen), max_ll_diff=None)]
    lines = ["| task | items | metric | ours | HF | items agreeing | max \\|ours - HF\\| loglikelihood |",
             "|---|---|---|---|---|---|---|"]
    r = rows[0]
    lines.append(f"| {r['task']} (multiple choice) | {r['items']} | acc / acc_norm | {r['ours']:.4f} / "
                 f"{r['ours_norm']:.4f} | {r['hf']:.4f} / {r['hf_norm']:.4f} | {r['items_equal']}/{r['items']} "
                 f"| {r['max_ll_diff']:.1e} nats |")
    r = rows[1]
    ties = f" ({r['near_ties']} at near-ties)" if r["near_ties"] else ""
    lines.append(f"| {r['task']} (greedy generation) | {r['items']} | {r['metric']} | {r['ours']:.4f} | "
                 f"{r['hf']:.4f} | {r['items_equal']}/{r['items']} strings identical{ties} | - |")
    return rows, "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=None, help="Serve's HTTP port (default: a free one)")
    args = ap.parse_args()

    from ray import serve

    from ray_attn.presets import default_gguf
    from ray_attn.runtime.cluster import init_local_ray
    from tests.serve.real_model import lm_eval_tasks as T
    from tests.serve.real_model.smollm2_app import MODEL_ID, Deploying, app_config, http_port

    path = default_gguf()
    init_local_ray(include_dashboard=False, log_to_driver=False)
    port, _ = http_port(port=args.port)
    t0 = time.perf_counter()
    app = Deploying(app_config(), port)  # the replica loads while HF reads the GGUF here
    try:
        model, tok = T.hf_model(path)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            tok.save_pretrained(tmp / "tokenizer")
            task_dir = T.write_tasks(Path(tmp))
            url = app.url()
            print(f"app up after {time.perf_counter() - t0:.1f}s; lm-eval local-completions ...", flush=True)
            t1 = time.perf_counter()
            ours = T.evaluate(T.local_completions(url, MODEL_ID, str(tmp / "tokenizer")), task_dir)
            ours_s = time.perf_counter() - t1
            print("lm-eval hf ...", flush=True)
            t1 = time.perf_counter()
            hf = T.evaluate(T.hf_lm(model, tok), task_dir)
            hf_s = time.perf_counter() - t1
            mc = T.compare_mc(ours, hf)
            gen = T.compare_gen(ours, hf, T.greedy_tokens(url, MODEL_ID, model, tok))
    finally:
        app.delete()
        serve.shutdown()
    rows, md = table(ours, hf, mc, gen)
    print(md)
    for r in gen:
        print(f"  {r.prompt!r}: ours {r.ours!r}, HF {r.hf!r}" + (f" ({r.fork})" if r.fork else ""))
    bad = [r for r in mc if not r.ok] + [r for r in gen if not r.ok]
    out = bl.save("lm_eval_real_model", rows, model=os.path.basename(path), eval_s={"ours": ours_s, "hf": hf_s},
                  generations=[dict(prompt=r.prompt, ours=r.ours, hf=r.hf, fork=r.fork) for r in gen],
                  markdown=md, disagreements=[repr(r) for r in bad])
    print(f"wrote {out}")
    if bad:
        print("DISAGREE:", *bad, sep="\n  ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
