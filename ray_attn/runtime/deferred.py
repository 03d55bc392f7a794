"""Rank 0's answers to deferred steps, and the host memory their tokens travel to.

Under async scheduling a deferred step is answered one step late (see ``StepInput``): its
tokens start their copy to the host when the step is queued, and rank 0 waits for that copy
only after the next step is queued behind it, so the GPU never idles while the driver plans.
A copy that does not block needs pinned host memory, which is slow to allocate, so it is
kept: two buffers, used in turn, since the previous deferred output may still be unread when
the next copy starts.

When rows asked for logprobs, they travel in the same copy: the tokens, ranks, ids and logprobs
(as their bits) are packed into one int32 tensor on the device (``pack_output``), so an answer
is one copy to the host either way, deferred or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ray_attn.runtime.messages import LogprobsArrays, StepOutput

MIN_CAPACITY = 256


def pack_output(tokens: torch.Tensor, logprobs) -> tuple[torch.Tensor, tuple | None]:
    """``tokens`` int32 [B] and the rows' ``LogprobsTensors`` (or None) as one int32 tensor, and
    what ``unpack_output`` needs to read it back (None without logprobs: the tokens alone)."""
    if logprobs is None:
        return tokens, None
    rows, ids, lps, ranks = logprobs
    packed = torch.cat([tokens, ranks, ids.reshape(-1), lps.contiguous().view(torch.int32).reshape(-1)])
    return packed, (rows, ids.shape[1])


def unpack_output(a: np.ndarray, num_tokens: int, layout: tuple | None
                  ) -> tuple[np.ndarray, LogprobsArrays | None]:
    """The host side of ``pack_output``: the tokens and the logprobs (views of ``a``)."""
    tokens = a[:num_tokens]
    if layout is None:
        return tokens, None
    rows, cols = layout
    L = len(rows)
    ranks, rest = a[num_tokens:num_tokens + L], a[num_tokens + L:]
    ids = rest[:L * cols].reshape(L, cols)
    lps = rest[L * cols:2 * L * cols].view(np.float32).reshape(L, cols)
    return tokens, LogprobsArrays(rows, ids, lps, ranks)


@dataclass(slots=True)
class DeferredOutput:
    """A step's output whose tokens may still be on their way to the host."""

    event: torch.cuda.Event | None  # recorded behind the copy on CUDA; None on CPU, already copied
    host_tokens: torch.Tensor | np.ndarray  # a view of a pinned buffer (CUDA), or a copy (CPU)
    step_id: int
    logits: np.ndarray | None
    num_tokens: int = 0
    layout: tuple | None = None  # pack_output's, when the copy holds logprobs too
    # (rows, then host copies of ids, logprobs and ranks), started before ``event``; rare (a
    # prefill chunk that asked for prompt logprobs), so it has a copy of its own
    prompt_logprobs: tuple | None = None

    def collect(self) -> StepOutput:
        """Wait for the copy and answer.  The tokens are copied out of the pinned buffer: it is
        reused by the deferred step after next, while the driver may still hold this answer."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host_tokens
        packed = host if isinstance(host, np.ndarray) else host.numpy().copy()
        tokens, logprobs = unpack_output(packed, self.num_tokens, self.layout)
        plp = None
        if self.prompt_logprobs is not None:
            rows, *host = self.prompt_logprobs
            plp = LogprobsArrays(rows, *(t.numpy() for t in host))
        return StepOutput(token_ids=tokens, step_id=self.step_id, logits=self.logits, logprobs=logprobs,
                          prompt_logprobs=plp)


class TokenStaging:
    """The two pinned host buffers that deferred steps' tokens are copied into, in turn."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._flip = 0

    def defer(self, tokens: torch.Tensor, step_id: int, logits: np.ndarray | None,
              logprobs=None, prompt_logprobs=None) -> DeferredOutput:
        """Start the copy of ``tokens`` (on the device) and the rows' ``LogprobsTensors`` (or
        None) to the host, without waiting for it; ``prompt_logprobs`` (``LogprobsTensors``)
        travel in a copy of their own, into pinned memory allocated for it."""
        packed, layout = pack_output(tokens, logprobs)
        plp = None
        if prompt_logprobs is not None:
            rows, *dev = prompt_logprobs
            plp = (rows, *(t.to("cpu", non_blocking=self.cuda) for t in dev))
        if not self.cuda:
            return DeferredOutput(None, packed.numpy().copy(), step_id, logits, len(tokens), layout, plp)
        self._flip ^= 1
        host = self._host[self._flip]
        if host is None or host.numel() < len(packed):
            host = torch.empty(max(2 * len(packed), MIN_CAPACITY), dtype=torch.int32, pin_memory=True)
            self._host[self._flip] = host
        view = host[:len(packed)]
        view.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return DeferredOutput(event, view, step_id, logits, len(tokens), layout, plp)


class SamplingThread:
    """A step's sampling on a thread of its own (``AttentionWorker._run``: a deferred step with
    constrained rows).  The CUDA work it queues goes on the same stream as the main thread's, so
    it stays in order with the next step, which is queued only after ``join``."""

    def __init__(self, fn, *args, **kwargs):
        import threading

        self.error: BaseException | None = None

        def run():
            try:
                with torch.inference_mode():
                    fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 -- raised again by join, on the next call
                self.error = e

        self.thread = threading.Thread(target=run, name="rank-sample", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
