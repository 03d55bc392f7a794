"""The real model on a GPU, scored the way the accuracy gate scores every feature.

SmolLM2-135M-Instruct (the embedded GGUF, or ``--gguf``) answers chat questions through the
engine -- Ray ranks, the default kernel (FlashAttention 3 for its head size 64 in bf16), CUDA
graphs and async scheduling on a GPU -- and each answer is printed.  Then, as in
``gpu_accuracy.py``: every generated token is compared with HF transformers' float32 argmax given
the same history (teacher forcing, HF loading the same GGUF), and the control is HF's own bf16
``generate`` scored the same way.  It passes when

    agreement >= control - 3 points

and the answers are text (each decodes to at least one word).  Also reported: how many answers
equal HF float32's own greedy answer token for token.

    python scripts/gpu_real_model.py --device cuda        # on the GPU machine
    python scripts/gpu_real_model.py --questions 2 --max-tokens 8   # CPU (float32, torch kernel)

Writes ``benchmarks/results/gpu_real_model.json`` (``--out``); exit status 1 when it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ray_attn.config import EngineConfig, ParallelConfig  # noqa: E402
from ray_attn.demo import QUESTIONS, chat_ids  # noqa: E402
from ray_attn.engine import LLMEngine, SamplingParams  # noqa: E402
from ray_attn.gguf_file import hf_causal_lm, load_tokenizer  # noqa: E402
from ray_attn.presets import default_gguf  # noqa: E402

MARGIN = 3.0
MORE_QUESTIONS = ["Explain what a hash table is.", "Give me a short recipe for pancakes.",
                  "Why is the sky blue?", "Translate 'good morning' into French and Spanish.",
                  "List four planets of the solar system.", "What is 12 times 7?",
                  "Write two sentences about Ray, the distributed computing framework.",
                  "Summarize the plot of Romeo and Juliet in one sentence."]


def hf_model(path: str, dtype, device):
    return hf_causal_lm(path, dtype).to(device)


@torch.no_grad()
def teacher_forced(model, prompt: list[int], out: list[int]) -> list[int]:
    seq = torch.tensor([prompt + out], device=model.device)
    return model(seq).logits[0, len(prompt) - 1: len(prompt) + len(out) - 1].argmax(-1).tolist()


@torch.no_grad()
def greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    t = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                       pad_token_id=next(iter(eos), 0))[0, len(prompt):].tolist()
    end = next((i + 1 for i, x in enumerate(t) if x in eos), len(t))
    return t[:end]


def agreement(model, prompts, outs) -> float:
    hits = total = 0
    for p, o in zip(prompts, outs):
        hits += sum(a == b for a, b in zip(teacher_forced(model, p, o), o))
        total += len(o)
    return 100.0 * hits / max(total, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--questions", type=int, default=len(QUESTIONS) + len(MORE_QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/gpu_real_model.json")
    args = ap.parse_args()
    path = args.gguf or default_gguf()
    gpu = args.device == "cuda"
    dev = torch.device(args.device)
    tok = load_tokenizer(path)
    questions = (QUESTIONS + MORE_QUESTIONS)[:args.questions]
    prompts = [chat_ids(tok, q) for q in questions]
    cfg = EngineConfig(checkpoint=path, model={"dtype": "bfloat16" if gpu else "float32"},
                       parallel=ParallelConfig(device=args.device), max_num_seqs=32, max_num_batched_tokens=2048)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    try:
        outs = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens))]
        info = engine.executor.infos[0]
        kernel, graphs = engine.executor.kernel_name, info.get("cuda_graphs")
        stats = engine.stats.as_dict()
    finally:
        engine.shutdown()
    engine_s = time.perf_counter() - t0
    answers = [tok.decode(o, skip_special_tokens=True).strip() for o in outs]
    for q, a in zip(questions, answers):
        print(f"Q: {q}\nA: {a}\n")
    ref = hf_model(path, torch.float32, dev)
    eos = ref.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    agree = agreement(ref, prompts, outs)
    hf32 = [greedy(ref, p, args.max_tokens, eos) for p in prompts]
    same = sum(a == b for a, b in zip(outs, hf32))
    ctl_model = hf_model(path, torch.bfloat16 if gpu else torch.float32, dev)
    ctl_outs = [greedy(ctl_model, p, args.max_tokens, eos) for p in prompts]
    del ctl_model
    control = agreement(ref, prompts, ctl_outs)
    words = all(any(c.isalpha() for c in a) for a in answers)
    passed = agree >= control - MARGIN and words
    res = dict(gguf=os.path.basename(path), device=torch.cuda.get_device_name() if gpu else "cpu",
               kernel=kernel, cuda_graphs=graphs, dtype=cfg.model.dtype, questions=questions, answers=answers,
               agreement=agree, control=control, threshold=control - MARGIN, equal_to_hf_fp32_greedy=same,
               answers_are_text=words, passed=passed, engine_s=round(engine_s, 1),
               tokens_generated=stats["tokens_generated"])
    print(json.dumps({k: v for k, v in res.items() if k not in ("questions", "answers")}, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
