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
    """One step for every rank: ``ray.put`` once, read by all."""

    plan: Any  # ray_attn.planner.StepPlan
    temperatures: np.ndarray  # float32 [B]; 0 = greedy
    seeds: np.ndarray  # int64 [B]; -1 = no seed (the worker's own generator)
    sample_index: np.ndarray  # int32 [B]; tokens generated so far, so a seeded request's n-th draw is fixed
    return_logits: bool = False
    step_id: int = 0


@dataclass
class StepOutput:
    """Rank 0's answer: one sampled token per request, in the plan's order."""

    token_ids: np.ndarray  # int32 [B]
    logits: np.ndarray | None = None  # float32 [B, vocab] when asked for
    step_id: int = 0
    timings: dict = field(default_factory=dict)
