"""FlashAttention 3 with ahead-of-time scheduler metadata (``get_scheduler_metadata``), as vLLM's
builder uses it: built once per step, read by every layer.

The plan must be built for the attention the call ends up running: on the H200 a plan built
non-causal and handed to a causal call segfaults the process (a probe over head size x query
length x window x causal flag found it), and so did a window wider than every context, which FA3's
forward drops but its planner kept (``fa3_window`` now drops it on both sides).  Each case runs in a subprocess, so that a
crash fails one test instead of killing pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from tests.timescale import scaled

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from ray_attn.backend import AttentionLayer, FlashAttentionImpl
    from tests.backend.batch import make_batch, dense_reference
    D, q_len, window = json.loads(sys.argv[1])
    gen = torch.Generator().manual_seed(D + q_len)
    B = 8
    b = make_batch([q_len] * B, [33 + 13 * i + q_len for i in range(B)], H=8, Hk=2, D=D,
                   block_size=16, dtype=torch.bfloat16, gen=gen)
    before = b.kv_cache.clone()
    impl = FlashAttentionImpl(8, D, D ** -0.5, 2, None, window, "auto", dtype=torch.bfloat16,
                              block_size=16, device="cuda", kernel="fa3")
    assert impl.kernel.uses_scheduler_metadata
    out = torch.empty_like(b.query, device="cuda")
    m = b.meta.to_device("cuda")
    layer = AttentionLayer(device="cuda")
    for _ in range(2):  # the second layer reuses the step's plan
        impl.forward(layer, b.query.cuda(), b.key.cuda(), b.value.cuda(), b.kv_cache.cuda(), m, out)
    assert len(m.scheduler_metadata) == 1, "the plan was not built once and shared"
    ref = dense_reference(b, before, scale=D ** -0.5, window=window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)
    print("ok")
""")


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("window", [None, 41, 10_000])  # none, clipping, covering every context
def test_fa3_aot_scheduler_metadata(head_size, q_len, window):
    pytest.importorskip("flash_attn_interface")
    args = json.dumps([head_size, q_len, window])
    r = subprocess.run([sys.executable, "-c", SCRIPT, args], capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])


def test_fa3_window_drops_only_windows_that_cannot_clip():
    from ray_attn.backend.kernels import fa3_window

    assert fa3_window((-1, -1), 1, 100) == (-1, -1)
    assert fa3_window((40, 0), 1, 100) == (40, -1)  # one query: "right = 0" clips nothing
    assert fa3_window((40, 0), 5, 100) == (40, 0)
    assert fa3_window((99, 0), 5, 100) == (-1, 0)  # reaches back past the longest context
    assert fa3_window((98, 0), 5, 100) == (98, 0)
