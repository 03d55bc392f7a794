"""lm-evaluation-harness against the Serve app over HTTP, as its users run it: ``local-completions``
on a multiple-choice task (loglikelihoods: ``echo`` + ``logprobs``) and a ``generate_until`` task,
and ``local-chat-completions`` on the latter (lm-eval runs no loglikelihood over chat).  Tasks are
small local JSONL files; every request must be answered, and each loglikelihood must equal the
teacher-forced float64 log-softmax of the served weights (``helpers.float64_logprobs``) -- the
numbers are checked, not the harness's score.

Tolerance 1e-3 on a continuation's summed loglikelihood (a few tokens at 2e-4 each, see
test_openai_echo.py).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.serve.conftest import MODEL_ID
from tests.serve.helpers import float64_logprobs
from tests.timescale import scaled

lm_eval = pytest.importorskip("lm_eval")  # the test extra has it
pytestmark = pytest.mark.slow

MC = [  # short: the test app takes prompts of at most 64 tokens
    {"question": "the quick brown fox jumps over the", "choices": [" lazy dog", " moon", " hello world"], "answer": 0},
    {"question": "hello world, hello", "choices": [" ray", " attention", " fox"], "answer": 0},
    {"question": "Paged attention keeps the key value cache in", "choices": [" fixed size blocks.", " a box"],
     "answer": 0},
    {"question": "numbers 0 1 2 3", "choices": [" 4 5", " 9", " the end"], "answer": 0},
]
GEN = [{"question": "Once upon a time there", "answer": "was"}, {"question": "hello world,", "answer": "hello"},
       {"question": "café naïve", "answer": "résumé"}]

TASKS = {
    "tiny_mc": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                "metric_list": [{"metric": "acc"}]},
    "tiny_gen": {"output_type": "generate_until", "doc_to_target": "{{answer}}",
                 "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False, "temperature": 0.0},
                 "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    import yaml

    d = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs in (("tiny_mc", MC), ("tiny_gen", GEN)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
        spec = dict(task=name, dataset_path="json", dataset_kwargs={"data_files": {"test": str(d / f"{name}.jsonl")}},
                    test_split="test", doc_to_text="{{question}}", **TASKS[name])
        (d / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    return d


def evaluate(model, tasks, task_dir, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, tasks=tasks, task_manager=TaskManager(include_path=str(task_dir)),
                           log_samples=True, **kw)


def local_completions(served):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(model=MODEL_ID, base_url=served.url + "/v1/completions", tokenizer=served.tokenizer_dir,
                               max_retries=1, timeout=int(scaled(120)), max_gen_toks=6)


def greedy_text(served, prompt: str, **body) -> str:
    r = httpx.post(served.url + "/v1/completions", json=dict(model=MODEL_ID, prompt=prompt, max_tokens=6,
                                                             temperature=0, stop=["\n"], **body),
                   timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_local_completions_loglikelihoods_are_the_models(served, task_dir):
    lm = local_completions(served)
    out = evaluate(lm, ["tiny_mc", "tiny_gen"], task_dir)
    mc, gen = out["samples"]["tiny_mc"], out["samples"]["tiny_gen"]
    assert len(mc) == len(MC) and len(gen) == len(GEN)
    engine = served.args["engine"]
    checked = 0
    for s in mc:
        assert len(s["filtered_resps"]) == len(s["doc"]["choices"])
        for (ctx, cont), (ll, greedy) in zip((a[:2] for a in s["arguments"]), s["filtered_resps"]):
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
            ids = ctx_ids + cont_ids
            ref = float64_logprobs(engine, ids)
            rows = np.arange(len(ctx_ids) - 1, len(ids) - 1)
            assert float(ll) == pytest.approx(float(ref[rows, cont_ids].sum()), abs=1e-3)
            assert bool(greedy) == bool((ref[rows].argmax(-1) == cont_ids).all())
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC)
    # generate_until: what greedy /v1/completions gives for the same prompt, cut at the stop
    for s in gen:
        assert s["filtered_resps"][0] == greedy_text(served, s["arguments"][0][0])
    assert 0 <= out["results"]["tiny_mc"]["acc,none"] <= 1


def test_local_chat_completions_generates(served, task_dir):
    from lm_eval.models.openai_completions import LocalChatCompletion

    lm = LocalChatCompletion(model=MODEL_ID, base_url=served.url + "/v1/chat/completions", max_retries=1,
                             timeout=int(scaled(120)), max_gen_toks=6)
    out = evaluate(lm, ["tiny_gen"], task_dir, apply_chat_template=True)
    gen = out["samples"]["tiny_gen"]
    assert len(gen) == len(GEN)
    for s in gen:
        ctx = s["arguments"][0][0]  # lm-eval's JsonChatStr (a 1-tuple once logged): the messages as JSON
        msgs = json.loads(ctx[0] if isinstance(ctx, tuple) else ctx)
        r = httpx.post(served.url + "/v1/chat/completions", timeout=scaled(120), json=dict(
            model=MODEL_ID, messages=msgs, max_tokens=6, temperature=0, stop=["\n"]))
        assert r.status_code == 200, r.text
        assert s["filtered_resps"][0] == r.json()["choices"][0]["message"]["content"]
