"""The planner under speculative decoding: a row's drafts are planned as more query tokens, their
blocks are never indexed for the prefix cache (in the step, lazily, or as another row's in-step
hit), and ``rollback`` sets the row back to its accepted length."""

from __future__ import annotations

import pytest

from ray_attn.planner import Planner, ScheduledRequest
from ray_attn.planner.block_pool import prompt_hashes
from ray_attn.planner.errors import InvalidRequestError

BS = 16


def planner() -> Planner:
    return Planner(num_blocks=32, block_size=BS, num_query_heads=4, num_kv_heads=2)


def indexed(p: Planner, tokens: list[int], n_blocks: int) -> list[bool]:
    """Whether each of the first ``n_blocks`` full blocks of ``tokens`` is in the prefix cache."""
    return [b is not None for b in p.pool.cached_blocks(prompt_hashes(tokens, n_blocks, BS).tolist())]


def speculate(p: Planner, req: ScheduledRequest, last: int, drafts: list[int], others=()):
    """One step verifying ``drafts`` after the sampled token ``last``."""
    req.token_ids += [last] + drafts
    req.num_new_tokens, req.num_draft_tokens = 1 + len(drafts), len(drafts)
    return p.plan([req, *others])


def test_drafts_are_query_tokens_whose_blocks_are_not_indexed():
    p = planner()
    toks = list(range(100, 130))  # 30 prompt tokens: block 0 full, block 1 holds 14
    a = ScheduledRequest("a", toks)
    p.plan([a])
    plan = speculate(p, a, 7, [8, 9, 10, 11])  # positions 30 .. 34: block 1 fills up with drafts
    assert plan.query_lens.tolist() == [5] and plan.positions[:5].tolist() == [30, 31, 32, 33, 34]
    assert plan.input_token_ids[:5].tolist() == [7, 8, 9, 10, 11]
    assert indexed(p, toks, 2) == [True, False], "a block holding drafts must not be indexed"
    assert not p.pool.is_cached(int(p.block_ids("a")[1]))
    # the target took the first draft only: KV stands for positions 0 .. 31
    p.rollback("a", 32)
    assert p.num_computed_tokens("a") == 32
    del toks[32:]
    toks.append(5)  # the target's own token at position 32
    p.free("a")  # lazy indexing: the blocks full up to num_computed (block 1: positions 16 .. 31)
    assert indexed(p, toks, 2) == [True, True]
    assert indexed(p, list(range(100, 130)) + [7, 8, 9], 2) == [True, True]  # its accepted content


def test_a_rejected_drafts_block_is_not_indexed_when_freed():
    p = planner()
    toks = list(range(200, 230))
    a = ScheduledRequest("a", toks)
    p.plan([a])
    speculate(p, a, 7, [8, 9, 10])
    p.rollback("a", 31)  # every draft rejected: position 31 holds draft 8's KV
    del toks[31:]
    toks.append(6)
    p.free("a")
    assert indexed(p, toks, 2) == [True, False]  # only 31 tokens computed: block 1 is not full
    assert indexed(p, list(range(200, 230)) + [7, 8], 2) == [True, False]


def test_a_row_admitted_with_a_speculating_one_takes_no_hit_on_its_drafts():
    """A new row whose prompt equals another row's tokens *with* its drafts would take the
    drafts' block as a hit computed in the same step, and read KV the rollback later leaves
    to be overwritten: it takes only the blocks before the drafts."""
    p = planner()
    toks = list(range(300, 330))
    a = ScheduledRequest("a", toks)
    p.plan([a])
    b = ScheduledRequest("b", list(range(300, 330)) + [7, 8, 9, 10, 11, 12])
    plan = speculate(p, a, 7, [8, 9, 10, 11], others=[b])
    assert plan.num_prefix_cache_hit_tokens == BS  # block 0 only; block 1 would be 2 * BS
    a_blocks, b_blocks = p.block_ids("a"), p.block_ids("b")
    assert a_blocks[0] == b_blocks[0] and a_blocks[1] != b_blocks[1]
    # b's own block 1 (its prompt, the same tokens) is indexed; a's, holding drafts, is not
    assert not p.pool.is_cached(int(a_blocks[1])) and p.pool.is_cached(int(b_blocks[1]))


def test_rollback_is_bounded_by_the_indexed_blocks_and_the_computed_tokens():
    p = planner()
    a = ScheduledRequest("a", list(range(40)))
    p.plan([a])
    with pytest.raises(InvalidRequestError, match="rollback to 41"):
        p.rollback("a", 41)
    with pytest.raises(InvalidRequestError, match="rollback to 15"):
        p.rollback("a", 15)  # block 0 (tokens 0 .. 15) is indexed: its KV must stay
    p.rollback("a", 36)
    assert p.num_computed_tokens("a") == 36


def _plan_arrays(plan) -> dict:
    a = plan.attn
    return dict(ids=list(plan.req_ids), input=plan.input_token_ids.tolist(), pos=plan.positions.tolist(),
                logits=plan.logits_indices.tolist(), computed=plan.num_computed_tokens.tolist(),
                slots=a.slot_mapping.tolist(), qsl=a.query_start_loc.tolist(), seq=a.seq_lens.tolist(),
                table=a.block_table.tolist(), new_blocks=plan.num_new_blocks, cascade=plan.num_cascade_groups)


@pytest.mark.parametrize("seed", range(4))
def test_verifying_steps_fast_path_plans_what_the_general_path_plans(seed, monkeypatch):
    """A step of the previous batch where every row is its token and its drafts skips the general
    path (``Planner._plan_decode`` with ``verify_queries``).  Against a planner held to the general
    path, over random drafts (0-9 a row, blocks of 4: a row needs up to three new blocks) and
    random acceptance: the same plans, block for block, and the same prefix cache once freed
    (the general path indexes full blocks in the step, the fast one when the request is freed)."""
    import random

    from ray_attn.planner import builder

    rnd = random.Random(seed)
    bs = 4

    def make():
        return Planner(num_blocks=256, block_size=bs, num_query_heads=4, num_kv_heads=2)

    fast, ref = make(), make()
    took = []
    real = builder.verify_inputs
    monkeypatch.setattr(builder, "verify_inputs", lambda *a: took.append(1) or real(*a))
    reqs = {}
    for name in (fast, ref):
        reqs[id(name)] = [ScheduledRequest(f"r{i}", [rnd.randrange(1000) for _ in range(n)])
                          for i, n in enumerate((5, 13, 16))]
    # both planners see the same tokens: copy the first's prompts into the second
    for a, b in zip(reqs[id(fast)], reqs[id(ref)]):
        b.token_ids[:] = a.token_ids
    for p in (fast, ref):
        p.plan(reqs[id(p)])
    for _ in range(12):
        drafts = [[rnd.randrange(1000) for _ in range(rnd.randrange(10))] for _ in range(3)]
        last = [rnd.randrange(1000) for _ in range(3)]
        keep = [rnd.randrange(len(d) + 1) for d in drafts]
        plans = []
        for p in (fast, ref):
            rs = reqs[id(p)]
            for r, t, d in zip(rs, last, drafts):
                r.token_ids += [t] + d
                r.num_new_tokens, r.num_draft_tokens = 1 + len(d), len(d)
            with monkeypatch.context() as m:
                if p is ref:
                    m.setattr(builder, "verify_queries", lambda *a: None)
                plans.append(_plan_arrays(p.plan(rs)))
            for r, d, k in zip(rs, drafts, keep):  # the first k drafts accepted, then the target's token
                n = len(r.token_ids) - len(d) + k
                p.rollback(r.req_id, n)
                del r.token_ids[n:]
                r.num_draft_tokens = 0
        assert plans[0] == plans[1]
    assert took, "the verifying steps never took the fast path"
    for p in (fast, ref):
        for r in reqs[id(p)]:
            r.token_ids.append(1)
            p.free(r.req_id)
    for a in reqs[id(fast)]:
        full = (len(a.token_ids) - 1) // bs
        assert indexed_bs(fast, a.token_ids, full, bs) == indexed_bs(ref, a.token_ids, full, bs)


def indexed_bs(p: Planner, tokens: list[int], n_blocks: int, bs: int) -> list[bool]:
    return [b is not None for b in p.pool.cached_blocks(prompt_hashes(tokens, n_blocks, bs).tolist())]


def test_a_verifying_row_whose_tokens_end_early_is_refused_by_name():
    p = planner()
    a = ScheduledRequest("a", list(range(20)))
    p.plan([a])
    a.token_ids += [1, 2, 3]
    a.num_new_tokens, a.num_draft_tokens = 5, 4  # asks for 5 tokens, the list has 3 past computed
    with pytest.raises(InvalidRequestError, match="'a'"):
        p.plan([a])
    assert p.num_computed_tokens("a") == 20  # nothing changed
