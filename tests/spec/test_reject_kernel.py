"""The one-kernel rejection (``spec_decode.reject_drafts_launch``, CUDA) against the torch
formulation it replaces, on random layouts: requests with no drafts, all drafts right, a mismatch
at every position, k up to 9 (a block of 16).  Exact: both keep the target's tokens or write -1.

On a GPU the kernel runs compiled; without one ``test_kernel_under_the_interpreter`` runs this
module again with TRITON_INTERPRET=1, on CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.runtime import spec_decode as S
from tests.interpreter import interpreter_test, kernels_mark

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernel = kernels_mark(S.triton)


def test_kernel_under_the_interpreter():
    interpreter_test(__file__, min_passed=8)


def layout(rng, k: np.ndarray, match: float):
    """Targets and drafts where each draft equals its verifying row's target with prob. ``match``."""
    seg_first, verify = S.spec_layout(k)
    R, D = len(seg_first), int(k.sum())
    target = torch.from_numpy(rng.integers(0, 50, R).astype(np.int32))
    drafts = target[torch.from_numpy(verify)].long().clone()
    flip = torch.from_numpy(rng.random(D) > match)
    drafts[flip] = (drafts[flip] + 1 + torch.from_numpy(rng.integers(0, 40, int(flip.sum())))) % 50
    return target, drafts, seg_first, verify


@kernel
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("match", [0.0, 0.7, 1.0])
def test_kernel_equals_the_torch_formulation(seed, match):
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 10, rng.integers(1, 12))
    k[0] = 0  # a request with no drafts this step
    target, drafts, seg_first, verify = layout(rng, k, match)
    want = S.reject_drafts(target, torch.from_numpy(verify), drafts, torch.from_numpy(seg_first))
    seg_start = torch.from_numpy(S.seg_starts(k)).to(DEVICE)
    got = S.reject_drafts_launch(target.to(DEVICE), drafts.to(DEVICE), seg_start, torch.from_numpy(k).to(DEVICE),
                                 int(k.max()))
    assert torch.equal(got.cpu(), want)
    if match == 1.0:
        assert (want >= 0).all()  # every draft right: each request keeps all 1 + k rows


@kernel
def test_no_requests_is_an_empty_answer():
    e = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert S.reject_drafts_launch(e, e.long(), e.long(), e.long(), 0).numel() == 0
