"""A rank's adapter reads in a process of their own: reading, checking, slicing and scaling an
adapter is CPU work in Python and torch, and a thread of the rank's own process that did it held
the rank's steps up (on an H100, steps that overlapped a read of an 8B model's rank-16 adapter
took 80-190 ms instead of 8.5: ``scripts/bench_lora_load.py``, its ``slowest`` steps with their
``reading`` spans).  The reader process writes one adapter's images into a staging file that both
processes map; the rank copies it into its pinned buffer (one copy, which releases the GIL).

``ImageSpec`` is what the reader needs of the rank's linears, as plain numbers: where each
linear's A [P*R, K] and B [N, R] images lie in the flat buffer, and for each checkpoint module
its part and shard.  ``fill_images`` is the one function that writes images, in the reader
process or, when that process cannot run, in the rank's own thread.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from ray_attn.lora.peft_format import read_adapter, warm_page_cache


@dataclass(frozen=True)
class ModuleSpec:
    linear: int  # the linear's index in ImageSpec.linears
    part: int  # its part of a fused projection (q/k/v, gate/up)
    dim: int  # the base weight's shard dim: 0 column-parallel (B's rows cut), 1 row-parallel (A's columns)
    start: int  # where this rank's shard starts, in the full weight


@dataclass(frozen=True)
class LinearSpec:
    at: int  # the image's first element in the flat buffer
    a_shape: tuple[int, int]  # (P*R, K local)
    b_shape: tuple[int, int]  # (N local, R)
    offsets: tuple[int, ...]  # each part's first row of B
    rank: int  # R, the padded rank

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This linear's A and B images in an adapter's flat buffer."""
        na = self.a_shape[0] * self.a_shape[1]
        return (flat[self.at:self.at + na].view(self.a_shape),
                flat[self.at + na:self.at + na + self.b_shape[0] * self.b_shape[1]].view(self.b_shape))


@dataclass(frozen=True)
class ImageSpec:
    linears: tuple[LinearSpec, ...]
    modules: dict  # checkpoint module path -> ModuleSpec
    elems: int  # the flat buffer's elements
    dtype: torch.dtype
    model: object  # the ModelConfig adapters are checked against
    max_lora_rank: int


def fill_images(spec: ImageSpec, path: str, name: str, flat: torch.Tensor) -> list[int]:
    """Read the adapter at ``path`` into ``flat`` (zeroed first); returns the indices of the
    linears it targets (the others keep zeros)."""
    warm_page_cache(path)
    adapter = read_adapter(path, name, spec.model, spec.max_lora_rank)
    flat.zero_()
    touched = set()
    for module, w in adapter.modules.items():
        m = spec.modules[module]
        lin = spec.linears[m.linear]
        a_img, b_img = lin.views(flat)
        bounds = list(lin.offsets) + [lin.b_shape[0]]
        rows = bounds[m.part + 1] - bounds[m.part]
        a, b = w.lora_a, w.lora_b
        if m.dim == 1:  # row-parallel: A's columns as the weight's
            a = a[:, m.start:m.start + lin.a_shape[1]]
        else:  # column-parallel: B's rows as the weight's
            b = b[m.start:m.start + rows]
        r, R, off = a.shape[0], lin.rank, lin.offsets[m.part]
        a_img[m.part * R:m.part * R + r] = a.to(spec.dtype)
        b_img[off:off + b.shape[0], :r] = (b.double() * w.scaling).to(spec.dtype)  # pre-scaled, rounded once
        touched.add(m.linear)
    return sorted(touched)


# -- the reader process ------------------------------------------------------------------------
# A plain subprocess (``python -m ray_attn.lora.reader``) speaking pickles over its stdin/stdout,
# not a multiprocessing pool: "spawn" would import the parent's __main__ in the child, and a
# user's script without a main guard would then build its engine again there.


def _staging_dir(nbytes: int) -> str | None:
    """/dev/shm when it has room for the staging file (a container's may be 64 MB), else the temp dir."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 2 * nbytes:
            return "/dev/shm"
    except OSError:
        pass
    return None


class ReaderProcess:
    """One process that fills adapter images into a staging file the rank maps too."""

    def __init__(self, spec: ImageSpec, threads: int | None = None, timeout_s: float = 300.0):
        threads = threads or max(1, min(2, (os.cpu_count() or 1) // 8))
        self.spec = spec
        nbytes = spec.elems * torch.empty(0, dtype=spec.dtype).element_size()
        fd, path = tempfile.mkstemp(prefix="ray_attn_lora_", dir=_staging_dir(nbytes))
        os.close(fd)
        try:
            self.staging = torch.from_file(path, shared=True, size=spec.elems, dtype=spec.dtype)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self.proc = subprocess.Popen([sys.executable, "-m", "ray_attn.lora.reader"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env)
            self._call(("init", spec, path, threads))  # both processes map the file; then its name goes
        finally:
            os.unlink(path)

    def _call(self, msg):
        try:
            pickle.dump(msg, self.proc.stdin)
            self.proc.stdin.flush()
            status, value = pickle.load(self.proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            raise RuntimeError(f"the adapter reader process ended (exit code {self.proc.poll()})") from e
        if status == "error":
            raise value
        return value

    def read(self, path: str, name: str, into: torch.Tensor) -> list[int]:
        """Fill ``into`` (a buffer of ``spec.elems``) with the adapter's images, through the
        reader process; the targeted linears' indices."""
        touched = self._call(("read", path, name))
        into.copy_(self.staging)
        return touched

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()  # its loop ends on EOF
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def _serve() -> None:
    """The reader's loop: ("init", spec, staging path, threads), then ("read", path, name) until EOF."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not break the pickles
    inp = sys.stdin.buffer
    spec = flat = None
    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        try:
            if msg[0] == "init":
                spec, path, threads = msg[1:]
                torch.set_num_threads(threads)  # a few cores: the rank's process keeps the rest
                flat = torch.from_file(path, shared=True, size=spec.elems, dtype=spec.dtype)
                reply = ("ok", None)
            else:
                reply = ("ok", fill_images(spec, msg[1], msg[2], flat))
        except Exception as e:  # noqa: BLE001 -- the rank raises it (an adapter error names the adapter)
            reply = ("error", e)
        try:
            pickle.dump(reply, out)
        except Exception as e:  # noqa: BLE001 -- an exception that does not pickle
            pickle.dump(("error", RuntimeError(f"{type(e).__name__}: {e}")), out)
        out.flush()


if __name__ == "__main__":
    _serve()
