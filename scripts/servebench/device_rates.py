"""The device's two rates the roofline needs, measured before the engine starts: a large
device-to-device copy (bytes read + written per second) and dense GEMMs at the model's own
shapes (``roofline.gemm_shapes``: a layer's four matmuls at 8192 rows, this rank's share), weighted
as a layer runs them -- total FLOPs over total time.  A square 8192 GEMM is reported beside them.

On a GPU this runs in a child process (``measure_in_child``), so that the benchmark's own process
holds no CUDA context and no cached memory on the device its engine's rank will size its KV
cache on.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path


def measure(device: str, shapes: list[tuple[str, int, int, int]], copy_bytes: int, dtype: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchlib, in a spawned child
    import torch
    import torch.nn.functional as F

    import benchlib as bl

    dev = torch.device(device)
    dt = getattr(torch, dtype)
    rows, flops, secs = [], 0.0, 0.0
    for name, M, K, N in shapes:
        x = torch.randn(M, K, dtype=dt, device=dev)
        w = torch.randn(N, K, dtype=dt, device=dev)  # [out, in], as the model's linear layers
        t = bl.timeit(lambda: F.linear(x, w), iters=10)
        rows.append(dict(name=name, M=M, K=K, N=N, us=t * 1e6, TFLOPs=2 * M * K * N / t / 1e12))
        flops += 2 * M * K * N
        secs += t
        del x, w
    out = dict(device=device, copy_Bps=bl.copy_bandwidth(copy_bytes, dev), gemm_flops=flops / secs,
               square_gemm_flops=bl.matmul_flops(dev), gemm_shapes=rows, gpu=None)
    if dev.type == "cuda":  # the same shapes in FP8 (e4m3, row-wise scales): FP8 weights' prefill bound
        flops8, secs8 = 0.0, 0.0
        for name, M, K, N in shapes:
            a = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
            sa, sb = torch.ones(M, 1, device=dev), torch.ones(1, N, device=dev)
            t = bl.timeit(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                          iters=10)
            flops8, secs8 = flops8 + 2 * M * K * N, secs8 + t
            del a, b
        out["fp8_gemm_flops"] = flops8 / secs8
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sms=p.multi_processor_count)
    return out


def measure_in_child(device: str, shapes, copy_bytes: int, dtype: str) -> dict:
    """``measure`` in a spawned process on a GPU (its CUDA context leaves with it); in this
    process on CPU, where there is nothing to leave behind."""
    if device == "cpu":
        return measure(device, shapes, copy_bytes, dtype)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (device, shapes, copy_bytes, dtype))
