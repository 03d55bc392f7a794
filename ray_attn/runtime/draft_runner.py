"""A rank's draft model (``speculative_config.method='draft_model'``): proposes a step's drafts.

The draft is TP-sharded like the target, on the target's ranks and TP group, with a KV cache of
its own in the target's block geometry (``spec/draft_inputs.py`` says how the two caches share
block tables, and what the catch-up query is).  Before the target's forward, ``propose`` runs
the catch-up query, takes each row's argmax as draft 1, then one single-token pass per further
draft; the drafts are written into the target's inputs at the draft positions and given to rank
0's rejection sampler.  Drafting by argmax makes the draft's distribution a point mass, which is
what the sampler's exact rejection rule assumes (``runtime/spec_decode.py``).

A draft that fails (any exception in its passes) proposes token 0 everywhere: verification is
exact whatever the drafts are, so the step's output is still right -- the target's token at the
first position, as plain decoding would give -- and the request goes on.  A rank's drafts are
broadcast from rank 0 when TP > 1, so that every rank embeds the same verifying query even if
two ranks' argmaxes were to split a tie differently.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import torch

from ray_attn.backend.validate import check_metadata_values
from ray_attn.runtime.messages import CATCH_UP_TOKENS, DraftInputs


class RankDraft:
    def __init__(self, config, rank: int, tp: int, group, device: torch.device):
        from ray_attn.model import build_model

        spec = config.speculative_config
        # The draft computes in the target's dtype, as vLLM's draft runs in the target's.
        self.config = spec.draft_config().model_copy(update={"dtype": config.model.dtype})
        self.rank, self.tp, self.device = rank, tp, device
        with torch.device(device):
            self.model = build_model(self.config, tp_rank=rank, tp_size=tp, tp_group=group, device=device,
                                     block_size=config.cache.block_size,
                                     kv_cache_dtype=config.cache.kv_cache_dtype, kernel=config.parallel.kernel)
        if spec.model is not None:
            self.model.load_weights(spec.model)
        else:
            self.model.init_random_weights(self.config.seed)
        self.failures = 0  # draft passes that raised (their steps verified token 0 instead)
        self.graphs = None  # DecodeGraphs of the draft, once captured (GPU): one-token queries
        self.catch_up_graphs = None  # and the steady-state catch-up's two-token ones
        self.replays = 0  # draft forwards that replayed a graph

    def kv_cache_bytes_per_block(self) -> int:
        return self.model.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.model.allocate_kv_cache(num_blocks)

    def check(self, d: DraftInputs, spec, plan, num_blocks: int, block_size: int) -> None:
        """Refuse draft inputs that disagree with the step or reach outside the cache
        (``ValueError`` naming the field), before anything reaches the device."""
        B = plan.attn.num_reqs
        k_all = np.zeros(B, np.int64) if spec is None else np.asarray(spec.num_draft_tokens, np.int64)
        rows = np.asarray(d.rows, np.int64)
        if rows.shape != np.shape(d.num_draft_tokens) or (len(rows) and (
                rows.min() < 0 or rows.max() >= B or (np.diff(rows) <= 0).any())):
            raise ValueError(f"draft.rows must be increasing plan rows in [0, {B}), one per draft row")
        if not np.array_equal(np.asarray(d.num_draft_tokens), k_all[rows]) or k_all[rows].sum() != k_all.sum():
            raise ValueError("draft.num_draft_tokens must be spec.num_draft_tokens at draft.rows, every "
                             "speculating row among them")
        if len(d.target_index) != int(k_all.sum()):
            raise ValueError(f"draft.target_index holds {len(d.target_index)} positions for {int(k_all.sum())} drafts")
        n = plan.attn.num_actual_tokens
        if len(d.target_index) and (d.target_index.min() < 0 or d.target_index.max() >= n):
            raise ValueError(f"draft.target_index must lie in [0, {n}) (the step's tokens)")
        vocab = self.config.vocab_size
        ids = d.input_token_ids
        if len(ids) != d.metadata.num_actual_tokens or len(d.positions) != len(ids):
            raise ValueError("draft.input_token_ids and draft.positions must hold the catch-up query's tokens")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"draft.input_token_ids must lie in [0, {vocab})")
        check_metadata_values(d.metadata, num_blocks, block_size)
        S = len(d.num_draft_tokens)
        for j, p in enumerate(d.passes, start=1):
            if len(p.rows) and (p.rows.min() < 0 or p.rows.max() >= S):
                raise ValueError(f"draft.passes[{j - 1}].rows must index the {S} drafting rows")
            check_metadata_values(p.metadata, num_blocks, block_size)
        d.metadata.host_checked = True
        for p in d.passes:
            p.metadata.host_checked = True

    @torch.inference_mode()
    def propose(self, d: DraftInputs, put) -> torch.Tensor:
        """The step's drafts, long [sum k] row after row, on the device."""
        k = np.asarray(d.num_draft_tokens)
        S, K = len(k), int(k.max()) if len(k) else 0
        try:
            out = self._passes(d, put, S, K)
        except Exception as e:  # noqa: BLE001 -- exact verification makes any draft safe
            self.failures += 1
            if self.failures == 1:
                warnings.warn(f"rank {self.rank}: the draft model failed ({type(e).__name__}: {e}); its "
                              "steps verify token 0 instead (their output is unchanged)")
            out = torch.zeros(S, K, dtype=torch.long, device=self.device)
        if self.tp > 1 and K:
            import torch.distributed as dist

            dist.broadcast(out, src=0)
        keep = put("draft.keep", (np.arange(K)[None, :] < k[:, None]).reshape(-1)).bool()
        return out.reshape(-1)[keep]

    def capture_graphs(self, max_batch: int, pool=None, capture: bool = True) -> None:
        """Decode graphs of the draft (``cuda_graphs.DecodeGraphs``, in the target's graph pool):
        a steady-state step's catch-up is two tokens a row and every pass after it one, so all of
        a step's draft forwards replay -- eager, k forwards of even a small model are k x its
        layers' launches, more than the target's replayed step.  ``capture=False`` runs the
        same padded path eagerly (CPU tests)."""
        from ray_attn.runtime.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, max_batch, self.device, capture=capture, pool=pool)
        self.catch_up_graphs = DecodeGraphs(self.model, max_batch, self.device, capture=capture,
                                            pool=self.graphs.pool, query_len=CATCH_UP_TOKENS)

    def _passes(self, d: DraftInputs, put, S: int, K: int) -> torch.Tensor:
        model = self.model
        out = torch.zeros(S, K, dtype=torch.long, device=self.device)
        hidden = self._forward(d.metadata, d.positions, put, "draft.m.", ids_host=d.input_token_ids)
        spec = np.flatnonzero(np.asarray(d.num_draft_tokens) > 0)  # the others only computed a chunk
        if not len(spec):
            return out
        last = (np.asarray(d.metadata.query_start_loc[1:]) - 1)[spec]
        first = model.compute_logits(hidden, put("draft.last", last).long()).argmax(-1)
        out[put("draft.spec_rows", spec).long(), 0] = first
        for j, p in enumerate(d.passes, start=1):
            rows = put(f"draft.rows{j}", p.rows).long()
            h = self._forward(p.metadata, p.positions, put, f"draft.p{j}.", ids_dev=out[rows, j - 1])
            out[rows, j] = model.compute_logits(h, torch.arange(len(p.rows), device=self.device)).argmax(-1)
        return out

    def _forward(self, m, positions: np.ndarray, put, prefix: str, ids_host=None, ids_dev=None) -> torch.Tensor:
        """Hidden states of one draft forward: a replayed graph when every row's query is one
        token (a pass) or two (the steady-state catch-up), else eager.  Its token ids are host ones (the catch-up's) or on the device (the
        pass before's argmaxes)."""
        n = m.num_actual_tokens
        plan = SimpleNamespace(attn=m, positions=positions,
                               input_token_ids=ids_host if ids_host is not None else np.zeros(n, np.int32))
        g = next((g for g in (self.graphs, self.catch_up_graphs) if g is not None and g.can_run(plan)), None)
        if g is not None:
            padded = g.load(plan)
            if ids_dev is not None:  # after load's copies, on the same stream
                g.input_ids[:n] = ids_dev.to(g.input_ids.dtype)
            self.replays += 1
            return g.replay(padded, m.num_reqs, False)
        dm = m.to_device(self.device, put=lambda name, a: put(prefix + name, a))
        ids = ids_dev if ids_dev is not None else put(prefix + "ids", ids_host).long()
        return self.model(ids, put(prefix + "pos", positions).long(), dm)
