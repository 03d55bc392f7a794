"""Rank 0's answers to deferred steps, and the host memory their tokens travel to.

Under async scheduling a deferred step is answered one step late (see ``StepInput``): its
tokens start their copy to the host when the step is queued, and rank 0 waits for that copy
only after the next step is queued behind it, so the GPU never idles while the driver plans.
A copy that does not block needs pinned host memory, which is slow to allocate, so it is
kept: two buffers, used in turn, since the previous deferred output may still be unread when
the next copy starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_attn.runtime.messages import StepOutput

MIN_CAPACITY = 256


@dataclass(slots=True)
class DeferredOutput:
    """A step's output whose tokens may still be on their way to the host."""

    event: torch.cuda.Event | None  # recorded behind the copy on CUDA; None on CPU, already copied
    host_tokens: torch.Tensor | np.ndarray  # a view of a pinned buffer (CUDA), or a copy (CPU)
    step_id: int
    logits: np.ndarray | None

    def collect(self) -> StepOutput:
        """Wait for the copy and answer.  The tokens are copied out of the pinned buffer: it is
        reused by the deferred step after next, while the driver may still hold this answer."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host_tokens
        tokens = host if isinstance(host, np.ndarray) else host.numpy().copy()
        return StepOutput(token_ids=tokens, step_id=self.step_id, logits=self.logits)


class TokenStaging:
    """The two pinned host buffers that deferred steps' tokens are copied into, in turn."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._flip = 0

    def defer(self, tokens: torch.Tensor, step_id: int, logits: np.ndarray | None) -> DeferredOutput:
        """Start the copy of ``tokens`` (on the device) to the host, without waiting for it."""
        if not self.cuda:
            return DeferredOutput(None, tokens.numpy().copy(), step_id, logits)
        self._flip ^= 1
        host = self._host[self._flip]
        if host is None or host.numel() < len(tokens):
            host = torch.empty(max(2 * len(tokens), MIN_CAPACITY), dtype=torch.int32, pin_memory=True)
            self._host[self._flip] = host
        view = host[:len(tokens)]
        view.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return DeferredOutput(event, view, step_id, logits)
