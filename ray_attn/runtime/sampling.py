"""Sampling on rank 0, so that only token ids (and logprobs when asked) travel back to the driver.

Sampling is Gumbel-max: ``argmax(logits / T + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(logits / T)``.  A seeded request's uniforms ``u`` come from a counter-based hash of
(seed, token index, vocabulary id), so the whole batch is drawn with a handful of tensor ops
instead of one generator per request (which cost ~60 us each on a GPU: 8 ms a step at 128
sampled requests).

Before the draw, the logits go through vLLM's pipeline (``logits_processors``): min_tokens
masking, logit_bias and penalties on the raw logits, the temperature, then min-p, top-k and top-p.  Each
stage runs once for the whole batch over just the rows that use it, which ``SamplingTensors.stage``
picks out on the host; a batch that uses none is the argmax alone, as before.  Logprobs are of the
raw logits (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ray_attn.runtime.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_token_bitmask_inplace,
    apply_top_k_only,
    apply_top_k_top_p,
    compute_logprobs,
    gumbel_argmax,
)
from ray_attn.runtime.messages import LogprobsArrays, SamplingInputs, SpecDecodeInputs
from ray_attn.runtime.spec_decode import reject_drafts, staged_layout

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads (seed, index) pairs apart
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9, splitmix64's multipliers as int64
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_STEP = 0x632BE59BD9B4E019  # odd: a seed's consecutive token indices land far apart


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hash_uniform(seeds: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [R, vocab] in (0, 1), a pure function of (seed, index, column): splitmix64's
    finaliser over a per-row counter.  int64 products wrap, which is the arithmetic we want.

    23 bits, not 24: (2**24 - 1 + 0.5) / 2**24 rounds to exactly 1.0 in float32, and a u of 1
    makes that token's Gumbel score +inf (NaN where it was filtered to -inf, which argmax also
    takes) -- a 2**-24 chance per entry, i.e. about one seeded draw in 128 at a 128k vocabulary
    drew a token regardless of its probability, its mask or top-k/top-p."""
    col = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = (seeds * _GOLDEN + index * _STEP)[:, None] + col[None, :]
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return (_shr(x, 41).float() + 0.5) * (1.0 / (1 << 23))


class _Pack:
    """Arrays of one dtype sent to the device as one: a single non-blocking copy (through
    ``put(name, int32 array)``, i.e. ``StepBuffers.put``, when given: other dtypes travel as their
    bits), where ``.to(dev)`` from pageable memory would wait for the whole stream -- and with it
    for the step that async scheduling keeps running ahead of this one."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.parts: list[np.ndarray] = []

    def add(self, a) -> int:
        self.parts.append(np.asarray(a, self.dtype).reshape(-1))
        return len(self.parts) - 1

    def send(self, device: torch.device, put, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The parts on ``device`` (views of one tensor, converted to ``dtype`` in one kernel)."""
        if not self.parts:
            return []
        a = np.concatenate(self.parts)
        if put is None:
            d = torch.from_numpy(a).to(device)
        else:
            d = put(f"sample_{self.dtype.name}", a.view(np.int32)).view(getattr(torch, self.dtype.name))
        return list(torch.split(d if dtype is None else d.to(dtype), [len(p) for p in self.parts]))


class LogprobsTensors(NamedTuple):
    """The rows' raw logprobs on the device (vLLM's name): see ``LogprobsArrays``."""

    rows: np.ndarray  # int32 [L], on the host
    logprob_token_ids: torch.Tensor  # int32 [L, 1 + k]
    logprobs: torch.Tensor  # float32 [L, 1 + k]
    selected_token_ranks: torch.Tensor  # int32 [L]

    def to_numpy(self) -> LogprobsArrays:
        return LogprobsArrays(self.rows, self.logprob_token_ids.cpu().numpy(),
                              self.logprobs.cpu().numpy(), self.selected_token_ranks.cpu().numpy())


@dataclass
class SamplingTensors:
    """A step's sampling inputs on the device.  Each group is None when no row uses it.

    The draw covers the hot rows (temperature > 0); the filters' ``*_pos`` are positions among
    them.  Penalties, min_tokens and logprobs name rows of the batch."""

    rows: torch.Tensor | None = None  # long [h] the hot rows; None: every row is greedy
    temperatures: torch.Tensor | None = None  # float32 [h, 1]
    seeded_pos: torch.Tensor | None = None  # long [s] positions in ``rows`` with a seed
    seeds: torch.Tensor | None = None  # int64 [s]
    index: torch.Tensor | None = None  # long [s] each seeded row's token index
    free_pos: torch.Tensor | None = None  # long [h - s] positions drawing from the generator
    min_p_pos: torch.Tensor | None = None  # long [a]
    min_p: torch.Tensor | None = None  # float32 [a, 1]
    sort_pos: torch.Tensor | None = None  # long [b] rows with top_p < 1 (sorted)
    sort_k: torch.Tensor | None = None  # long [b] their top_k (2**31 - 1 = off)
    sort_p: torch.Tensor | None = None  # float32 [b]
    top_k_pos: torch.Tensor | None = None  # long [c] rows with only top_k (torch.topk)
    top_k: torch.Tensor | None = None  # long [c]
    max_top_k: int = 0
    penalty_rows: torch.Tensor | None = None  # long [P]
    presence: torch.Tensor | None = None  # float32 [P, 1]
    frequency: torch.Tensor | None = None  # float32 [P, 1]
    repetition: torch.Tensor | None = None  # float32 [P, 1]
    history: torch.Tensor | None = None  # long [N] (see SamplingInputs)
    history_lens: torch.Tensor | None = None  # long [P]
    history_prev_index: torch.Tensor | None = None  # long [K]; None: no placeholder
    history_prev_rows: torch.Tensor | None = None  # long [K]
    history_draft_index: torch.Tensor | None = None  # long [K'] filled from spec_draft_ids
    history_draft_src: torch.Tensor | None = None  # long [K']
    min_tokens_rows: torch.Tensor | None = None  # long [M]
    min_tokens_ids: torch.Tensor | None = None  # long [M]
    logit_bias_rows: torch.Tensor | None = None  # long [E]
    logit_bias_ids: torch.Tensor | None = None  # long [E]
    logit_bias_values: torch.Tensor | None = None  # float32 [E]
    grammar_rows: torch.Tensor | None = None  # long [G]
    grammar_bitmask: torch.Tensor | None = None  # int32 [G, words]
    logprob_rows: np.ndarray | None = None  # int32 [L] on the host
    logprob_rows_dev: torch.Tensor | None = None  # long [L]
    max_num_logprobs: int = 0
    # Speculative decoding (runtime/spec_decode.py): rows are logits rows, a draft's verifying row
    # and token, each logits row's first row of its request.  None: no drafts.
    spec_verify_rows: torch.Tensor | None = None  # long [D]
    spec_draft_ids: torch.Tensor | None = None  # long [D]
    spec_seg_first: torch.Tensor | None = None  # long [R]
    spec_seg_start: torch.Tensor | None = None  # long [B] each request's first logits row
    spec_num_drafts: torch.Tensor | None = None  # long [B]
    spec_max_drafts: int = 0

    @classmethod
    def stage(cls, temperatures: np.ndarray, seeds: np.ndarray, sample_index: np.ndarray,
              device: torch.device, put=None, inputs: SamplingInputs | None = None,
              spec: SpecDecodeInputs | None = None) -> "SamplingTensors":
        """Copy what sampling needs to ``device``: one array per dtype (int32, float32, int64),
        before the step's forward.  Only the rows that use a stage are sent for it."""
        ints, floats, longs = _Pack(np.int32), _Pack(np.float32), _Pack(np.int64)
        i: dict[str, int] = {}  # field -> its part in ``ints``
        f: dict[str, int] = {}
        extra: dict = {}
        if spec is not None:
            verify_rows, seg_first, seg_start, k = staged_layout(spec.num_draft_tokens)
            for name, a in (("spec_verify_rows", verify_rows), ("spec_draft_ids", spec.draft_token_ids),
                            ("spec_seg_first", seg_first), ("spec_seg_start", seg_start),
                            ("spec_num_drafts", k)):
                i[name] = ints.add(a)
            extra["spec_max_drafts"] = int(k.max()) if len(k) else 0
        hot = np.nonzero(temperatures > 0)[0]
        if hot.size:
            seeded = seeds[hot] >= 0
            for name, a in (("rows", hot), ("seeded_pos", np.nonzero(seeded)[0]),
                            ("free_pos", np.nonzero(~seeded)[0]), ("index", sample_index[hot][seeded])):
                i[name] = ints.add(a)
            f["temperatures"] = floats.add(temperatures[hot])
            longs.add(seeds[hot][seeded])
        if inputs is not None:
            if hot.size and inputs.top_k is not None:
                _stage_filters(inputs, hot, ints, floats, i, f, extra)
            if inputs.penalty_rows is not None:
                for name in ("penalty_rows", "history", "history_lens"):
                    i[name] = ints.add(getattr(inputs, name))
                for name in ("presence", "frequency", "repetition"):
                    f[name] = floats.add(getattr(inputs, f"{name}_penalty"))
                if inputs.history_prev_index is not None and len(inputs.history_prev_index):
                    i["history_prev_index"] = ints.add(inputs.history_prev_index)
                    i["history_prev_rows"] = ints.add(inputs.history_prev_rows)
                if inputs.history_draft_index is not None and len(inputs.history_draft_index):
                    i["history_draft_index"] = ints.add(inputs.history_draft_index)
                    i["history_draft_src"] = ints.add(inputs.history_draft_src)
            if inputs.min_tokens_rows is not None and len(inputs.min_tokens_rows):
                i["min_tokens_rows"] = ints.add(inputs.min_tokens_rows)
                i["min_tokens_ids"] = ints.add(inputs.min_tokens_ids)
            if inputs.logit_bias_rows is not None and len(inputs.logit_bias_rows):
                i["logit_bias_rows"] = ints.add(inputs.logit_bias_rows)
                i["logit_bias_ids"] = ints.add(inputs.logit_bias_ids)
                f["logit_bias_values"] = floats.add(inputs.logit_bias_values)
            if inputs.grammar_rows is not None and len(inputs.grammar_rows):
                i["grammar_rows"] = ints.add(inputs.grammar_rows)
                # int32 words, in a copy of their own (the shared int part becomes long); None
                # here when rank 0 fills them after the forward (``worker._fill_grammar``)
                bm = inputs.grammar_bitmask
                if bm is not None:
                    extra["grammar_bitmask"] = (put("grammar_bitmask", bm) if put is not None
                                                else torch.from_numpy(np.ascontiguousarray(bm)).to(device))
            if inputs.logprobs is not None:
                rows = np.nonzero(inputs.logprobs >= 0)[0].astype(np.int32)
                if rows.size:
                    i["logprob_rows_dev"] = ints.add(rows)
                    extra.update(logprob_rows=rows, max_num_logprobs=int(inputs.logprobs[rows].max()))
        if not ints.parts:
            return cls()
        # every index as long (what indexing wants); the float views are [n] or [n, 1]
        di, df, dl = ints.send(device, put, torch.long), floats.send(device, put), longs.send(device, put)
        out = {name: di[k] for name, k in i.items()}
        flat = ("sort_p", "logit_bias_values")  # per entry, not per row
        out.update({name: df[k] if name in flat else df[k][:, None] for name, k in f.items()})
        if dl:
            out["seeds"] = dl[0]
        return cls(**out, **extra)


def _stage_filters(inputs: SamplingInputs, hot: np.ndarray, ints: _Pack, floats: _Pack,
                   i: dict, f: dict, extra: dict) -> None:
    """min-p, top-k and top-p of the hot rows: a sort only for rows with top_p < 1; rows with
    top_k alone take one ``topk`` of the largest k."""
    top_k, top_p, min_p = inputs.top_k[hot], inputs.top_p[hot], inputs.min_p[hot]
    pos = np.nonzero(min_p > 0)[0]
    if pos.size:
        i["min_p_pos"], f["min_p"] = ints.add(pos), floats.add(min_p[pos])
    pos = np.nonzero(top_p < 1)[0]
    if pos.size:
        i["sort_pos"] = ints.add(pos)
        i["sort_k"] = ints.add(np.where(top_k[pos] > 0, top_k[pos], np.iinfo(np.int32).max))
        f["sort_p"] = floats.add(top_p[pos])
    pos = np.nonzero((top_k > 0) & (top_p >= 1))[0]
    if pos.size:
        i["top_k_pos"], i["top_k"] = ints.add(pos), ints.add(top_k[pos])
        extra["max_top_k"] = int(top_k[pos].max())


def apply_raw_processors(logits: torch.Tensor, st: SamplingTensors,
                         last_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [B, V] after min_tokens masking, logit_bias and the penalties (vLLM's order):
    what greedy rows take the argmax of.  ``logits`` itself when no row uses either, else a new tensor (the raw logits
    stay as they are, for logprobs and ``return_logits``).  ``last_tokens`` are the previous
    step's tokens, which fill the histories' placeholders under async scheduling."""
    if (st.min_tokens_rows is None and st.penalty_rows is None and st.logit_bias_rows is None
            and st.grammar_rows is None):
        return logits
    logits = logits.float().clone()
    if st.grammar_rows is not None:
        apply_grammar(logits, st)
    if st.min_tokens_rows is not None:
        logits[st.min_tokens_rows, st.min_tokens_ids] = float("-inf")
    if st.logit_bias_rows is not None:
        # one scatter-add over every (row, id) of the batch; the pairs are unique (a row's ids
        # are), and a masked -inf stays -inf
        logits.index_put_((st.logit_bias_rows, st.logit_bias_ids), st.logit_bias_values, accumulate=True)
    if st.penalty_rows is not None:
        history = st.history
        if st.history_prev_index is not None:
            if last_tokens is None:
                raise RuntimeError("a penalty row's history reads the previous step's token, "
                                   "but no previous step's tokens are on this rank")
            history[st.history_prev_index] = last_tokens[st.history_prev_rows].long()
        if st.history_draft_index is not None:  # a draft model's drafts, proposed on the ranks
            history[st.history_draft_index] = st.spec_draft_ids[st.history_draft_src].long()
        logits[st.penalty_rows] = apply_penalties(
            logits[st.penalty_rows], history, st.history_lens, len(history),
            st.presence, st.frequency, st.repetition)
    return logits


def apply_grammar(logits: torch.Tensor, st: SamplingTensors) -> None:
    """-inf, in place, at each constrained row's disallowed ids (``apply_token_bitmask_inplace``)."""
    if st.grammar_bitmask is None:
        raise RuntimeError("constrained rows without a grammar_bitmask: it is filled before sampling")
    apply_token_bitmask_inplace(logits, st.grammar_rows, st.grammar_bitmask)


def apply_hot_processors(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The hot rows' logits [h, V] divided by their temperatures, then min-p, top-k and top-p
    (vLLM's order): the distribution they draw from is their softmax."""
    x = logits[st.rows].float() / st.temperatures
    if st.min_p_pos is not None:
        x[st.min_p_pos] = apply_min_p(x[st.min_p_pos], st.min_p)
    if st.sort_pos is not None:
        x[st.sort_pos] = apply_top_k_top_p(x[st.sort_pos], st.sort_k, st.sort_p)
    if st.top_k_pos is not None:
        x[st.top_k_pos] = apply_top_k_only(x[st.top_k_pos], st.top_k, st.max_top_k)
    return x


def sample_on_device(logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator | None = None,
                     last_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, LogprobsTensors | None]:
    """Token ids [B] (int32, on the logits' device) and the raw logprobs of the rows that asked,
    with no host-device sync: argmax of the processed logits where temperature is 0, else a draw
    from softmax(processed logits / T) restricted by min-p, top-k and top-p.

    A seeded request's n-th token depends only on (seed, n) and its logits (and history) -- not
    on the batch it shares, the step it lands in, or the TP size.  Unseeded requests draw from
    ``generator``.  ``logits`` are left as they are (the raw logits).
    """
    raw = logits
    logits = apply_raw_processors(logits, st, last_tokens)
    tokens = logits.argmax(dim=-1).to(torch.int32)
    if st.rows is not None:
        x = apply_hot_processors(logits, st)
        k, V = x.shape
        u = torch.empty(k, V, device=logits.device)
        if len(st.seeded_pos):
            u[st.seeded_pos] = hash_uniform(st.seeds, st.index, V)
        if len(st.free_pos):
            u[st.free_pos] = torch.rand(len(st.free_pos), V, device=logits.device,
                                        generator=generator).clamp_(1e-7, 1 - 1e-7)
        tokens[st.rows] = gumbel_argmax(x, u).to(torch.int32)
    lp = None
    if st.logprob_rows is not None:
        rows = st.logprob_rows_dev
        lp = LogprobsTensors(st.logprob_rows, *compute_logprobs(raw[rows], tokens[rows], st.max_num_logprobs))
    if st.spec_seg_first is not None:  # the rows' tokens after their first rejected draft: -1
        tokens = reject_drafts(tokens, st.spec_verify_rows, st.spec_draft_ids, st.spec_seg_first, st.spec_seg_start,
                               st.spec_num_drafts, st.spec_max_drafts)
    return tokens, lp


PROMPT_LOGITS_ROWS = 1024  # prompt rows turned into logits at once: [1024, 128k] fp32 is 0.5 GiB


def prompt_logprobs_on_device(compute_logits, hidden: torch.Tensor, indices: torch.Tensor,
                              targets: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Each prompt row's raw logprob of the token after it, its rank and the top ``num_logprobs``
    (``compute_logprobs`` per row), ``PROMPT_LOGITS_ROWS`` rows at a time: a 4k-token chunk would
    otherwise hold its whole [4k, vocab] logits twice over (logits, then their log-softmax)."""
    parts = [compute_logprobs(compute_logits(hidden, indices[s:s + PROMPT_LOGITS_ROWS]),
                              targets[s:s + PROMPT_LOGITS_ROWS], num_logprobs)
             for s in range(0, len(indices), PROMPT_LOGITS_ROWS)]
    ids, lps, ranks = (torch.cat(x) for x in zip(*parts))
    return LogprobsTensors(np.arange(len(indices), dtype=np.int32), ids, lps, ranks)


def sample(logits: torch.Tensor, temperatures: np.ndarray, seeds: np.ndarray,
           sample_index: np.ndarray, generator: torch.Generator | None = None,
           inputs: SamplingInputs | None = None, last_tokens: torch.Tensor | None = None,
           spec: SpecDecodeInputs | None = None) -> np.ndarray:
    """``sample_on_device`` in one call, its tokens brought to the host as a numpy int32 array."""
    st = SamplingTensors.stage(temperatures, seeds, sample_index, logits.device, inputs=inputs, spec=spec)
    return sample_on_device(logits, st, generator, last_tokens)[0].cpu().numpy()
