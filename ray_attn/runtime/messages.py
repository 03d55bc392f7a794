"""What travels between the driver and the workers: plain dataclasses of numpy arrays, no torch.

On the wire a message is ``dumps(msg)``: bytes, which Ray passes through without pickling, where
each array is its raw bytes.  Left to itself, Ray serialises every numpy array out of band, at
15-35 us each way per array however small, and a step holds a dozen; numpy's own pickling still
costs ~5 us an array.  A 64-request decode step is ~6 KB either way: the per-object work is what
costs, not the bytes.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _array(dtype: str, shape: tuple, data: bytearray) -> np.ndarray:
    return np.frombuffer(data, dtype).reshape(shape)  # a bytearray: writable, as torch wants


def _reduce_array(a: np.ndarray):
    if a.dtype.hasobject:
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _array, (a.dtype.str, a.shape, bytearray(np.ascontiguousarray(a)))


_DISPATCH = {**copyreg.dispatch_table, np.ndarray: _reduce_array}


def dumps(obj) -> bytes:
    """``pickle.dumps`` with arrays as raw bytes; ``loads`` reads it back."""
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = _DISPATCH
    try:
        p.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError):  # e.g. a lambda somewhere
        import ray.cloudpickle

        return ray.cloudpickle.dumps(obj)
    return f.getvalue()


loads = pickle.loads


@dataclass
class SamplingInputs:
    """A step's sampling inputs beyond temperature and seed, for the rows that use them; the
    driver sends None when no row does, so a plain step carries none of this.

    Penalties need each penalized row's token history on rank 0.  It travels whole every step
    (the ranks keep no per-request state, so preemption, recovery and batch changes need no
    bookkeeping there): 4 bytes per token of each such row -- its output, plus its prompt when
    ``repetition_penalty`` != 1 -- i.e. 64 rows of 4k tokens send 1 MiB a step, ~50 us over
    PCIe, in the same non-blocking copy as the other int32 inputs.
    """

    top_k: np.ndarray | None = None  # int32 [B]; 0 = off.  None: no row filters
    top_p: np.ndarray | None = None  # float32 [B]; 1 = off
    min_p: np.ndarray | None = None  # float32 [B]; 0 = off
    penalty_rows: np.ndarray | None = None  # int32 [P] the rows with a penalty.  None: none
    presence_penalty: np.ndarray | None = None  # float32 [P]
    frequency_penalty: np.ndarray | None = None  # float32 [P]
    repetition_penalty: np.ndarray | None = None  # float32 [P]
    # Each penalty row's tokens, concatenated: prompt tokens as id + vocab (only with a repetition
    # penalty), then output tokens as id; -1 is the previous step's token of that row, still on
    # the ranks under async scheduling: ``history_prev_index`` are those positions and
    # ``history_prev_rows`` the previous step's rows that fill them.
    history: np.ndarray | None = None  # int32 [N]
    history_lens: np.ndarray | None = None  # int32 [P]
    history_prev_index: np.ndarray | None = None  # int32 [K]
    history_prev_rows: np.ndarray | None = None  # int32 [K]
    # A draft model's drafts in the histories of the positions after them (speculative decoding):
    # rank 0 fills ``history_draft_index`` from the step's drafts at ``history_draft_src``.
    history_draft_index: np.ndarray | None = None  # int32 [K']
    history_draft_src: np.ndarray | None = None  # int32 [K'] flat draft index (row after row)
    # (row, token id) pairs masked to -inf: stop ids and EOS of rows short of min_tokens.
    min_tokens_rows: np.ndarray | None = None  # int32 [M]
    min_tokens_ids: np.ndarray | None = None  # int32 [M]
    logprobs: np.ndarray | None = None  # int32 [B]; -1 = none, else how many top logprobs
    # (row, token id, bias) triples added to the raw logits: every logit_bias entry of the rows.
    logit_bias_rows: np.ndarray | None = None  # int32 [E]
    logit_bias_ids: np.ndarray | None = None  # int32 [E]
    logit_bias_values: np.ndarray | None = None  # float32 [E]
    # Rows with a grammar.  Rank 0 keeps a matcher per request (``runtime/grammars.py``) and fills
    # their masks itself, from what ``structured_output.GrammarSync`` sends it once each: the
    # tokenizer, compiled grammars by spec, and a new matcher's spec and output tokens so far.
    grammar_rows: np.ndarray | None = None  # int32 [G]
    grammar_keys: list[str] | None = None  # [G] the rows' request ids
    grammar_counts: np.ndarray | None = None  # int32 [G] output tokens its matcher takes first
    grammar_new: dict | None = None  # request id -> (spec, output token ids)
    grammar_specs: dict | None = None  # spec -> (backend, its compiled grammar as text)
    grammar_tokenizer: dict | None = None  # backend -> its vocabulary (grammar_backends.py)
    grammar_drop: list[str] | None = None  # request ids whose matchers rank 0 forgets
    # The allowed next tokens (bit id % 32 of word id // 32), when the caller fills them itself
    # (benchmarks, tests); rank 0 sets it from its matchers otherwise.
    grammar_bitmask: np.ndarray | None = None  # int32 [G, ceil(vocab / 32)]


@dataclass
class LogprobsArrays:
    """The raw logprobs of the rows that asked (vLLM's ``LogprobsTensors``), in row order.
    Column 0 is the sampled token, then the top ``max_num_logprobs`` (padded to the step's
    largest k; a row reads its own k)."""

    rows: np.ndarray  # int32 [L]
    logprob_token_ids: np.ndarray  # int32 [L, 1 + k]
    logprobs: np.ndarray  # float32 [L, 1 + k]
    selected_token_ranks: np.ndarray  # int32 [L]


@dataclass
class PromptLogprobsInputs:
    """The prompt positions whose logprobs a step computes (``SamplingParams.prompt_logprobs``):
    hidden-state row ``indices[i]`` of the step predicts token ``targets[i]``, the prompt token
    after it.  Rank 0 turns them into logits a slice at a time, so a long prefill chunk never holds
    [chunk, vocab] logits at once."""

    indices: np.ndarray  # int32 [M] rows of the step's hidden states (token positions)
    targets: np.ndarray  # int32 [M] the prompt token each row predicts
    num_logprobs: int = 0  # the top k returned beside each target (the step's largest k)


@dataclass
class SpecDecodeInputs:
    """A step that verifies draft tokens (speculative decoding).  Row r's last ``1 + k_r`` tokens
    (``k_r = num_draft_tokens[r]``) each get a logits row, in order (``logits_indices``): the
    sampler draws the target's token at each, and rank 0's rejection keeps row r's tokens up to
    and including the first whose draft differs (``runtime/spec_decode.py``).  The step's
    per-row sampling arrays (temperatures, seeds, sample_index, ``SamplingInputs``) are then
    per logits row: R = B + sum(k) of them."""

    num_draft_tokens: np.ndarray  # int32 [B]
    draft_token_ids: np.ndarray  # int32 [sum k] row after row: the tokens after each row's first
    logits_indices: np.ndarray  # int32 [R] the token positions whose logits are sampled


# A draft model's steady-state catch-up per row: the token before the last sampled one, and that
# one (``spec/draft_inputs.py`` says why two).
CATCH_UP_TOKENS = 2


@dataclass
class DraftPass:
    """One single-token pass of the draft model: its rows (of the drafting rows) read draft j at
    ``positions`` and propose draft j + 1."""

    rows: np.ndarray  # int32 [S_j]
    positions: np.ndarray  # int32 [S_j]
    metadata: Any  # FlashAttentionMetadata: one token per row, the rows' own block tables


@dataclass
class DraftInputs:
    """What the ranks' draft model runs before a step's forward (``spec/draft_inputs.py``): the
    catch-up query of each of its rows (S plan rows, in plan order: those that speculate, and
    those carrying a prompt's chunk, k = 0), whose last logits give a speculating row's draft 1,
    then ``passes``; the drafts go to the plan's inputs at ``target_index`` [sum k]."""

    metadata: Any  # FlashAttentionMetadata of the catch-up query, in the draft cache's slots
    input_token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    num_draft_tokens: np.ndarray  # int32 [S] each drafting row's k
    passes: list  # [DraftPass] one per draft after the first (K - 1 of them)
    target_index: np.ndarray  # int32 [sum k]
    rows: np.ndarray  # int32 [S] each row's index in the plan


@dataclass
class StepInput:
    """One step for every rank: ``ray.put`` once, read by all.

    Async scheduling (``defer``): the driver plans step N+1 before it has step N's tokens.  Those
    inputs are placeholders in ``plan.input_token_ids``; ``prev_token_index`` says which input
    positions they are and ``prev_token_rows`` which row of step N's sampled tokens fills each --
    the ranks still hold them on the device.  A deferred step is answered with the *previous*
    deferred step's output (None for the first), so the ranks queue step N+1 on the GPU before
    they wait for step N.  ``plan=None`` runs nothing and answers the last deferred step (a
    flush).
    """

    plan: Any  # ray_attn.planner.StepPlan, or None to flush a deferred output
    temperatures: np.ndarray  # float32 [B]; 0 = greedy
    seeds: np.ndarray  # int64 [B]; -1 = no seed (the worker's own generator)
    sample_index: np.ndarray  # int32 [B]; tokens generated so far, so a seeded request's n-th draw is fixed
    return_logits: bool = False
    step_id: int = 0
    defer: bool = False
    prev_token_index: np.ndarray | None = None  # int32 [K] input positions to fill on the device
    prev_token_rows: np.ndarray | None = None  # int32 [K] rows of the previous step's tokens
    sampling: SamplingInputs | None = None  # top-k/p, min-p, penalties, min_tokens, logprobs
    prompt_logprobs: PromptLogprobsInputs | None = None  # when a row asked for them
    # Copies between KV tiers with no step to ride on (a flush: the blocks an idle engine's last
    # steps filled, published); a planned step carries its own in ``plan.kv_transfers``.
    kv_transfers: Any = None
    spec: SpecDecodeInputs | None = None  # draft tokens this step verifies; None: none
    # method='draft_model': what the ranks' draft runs first (its drafts fill the plan's inputs
    # at the draft positions, where the driver put 0, and ``spec.draft_token_ids``); None: nothing
    draft: DraftInputs | None = None
    # Multi-LoRA: adapter slots the ranks fill before this step's forward, as
    # (slot, lora_int_id, lora_name, lora_path) (ray_attn/lora/manager.py); None: none.
    lora_loads: list | None = None
    # Adapters each rank reads into its host LRU on a thread of its own, as (lora_int_id,
    # lora_name, lora_path): a later step's load then copies them from host memory.
    lora_prefetch: list | None = None

    @classmethod
    def flush(cls, step_id: int) -> "StepInput":
        empty = np.zeros(0, np.int32)
        return cls(plan=None, temperatures=empty.astype(np.float32), seeds=empty.astype(np.int64),
                   sample_index=empty, step_id=step_id, defer=True)


@dataclass
class StepOutput:
    """Rank 0's answer: one sampled token per request, in the plan's order."""

    # int32 [B]; with StepInput.spec [R], a speculating row's rejected positions -1
    token_ids: np.ndarray
    logits: np.ndarray | None = None  # float32 [B, vocab] when asked for (the raw logits)
    step_id: int = 0
    timings: dict = field(default_factory=dict)
    logprobs: LogprobsArrays | None = None  # when some row asked
    # One row per PromptLogprobsInputs entry, in its order (column 0: the target token).
    prompt_logprobs: LogprobsArrays | None = None
    lora_ready: list | None = None  # lora_int_ids whose prefetch rank 0 finished since its last answer
