"""The driver's speculative bookkeeping (ray_attn/spec/decoder.py) on a real planner: which rows get
drafts and how many, the per-logits-row sampling inputs of a step (token index and penalty
history at each draft position), and the rollback once the step's tokens are read."""

from __future__ import annotations

import numpy as np

from ray_attn.config import EngineConfig, ModelConfig, ParallelConfig
from ray_attn.planner import Planner
from ray_attn.request import PLACEHOLDER, Request
from ray_attn.sampling_params import SamplingParams
from ray_attn.scheduler import SchedulerOutput
from ray_attn.spec.decoder import SpecDecoder

V = 64


def setup(max_tokens=20, budget=256, **params):
    cfg = EngineConfig(model=ModelConfig(vocab_size=V, hidden_size=128, intermediate_size=128, num_hidden_layers=1),
                       parallel=ParallelConfig(device="cpu"), max_num_batched_tokens=budget,
                       speculative_config=dict(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    planner = Planner(num_blocks=16, block_size=16, num_query_heads=4, num_kv_heads=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5]
    out = [6, 7, 1, 2]  # generated so far; its last token is not computed yet
    req = Request("a", prompt + out, len(prompt), SamplingParams(max_tokens=max_tokens, **params))
    req.sched.num_new_tokens = len(req.token_ids) - 1
    planner.plan([req.sched])
    return SpecDecoder(cfg, planner), planner, req


def propose(dec, req, n_running=1):
    out = SchedulerOutput([req], [1], 0)
    dec.propose(out, n_running)
    return out


def test_a_decoding_row_gets_the_lookup_drafts_within_max_tokens_and_the_budget():
    dec, planner, req = setup()
    out = propose(dec, req)
    assert req.token_ids[-3:] == [3, 4, 5] and req.num_drafts == 3 and out.num_new_tokens == [4]
    assert req.sched.num_draft_tokens == 3
    dec.undo(out)
    assert req.num_drafts == 0 and req.token_ids[-1] == 2 and out.num_new_tokens == [1]
    # max_tokens 6 with 4 out: one more token after this step's, so one draft (+ the target's)
    dec, _, req = setup(max_tokens=6)
    assert propose(dec, req).num_new_tokens == [2]
    dec, _, req = setup(max_tokens=5)  # the step's own token is the last: no drafts
    assert propose(dec, req).num_new_tokens == [1]
    dec, _, req = setup()
    dec.max_num_batched_tokens = 3  # 1 token scheduled, 2 left in the budget
    assert propose(dec, req).num_new_tokens == [3]
    dec, _, req = setup()
    dec.disable_by_batch_size = 2
    assert propose(dec, req, n_running=3).num_new_tokens == [1]


class TakesFirst:
    """A grammar that takes ``n`` of any drafts from where the request is."""

    def __init__(self, n):
        self.n, self.asked = n, []

    def accepts(self, tokens):
        self.asked.append(list(tokens))
        return min(self.n, len(tokens))


def test_a_constrained_row_gets_the_drafts_its_grammar_takes():
    dec, planner, req = setup()
    req.grammar = TakesFirst(0)
    assert propose(dec, req).num_new_tokens == [1] and req.num_drafts == 0
    assert req.grammar.asked == [[3, 4, 5]]  # the lookup's drafts, cut to none
    req.grammar = TakesFirst(2)
    assert propose(dec, req).num_new_tokens == [3] and req.token_ids[-2:] == [3, 4] and req.num_drafts == 2


def test_prefill_rows_get_none():
    dec, planner, req = setup()
    out = SchedulerOutput([req], [1], 0)
    req.token_ids.append(9)  # two tokens not computed: a chunk of a prefill, not a decode
    dec.propose(out, 1)
    assert out.num_new_tokens == [1] and req.num_drafts == 0


def test_each_logits_row_samples_its_own_token_index_over_its_own_history():
    dec, planner, req = setup(repetition_penalty=1.2, frequency_penalty=0.5, temperature=0.7, seed=3)
    out = propose(dec, req)
    req.sched.num_new_tokens = out.num_new_tokens[0]
    plan = planner.plan([req.sched])
    n_out = req.num_output_tokens - req.num_drafts  # 4: the drafts are not outputs yet
    got = dec.step_inputs(0, plan, [req], [True], np.array([0.7], np.float32), np.array([3], np.int64),
                          np.array([n_out], np.int32), frozenset(), V, None)
    temps, seeds, index, si, spec = got
    assert temps.tolist() == [np.float32(0.7)] * 4 and seeds.tolist() == [3] * 4
    assert index.tolist() == [4, 5, 6, 7]  # position j draws token index n_out + j
    assert spec.num_draft_tokens.tolist() == [3] and spec.draft_token_ids.tolist() == [3, 4, 5]
    # the logits rows are the positions of the last sampled token and of each draft
    assert plan.input_token_ids[spec.logits_indices].tolist() == [2, 3, 4, 5]
    prompt = np.array(req.prompt_token_ids) + V  # a repetition penalty sees the prompt, offset by V
    starts = np.concatenate([[0], np.cumsum(si.history_lens)])
    for j in range(4):
        h = si.history[starts[j]:starts[j + 1]].tolist()
        assert h == prompt.tolist() + [6, 7, 1, 2] + [3, 4, 5][:j], j


def test_accept_rolls_the_planner_back_and_leaves_a_placeholder_per_emitted_token():
    dec, planner, req = setup()
    out = propose(dec, req)
    req.sched.num_new_tokens = out.num_new_tokens[0]
    plan = planner.plan([req.sched])
    dec.step_inputs(7, plan, [req], [True], np.zeros(1, np.float32), np.full(1, -1, np.int64),
                    np.array([4], np.int32), frozenset(), V, None)
    req.token_ids.append(PLACEHOLDER)  # the engine's placeholder for the step's token
    req.pending = 1
    assert planner.num_computed_tokens("a") == 19  # 15 before the step, then 2 + three drafts
    layout, emitted = dec.take(7, np.array([3, 4, 9, -1], np.int32))
    assert emitted == [[3, 4, 9]]
    dec.accept(req, 0, layout, emitted[0])
    assert planner.num_computed_tokens("a") == 15 + 1 + 2  # the KV of 2, 3, 4: draft 5's is stale
    assert req.num_drafts == 0 and req.pending == 3 and req.token_ids[-3:] == [PLACEHOLDER] * 3
    assert dec.stats.num_drafts == 1 and dec.stats.num_accepted_tokens == 2
    assert dec.stats.num_accepted_tokens_per_pos == [1, 1, 0] and dec.stats.mean_acceptance_length == 3.0
    assert dec.take(7, np.zeros(4, np.int32)) is None  # read once
