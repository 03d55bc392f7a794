"""What travels between the driver and the workers: plain dataclasses of numpy arrays, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
