"""StepBuffers: the worker's persistent staging of a step's arrays."""

import numpy as np
import torch

from ray_attn.runtime.buffers import MIN_CAPACITY, StepBuffers


def test_values_shapes_and_reuse():
    rng = np.random.default_rng(0)
    buf = StepBuffers("cpu")
    first = rng.integers(-1, 1000, (4, 7)).astype(np.int32)
    buf.begin()
    t = buf.put("block_table", first)
    buf.end()
    assert t.dtype == torch.int32 and t.shape == (4, 7) and np.array_equal(t.numpy(), first)
    ptr = t.data_ptr()
    second = rng.integers(0, 1000, (3, 5)).astype(np.int64)  # smaller, and int64 in
    buf.begin()
    t2 = buf.put("block_table", second)
    assert t2.data_ptr() == ptr, "a step that fits must reuse the buffer, not allocate"
    assert np.array_equal(t2.numpy(), second)
    big = rng.integers(0, 1000, MIN_CAPACITY * 3).astype(np.int32)
    t3 = buf.put("block_table", big)
    assert np.array_equal(t3.numpy(), big) and t3.data_ptr() != ptr


def test_fields_do_not_alias():
    buf = StepBuffers("cpu")
    a = buf.put("seq_lens", np.arange(5, dtype=np.int32))
    b = buf.put("query_start_loc", np.arange(6, dtype=np.int32) * 10)
    assert a.tolist() == [0, 1, 2, 3, 4] and b.tolist() == [0, 10, 20, 30, 40, 50]


def test_metadata_through_buffers_equals_plain_copy():
    from ray_attn.planner import Planner, ScheduledRequest

    p = Planner(num_blocks=256, block_size=16, num_query_heads=4, num_kv_heads=2, attention_chunk_size=32)
    plan = p.plan([ScheduledRequest(i, list(range(1, 40 + 9 * i))) for i in range(5)])
    plain = plan.attn.to_device("cpu")
    staged = plan.attn.to_device("cpu", put=StepBuffers("cpu").put)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(plain, name), getattr(staged, name)), name
    assert torch.equal(plain.local_attn_metadata.local_block_table,
                       staged.local_attn_metadata.local_block_table)
