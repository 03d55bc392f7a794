"""Greedy and seeded sampling on rank 0, so that only token ids travel back to the driver."""

from __future__ import annotations

import numpy as np
import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: spreads (seed, index) pairs apart


def sample(logits: torch.Tensor, temperatures: np.ndarray, seeds: np.ndarray,
           sample_index: np.ndarray, generator: torch.Generator | None = None) -> np.ndarray:
    """Token ids [B]: argmax where temperature is 0, else a draw from softmax(logits / T).

    A seeded request's n-th token depends only on (seed, n) and its logits -- not on the batch it
    shares, the step it lands in, or the TP size -- because each draw gets its own generator.
    """
    tokens = logits.argmax(dim=-1)
    hot = np.nonzero(temperatures > 0)[0]
    if hot.size:
        probs = torch.softmax(logits[hot].float() / torch.from_numpy(temperatures[hot]).to(logits.device)[:, None], -1)
        for j, i in enumerate(hot.tolist()):
            gen = generator
            if seeds[i] >= 0:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed((int(seeds[i]) * _SEED_MIX + int(sample_index[i])) % (2 ** 63))
            tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return tokens.to(torch.int32).cpu().numpy()
