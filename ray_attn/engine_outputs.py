"""What a step's answer does to its requests (``LLMEngine._apply``): each sampled token written over
its placeholder, the checks that end a request (vLLM's ``check_stop``: grammar, stop ids and EOS
once ``min_tokens`` are out, ``max_tokens``), logprobs, and the ``RequestOutput`` of each row.

A row emits one token a step -- or, when it verified drafts (speculative decoding,
``spec/decoder.py``), its accepted drafts and the target's token, applied one by one through the
same checks: a stop inside an accepted run ends the request there and drops the tokens after it.
Kept apart from ``engine.py``, which drives the steps, so that each reads on its own.
"""

from __future__ import annotations

from ray_attn.request import Request, RequestOutput
from ray_attn.sampling_inputs import apply_prompt_logprobs, token_logprobs


def apply_step_output(engine, done, out) -> list[RequestOutput]:
    """Apply rank 0's answer ``out`` to the step ``done`` (a ``SubmittedStep``) of ``engine``."""
    if out is None or out.step_id != done.step_id:
        got = None if out is None else out.step_id
        raise RuntimeError(f"expected the output of step {done.step_id}, got {got}")
    outputs = []
    if done.prompt_spans:  # first: a prompt's last chunk also samples its first token
        apply_prompt_logprobs(done.prompt_spans, out.prompt_logprobs)
    lp = out.logprobs
    lp_index = {} if lp is None else dict(zip(lp.rows.tolist(), range(len(lp.rows))))
    tokens = out.token_ids.tolist()
    spec = None if engine.spec is None else engine.spec.take(done.step_id, out.token_ids)
    for row, (req, sampled) in enumerate(zip(done.reqs, done.samples)):
        if not sampled or req.finished:
            continue  # a prompt's chunk; or a request that stopped or was aborted meanwhile
        toks, at = [tokens[row]], row  # at: the row's first logits row
        if spec is not None:  # its accepted drafts and the target's token
            toks, at = spec[1][row], int(spec[0].first_row[row])
            engine.spec.accept(req, row, spec[0], toks)
        new_lps = None if req.logprobs is None else []
        for j, tok in enumerate(toks):
            if new_lps is not None:
                new_lps.append(token_logprobs(lp, lp_index[at + j], req.params.logprobs))
                req.logprobs.append(new_lps[-1])
            take_token(engine, req, tok)
            if req.finished:  # a stop inside an accepted run: the tokens after it are dropped
                toks = toks[:j + 1]
                break
        outputs.append(row_output(engine, req, toks, new_lps))
    if spec is not None:
        engine.spec.publish(engine.stats)
    s = engine.stats
    s.steps += 1
    s.tokens_computed += done.num_tokens
    s.cascade_steps += done.cascade_groups > 0
    s.multi_group_cascade_steps += done.cascade_groups > 1
    s.local_steps += done.local
    return outputs


def take_token(engine, req: Request, tok: int) -> None:
    """One sampled token over the request's first placeholder, then the checks that end it."""
    req.token_ids[len(req.token_ids) - req.pending] = tok
    req.pending -= 1
    engine.stats.tokens_generated += 1
    p = req.params
    if req.grammar is not None and not req.grammar.accept(tok):
        engine._finish(req, "error", f"token {tok} does not continue the request's grammar")
    # vLLM's check_stop: a stop token counts once min_tokens are out (the rank masks
    # them until then; the rule holds here whatever a rank drew)
    elif req.grammar is not None and req.grammar.terminated:
        engine._finish(req, "stop")
    elif (tok in p.stop_token_ids or (tok in engine._eos and not p.ignore_eos)) \
            and req.num_output_tokens > p.min_tokens:
        engine._finish(req, "stop")
    elif req.num_output_tokens >= p.max_tokens:
        engine._finish(req, "length")


def row_output(engine, req: Request, toks: list[int], new_lps) -> RequestOutput:
    """The row's output: the request's whole state once it finished, else just what it gained."""
    if req.finished:
        return engine.output(req.request_id, new_token_ids=toks, new_logprobs=new_lps)
    first = req.prompt_logprobs is not None and req.num_output_tokens == len(toks)
    return RequestOutput(req.request_id, [], [], toks, False, new_logprobs=new_lps,
                         logprobs=None if new_lps is None else [], num_cached_tokens=req.num_cached_tokens or 0,
                         prompt_logprobs=list(req.prompt_logprobs) if first else None)
