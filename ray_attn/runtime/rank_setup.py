"""A rank's set-up beside its model: the KV cache's size and the decode graphs captured over it.

Functions of the ``AttentionWorker`` ``w`` they set up (``worker.py`` calls them from
``load_model``), kept apart from the step's code.
"""

from __future__ import annotations

import os
import warnings

import torch

CPU_CACHE_CAP_BYTES = 1 << 30  # on CPU, memory_fraction sizing stops here: the host is shared


def capture_graphs(w):
    """CUDA graphs for decode, captured against this KV cache (they hold its addresses).  The
    memory their pool takes is recorded beside the reserve the cache was sized to leave them."""
    from ray_attn.runtime.cuda_graphs import DecodeGraphs, wants_cuda_graphs

    par = w.config.parallel
    if w.device.type != "cuda" or not wants_cuda_graphs(par, w.model.kernel_name):
        return None
    try:
        before = torch.cuda.memory_reserved(w.device)
        graphs = DecodeGraphs(w.model, min(par.cuda_graph_max_batch, w.config.max_num_seqs), w.device)
    except Exception as e:  # noqa: BLE001 -- any capture failure leaves a working eager path
        if par.cuda_graphs == "on":
            raise
        warnings.warn(f"rank {w.rank}: CUDA graph capture failed ({type(e).__name__}: {e}); "
                      "decode steps run eagerly (set parallel.cuda_graphs='off' to skip the attempt)")
        return None
    w.spec_graphs = capture_spec_graphs(w, graphs)
    if w.draft is not None:
        capture_draft_graphs(w, graphs)
    w.graph_pool_bytes = torch.cuda.memory_reserved(w.device) - before
    return graphs


def capture_spec_graphs(w, graphs):
    """Graphs of speculative decoding's uniform verifying steps (1 + k tokens a row, up to
    ``SPEC_GRAPH_MAX_BATCH`` rows), in the decode graphs' memory pool: eager, such a step cost
    3x a plain one at batch 1 on an H200, whatever k (launch-bound; bench_spec_verify.py)."""
    from ray_attn.runtime.cuda_graphs import SPEC_GRAPH_MAX_BATCH, DecodeGraphs

    spec, cfg = w.config.speculative_config, w.config
    if spec is None or "chunked_attention" in cfg.model.layer_kinds():
        return None
    try:
        return DecodeGraphs(w.model, min(cfg.parallel.cuda_graph_max_batch, cfg.max_num_seqs,
                                            SPEC_GRAPH_MAX_BATCH), w.device,
                            query_len=1 + spec.num_speculative_tokens, pool=graphs.pool)
    except Exception as e:  # noqa: BLE001 -- verifying steps then run eagerly, as before
        if cfg.parallel.cuda_graphs == "on":
            raise
        warnings.warn(f"rank {w.rank}: CUDA graph capture of verifying steps failed "
                      f"({type(e).__name__}: {e}); they run eagerly")
        return None


def capture_draft_graphs(w, graphs) -> None:
    """The draft model's decode graphs, in the target's pool (``RankDraft.capture_graphs``);
    a failure leaves its forwards eager."""
    par = w.config.parallel
    try:
        w.draft.capture_graphs(min(par.cuda_graph_max_batch, w.config.max_num_seqs), pool=graphs.pool)
    except Exception as e:  # noqa: BLE001 -- the draft then runs eagerly, as before
        if par.cuda_graphs == "on":
            raise
        warnings.warn(f"rank {w.rank}: CUDA graph capture of the draft model failed "
                      f"({type(e).__name__}: {e}); its forwards run eagerly")


def blocks_from_memory(w) -> int:
    """On a GPU: as many KV blocks as ``memory_fraction`` of the device's total memory holds
    once the weights, the largest step's activations (a profile step) and the CUDA graphs'
    reserve are counted (``memory.profile_cuda_memory``, as vLLM's profiling run).  On CPU:
    ``memory_fraction`` of the host memory available, shared by its ranks and with everything
    else on it, capped at ``CPU_CACHE_CAP_BYTES``."""
    per_block = w.model.kv_cache_bytes_per_block()
    if w.draft is not None:  # the draft's cache has a block for each of the target's
        per_block += w.draft.kv_cache_bytes_per_block()
    if w.device.type == "cuda":
        from ray_attn.runtime.cuda_graphs import wants_cuda_graphs
        from ray_attn.runtime.memory import profile_cuda_memory

        graphs = wants_cuda_graphs(w.config.parallel, w.model.kernel_name)
        try:
            w.memory_profile = profile_cuda_memory(w.model, w.config, w.device, per_block,
                                                      graphs)
        except ValueError as e:
            raise RuntimeError(f"rank {w.rank}: {e}") from None
        return w.memory_profile.num_blocks
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = min(avail * w.config.cache.memory_fraction / w.tp, CPU_CACHE_CAP_BYTES)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise RuntimeError(f"rank {w.rank}: no memory left for even one KV block ({per_block} bytes)")
    return blocks
