"""lm-eval on a real model (issue 38 part 3): ``local-completions`` against ``ray-attn serve``'s app
serving SmolLM2-135M-Instruct, against lm-eval's own ``hf`` backend on the same GGUF (HF
transformers' reading of it, float32), on the two small tasks of ``lm_eval_tasks.py``.  Item by
item: each choice's loglikelihood within 1e-3 nats and each item's score equal; each greedy
string equal, or parted at a near-tie of HF's logits (``ray_attn.demo.compare``).

What breaks it: a served loglikelihood off by a position or computed in another dtype, an echoed
prompt logprob dropped, a stop string cut in the wrong place, a tokenizer that is not the file's.
"""

from __future__ import annotations

import pytest

from tests.serve.real_model import lm_eval_tasks as T
from tests.serve.real_model.smollm2_app import MODEL_ID
from tests.timescale import scaled

pytest.importorskip("lm_eval")  # the test extra has it
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_reference(smollm2, gguf_path):
    """HF's model and tokenizer from the GGUF, read while the app deploys (``smollm2`` first)."""
    return T.hf_model(gguf_path)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return T.write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def ours_lm(hf_reference, smollm2_url, tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_reference[1].save_pretrained(tok_dir)
    return T.local_completions(smollm2_url, MODEL_ID, str(tok_dir), timeout_s=int(scaled(120)))


@pytest.fixture(scope="module")
def reference_lm(hf_reference):
    return T.hf_lm(*hf_reference)


@pytest.fixture(scope="module")
def ours(ours_lm, task_dir):
    return T.evaluate(ours_lm, task_dir)


@pytest.fixture(scope="module")
def hf(reference_lm, task_dir, ours):  # after ours: the two never share the cores
    return T.evaluate(reference_lm, task_dir)


def test_both_backends_send_the_same_tokens(ours_lm, reference_lm):
    """What each backend feeds its model: the same ids for every (context, continuation)."""
    for doc in T.items(T.MC):
        for choice in doc["choices"]:
            pair = (doc["question"], " " + choice)  # lm-eval's default target_delimiter
            assert ours_lm._encode_pair(*pair) == reference_lm._encode_pair(*pair), pair
    for doc in T.items(T.GEN):
        assert ours_lm.tok_encode(doc["question"]) == reference_lm.tok_encode(doc["question"])


def test_multiple_choice_loglikelihoods_equal_hf_item_by_item(ours, hf):
    rows = T.compare_mc(ours, hf)
    assert len(rows) == len(T.items(T.MC))
    bad = [r for r in rows if not r.ok]
    assert not bad, bad
    assert T.score(ours, T.MC) == T.score(hf, T.MC)
    assert ours["results"][T.MC]["acc_norm,none"] == hf["results"][T.MC]["acc_norm,none"]


def test_greedy_generations_equal_hf_item_by_item(ours, hf, smollm2_url, hf_reference):
    rows = T.compare_gen(ours, hf, T.greedy_tokens(smollm2_url, MODEL_ID, *hf_reference))
    assert len(rows) == len(T.items(T.GEN))
    bad = [r for r in rows if not r.ok]
    assert not bad, bad
    if all(r.fork is None for r in rows):
        assert T.score(ours, T.GEN) == T.score(hf, T.GEN)


def test_a_string_that_differs_passes_only_at_a_near_tie():
    """The rule itself (no server): equal strings pass without a look at the tokens; different
    ones pass only where the tokens part at a near-tie of HF's logits (``demo.TIE``) -- not
    where they part farther apart, nor where the tokens agree and the text differs (a stop
    string cut in the wrong place)."""
    from ray_attn.demo import TIE

    def run(ours_text, hf_text, got, want, gap):
        asked = []
        scores = [[0.0, 0.0, 0.0], [5.0, 5.0 - gap, 0.0]]  # step 1: token 0 ahead of token 1 by gap

        def tokens(prompt):
            asked.append(prompt)
            return got, want, scores

        def out(text):
            return {"samples": {T.GEN: [{"doc_id": 0, "arguments": [("Q:", {})], "resps": [[text]],
                                         "exact_match": float(text == " a")}]}}
        (row,) = T.compare_gen(out(ours_text), out(hf_text), tokens)
        return row.ok, asked

    assert run(" a", " a", None, None, 0.0) == (True, [])
    assert run(" a b", " a c", [2, 1], [2, 0], TIE / 2) == (True, ["Q:"])
    assert run(" a b", " a c", [2, 1], [2, 0], 2 * TIE)[0] is False
    assert run(" a.", " a", [2, 1], [2, 1], 0.0)[0] is False
