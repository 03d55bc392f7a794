"""Rank 0's grammar matchers: the structured-output masks of a step, filled on the rank.

The driver plans step N+1 before step N's tokens are back (async scheduling), so it cannot fill
a constrained row's mask for N+1; rank 0 can, once N+1's forward is queued (``worker._run``):
N's tokens are on their way to the host by then, and the fill runs while the GPU works.  The
matchers here mirror the driver's (``structured_output.GrammarSync`` sends each one's spec and
output tokens once); each step a row's matcher takes the row's newest token, which is its last
input token -- on the host in the plan, or, for a placeholder, in step N's output.  Each
grammar comes with its backend's name (``grammar_backends.py``): xgrammar's and llguidance's
matchers live side by side, each backend's vocabulary sent once.
"""

from __future__ import annotations

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

    def bitmask(self, step: StepInput, previous: StepOutput | None) -> np.ndarray:
        """int32 [G, words]: the allowed next tokens of the step's constrained rows.  ``previous``
        is the output of the step before (async scheduling), whose tokens fill placeholders."""
        si = step.sampling
        for key in si.grammar_drop or ():
            self.rows.pop(key, None)
            self.taken.pop(key, None)
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
        trim_oldest(self.compiled, MAX_COMPILED)  # as GrammarSync does after the step's grammars
        newest = self._newest_tokens(step, previous)
        live: dict[int, GrammarState] = {}  # row -> its matcher, for the rows not yet finished
        for g, (key, want) in enumerate(zip(si.grammar_keys, si.grammar_counts.tolist())):
            row = self.rows.get(key)
            if row is None:
                raise RuntimeError(f"rank 0: no grammar matcher for request {key!r}")
            if self.taken[key] == want - 1:
                if not row.terminated:  # a finished grammar's row is dropped by the driver
                    row.accept(newest[g])  # a refusal: the driver ends the request
                self.taken[key] += 1
            elif self.taken[key] != want:
                raise RuntimeError(f"rank 0: request {key!r}'s matcher has taken {self.taken[key]} tokens, "
                                   f"the step expects {want}")
            if not row.terminated:
                live[g] = row
        out = np.full((len(si.grammar_keys), self.words), -1, np.int32)
        if live:  # a finished row allows anything: the driver drops its token
            out[list(live)] = fill_bitmask(list(live.values()))
        return out

    @staticmethod
    def _newest_tokens(step: StepInput, previous: StepOutput | None) -> np.ndarray:
        """Each constrained row's last input token, from the plan or from step N's output."""
        plan, rows = step.plan, step.sampling.grammar_rows
        pos = plan.attn.query_start_loc[rows + 1] - 1
        tokens = plan.input_token_ids[pos].astype(np.int64)
        holes = np.flatnonzero(tokens < 0)
        if len(holes):
            if previous is None or step.prev_token_index is None:
                raise RuntimeError("rank 0: a constrained row reads the previous step's token, "
                                   "but that step's output is not here")
            where = dict(zip(step.prev_token_index.tolist(), step.prev_token_rows.tolist()))
            tokens[holes] = previous.token_ids[[where[p] for p in pos[holes].tolist()]]
        return tokens
