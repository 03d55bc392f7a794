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

    @classmethod
    def flush(cls, step_id: int) -> "StepInput":
        empty = np.zeros(0, np.int32)
        return cls(plan=None, temperatures=empty.astype(np.float32), seeds=empty.astype(np.int64),
                   sample_index=empty, step_id=step_id, defer=True)


@dataclass
class StepOutput:
    """Rank 0's answer: one sampled token per request, in the plan's order."""

    token_ids: np.ndarray  # int32 [B]
    logits: np.ndarray | None = None  # float32 [B, vocab] when asked for
    step_id: int = 0
    timings: dict = field(default_factory=dict)
