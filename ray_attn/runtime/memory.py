"""KV-cache sizing on a GPU the way vLLM's profiling run does it.

Before, a rank took ``memory_fraction`` of the memory *free after the weights* for its cache.
That figure is taken with whatever the caching allocator still held (the random initialisation
makes each full tensor in float32 before slicing it: 2.1 GB for Llama-3-8B's LM head), it left
the activations, logits and sampling temporaries of the largest step to the 15% remainder by
luck, and it meant a different share of the GPU on every model.

Now (``profile_cuda_memory``), as vLLM's ``determine_available_memory``:

1. ``torch.cuda.empty_cache()``; what is still allocated is the weights (and the model's
   persistent buffers).
2. A profile forward of ``max_num_batched_tokens`` tokens -- prompts of up to the model's
   context, planned by the planner's own code as a real step is (``profile_plan``: chunked-local
   virtual batches included), real paged attention over a temporary one-layer KV cache that
   every layer shares --
   then the logits of ``max_num_seqs`` rows and the costliest sampling path (temperature, seeds,
   top-k/top-p sort, min-p, penalties, 20 logprobs on every row).  The peak of
   ``torch.cuda.max_memory_allocated`` over the weights, less the temporary cache, is the peak
   activation memory.
3. Non-torch memory: what the device uses that this process's allocator does not hold (the CUDA
   context, NCCL's buffers once the profile's all-reduce made them, other processes).
4. ``kv_bytes = total * memory_fraction - weights - peak activations - non-torch - graph
   reserve``; ``memory_fraction`` is vLLM's ``gpu_memory_utilization``: the share of the whole
   GPU this engine may use.

The graph reserve.  Decode graphs are captured after the cache exists (they hold its
addresses), as vLLM captures its graphs after sizing the cache.  Ours share one memory pool
(largest batch first), which holds a decode step's activations at the largest batch (a few tens
of MB on Llama-3-8B at batch 256) and the static input buffers; ``GRAPH_POOL_RESERVE_BYTES``
covers that with a wide margin, and the pool actually taken is measured at capture and reported
beside it (``graph_pool_bytes`` in ``device_info()['memory']``), so the margin can be checked.

``kv_cache_budget`` is the arithmetic alone (no device), so that it can be tested on CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

GRAPH_POOL_RESERVE_BYTES = 512 << 20
PROFILE_LOGPROBS = 20  # vLLM's default cap on logprobs a request may ask for
PROFILE_TOP_K, PROFILE_TOP_P, PROFILE_MIN_P = 50, 0.9, 0.05


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's memory, in bytes, as the KV cache was sized from it."""

    total_bytes: int  # the device's memory
    memory_fraction: float  # share of total_bytes the engine may use
    weights_bytes: int  # allocated after the weights loaded (and the allocator's cache was emptied)
    peak_activation_bytes: int  # peak of the profile step over the weights, temporary KV excluded
    non_torch_bytes: int  # on the device but not in this process's allocator
    graph_pool_reserve_bytes: int  # kept for decode graphs, captured after the cache
    bytes_per_block: int
    kv_bytes: int  # what the budget leaves for the cache
    num_blocks: int
    # What the sizing before this one saw, for the record: free memory after the weights with
    # the allocator's cache still held, and how much that cache held.
    free_after_weights_bytes: int | None = None
    allocator_cache_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def kv_cache_budget(*, total_bytes: int, memory_fraction: float, weights_bytes: int,
                    peak_activation_bytes: int, non_torch_bytes: int, graph_pool_reserve_bytes: int,
                    bytes_per_block: int, free_after_weights_bytes: int | None = None,
                    allocator_cache_bytes: int | None = None) -> MemoryProfile:
    """The KV cache a rank can hold: ``total * memory_fraction`` less everything else the engine
    needs, in whole blocks.  Raises ValueError, with the breakdown, when not one block fits."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"cache.memory_fraction must be in (0, 1], got {memory_fraction}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    named = dict(total_bytes=total_bytes, weights_bytes=weights_bytes,
                 peak_activation_bytes=peak_activation_bytes, non_torch_bytes=non_torch_bytes,
                 graph_pool_reserve_bytes=graph_pool_reserve_bytes)
    for name, v in named.items():
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    allowed = int(total_bytes * memory_fraction)
    non_kv = weights_bytes + peak_activation_bytes + non_torch_bytes + graph_pool_reserve_bytes
    kv = allowed - non_kv
    if kv < bytes_per_block:
        gib = 1 << 30
        raise ValueError(
            f"cache.memory_fraction={memory_fraction} allows {allowed / gib:.2f} GiB of the device's "
            f"{total_bytes / gib:.2f} GiB, but weights ({weights_bytes / gib:.2f} GiB) + peak activations "
            f"({peak_activation_bytes / gib:.2f} GiB) + non-torch memory ({non_torch_bytes / gib:.2f} GiB) "
            f"+ the CUDA-graph reserve ({graph_pool_reserve_bytes / gib:.2f} GiB) already take "
            f"{non_kv / gib:.2f} GiB: no room for one KV block of {bytes_per_block} bytes. Raise "
            "cache.memory_fraction, lower max_num_batched_tokens / max_num_seqs, or set cache.num_blocks")
    return MemoryProfile(total_bytes, memory_fraction, weights_bytes, peak_activation_bytes,
                         non_torch_bytes, graph_pool_reserve_bytes, bytes_per_block, kv,
                         kv // bytes_per_block, free_after_weights_bytes, allocator_cache_bytes)


def profile_prompt_lens(num_tokens: int, max_model_len: int) -> list[int]:
    """The profile step's prompts: ``num_tokens`` in prompts of the longest the model takes (the
    longest one is what costs attention its most)."""
    if num_tokens < 1 or max_model_len < 1:
        raise ValueError(f"num_tokens and max_model_len must be >= 1, got {num_tokens}, {max_model_len}")
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def profile_plan(lens: list[int], config, block_size: int, vocab_size: int):
    """The profile step as the planner plans a real one: a ``Planner`` of its own (numpy, no
    prefix cache, no cascade) admits one request per prompt over fresh blocks and builds the
    step's ``StepPlan`` -- so a model with chunked-local layers gets its local virtual batches
    (a prompt longer than ``attention_chunk_size`` needs them), a sliding window its window, and
    whatever the planner adds to a step later reaches the profile too.  Returns the plan
    (values checked on the host) and the blocks its cache must hold."""
    from ray_attn.backend.validate import check_metadata_values
    from ray_attn.planner import Planner
    from ray_attn.planner.plan import ScheduledRequest

    kinds = set(config.layer_kinds())
    num_blocks = sum(-(-n // block_size) for n in lens)
    planner = Planner(num_blocks=num_blocks, block_size=block_size, num_query_heads=config.num_attention_heads,
                      num_kv_heads=config.num_key_value_heads, use_alibi=config.use_alibi,
                      sliding_window=config.sliding_window if "sliding_attention" in kinds else None,
                      attention_chunk_size=config.attention_chunk_size if "chunked_attention" in kinds else None,
                      enable_prefix_caching=False, enable_cascade=False, max_model_len=max(lens),
                      max_num_reqs_hint=len(lens))
    # Token ids do not change the plan (no prefix cache); the forward draws its own.
    plan = planner.plan([ScheduledRequest(f"profile-{i}", np.zeros(n, np.int64), n)
                         for i, n in enumerate(lens)])
    check_metadata_values(plan.attn, num_blocks, block_size)
    plan.attn.host_checked = True
    return plan, num_blocks


def _profile_sampling(num_rows: int, vocab: int, device: torch.device):
    """Every row hot, half of them seeded, with every filter, penalties and logprobs: the
    costliest sampling step ``max_num_seqs`` rows can make."""
    from ray_attn.runtime.messages import SamplingInputs
    from ray_attn.runtime.sampling import SamplingTensors

    rows = np.arange(num_rows, dtype=np.int32)
    inputs = SamplingInputs(
        top_k=np.full(num_rows, PROFILE_TOP_K, np.int32), top_p=np.full(num_rows, PROFILE_TOP_P, np.float32),
        min_p=np.full(num_rows, PROFILE_MIN_P, np.float32), penalty_rows=rows,
        presence_penalty=np.full(num_rows, 0.5, np.float32), frequency_penalty=np.full(num_rows, 0.5, np.float32),
        repetition_penalty=np.full(num_rows, 1.1, np.float32),
        history=(rows % vocab).astype(np.int32), history_lens=np.ones(num_rows, np.int32),
        logprobs=np.full(num_rows, PROFILE_LOGPROBS, np.int32))
    seeds = np.where(rows % 2 == 0, rows, -1).astype(np.int64)
    return SamplingTensors.stage(np.ones(num_rows, np.float32), seeds, np.zeros(num_rows, np.int32),
                                 device, inputs=inputs)


@torch.inference_mode()
def profile_run(model, num_tokens: int, num_seqs: int, max_model_len: int) -> int:
    """The largest step this rank can be asked for: a forward of ``num_tokens`` prompt tokens
    with attention, then logits and the costliest sampling of ``num_seqs`` rows.  Returns the
    bytes of the temporary KV cache it used (freed again), which a peak measured around it must
    not count.  Runs on any device; leaves the model without a KV cache, as it found it."""
    from ray_attn.runtime.sampling import sample_on_device

    if model.kv_caches is not None:
        raise RuntimeError("profile_run needs a model without a KV cache (it runs before the cache is sized)")
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    dev = model.device
    lens = profile_prompt_lens(num_tokens, max_model_len)
    plan, num_blocks = profile_plan(lens, model.config, model.block_size, model.config.vocab_size)
    # One layer's cache, shared by every layer: the activations are what we measure, and a full
    # cache for the step would be the largest tensor of the run.
    cache = torch.zeros(model.kv_cache_shape(num_blocks), dtype=model.cache_dtype, device=dev)
    try:
        model.kv_caches = [cache] * len(model.layers)
        # A generator of its own: the process's and the rank's streams must draw the same
        # whether or not a profile ran.
        gen = torch.Generator(device=dev).manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=dev, generator=gen)
        pos = torch.from_numpy(plan.positions.astype(np.int64)).to(dev)
        hidden = model(ids, pos, plan.attn.to_device(dev))
        rows = torch.arange(num_seqs, device=dev) % num_tokens
        logits = model.compute_logits(hidden, rows)
        st = _profile_sampling(num_seqs, model.config.vocab_size, dev)
        tokens, _ = sample_on_device(logits, st, gen, None)
        del hidden, logits, tokens, st
    finally:
        model.kv_caches = None
    return cache.numel() * cache.element_size()


def profile_cuda_memory(model, config, device: torch.device, bytes_per_block: int,
                        graph_reserve: bool) -> MemoryProfile:
    """Size this rank's KV cache from a profile step (see the module docstring).  Every rank of a
    TP group must call it together: the profile forward all-reduces."""
    free_before, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tmp_kv = profile_run(model, config.max_num_batched_tokens, config.max_num_seqs,
                         config.model.max_position_embeddings)
    torch.cuda.synchronize(device)
    peak = max(torch.cuda.max_memory_allocated(device) - weights - tmp_kv, 0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    return kv_cache_budget(
        total_bytes=total, memory_fraction=config.cache.memory_fraction, weights_bytes=weights,
        peak_activation_bytes=peak, non_torch_bytes=non_torch,
        graph_pool_reserve_bytes=GRAPH_POOL_RESERVE_BYTES if graph_reserve else 0,
        bytes_per_block=bytes_per_block, free_after_weights_bytes=free_before,
        allocator_cache_bytes=cached)
