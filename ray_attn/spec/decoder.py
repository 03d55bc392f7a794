"""The driver's side of speculative decoding: drafts in, accepted tokens out, for ``LLMEngine``.

Each step, after the scheduler proposed the batch, ``propose`` asks the proposer for drafts for
every row that decodes (its one new token is the last one sampled) and appends them to the
request's token list, so that the planner schedules the row as a query of 1 + k tokens and
allocates their slots like any multi-token query (chunked prefill).  The planner indexes none of
the drafts' blocks for the prefix cache (``ScheduledRequest.num_draft_tokens``).  When the
planner cannot hold the step, ``undo`` takes the drafts back and the step is planned without
them before anything is preempted: a failed draft never costs a request.

``step_inputs`` turns the step's per-row sampling arrays into per-logits-row ones (a speculating
row samples at each of its 1 + k positions, with the token index and the penalties' history of
that position), and ``accept`` reads a row's emitted tokens, sets the planner back to the
accepted length (``Planner.rollback``) and drops the drafts.  Rank 0 decides what is accepted
(``runtime/spec_decode.py``).

Constrained rows (structured outputs) speculate too: their drafts are cut to what the grammar
takes from the request's state (``GrammarState.accepts``), and rank 0 masks each draft position
with its matcher advanced through the drafts before it, rolling back the rejected ones at the next
step (``runtime/grammars.py``).

What does not speculate, and why:
- a prompt's last chunk: its first token is not sampled yet, so there is nothing to continue;
- rows whose ``max_tokens`` leave no room (k is cut to what is left, minus the bonus token), and
  every row of a step with more than ``disable_by_batch_size`` running requests;
- in batch-invariant mode, drafts past the row's next cascade grid line (planner/invariant.py):
  k is cut so that the 1 + k query ends before it.
With async scheduling, a step that may speculate (``wants``) is not deferred: its drafts are
found from the tokens before it, and how many of them it accepts sets where each row's next query
starts, which the driver's planner must know before it plans that query.  So below
``disable_by_batch_size`` steps are collected before the next one is planned (collecting first
the one still out, when the batch shrinks below it), and above it, where nothing speculates,
steps overlap as they do without speculation (``LLMEngine.step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ray_attn.engine_stats import EngineStats
from ray_attn.planner.invariant import grid_room
from ray_attn.request import PLACEHOLDER
from ray_attn.runtime.messages import SpecDecodeInputs
from ray_attn.runtime.spec_decode import accepted_tokens
from ray_attn.sampling_inputs import build_sampling_inputs
from ray_attn.spec.draft_inputs import build_draft_inputs, committed_after
from ray_attn.spec.ngram import NgramProposer
from ray_attn.spec.suffix import SuffixProposer


@dataclass(slots=True)
class SpecStep:
    """What the engine needs to read a speculative step's answer."""

    num_drafts: np.ndarray  # int32 [B] per plan row
    computed: np.ndarray  # int32 [B] the planner's num_computed per row before the step
    first_row: np.ndarray  # int64 [B] each row's first logits row


@dataclass
class SpecDecodingStats:
    """vLLM's ``SpecDecodingStats``: drafts (rows that speculated in a step), draft tokens
    proposed, accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating row emits per step: 1 + accepted drafts per draft (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    def __init__(self, config, planner, device: str = "cpu"):
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.batch_limit(device)  # 'auto': the device's measured break-even
        # n-gram and suffix drafts are found here; a draft model's are proposed on the ranks, in
        # the step itself (spec/draft_inputs.py), and the driver appends token 0 in their place.
        self.drafts_on_ranks = spec.method == "draft_model"
        self.proposer = (NgramProposer(self.k, *spec.ngram_bounds) if spec.method == "ngram" else
                         SuffixProposer(self.k, **spec.suffix_params) if spec.method == "suffix" else None)
        self.block_size = config.cache.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # batch-invariant mode's cascade grid, the planner's: a row's 1 + k query stays below its next line
        self.cascade_grid = planner.cascade_grid
        self.planner = planner
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * self.k)
        self._steps: dict[int, SpecStep] = {}  # step id -> its layout, until its answer is read

    # -- planning -------------------------------------------------------------------------------
    def wants(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests speculates (at most
        ``disable_by_batch_size``: above it, verifying drafts costs more than it saves)."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def propose(self, out, num_running: int) -> int:
        """Append drafts to the decoding rows of the scheduler's proposal ``out`` (its
        ``num_new_tokens`` grow by them) within the step's token budget; returns how many."""
        if not self.wants(num_running):
            return 0
        budget = self.max_num_batched_tokens - sum(out.num_new_tokens)
        planner, total = self.planner, 0
        for i, r in enumerate(out.reqs):
            if budget <= 0:
                break
            if (out.num_new_tokens[i] != 1 or r.pending or not r.num_output_tokens
                    or not planner.has_request(r.request_id)
                    or len(r.token_ids) - planner.num_computed_tokens(r.request_id) != 1):
                continue
            room = min(budget, r.params.max_tokens - r.num_output_tokens - 1)
            if self.cascade_grid is not None:  # the query starts at the row's last token
                room = min(room, grid_room(len(r.token_ids) - 1, self.cascade_grid) - 1)
            if room <= 0:
                continue
            if self.drafts_on_ranks:
                # Made on the ranks, a draft model's drafts are 0 here until then: rank 0 puts them
                # in penalty histories and through its grammar matchers (a draft the grammar
                # refuses is rejected there, and so are the ones after it).
                drafts = np.zeros(min(self.k, room), np.int32)
            else:
                try:
                    drafts = self.proposer.propose(r.token_array(), room)
                except Exception:  # noqa: BLE001 -- a proposer that fails leaves the row decoding as usual
                    continue
                if r.grammar is not None and len(drafts):  # only what the grammar takes from here
                    drafts = drafts[:r.grammar.accepts(drafts)]
            if len(drafts):
                r.append_drafts(drafts)
                out.num_new_tokens[i] += len(drafts)
                budget -= len(drafts)
                total += len(drafts)
        for r in out.reqs:
            r.sched.num_draft_tokens = r.num_drafts
        return total

    def undo(self, out) -> None:
        """Take back what ``propose`` appended (the planner refused the step)."""
        for i, r in enumerate(out.reqs):
            if r.num_drafts:
                out.num_new_tokens[i] -= r.num_drafts
                r.drop_drafts()
            r.sched.num_draft_tokens = 0

    # -- the step's message ---------------------------------------------------------------------
    def step_inputs(self, step_id: int, plan, reqs, samples: list[bool], temperatures: np.ndarray,
                    seeds: np.ndarray, sample_index: np.ndarray, eos, vocab_size: int, grammars):
        """The per-logits-row sampling arrays of a step with drafts (temperatures, seeds, token
        indices, ``SamplingInputs`` whose penalty histories end at each position) and its
        ``SpecDecodeInputs``; None when no row of the plan has drafts."""
        k = np.fromiter((r.num_drafts for r in reqs), np.int32, len(reqs))
        if not k.any():
            return None
        seg = k.astype(np.int64) + 1
        first = np.cumsum(seg) - seg
        R = int(seg.sum())
        offset = np.arange(R) - np.repeat(first, seg)  # position of each logits row in its request's query
        ends = np.asarray(plan.attn.query_start_loc[1:], np.int64)
        logits_indices = (np.repeat(ends - seg, seg) + offset).astype(np.int32)
        drafts = [r.token_ids[len(r.token_ids) - r.num_drafts:] for r in reqs if r.num_drafts]
        spec = SpecDecodeInputs(k, np.array([t for d in drafts for t in d], np.int32), logits_indices)
        rows = np.repeat(np.arange(len(reqs)), seg)
        sample_idx = (sample_index[rows] + offset).astype(np.int32)
        # a row's history at position j: its tokens before the drafts, then drafts 1..j
        base = np.array([len(r.token_ids) - r.num_drafts for r in reqs], np.int64)
        history_ends = (base[rows] + offset).tolist()
        self._steps[step_id] = SpecStep(k, plan.num_computed_tokens.copy(), first)
        rows_l = rows.tolist()
        draft_ranges = None
        if self.drafts_on_ranks:  # a draft model's drafts reach the histories on rank 0
            src = (np.cumsum(k) - k)[rows]
            draft_ranges = list(zip(base[rows].tolist(), src.tolist()))
        sampling = build_sampling_inputs([reqs[i] for i in rows_l], [samples[i] for i in rows_l], sample_idx,
                                         eos, vocab_size, grammars, history_ends=history_ends,
                                         draft_ranges=draft_ranges)
        return temperatures[rows], seeds[rows], sample_idx, sampling, spec

    def draft_inputs(self, plan, reqs, spec: SpecDecodeInputs | None):
        """A draft model's work in the step (``spec/draft_inputs.py``): its speculating rows and
        the prompt chunks it computes alongside the target; None with n-gram drafts or no work."""
        if not self.drafts_on_ranks:
            return None
        return build_draft_inputs(plan, reqs, None if spec is None else spec.num_draft_tokens, self.block_size)

    # -- the answer -----------------------------------------------------------------------------
    def take(self, step_id: int, token_ids: np.ndarray) -> tuple[SpecStep, list[list[int]]] | None:
        """A step's layout and each row's emitted tokens; None for a step without drafts."""
        layout = self._steps.pop(step_id, None)
        if layout is None:
            return None
        return layout, accepted_tokens(token_ids, layout.num_drafts)

    def accept(self, req, row: int, layout: SpecStep, emitted: list[int]) -> None:
        """Row ``row`` of a speculative step emitted ``emitted`` (its accepted drafts, then the
        target's token): the planner keeps the KV of the tokens before the last one, and the
        request's drafts give way to placeholders the engine fills with ``emitted``."""
        k = int(layout.num_drafts[row])
        if not k:
            return
        a = len(emitted) - 1  # drafts accepted
        if self.drafts_on_ranks:
            req.num_draft_computed = committed_after(int(layout.computed[row]), k, a)
        # first, while the request is still running: a finish would index its blocks up to here
        self.planner.rollback(req.request_id, int(layout.computed[row]) + 1 + a)
        req.drop_drafts()
        req.token_ids.extend([PLACEHOLDER] * a)  # one placeholder per emitted token, filled in order
        req.pending += a
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += k
        s.num_accepted_tokens += a
        for j in range(a):
            s.num_accepted_tokens_per_pos[j] += 1

    def finished(self, req) -> None:
        """A request ended: suffix decoding keeps its response (with the prompt's last tokens,
        which a later request's end may match) to draft from."""
        add = getattr(self.proposer, "add_response", None)
        if add is not None and req.num_output_tokens and req.finish_reason != "error":
            toks = req.all_token_ids
            add(toks[max(0, req.num_prompt_tokens - self.proposer.max_depth):])

    def publish(self, stats: EngineStats) -> None:
        """The counters into the engine's stats (what servers read)."""
        s = self.stats
        stats.spec_num_drafts, stats.spec_num_draft_tokens = s.num_drafts, s.num_draft_tokens
        stats.spec_num_accepted_tokens = s.num_accepted_tokens
        stats.spec_num_accepted_tokens_per_pos = list(s.num_accepted_tokens_per_pos)
        stats.spec_mean_acceptance_length = s.mean_acceptance_length

    def forget(self) -> None:
        """The steps out died with the ranks (their requests drop their drafts themselves)."""
        self._steps.clear()
