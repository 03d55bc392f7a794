"""Hand-built paged steps for the model tests: chunked prefill, then decode, with their metadata.

Independent of the planner: blocks come from a fixed permutation, local (chunked) attention
virtual batches are cut here one chunk at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from ray_attn.metadata import FlashAttentionMetadata, LocalAttentionMetadata

BLOCK_SIZE = 16
MAX_BLOCKS = 8  # per sequence: 128 tokens


def block_rows(num_seqs: int) -> np.ndarray:
    perm = np.random.default_rng(1234).permutation(num_seqs * MAX_BLOCKS).astype(np.int32)
    return perm.reshape(num_seqs, MAX_BLOCKS)


def make_step(rows, ctx_lens, q_lens, chunk=None) -> FlashAttentionMetadata:
    """Metadata for the sequences with ``q_lens[b] > 0`` new tokens after ``ctx_lens[b]`` cached ones."""
    live = [b for b, q in enumerate(q_lens) if q]
    seq_lens = np.array([ctx_lens[b] + q_lens[b] for b in live], np.int32)
    qsl = np.concatenate([[0], np.cumsum([q_lens[b] for b in live])]).astype(np.int32)
    pos = np.concatenate([np.arange(ctx_lens[b], ctx_lens[b] + q_lens[b]) for b in live])
    owner = np.repeat([rows[b] for b in live], [q_lens[b] for b in live], axis=0)
    slots = owner[np.arange(len(pos)), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    m = FlashAttentionMetadata(
        num_actual_tokens=len(pos), max_query_len=int(np.diff(qsl).max()), query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=rows[live].copy(),
        slot_mapping=slots.astype(np.int32))
    if chunk:
        m.local_attn_metadata = local_batches(rows[live], seq_lens - np.diff(qsl), seq_lens, chunk)
    return m


def local_batches(rows, ctx_lens, seq_lens, chunk) -> LocalAttentionMetadata:
    """One virtual sequence per (sequence, chunk its queries touch): the chunk's keys only."""
    per = chunk // BLOCK_SIZE
    qls, kls, tables = [], [], []
    for row, ctx, n in zip(rows, ctx_lens, seq_lens):
        for c in range(ctx // chunk, (n - 1) // chunk + 1):
            start, end = c * chunk, min(n, (c + 1) * chunk)
            qls.append(end - max(ctx, start))
            kls.append(end - start)
            tables.append(np.resize(row[c * per:(c + 1) * per], per))
    return LocalAttentionMetadata(
        local_query_start_loc=np.concatenate([[0], np.cumsum(qls)]).astype(np.int32),
        local_seqused_k=np.array(kls, np.int32), local_block_table=np.stack(tables).astype(np.int32),
        local_max_query_len=max(qls), local_max_seq_len=max(kls))


def run_schedule(model, tokens, schedule, chunk=None, device="cpu") -> list[torch.Tensor]:
    """Feed ``tokens`` (one list per sequence) through ``schedule`` (new tokens per sequence per
    step); returns per sequence the float32 logits of every position it computed, in order."""
    rows = block_rows(len(tokens))
    model.allocate_kv_cache(len(tokens) * MAX_BLOCKS)
    done = [0] * len(tokens)
    out = [[] for _ in tokens]
    for q_lens in schedule:
        m = make_step(rows, done, q_lens, chunk)
        live = [b for b, q in enumerate(q_lens) if q]
        # int32, as the runtime's plans carry them.
        ids = torch.tensor(np.concatenate([tokens[b][done[b]:done[b] + q_lens[b]] for b in live]), dtype=torch.int32)
        pos = torch.tensor(np.concatenate([np.arange(done[b], done[b] + q_lens[b]) for b in live]), dtype=torch.int32)
        hidden = model(ids.to(device), pos.to(device), m.to_device(device))
        logits = model.compute_logits(hidden, torch.arange(len(ids), device=device)).cpu()
        for b, part in zip(live, logits.split([q_lens[b] for b in live])):
            out[b].append(part)
            done[b] += q_lens[b]
    return [torch.cat(o) for o in out]


# Two sequences: chunked prefill (20 + 17, and 50 at once), then three decode steps.
SCHEDULE = [[20, 50], [17, 0], [1, 1], [1, 1], [1, 1]]
LENGTHS = [40, 53]


def random_tokens(vocab: int, seed: int = 0) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.integers(0, vocab, n) for n in LENGTHS]
