"""Two small lm-eval tasks on SmolLM2 and the item-by-item comparison of two lm-eval runs on them:
ours (``local-completions`` against the Serve app) and lm-eval's own ``hf`` backend (HF
transformers loading the same GGUF, float32).  Shared by ``test_lm_eval_smollm2.py`` and
``scripts/lm_eval_real_model.py`` (the README's table).

The items are in ``tests/data/smollm2_facts_{mc,gen}.jsonl``: simple facts that a 135M instruct
model gets partly right as plain completions.  ``smollm2_facts_mc`` scores each choice by its
loglikelihood (echo + logprobs over HTTP); ``smollm2_facts_gen`` is greedy ``generate_until``
(stop at a newline or a period, 8 tokens at most), scored on the first word.

What must agree (``compare_mc``, ``compare_gen``): each choice's loglikelihood within ``LL_TOL``
and each item's score; each generated string, or else a near-tie of HF's logits at the first
token where the two runs part (``ray_attn.demo.compare``: both compute one float32 function in
different summation orders, so a pick between two tokens ``TIE`` apart may differ).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

DATA = Path(__file__).resolve().parents[2] / "data"
MC, GEN = "smollm2_facts_mc", "smollm2_facts_gen"
MAX_GEN_TOKS = 8
UNTIL = ["\n", "."]
BATCH = 16  # prompts per HTTP request (the app's max_choices)
LL_TOL = 1e-3  # nats, on a choice's summed loglikelihood (the float32 runs agree to ~1e-4)

TASKS = {
    MC: {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                         {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]},
    GEN: {"output_type": "generate_until", "doc_to_target": "{{answer}}",
          "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False, "temperature": 0.0},
          # the first word of the answer, case and punctuation aside
          "filter_list": [{"name": "first_word", "filter": [{"function": "regex", "regex_pattern": r"(\w+)"},
                                                            {"function": "take_first"}]}],
          "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                           "ignore_case": True, "ignore_punctuation": True}]},
}
METRIC = {MC: "acc,none", GEN: "exact_match,first_word"}


def items(task: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{task}.jsonl").read_text().splitlines() if line]


def write_tasks(folder: Path) -> Path:
    """The tasks' YAMLs in ``folder`` (lm-eval's ``include_path``), naming the shipped items."""
    import yaml

    for name, spec in TASKS.items():
        body = dict(task=name, dataset_path="json", dataset_kwargs={"data_files": {"test": str(DATA / f"{name}.jsonl")}},
                    test_split="test", doc_to_text="{{question}}", **spec)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return folder


def evaluate(lm, task_dir: Path, tasks=(MC, GEN)) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's own ~14k task YAMLs took 10 s a run
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0)


# -- the two backends --------------------------------------------------------------------------------
def hf_model(path: str):
    """HF transformers' own reading of the GGUF: the model in float32 and the tokenizer (transformers'
    build from the metadata, saved once per run or machine by ``gguf_file.load_tokenizer``)."""
    import torch

    from ray_attn.gguf_file import hf_causal_lm, load_tokenizer

    return hf_causal_lm(path, torch.float32), load_tokenizer(path)


def hf_lm(model, tok):
    """lm-eval's ``hf`` backend on that model, 16 requests a batch (padded: its float32 sums move
    by ~1e-6, far inside LL_TOL)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tok, batch_size=BATCH, max_gen_toks=MAX_GEN_TOKS)


def local_completions(url: str, model_id: str, tokenizer_dir: str, timeout_s: int = 120):
    """lm-eval's ``local-completions`` against the app, as its users run it (token-id prompts,
    echo + logprobs for loglikelihoods, 16 prompts a request); the tokenizer is HF's reading of
    the same GGUF, saved."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(model=model_id, base_url=url + "/v1/completions", tokenizer=tokenizer_dir,
                               tokenizer_backend="huggingface", max_retries=1, timeout=timeout_s,
                               max_gen_toks=MAX_GEN_TOKS, batch_size=BATCH)


# -- item by item ------------------------------------------------------------------------------------
def samples(out: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in out["samples"][task]}


@dataclass
class McRow:
    doc_id: int
    ours: list[float]  # each choice's loglikelihood
    hf: list[float]
    acc: tuple[float, float]  # (ours, hf)

    @property
    def max_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.ours, self.hf))

    @property
    def ok(self) -> bool:
        return len(self.ours) == len(self.hf) and self.max_diff <= LL_TOL and self.acc[0] == self.acc[1]


def compare_mc(ours: dict, hf: dict) -> list[McRow]:
    a, b = samples(ours, MC), samples(hf, MC)
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    rows = []
    for i in sorted(a):
        assert [x[:2] for x in a[i]["arguments"]] == [x[:2] for x in b[i]["arguments"]], i  # same requests
        lls = [[float(r[0]) for r in s["filtered_resps"]] for s in (a[i], b[i])]
        rows.append(McRow(i, lls[0], lls[1], (a[i]["acc"], b[i]["acc"])))
    return rows


@dataclass
class GenRow:
    doc_id: int
    prompt: str
    ours: str
    hf: str
    score: tuple[float, float]  # exact_match of the first word, (ours, hf)
    fork: Optional[str] = None  # where the strings differ: where the tokens part, and how far apart
    near_tie: bool = False  # ... at a near-tie of HF's logits

    @property
    def ok(self) -> bool:
        return self.ours == self.hf and self.score[0] == self.score[1] or self.near_tie


def compare_gen(ours: dict, hf: dict, tokens: Callable[[str], tuple]) -> list[GenRow]:
    """Per item; where the strings differ, ``tokens(prompt)`` gives (our token ids, HF's, HF's
    logits per step) and the difference passes only where they part at a near-tie."""
    from ray_attn.demo import compare

    a, b = samples(ours, GEN), samples(hf, GEN)
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    rows = []
    for i in sorted(a):
        prompt = a[i]["arguments"][0][0]
        assert prompt == b[i]["arguments"][0][0], i
        row = GenRow(i, prompt, a[i]["resps"][0][0], b[i]["resps"][0][0], (a[i]["exact_match"], b[i]["exact_match"]))
        if row.ours != row.hf:
            got, want, scores = tokens(prompt)
            n = min(len(got), len(want))
            if got[:n] == want[:n]:  # the tokens agree: the text is cut or decoded differently
                row.fork = "the same tokens, different text"
            else:
                row.near_tie, row.fork = compare(got, want, scores)
        rows.append(row)
    return rows


def greedy_tokens(url: str, model_id: str, model, tok) -> Callable[[str], tuple]:
    """``tokens(prompt)``: our greedy tokens (over HTTP, ``return_token_ids``, no stop strings)
    and as many of HF's greedy ``generate``, with its logits at each step."""
    import httpx
    import torch

    def tokens(prompt: str) -> tuple:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
            model=model_id, prompt=ids, max_tokens=MAX_GEN_TOKS, temperature=0, return_token_ids=True))
        r.raise_for_status()
        got = r.json()["choices"][0]["token_ids"]
        with torch.no_grad():
            t = torch.tensor([ids])
            out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=len(got), do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        return got, out.sequences[0, len(ids):].tolist(), [s[0] for s in out.scores]

    return tokens


def score(out: dict, task: str) -> float:
    return float(out["results"][task][METRIC[task]])
