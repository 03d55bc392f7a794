"""The correctness gate: every feature through the whole engine, against HF transformers.

For each row a checkpoint written by transformers is served by a fresh ``LLMEngine`` (Ray actors,
the default kernel, CUDA graphs and async scheduling unless the row turns one off), 12 prompts with
shared prefixes, long and short, are decoded greedily, and each generated token is compared with
HF's float32 argmax given the same history (teacher forcing).  The control is HF itself: its bf16
``generate`` on the same prompts, scored the same way.  A row passes when

    agreement >= control - margin   (3 points; fp8 rows: FP8_MARGIN, see below)

and the feature demonstrably ran (the kernel, cascade/local steps, prefix hits, preemptions,
graphs...: ``Row.expect``).  FP8-weight rows (``Row.weights``) serve the checkpoint in that format
(``fp8_checkpoints.py`` writes it) and hold it to HF on the same weights dequantized, with the
format's activation quantization on HF's linears in both the reference and the control.

    python scripts/gpu_accuracy.py                      # GPU: every single-GPU row
    python scripts/gpu_accuracy.py --rows tp2_graphs,tp2_eager --suffix _tp2   # on 2 GPUs
    python scripts/gpu_accuracy.py --rows bf16,fp8      # a subset; on CPU: tiny models, torch kernel

Writes ``benchmarks/results/gpu_accuracy{suffix}.json``; ``scripts/report.py`` makes the README's
"Correctness on GPU" table from it.  Exit status 1 when a row fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_lora as lora  # noqa: E402
import fp8_checkpoints as f8c  # noqa: E402
import hf_reference as hf  # noqa: E402
from accuracy_rows import Row, rows  # noqa: E402  (the gate's rows, one module of their own)

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402

# fp8 (e4m3) keeps 3 mantissa bits: every K/V element (and, on FlashAttention 3, q) moves by up to
# 6%, where bf16 moves it by 0.4%.  Published fp8-KV evaluations of real checkpoints stay within
# about a point of bf16 on downstream accuracy, but on a random-weight model (logits of order 1,
# close runner-ups) that perturbation flips more argmaxes; so an fp8 row is held to the HF bf16
# control with the q/K/V rounding applied (``fp8_control``), with the usual 3-point margin -- the
# format's own error is in the control, and the margin measures only our implementation.
MARGIN = 3.0
MAX_TOKENS = 32
# The json_schema row's schema: bounded, so that a random model's greedy output ends (an
# unbounded string would run to max_tokens); a synthetic byte vocabulary stands in for a tokenizer.
# Tokens are mostly single bytes there, so the row decodes up to GRAMMAR_MAX_TOKENS.
SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "ok", "n"], "additionalProperties": False}
GRAMMAR_MAX_TOKENS = 64


def prompt_sets(vocab: int, gpu: bool, seed: int = 0, chunk: int = 256) -> dict[str, list[list[int]]]:
    """12 prompts each: ``mixed`` = 8 sharing a long prefix + 4 unrelated (two short, two long);
    ``one_prefix`` = 12 sharing one; ``three_prefixes`` = 4 on each of three prefixes;
    ``repeats`` = 4 prompts, each 3 times (the n samples of a request, as the OpenAI app sends them);
    ``chunk_edges`` = 4 and 20 tokens short of each of the first six multiples of ``chunk``, so that
    every prompt's decode crosses a chunk boundary (up to ~6 chunks: 1,532 tokens at chunk 256)."""
    r = np.random.default_rng(seed)
    tok = lambda n: r.integers(0, vocab, n).tolist()
    k = 1 if gpu else 4  # CPU: the same shapes, shorter (the prefix still passes cascade's 256-token minimum)
    prefix = tok(1200 // k)
    suffixes = [tok(max(2, (10 + 9 * i) // k)) for i in range(12)]
    singles = [tok(max(3, n // k)) for n in (30, 80, 1500, 2400)]
    prefixes = [tok(n // k) for n in (600, 900, 1200)]
    return {"mixed": [prefix + s for s in suffixes[:8]] + singles,
            "one_prefix": [prefix + s for s in suffixes],
            "three_prefixes": [prefixes[i // 4] + suffixes[i] for i in range(12)],
            "repeats": [p for p in [prefixes[i] + suffixes[i] for i in range(3)] + [singles[2]] for _ in range(3)],
            "chunk_edges": [tok(chunk * j - d) for j in range(1, 7) for d in (4, 20)],
            # a pattern said three times: the model tends to go on repeating it, so drafts get accepted
            "repeating": [tok(max(4, n // k)) * 3 for n in (12, 16, 24, 32, 40, 48)],
            # 12 of them: cascade needs 8 requests at least (vLLM's rule)
            "repeating_prefix": [prefix + tok(max(4, n // k)) * 3 for n in range(12, 60, 4)],
            "_prefix": [prefix]}


def engine_config(row: Row, folder: str, gpu: bool, num_blocks: int) -> EngineConfig:
    dtype = "bfloat16" if gpu else "float32"
    extra = dict(quantization="fp8") if row.weights == "online" else {}
    model = ModelConfig.from_pretrained(folder, dtype=dtype, **row.model, **extra)
    cache = dict(num_blocks=num_blocks) | row.cache
    par = dict(tensor_parallel_size=row.tp, device="cuda" if gpu else "cpu") | row.parallel
    extra = dict(lora_config=lora.lora_config()) if row.lora else {}
    return EngineConfig(model=model, checkpoint=folder, cache=CacheConfig(**cache),
                        parallel=ParallelConfig(**par), **(dict(max_num_seqs=16) | row.engine),
                        speculative_config=draft_spec(row.spec, folder) or None, **extra)


def draft_spec(spec: dict, folder: str) -> dict:
    return spec | {"model": folder} if spec.get("model") == "target" else spec


def grammar(vocab: int):
    """(GrammarCompiler over ``hf.byte_vocab``, SCHEMA's compiled grammar, its spec)."""
    import xgrammar as xgr

    from ray_attn.structured_output import GrammarCompiler, StructuredOutputsParams

    info = xgr.TokenizerInfo(hf.byte_vocab(vocab), xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[0])
    compiler = GrammarCompiler(None, vocab, tokenizer_info=info)
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    return compiler, compiler.compile(spec), spec


class PlainRunDrafts:
    """Drafts from the same model's plain greedy run: for a request at output position i, the
    plain run's next k tokens, the last of every third draft run made wrong.  With random weights
    prompt lookup finds nothing the model goes on to say (the rows' drafts were never accepted),
    so the verifying path -- accepted runs, a rejection inside a run, the bonus token -- would go
    untested; with these, every step verifies drafts that are mostly right and sometimes not."""

    def __init__(self, prompts, plain, k: int, vocab: int):
        self.runs = {tuple(p): list(o) for p, o in zip(prompts, plain)}
        self.k, self.vocab, self.calls = k, vocab, 0

    def propose(self, tokens, k=None):
        k = self.k if k is None else min(k, self.k)
        for p, out in self.runs.items():
            if len(tokens) >= len(p) and tuple(tokens[:len(p)].tolist()) == p:
                i = len(tokens) - len(p)
                d = list(out[i:i + k])
                self.calls += 1
                if d and self.calls % 3 == 0:
                    d[-1] = (d[-1] + 1) % self.vocab
                return np.array(d, dtype=tokens.dtype)
        return tokens[:0]


def run_engine(row: Row, cfg: EngineConfig, prompts, prefix, loras=None,
               executor: str = "ray") -> tuple[list[list[int]], dict, dict]:
    from ray_attn.engine import LLMEngine, SamplingParams
    from ray_attn.runtime import InProcessExecutor

    if row.fp8_kernel:
        from ray_attn.model import fp8 as F8

        forced, F8.FORCE = F8.FORCE, row.fp8_kernel
        try:
            return run_engine(dataclasses.replace(row, fp8_kernel=""), cfg, prompts, prefix, loras, "in_process")
        finally:
            F8.FORCE = forced
    want = None
    if row.spec:  # the plain run first: its tokens are the drafts, then what speculation must equal
        want, _, _ = run_engine(dataclasses.replace(row, spec={}), cfg.model_copy(update={"speculative_config": None}),
                                prompts, prefix, executor=executor)
    engine = LLMEngine(cfg, InProcessExecutor(cfg) if executor == "in_process" and row.tp == 1 else None)
    if want is not None and engine.spec.proposer is not None:  # a draft model proposes on the ranks
        engine.spec.proposer = PlainRunDrafts(prompts, want, row.spec["num_speculative_tokens"], cfg.model.vocab_size)
    try:
        if row.warm_prefix:
            engine.generate([prefix[0] + [0]], SamplingParams(max_tokens=1))
        # HF's control runs all MAX_TOKENS whatever it emits, so ours does too (a checkpoint's
        # eos_token_id would otherwise end some outputs early); a grammar ends where it ends.
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        if row.grammar:
            engine.grammar_compiler, _, spec = grammar(cfg.model.vocab_size)
            params = SamplingParams(max_tokens=GRAMMAR_MAX_TOKENS, ignore_eos=True, structured_outputs=spec)
        outs = engine.generate(prompts, params, lora_request=loras)
        info = {"kernel": engine.executor.kernel_name, "async": engine.async_scheduling,
                "cuda_graphs": bool(engine.executor.infos[0].get("cuda_graphs")),  # what rank 0 captured
                "fp8_linears": engine.executor.infos[0].get("fp8_linears", 0), "num_prompts": len(prompts)}
        stats = engine.stats.as_dict() | engine.planner.stats()  # the planner's: KV tier hits
        tokens = [o.output_token_ids for o in outs]
    finally:
        engine.shutdown()
    if want is not None:
        forks = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                 for x, y in zip(tokens, want) if x != y]
        info.update(spec_identical=len(prompts) - len(forks), spec_forks=forks)
    return tokens, stats, info


class Controls:
    """HF references per (checkpoint, attention variant), built once and shared by the rows."""

    def __init__(self, device):
        self.device = device
        self._fp32 = {}
        self.cache = {}

    def attention(self, row: Row, cfg: EngineConfig, fp8_round: bool = False):
        """The HF attention implementation that computes what the row's model computes."""
        m = cfg.model
        if not fp8_round and row.model.get("layer_types") is None:
            return "eager"
        import transformers as tf

        kinds = m.layer_kinds()
        name = f"ray_attn_{row.name}_{int(fp8_round)}"
        rounder = hf.fp8_rounder() if fp8_round else None
        tf.AttentionInterface.register(name, hf.masked_attention(
            kinds, chunk=m.attention_chunk_size, window=m.sliding_window, kv_round=rounder))
        return name

    def load(self, folder: str, dtype, attn: str, act: str | None):
        model = hf.load_hf(folder, dtype, self.device, attn)
        if act:
            f8c.add_activation_rounding(model, act)
        return model

    def fp32(self, folder: str, attn: str, act: str | None = None):
        key = (folder, attn, act)
        if key not in self._fp32:
            self._fp32.clear()  # one float32 model at a time
            self._fp32[key] = self.load(folder, torch.float32, attn, act)
        return self._fp32[key]

    def control(self, folder: str, attn_ref: str, attn_ctrl: str, prompts_key: str, prompts,
                act: str | None = None) -> float:
        key = (folder, attn_ref, attn_ctrl, prompts_key, act)
        if key not in self.cache:
            model = self.load(folder, torch.bfloat16, attn_ctrl, act)
            outs = [hf.greedy_generate(model, p, MAX_TOKENS) for p in prompts]
            del model
            self.cache[key] = 100 * hf.agreement(self.fp32(folder, attn_ref, act), prompts, outs)
        return self.cache[key]


class Gate:
    """Checkpoints, prompts and HF controls for one machine; ``run(row)`` scores one row."""

    def __init__(self, gpu: bool, workdir: str, init: str = "alive", executor: str = "ray"):
        # executor "in_process": TP=1 rows run their rank in this process instead of a Ray actor
        # (the CPU tests: an actor's start is a third of a tiny row's time there)
        self.gpu, self.workdir, self.init, self.executor = gpu, workdir, init, executor
        self.size = hf.GPU_SIZE if gpu else hf.CPU_SIZE
        self.window, self.chunk = (384, 512) if gpu else (40, 48)
        # Llama 4's checkpoints: chunk 256 (decode crosses boundaries), and one chunk long enough
        # to hold every one_prefix prompt (so cascade is exact)
        self.llama4_chunks = {"llama4": 256 if gpu else 32, "llama4_onechunk": 2048 if gpu else 512,
                              "llama4_c512": 512 if gpu else 48}
        self.prompts = prompt_sets(self.size["vocab"], gpu, chunk=self.llama4_chunks["llama4"])
        self.controls = Controls(torch.device("cuda" if gpu else "cpu"))
        self.folders: dict[str, str] = {}

    def rows(self) -> list[Row]:
        return rows(self.gpu, self.chunk, self.size["layers"])

    def checkpoint(self, family: str, weights: str = "") -> str:
        """The family's checkpoint (``weights``: in that FP8 format; ``weights + "_hf"``: its
        weights dequantized to float32, for HF)."""
        key = family + (f"_{weights}" if weights else "")
        if key in self.folders:
            return self.folders[key]
        folder = os.path.join(self.workdir, key)
        if weights.endswith("_hf"):
            kind = weights[:-3]
            f8c.write_dequantized(self.checkpoint(family, kind), folder, kind)
        elif weights:
            folder = f8c.write_fp8_checkpoint(self.checkpoint(family), folder, weights)
        else:
            hf.write_checkpoint(family, folder, size=self.size, seed=1, window=self.window, init=self.init,
                                dtype=torch.bfloat16 if self.gpu else torch.float32,
                                chunk=self.llama4_chunks.get(family))
        self.folders[key] = folder
        return folder

    def run(self, row: Row) -> dict:
        t0 = time.perf_counter()
        res = dict(row=row.name, what=row.what, family=row.family, tp=row.tp, prompts=row.prompts)
        try:
            folder = self.checkpoint(row.family, row.weights)
            ref_folder = self.checkpoint(row.family, row.weights + "_hf") if row.weights else folder
            act = f8c.ACT[row.weights] if row.weights else None
            prompts = self.prompts[row.prompts]
            cfg = engine_config(row, folder, self.gpu, 4096 if row.cache.get("block_size", 16) == 16 else 256)
            adapters = lora.write_adapters(folder, self.workdir) if row.lora else None
            outs, stats, info = run_engine(row, cfg, prompts, self.prompts["_prefix"],
                                           lora.requests(adapters, len(prompts)) if row.lora else None,
                                           executor=self.executor)
            c = self.controls
            attn_ref = c.attention(row, cfg)
            if row.lora:
                agree, ctrl, info["lora_shift"] = lora.score(c, folder, attn_ref, adapters, row.prompts, prompts, outs)
                res["lora_shift"] = round(info["lora_shift"], 1)
            elif row.grammar:
                agree, ctrl = self.grammar_scores(ref_folder, attn_ref, cfg.model.vocab_size, prompts, outs)
                res["json_valid"] = self.valid_json(cfg.model.vocab_size, outs)
            else:
                agree = 100 * hf.agreement(c.fp32(ref_folder, attn_ref, act), prompts, outs)
                ctrl = c.control(ref_folder, attn_ref, attn_ref, row.prompts, prompts, act)
            res.update(agreement=agree, control_bf16=ctrl, kernel=info["kernel"], cuda_graphs=info["cuda_graphs"],
                       fp8_linears=info["fp8_linears"],
                       async_scheduling=info["async"], stats={k: stats[k] for k in (
                           "steps", "cascade_steps", "multi_group_cascade_steps", "local_steps",
                           "preemptions", "prefix_cache_hit_tokens", "host_hit_blocks", "onloaded_blocks",
                           "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_mean_acceptance_length") if k in stats})
            if row.spec:
                res.update(spec_identical=info["spec_identical"], spec_forks=info["spec_forks"])
            threshold = ctrl - MARGIN
            if row.fp8:
                res["control_fp8"] = c.control(ref_folder, attn_ref, c.attention(row, cfg, True), row.prompts, prompts,
                                               act)
                threshold = res["control_fp8"] - MARGIN
            res["threshold"] = threshold
            why = row.expect(res["stats"], info)
            if row.grammar and res["json_valid"] < len(outs):
                why = f"only {res['json_valid']} of {len(outs)} outputs are valid JSON of the schema"
            res["passed"] = agree >= threshold and why is None
            res["note"] = why or ""
        except Exception as e:  # a row that cannot run is a failed row, not a crashed gate
            res.update(passed=False, note=f"{type(e).__name__}: {e}"[:500])
        res["seconds"] = round(time.perf_counter() - t0, 1)
        return res


    def grammar_scores(self, folder, attn, vocab, prompts, outs) -> tuple[float, float]:
        """(ours, HF bf16's masked greedy) agreement with HF fp32 under the same mask."""
        compiler, compiled, spec = grammar(vocab)
        new = lambda: compiler.matcher(compiled, spec)  # noqa: E731 -- the engine's own matcher, either backend
        ref = self.controls.fp32(folder, attn)
        agree = 100 * hf.masked_agreement(ref, prompts, outs, new, vocab)
        model = hf.load_hf(folder, torch.bfloat16, self.controls.device, attn)
        ctrl_outs = [hf.masked_greedy_generate(model, p, GRAMMAR_MAX_TOKENS, new, vocab) for p in prompts]
        del model
        return agree, 100 * hf.masked_agreement(ref, prompts, ctrl_outs, new, vocab)

    @staticmethod
    def valid_json(vocab, outs) -> int:
        """How many outputs decode (through ``hf.byte_vocab``) to JSON that SCHEMA accepts."""
        import jsonschema

        pieces, ok = hf.byte_vocab(vocab), 0
        for o in outs:
            text = b"".join(pieces[t] for t in o if t != 0).decode("utf-8", "replace")
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="comma-separated row names (default: every TP=1 row)")
    ap.add_argument("--suffix", default="", help="result file suffix, e.g. _tp2")
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/gpu_accuracy{suffix}.json)")
    ap.add_argument("--update", action="store_true", help="keep the result file's rows that this run does not redo")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--init", choices=["alive", "hf"], default="alive",
                    help="weights: re-drawn to keep the model alive (default), or transformers' own init")
    args = ap.parse_args()
    import ray
    import transformers
    from tqdm.auto import tqdm

    from ray_attn.runtime.cluster import ensure_ray

    gpu = torch.cuda.is_available()
    gate = Gate(gpu, args.workdir or tempfile.mkdtemp(prefix="ray_attn_accuracy_"), args.init)
    all_rows = gate.rows()
    names = [n for n in args.rows.split(",") if n] or [r.name for r in all_rows if r.tp == 1]
    unknown = set(names) - {r.name for r in all_rows}
    if unknown:
        sys.exit(f"unknown rows {sorted(unknown)}; choose from {[r.name for r in all_rows]}")
    transformers.utils.logging.disable_progress_bar()
    started = not ray.is_initialized()  # called in-process (the tests), a Ray already up stays up
    ensure_ray()
    path = Path(args.out) if args.out else (Path(__file__).resolve().parent.parent / "benchmarks" / "results"
                                            / f"gpu_accuracy{args.suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    # --update keeps the file's other rows (a run split over several time-limited GPU calls)
    kept = [r for r in json.loads(path.read_text())["rows"] if r["row"] not in names] \
        if args.update and path.exists() else []
    results = []
    bar = tqdm([r for r in all_rows if r.name in names], desc="accuracy rows", unit="row")
    for row in bar:
        bar.set_postfix_str(row.name)
        results.append(gate.run(row))
        tqdm.write(format_row(results[-1]))
        # written after every row, so that a run cut short keeps what it measured
        order = {r.name: i for i, r in enumerate(all_rows)}
        rows_out = sorted(kept + results, key=lambda r: order.get(r["row"], len(order)))
        out = hf_env(gpu) | dict(margin=MARGIN, max_tokens=MAX_TOKENS, size=gate.size, init=args.init,
                                 rows=rows_out)
        path.write_text(json.dumps(out, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], path.name).write_text(path.read_text())
    if started:
        ray.shutdown()
    failed = [r["row"] for r in results if not r["passed"]]
    print(f"{len(results) - len(failed)}/{len(results)} rows passed" + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


def format_row(r: dict) -> str:
    if "agreement" not in r:
        return f"{r['row']:20s} ERROR {r['note']}"
    ctrl = f"bf16 {r['control_bf16']:.1f}" + (f", fp8-rounded {r['control_fp8']:.1f}" if "control_fp8" in r else "")
    return (f"{r['row']:20s} {'PASS' if r['passed'] else 'FAIL'}  agreement {r['agreement']:.1f}%  "
            f"(HF control: {ctrl}; needs {r['threshold']:.1f})  kernel={r['kernel']} graphs={r['cuda_graphs']} "
            f"async={r['async_scheduling']} {r['stats']} {r['note']}")


def hf_env(gpu: bool) -> dict:
    import transformers

    return dict(device=torch.cuda.get_device_name() if gpu else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"))


if __name__ == "__main__":
    main()
