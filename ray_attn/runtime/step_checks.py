"""The host checks of a step a rank received, before any of it reaches the device."""

from __future__ import annotations

from ray_attn.backend.validate import check_metadata_values
from ray_attn.runtime.spec_decode import check_spec_inputs


def check_step(w, step) -> None:
    """Refuse a step that would lose an answer or read outside the cache, before any of it
    is queued."""
    if not step.defer and w.deferred is not None:
        raise RuntimeError(f"rank {w.rank}: step {step.step_id} is not deferred, but the output "
                           f"of deferred step {w.deferred.step_id} was never collected")
    m = step.plan.attn
    check_metadata_values(m, w.num_blocks, w.config.cache.block_size)
    if step.spec is not None:
        check_spec_inputs(step)
    if step.draft is not None:
        if w.draft is None:
            raise ValueError(f"rank {w.rank}: step {step.step_id} carries draft-model inputs, but "
                             "this rank has no draft model (speculative_config.method='draft_model')")
        w.draft.check(step.draft, step.spec, step.plan, w.num_blocks, w.config.cache.block_size)
    t = step.plan.kv_transfers
    if t is not None:
        if w.tiers is None:
            raise ValueError(f"rank {w.rank}: step {step.step_id} carries kv_transfers, but this rank "
                             "has no KV tiers (cache.host_cache_gib and cache.kv_sharing are off)")
        w.tiers.check(t, w.num_blocks)
    p = step.prompt_logprobs
    if p is not None and len(p.indices):  # an index past the step would fail on the device
        if len(p.indices) != len(p.targets):
            raise ValueError(f"prompt_logprobs: {len(p.indices)} indices but {len(p.targets)} targets")
        if p.indices.min() < 0 or p.indices.max() >= m.num_actual_tokens:
            raise ValueError(f"prompt_logprobs.indices must lie in [0, {m.num_actual_tokens}) "
                             "(the step's tokens)")
        vocab = w.config.model.vocab_size
        if p.targets.min() < 0 or p.targets.max() >= vocab:
            raise ValueError(f"prompt_logprobs.targets must lie in [0, {vocab})")
    m.host_checked = True  # carried to the device copy: its layers need not read values back
