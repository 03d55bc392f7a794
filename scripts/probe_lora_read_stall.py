"""What part of an adapter read slows a GPU decode step that runs beside it (issue 41, load goal).

A stand-in decode step -- a CUDA graph of bf16 GEMVs that reads ~``--step-gb`` of weights, plus
``--py-ops`` small eager ops, as the engine's Python does around its graph -- is timed step after
step while one thing from a real read runs beside it, each alone:

- ``none``: nothing (the baseline);
- ``memcpy``: the rank's copy of a 93 MB image from the reader's staging file (/dev/shm) into a
  pinned buffer (``ReaderProcess.read``), on a thread of its own, with one torch thread;
- ``python``: a thread running pure Python (a GIL holder, as the views of a read's images are);
  ``python_switch``: the same with ``sys.setswitchinterval(0.0005)`` (the rank's, with a prefetch);
- ``process``: a child process doing a read's CPU work (bf16 conversion of 93 MB, 2 threads).

    python scripts/probe_lora_read_stall.py          # on a GPU; prints and writes JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

MB = 1 << 20


def decode_graph(step_gb: float):
    n = max(1, int(step_gb * (1 << 30) / (4096 * 14336 * 2)))
    ws = [torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(32, 14336, device="cuda", dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for w in ws:
                torch.matmul(x, w.t(), out=out)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for w in ws:
            torch.matmul(x, w.t(), out=out)
    return g


def timed_steps(g, steps: int, py_ops: int) -> list[float]:
    small = torch.zeros(64, device="cuda")
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(py_ops):  # the engine's Python around its graph: small eager ops
            small.add_(1)
        g.replay()
        small.sum().item()  # the sampled tokens' read back
        out.append(time.perf_counter() - t0)
    return out


def beside(kind: str, stop: threading.Event, nbytes: int):
    if kind == "memcpy":
        fd, path = tempfile.mkstemp(dir="/dev/shm")
        os.close(fd)
        staging = torch.from_file(path, shared=True, size=nbytes // 2, dtype=torch.bfloat16)
        os.unlink(path)
        staging.fill_(1)
        pinned = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)

        def run():
            torch.set_num_threads(1)
            while not stop.is_set():
                pinned.copy_(staging)
        return threading.Thread(target=run, daemon=True), None
    if kind == "python":
        def run():
            x = 0
            while not stop.is_set():
                for i in range(10000):
                    x += i * i % 7
        return threading.Thread(target=run, daemon=True), None
    if kind == "process":
        code = ("import torch,sys; torch.set_num_threads(2); a=torch.randn(%d); "
                "[a.to(torch.bfloat16).double() for _ in iter(int, 1)]" % (nbytes // 4))
        return None, subprocess.Popen([sys.executable, "-c", code])
    return None, None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-gb", type=float, default=16.0, help="weights one step reads (8B bf16: ~16)")
    ap.add_argument("--py-ops", type=int, default=300)
    ap.add_argument("--python-steps", type=int, default=10, help="steps beside the Python thread (each is slow)")
    ap.add_argument("--image-mb", type=int, default=93)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parents[1] / "benchmarks/results/probe_lora_read_stall.json"))
    a = ap.parse_args(argv)
    g = decode_graph(a.step_gb)
    timed_steps(g, 20, a.py_ops)
    rows = {}
    default_switch = sys.getswitchinterval()
    for kind in ("none", "memcpy", "python", "python_switch", "process", "none"):
        sys.setswitchinterval(0.0005 if kind == "python_switch" else default_switch)
        steps = a.steps if not kind.startswith("python") else a.python_steps
        stop = threading.Event()
        th, proc = beside(kind.split("_")[0], stop, a.image_mb * MB)
        if th is not None:
            th.start()
        if proc is not None:
            time.sleep(3)  # its import and first tensor
        ms = np.array(timed_steps(g, steps, a.py_ops)) * 1e3
        stop.set()
        if th is not None:
            th.join()
        if proc is not None:
            proc.kill()
            proc.wait()
        key = kind if kind not in rows else kind + "_again"
        rows[key] = dict(p50_ms=round(float(np.percentile(ms, 50)), 3), p99_ms=round(float(np.percentile(ms, 99)), 3),
                         max_ms=round(float(ms.max()), 3))
        print(f"{key:12s} p50 {rows[key]['p50_ms']:7.2f}  p99 {rows[key]['p99_ms']:7.2f}  max {rows[key]['max_ms']:7.2f} ms",
              flush=True)
    out = dict(gpu=torch.cuda.get_device_name(), cpus=os.cpu_count(), args=vars(a), rows=rows)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
