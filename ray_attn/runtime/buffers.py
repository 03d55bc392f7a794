"""Persistent staging for a step's arrays: no allocation (and no page-locking) per step.

Each named array gets a host buffer (pinned on CUDA) and a device buffer that are reused every
step and grow geometrically when a step needs more.  The step's numpy arrays are copied into the
host buffer and sent with one non-blocking copy each; the tensors handed out are views, valid
until the next step's ``begin()``.
"""

from __future__ import annotations

import numpy as np
import torch

MIN_CAPACITY = 256


class StepBuffers:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}
        self._copied = None  # CUDA event: the previous step's copies are done with the host side

    def begin(self) -> None:
        """Before writing a new step: the last step's non-blocking copies must have read their
        pinned source, or we would overwrite it under them."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def end(self) -> None:
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def put(self, name: str, a: np.ndarray) -> torch.Tensor:
        """``a`` (any integer array) as an int32 tensor on the device, shaped like ``a``."""
        n = a.size
        host, dev = self._slot(name, n)
        host[:n].numpy()[:] = np.asarray(a).reshape(-1)  # casts to int32 as it copies
        if dev is host:
            return host[:n].view(a.shape)
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n].view(a.shape)

    def _slot(self, name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        host = self._host.get(name)
        if host is None or host.numel() < n:
            cap = max(n, MIN_CAPACITY, 2 * (0 if host is None else host.numel()))
            host = torch.empty(cap, dtype=torch.int32, pin_memory=self.cuda)
            self._host[name] = host
            self._dev[name] = (torch.empty(cap, dtype=torch.int32, device=self.device)
                               if self.cuda else host)
        return host, self._dev[name]
