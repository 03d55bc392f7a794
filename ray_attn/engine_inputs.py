"""What one step sends to the ranks (``LLMEngine._submit``): the plan, and per row its sampling
inputs -- temperature, seed, the index of the token drawn, grammar masks and penalties -- with
the drafts to verify when speculating, the adapters to load and the prompt-logprob spans.

With async scheduling the plan may read tokens that are still out: those positions hold -1, and
``prev_token_index`` / ``prev_token_rows`` tell the ranks which of the previous step's sampled
rows fill them.  Every row that samples now gets a placeholder token in its history, written over
when the answer comes back (``engine_outputs.py``).  Kept apart from ``engine.py``, which drives
the steps, as the answer's side is.
"""

from __future__ import annotations

import numpy as np

from ray_attn.engine_stats import SubmittedStep
from ray_attn.request import PLACEHOLDER
from ray_attn.runtime.messages import StepInput
from ray_attn.sampling_inputs import build_sampling_inputs, prompt_logprobs_inputs


def build_step_input(engine, plan, defer: bool) -> tuple[SubmittedStep, StepInput]:
    """The step's message; each row that samples gets a placeholder token until its output
    is applied (with async scheduling the next plan reads it as that row's input)."""
    reqs = [engine.requests[i] for i in plan.req_ids]
    samples = plan.completes_prompt(np.array([len(r.token_ids) for r in reqs])).tolist()
    prev_index = prev_rows = None
    waiting_for = np.flatnonzero(plan.input_token_ids[: plan.attn.num_actual_tokens] < 0)
    if len(waiting_for):
        if engine._submitted is None:
            raise RuntimeError("the plan reads tokens of a step that is not in flight")
        rows = np.searchsorted(plan.attn.query_start_loc[1:], waiting_for, side="right")
        prev_index = waiting_for.astype(np.int32)
        prev_rows = np.fromiter((reqs[i].sampled_row for i in rows.tolist()), np.int32, len(rows))
    # the index of the token drawn now, counting those still out (and not the drafts)
    sample_index = np.array([len(r.token_ids) - r.num_prompt_tokens - r.num_drafts for r in reqs], np.int32)
    temps = np.array([r.params.temperature for r in reqs], np.float32)
    seeds = np.array([-1 if r.params.seed is None else r.params.seed for r in reqs], np.int64)
    vocab, spec = engine.config.model.vocab_size, None
    if engine.spec is not None:  # with drafts: all per logits row (spec/decoder.py)
        spec = engine.spec.step_inputs(engine._step_id, plan, reqs, samples, temps, seeds, sample_index,
                                       engine._eos, vocab, engine.grammar_sync)
    if spec is None:
        # before this step's placeholders are appended (see build_sampling_inputs)
        sampling = build_sampling_inputs(reqs, samples, sample_index, engine._eos, vocab, engine.grammar_sync)
    else:
        temps, seeds, sample_index, sampling, spec = spec
    step_in = StepInput(plan=plan, temperatures=temps, seeds=seeds, sample_index=sample_index,
                        step_id=engine._step_id, defer=defer,
                        prev_token_index=prev_index, prev_token_rows=prev_rows, sampling=sampling, spec=spec,
                        lora_loads=engine.lora.take_loads() if engine.lora is not None else None,
                        lora_prefetch=engine.lora.take_prefetches() if engine.lora is not None else None)
    if engine.spec is not None:  # a draft model's work in the step (spec/draft_inputs.py)
        step_in.draft = engine.spec.draft_inputs(plan, reqs, spec)
    step_in.prompt_logprobs, spans = prompt_logprobs_inputs(plan, reqs)
    engine._step_id += 1
    for row, (r, smp) in enumerate(zip(reqs, samples)):
        if smp:
            r.token_ids.append(PLACEHOLDER)
            r.pending += 1
            r.sampled_row = row
    a = plan.attn
    return SubmittedStep(step_in.step_id, reqs, samples, a.num_actual_tokens, a.local_attn_metadata is not None,
                         plan.num_cascade_groups if a.use_cascade else 0, spans), step_in
