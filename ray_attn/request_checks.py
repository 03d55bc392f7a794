"""The checks a new request passes before the engine queues it: every token id inside the
vocabulary, the prompt and ``max_tokens`` inside the context and the KV cache, resumed outputs
that leave something to generate.  A request that could never run is refused here with the field
it is about, and no other request is touched.
"""

from __future__ import annotations

from typing import Sequence

from ray_attn.config import EngineConfig
from ray_attn.sampling_params import SamplingParams


def check_new_request(config: EngineConfig, num_blocks: int, prompt_token_ids: Sequence[int],
                      params: SamplingParams, output_token_ids: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """The prompt and the resumed outputs as lists of ints; ``ValueError`` naming what is wrong."""
    prompt = [int(t) for t in prompt_token_ids]
    vocab = config.model.vocab_size
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    total = len(prompt) + params.max_tokens
    limit = config.model.max_position_embeddings
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    bad = [t for t, _ in params.logit_bias if t >= vocab]
    if bad:  # an index past the logits' row on rank 0 would fail the whole step
        raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    resumed = [int(t) for t in output_token_ids]
    bad = [t for t in resumed if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"output_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(resumed) >= params.max_tokens:
        raise ValueError(f"output_token_ids: {len(resumed)} tokens leave nothing to generate under "
                         f"max_tokens={params.max_tokens}")
    if resumed and params.prompt_logprobs is not None:
        raise ValueError("output_token_ids: a resumed request cannot ask for prompt_logprobs")
    if total > limit:
        raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} "
                         f"exceeds the model's {limit}-token context")
    bs = config.cache.block_size
    blocks = -(-total // bs)
    if blocks > num_blocks:
        raise ValueError(f"request needs {blocks} KV blocks ({total} tokens) but the cache "
                         f"holds only {num_blocks}")
    return prompt, resumed
