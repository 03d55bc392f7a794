"""Rank 0's grammar matchers: the structured-output masks of a step, filled on the rank.

The driver plans step N+1 before step N's tokens are back (async scheduling), so it cannot fill
a constrained row's mask for N+1; rank 0 can, once N+1's forward is queued (``worker._run``):
N's tokens are on their way to the host by then, and the fill runs while the GPU works.  The
matchers here mirror the driver's (``structured_output.GrammarSync`` sends each one's spec and
output tokens once); each step a row's matcher takes the row's newest token, which is its last
input token -- on the host in the plan, or, for a placeholder, in step N's output.  Each
grammar comes with its backend's name (``grammar_backends.py``): xgrammar's and llguidance's
matchers live side by side, each backend's vocabulary sent once.

Speculative decoding: a request that verifies k drafts has k + 1 constrained rows, the j-th
``grammar_counts`` one more than the (j-1)-th.  Its first row's mask is the usual one; each later
row's matcher first takes the draft before it -- on trial -- and masks what may follow it.  A draft
the grammar refuses ends the request's rows for this step: the row before masked it out, so the
sampler rejects it and the rows after it are never used.  The next step rolls the trial back to
what was kept (its first row's count says how many output tokens there are now) before taking
the row's newest token, as any step does.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ray_attn.runtime.messages import StepInput, StepOutput
from ray_attn.grammar_backends import BACKENDS
from ray_attn.structured_output import BITS, MAX_COMPILED, GrammarState, fill_bitmask, trim_oldest


class RankGrammars:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        self.tokenizers: dict[str, object] = {}  # backend -> its vocabulary
        self.compiled: dict = {}  # spec -> (backend, compiled), oldest first; a matcher keeps its own alive
        self.rows: dict[str, GrammarState] = {}
        self.taken: dict[str, int] = {}  # output tokens each matcher has taken
        self.trial: dict[str, int] = {}  # of those, the drafts taken on trial by the last step

    def bitmask(self, step: StepInput, previous: StepOutput | None, drafts: np.ndarray | None = None) -> np.ndarray:
        """int32 [G, words]: the allowed next tokens of the step's constrained rows.  ``previous``
        is the output of the step before (async scheduling), whose tokens fill placeholders."""
        si = step.sampling
        for key in si.grammar_drop or ():
            self.rows.pop(key, None)
            self.taken.pop(key, None)
            self.trial.pop(key, None)
        for name, payload in (si.grammar_tokenizer or {}).items():
            self.tokenizers[name] = BACKENDS[name].rank_tokenizer(payload, self.vocab_size)
        for spec, (name, text) in (si.grammar_specs or {}).items():
            if name not in self.tokenizers:
                raise RuntimeError(f"rank 0: a {name} grammar came before that backend's vocabulary")
            self.compiled[spec] = (name, BACKENDS[name].rank_compiled(self.tokenizers[name], text))
        for key, (spec, tokens) in (si.grammar_new or {}).items():
            if spec not in self.compiled:
                raise RuntimeError(f"rank 0: request {key!r} needs a grammar it was never sent")
            name, compiled = self.compiled[spec]
            row = self.rows[key] = GrammarState(BACKENDS[name].rank_matcher(compiled), self.vocab_size)
            for t in tokens:
                row.accept(t)
            self.taken[key] = len(tokens)
            self.trial.pop(key, None)
        trim_oldest(self.compiled, MAX_COMPILED)  # as GrammarSync does after the step's grammars
        newest = self._newest_tokens(step, previous, drafts)
        keys = si.grammar_keys
        out = np.full((len(keys), self.words), -1, np.int32)  # a finished row allows anything
        batched: dict[int, GrammarState] = {}  # row -> its matcher: filled together, at the end
        speculating = {k for k, n in Counter(keys).items() if n > 1}
        seen: set[str] = set()  # requests with a row before: their later rows follow a draft
        refused: set[str] = set()  # requests whose draft the grammar refused in this step
        for g, (key, want) in enumerate(zip(keys, si.grammar_counts.tolist())):
            row = self.rows.get(key)
            if row is None:
                raise RuntimeError(f"rank 0: no grammar matcher for request {key!r}")
            if key in seen:  # a draft position: its matcher takes the draft before it, on trial
                if key in refused or not self._take_draft(key, row, want, newest[g]):
                    refused.add(key)
                    continue
            else:
                seen.add(key)
                self._catch_up(key, row, want, newest[g])
            if row.terminated:  # the driver drops a finished row's token
                continue
            if key in speculating:  # its next row moves the matcher on: this row's mask now
                out[g] = fill_bitmask([row])[0]
            else:
                batched[g] = row
        if batched:
            out[list(batched)] = fill_bitmask(list(batched.values()))
        return out

    def _catch_up(self, key: str, row: GrammarState, want: int, newest: int) -> None:
        """A request's first row of the step: its matcher rolls back the drafts of the step before
        that were not kept, then takes the newest token if it lacks it."""
        trial = self.trial.pop(key, 0)
        if trial:
            back = self.taken[key] - (want - 1)
            if not 0 <= back <= trial:
                raise RuntimeError(f"rank 0: request {key!r} kept {trial - back} of the {trial} drafts "
                                   "its matcher took on trial")
            row.rollback(back)
            self.taken[key] -= back
        if self.taken[key] == want - 1:
            if not row.terminated:  # a finished grammar's row is dropped by the driver
                row.accept(newest)  # a refusal: the driver ends the request
            self.taken[key] += 1
        elif self.taken[key] != want:
            raise RuntimeError(f"rank 0: request {key!r}'s matcher has taken {self.taken[key]} tokens, "
                               f"the step expects {want}")

    def _take_draft(self, key: str, row: GrammarState, want: int, draft: int) -> bool:
        """A later row of a speculating request: its matcher takes the draft before it, on trial;
        False when the grammar refuses it (the matcher stays)."""
        if self.taken[key] != want - 1:
            raise RuntimeError(f"rank 0: request {key!r}'s matcher has taken {self.taken[key]} tokens, "
                               f"its draft row expects {want - 1}")
        if row.terminated or not row.try_accept(draft):
            return False
        self.taken[key] += 1
        self.trial[key] = self.trial.get(key, 0) + 1
        return True

    @staticmethod
    def _newest_tokens(step: StepInput, previous: StepOutput | None, drafts: np.ndarray | None = None) -> np.ndarray:
        """Each constrained row's last input token, from the plan or from step N's output; a
        draft model's drafts (``drafts``, made on the ranks: 0 in the plan) from the ranks'."""
        plan, rows = step.plan, step.sampling.grammar_rows
        # a verifying step samples at each draft's position too
        pos = plan.attn.query_start_loc[rows + 1] - 1 if step.spec is None else step.spec.logits_indices[rows]
        ids = plan.input_token_ids
        if drafts is not None:
            ids = ids.copy()
            ids[step.draft.target_index] = drafts
        tokens = ids[pos].astype(np.int64)
        holes = np.flatnonzero(tokens < 0)
        if len(holes):
            if previous is None or step.prev_token_index is None:
                raise RuntimeError("rank 0: a constrained row reads the previous step's token, "
                                   "but that step's output is not here")
            where = dict(zip(step.prev_token_index.tolist(), step.prev_token_rows.tolist()))
            tokens[holes] = previous.token_ids[[where[p] for p in pos[holes].tolist()]]
        return tokens
