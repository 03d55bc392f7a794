"""The host checks' bounds, at the bound itself: a slot equal to ``num_blocks * block_size`` and a
block id equal to ``num_blocks`` lie outside the cache (the last valid ones are one less), in
every table the kernels read -- the plain block table, cascade's prefix and suffix tables and the
local virtual batches'.  Ids far past the bound cannot tell ``>=`` from ``>``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ray_attn.backend.validate import check_metadata_values
from ray_attn.metadata import FlashAttentionMetadata, LocalAttentionMetadata

NB, BS = 4, 16  # the cache: blocks 0..3, slots 0..63


def _meta(block: int = NB - 1, slot0: int | None = None, cols: int = 1) -> FlashAttentionMetadata:
    """One sequence of 3 new tokens in block ``block`` (slots from ``slot0``)."""
    s = block * BS if slot0 is None else slot0
    table = np.zeros((1, cols), np.int32)
    table[0, 0] = block
    return FlashAttentionMetadata(num_actual_tokens=3, max_query_len=3, query_start_loc=np.array([0, 3], np.int32),
                                  max_seq_len=3, seq_lens=np.array([3], np.int32), block_table=table,
                                  slot_mapping=np.arange(s, s + 3, dtype=np.int32))


def test_the_last_block_and_slot_are_inside():
    check_metadata_values(_meta(NB - 1, slot0=NB * BS - 3), NB, BS)


def test_a_slot_equal_to_the_cache_size_is_refused():
    with pytest.raises(ValueError, match=f"slot {NB * BS} is outside the cache"):
        check_metadata_values(_meta(NB - 1, slot0=NB * BS - 2), NB, BS)


def test_a_block_id_equal_to_num_blocks_is_refused():
    with pytest.raises(ValueError, match=f"block_table: block id {NB} is outside the cache"):
        check_metadata_values(_meta(NB, slot0=0), NB, BS)


def test_an_unused_column_may_hold_anything():
    m = _meta(NB - 1, cols=3)
    m.block_table[0, 1:] = NB  # past the sequence's one block: never read
    check_metadata_values(m, NB, BS)


def _cascade(prefix_block: int, suffix_block: int) -> FlashAttentionMetadata:
    """Two sequences of 1 new token over a shared 16-token prefix block, each with its own block."""
    m = FlashAttentionMetadata(
        num_actual_tokens=2, max_query_len=1, query_start_loc=np.array([0, 1, 2], np.int32), max_seq_len=18,
        seq_lens=np.array([18, 18], np.int32), block_table=np.array([[0, 1], [0, 2]], np.int32),
        slot_mapping=np.array([BS + 1, 2 * BS + 1], np.int32), use_cascade=True, common_prefix_len=BS,
        cu_prefix_query_lens=np.array([0, 2], np.int32), prefix_kv_lens=np.array([BS], np.int32),
        prefix_block_table=np.array([[prefix_block]], np.int32), suffix_kv_lens=np.array([2, 2], np.int32),
        suffix_block_table=np.array([[1], [suffix_block]], np.int32), max_suffix_kv_len=2)
    return m


@pytest.mark.parametrize("prefix,suffix,bad", [(NB - 1, NB - 1, None), (NB, 2, "prefix_block_table"),
                                               (0, NB, "suffix_block_table")])
def test_cascade_tables_at_the_bound(prefix, suffix, bad):
    m = _cascade(prefix, suffix)
    if bad is None:
        check_metadata_values(m, NB, BS)
    else:
        with pytest.raises(ValueError, match=f"{bad}: block id {NB} is outside the cache"):
            check_metadata_values(m, NB, BS)


@pytest.mark.parametrize("block,ok", [(NB - 1, True), (NB, False)])
def test_local_table_at_the_bound(block, ok):
    m = dataclasses.replace(_meta(NB - 1), local_attn_metadata=LocalAttentionMetadata(
        local_query_start_loc=np.array([0, 3], np.int32), local_seqused_k=np.array([3], np.int32),
        local_block_table=np.array([[block]], np.int32), local_max_query_len=3, local_max_seq_len=3))
    if ok:
        check_metadata_values(m, NB, BS)
    else:
        with pytest.raises(ValueError, match=f"local_block_table: block id {NB} is outside the cache"):
            check_metadata_values(m, NB, BS)
