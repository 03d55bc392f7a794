"""A rank's LoRA: slot-stacked A/B weights on every targeted linear, the step's slot metadata,
and the slots' contents (filled from a host LRU of this rank's adapter shards).

Sharding follows the layer an adapter attaches to (vLLM's ``ColumnParallelLinearWithLoRA`` /
``RowParallelLinearWithLoRA``): on a column-parallel projection (q/k/v, gate/up) A is replicated
and B cut like the weight's rows, so each rank computes its own output rows; on a row-parallel
one (o_proj, down_proj) A is cut like the weight's columns and B replicated, and the rank's
partial update joins the base's partial sum before the layer's one all-reduce
(``sum_r x_r A_r^T B^T = x A^T B^T``).  Which slice is this rank's comes from the base weight's
own ``Shard`` (``CausalLM.weight_shards``), so every family whose checkpoint names the
projections as HF Llama does is served with no code of its own.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
import torch

from ray_attn.lora import punica
from ray_attn.lora.config import TARGET_MODULES, LoRAConfig
from ray_attn.lora.peft_format import LoRAAdapterError
from ray_attn.lora.reader import ImageSpec, LinearSpec, ModuleSpec, ReaderProcess, fill_images
from ray_attn.model.parallel_linear import ColumnParallelLinear, RowParallelLinear

_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(?P<proj>\w+)\.weight$")


class LoRAStepContext:
    """The step's slot of each token and the SGMV segments (``punica.step_meta``), in device
    buffers of fixed size that every LoRA layer (and a captured graph) reads."""

    def __init__(self, capacity: int, max_loras: int, device: torch.device):
        self.capacity, self.max_loras, self.device = capacity, max_loras, device
        self.cuda = device.type == "cuda"
        n = 2 * capacity + max_loras + 1
        self.meta = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.token_slots = self.meta[:capacity]
        self.sorted_tokens = self.meta[capacity:2 * capacity]
        self.seg_start = self.meta[2 * capacity:]
        self.active = False  # any token of the step has an adapter (CPU skips the math when not)
        self.shrunk = None  # the shrink's float32 scratch (flat), grown to punica.scratch_elems(capacity, widest P*R)
        # RAY_ATTN_LORA_OVERLAP=0 runs the shrink on the main stream (to measure what the overlap saves)
        self.overlap = self.cuda and os.environ.get("RAY_ATTN_LORA_OVERLAP", "1") != "0"
        self._side = None

    def side_stream(self):
        """The stream the shrinks overlap the base GEMMs on while a graph is captured (None: no
        overlap; eager steps would pay an event pair a projection on the host for it)."""
        if not (self.overlap and torch.cuda.is_current_stream_capturing()):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def set_step(self, row_slots: np.ndarray | None, query_lens: np.ndarray, num_tokens: int, put) -> None:
        if num_tokens > self.capacity:
            raise ValueError(f"a step of {num_tokens} tokens exceeds the LoRA metadata's {self.capacity}")
        host = np.full(self.meta.numel(), -1, np.int32)
        host[2 * self.capacity:] = 0
        self.active = row_slots is not None and bool((row_slots >= 0).any())
        if self.active:
            ts = np.repeat(row_slots, query_lens).astype(np.int32)
            host[:len(ts)] = ts
            order, start = punica.step_meta(ts, self.max_loras)
            host[self.capacity:self.capacity + len(order)] = order
            host[2 * self.capacity:] = start
        # one staged copy into the fixed buffer (stream-ordered: a step in flight keeps its own)
        self.meta.copy_(put("lora_meta", host), non_blocking=True)


class LoRALinear:
    """The slots of one linear layer: A [L, P*R, K_local], B [L, N_local, R] (B pre-scaled)."""

    def __init__(self, module, parts: list[tuple[str, int, int, int]], cfg: LoRAConfig, ctx: LoRAStepContext,
                 dtype: torch.dtype):
        # parts: (checkpoint module path, local row offset, shard dim, shard start), by offset;
        # ``dtype``: the model's (an FP8 layer's adapter stays in the activations' dtype)
        self.module, self.ctx, self.parts = module, ctx, parts
        self.rank = cfg.padded_rank
        w = module.weight
        N, K = w.shape[0], w.shape[1]
        L, P, R = cfg.max_loras, len(parts), self.rank
        self.a = torch.zeros(L, P * R, K, dtype=dtype, device=w.device)
        self.b = torch.zeros(L, N, R, dtype=dtype, device=w.device)
        self.offsets = tuple(off for _, off, _, _ in parts)
        self.row_parallel = isinstance(module, RowParallelLinear)

    def __call__(self, x: torch.Tensor, base) -> torch.Tensor:
        """``base()`` (the layer's own product of x, [T, N]) plus each token's adapter update."""
        ctx = self.ctx
        if not (ctx.cuda and punica.use_triton(x, self.offsets)):
            y = base()
            if not ctx.active:
                return y
            return punica.lora_reference(x, y, self.a, self.b, self.offsets, self.rank, ctx.token_slots)
        x = x if x.stride(1) == 1 else x.contiguous()
        need = punica.scratch_elems(ctx.capacity, self.a.shape[1])
        if ctx.shrunk is None or ctx.shrunk.numel() < need:  # the first forward sizes it, before any capture
            ctx.shrunk = torch.empty(need, dtype=torch.float32, device=x.device)
        launch = punica.plan_launch(x, self.a, self.b.shape[1], self.offsets, self.rank)
        args = (ctx.sorted_tokens, ctx.seg_start)
        if launch.config.fused:
            y = base()
            punica.check_strides(x, y, self.a, self.b)
            return punica.fused(launch, x, y, self.a, self.b, self.offsets, self.rank, *args)
        # The shrink needs only x, so it runs on a side stream while the base GEMM runs: at decode
        # sizes both are latency-bound, and the shrink's few microseconds a projection (7 a layer)
        # leave the critical path.  The join before the expand orders it after both (a graph
        # captures the fork and join as edges).
        side = ctx.side_stream()
        if side is None:
            punica.shrink(launch, x, self.a, ctx.shrunk, *args)
            y = base()
        else:
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                punica.shrink(launch, x, self.a, ctx.shrunk, *args)
            y = base()
            main.wait_stream(side)
        punica.check_strides(x, y, self.a, self.b)
        return punica.expand(launch, ctx.shrunk, self.b, y, self.offsets, self.rank, *args)

    def image_sizes(self) -> tuple[int, int]:
        """Elements of a slot's A and B."""
        return self.a[0].numel(), self.b[0].numel()

    def fill(self, slot: int, image: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if image is None:  # a module the adapter does not target
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(image[0], non_blocking=True)
        self.b[slot].copy_(image[1], non_blocking=True)


def attach_lora(model, cfg: LoRAConfig, capacity: int) -> tuple[LoRAStepContext, dict]:
    """Give every q/k/v/o/gate/up/down projection of ``model`` its slots; returns the step context
    and, by checkpoint module path, (its LoRALinear, its part index)."""
    ctx = LoRAStepContext(capacity, cfg.max_loras, model.device)
    owners = {}
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            owners[m.weight.untyped_storage().data_ptr()] = m
    found: dict[int, list] = {}
    for name, shard in model.weight_shards().items():
        mm = _WEIGHT.match(name)
        if mm is None or mm["proj"] not in TARGET_MODULES or not hasattr(shard, "dest"):
            continue
        m = owners.get(shard.dest.untyped_storage().data_ptr())
        if m is None:
            continue
        off = (shard.dest.data_ptr() - m.weight.data_ptr()) // (m.weight.stride(0) * m.weight.element_size())
        found.setdefault(id(m), [m, []])[1].append((name[:-len(".weight")], int(off), shard.dim, shard.start))
    table = {}
    for m, parts in found.values():
        parts.sort(key=lambda p: p[1])
        lin = LoRALinear(m, parts, cfg, ctx, model.dtype)
        m.lora = lin
        for i, (path, *_) in enumerate(parts):
            table[path] = (lin, i)
    return ctx, table


SWITCH_INTERVAL_S = 0.0005


class HostImage:
    """One adapter in a rank's host LRU: its images for the rank's linears (views of ``flat``),
    and the event after the last copy made from them (the buffer is reused only after it)."""

    def __init__(self, flat: torch.Tensor, images: dict):
        self.flat, self.images = flat, images
        self.copied: torch.cuda.Event | None = None


class RankLoRA:
    """This rank's adapters: the slots' contents and a host LRU of adapter images
    (``LoRAConfig.max_cpu_loras``), read from the adapter's folder on a prefetch (a thread of its
    own, while steps run) or, failing that, in the step that loads it."""

    def __init__(self, model, engine_config, device: torch.device):
        self.cfg: LoRAConfig = engine_config.lora_config
        self.model_config = engine_config.model
        cap = engine_config.max_num_batched_tokens + engine_config.max_num_seqs
        self.ctx, self.table = attach_lora(model, self.cfg, cap)
        self.linears = {id(lin): lin for lin, _ in self.table.values()}
        self.dtype = model.dtype
        self.pin = device.type == "cuda"
        self.host: OrderedDict[int, HostImage] = OrderedDict()  # lora_int_id -> its images
        self.lock = threading.Lock()  # the host LRU and the free buffers, shared with the prefetch thread
        # Every adapter's images take the same places in a buffer of one slot's size.  On a GPU
        # the buffers are pinned once, here: page-locking while steps run (cudaHostAlloc) held
        # the steps up by tens of ms a load (scripts/bench_lora_load.py).
        self.keys = list(self.linears)
        linears, at = [], 0
        for key in self.keys:
            lin = self.linears[key]
            linears.append(LinearSpec(at, tuple(lin.a.shape[1:]), tuple(lin.b.shape[1:]), lin.offsets, lin.rank))
            at += sum(lin.image_sizes())
        index = {key: i for i, key in enumerate(self.keys)}
        modules = {path: ModuleSpec(index[id(lin)], part, lin.parts[part][2], lin.parts[part][3])
                   for path, (lin, part) in self.table.items()}
        self.spec = ImageSpec(tuple(linears), modules, at, self.dtype, self.model_config, self.cfg.max_lora_rank)
        self.free = [torch.empty(at, dtype=self.dtype, pin_memory=True) for _ in range(self.cfg.cpu_capacity)] \
            if self.pin else []
        # Each pooled buffer's A/B views, cut once: cutting them per read (~900 tensor ops, the
        # GIL held throughout) on the prefetch thread stalled the step's thread beside it.
        self._views = {buf.data_ptr(): [lin.views(buf) for lin in self.spec.linears] for buf in self.free}
        self.reader: ReaderProcess | None = None  # started by the first prefetch
        self.reader_failed: str | None = None  # why it could not run (reads then stay in-process)
        if os.environ.get("RAY_ATTN_LORA_READER", "1") == "0":  # to measure what the process changes
            self.reader_failed = "RAY_ATTN_LORA_READER=0"
        self.reading: dict[int, Future] = {}  # prefetches in flight or not yet reported
        self._pool: ThreadPoolExecutor | None = None
        self._unreported: list[int] = []
        self.slot_ids = [0] * self.cfg.max_loras  # the adapter each slot holds (0: none)
        self.disk_loads = 0
        self.reads: deque = deque(maxlen=256)  # (lora_int_id, thread, perf_counter at start, at end)
        # what the step's own thread spent on adapters: (what, lora_int_ids, start, end), for the
        # load benchmark to place against slow steps ("load": a slot fill made before the forward,
        # "load_ahead": after it, "wait_read": a load waiting for its prefetch to finish)
        self.trace: deque = deque(maxlen=256)
        # Loads into slots no row of the step uses (the driver sends them a step ahead) are made
        # after the forward is queued, on a copy stream of their own: the step does not wait for
        # them, and the next step's forward waits for their event (``begin_step``).
        self.copy_stream = torch.cuda.Stream(device) if self.pin else None
        self._ahead: list = []  # this step's loads for later steps
        self._step_began: torch.cuda.Event | None = None
        self._landed: torch.cuda.Event | None = None

    def _buffer(self) -> torch.Tensor:
        """A buffer for one more adapter: a free one, else the least recently used entry's
        (evicted, once the copies from it are done); on CPU a new one."""
        with self.lock:
            if self.free:
                return self.free.pop()
            if not (self.pin and self.host):  # CPU; or every pooled buffer is being read into
                return torch.empty(self.spec.elems, dtype=self.dtype, pin_memory=self.pin)
            _, old = self.host.popitem(last=False)
        if old.copied is not None:
            old.copied.synchronize()
        return old.flat

    def _fill(self, path: str, name: str, flat: torch.Tensor, in_reader: bool) -> list[int]:
        if in_reader and self.reader_failed is None:
            try:
                if self.reader is None:
                    self.reader = ReaderProcess(self.spec)
                return self.reader.read(path, name, flat)
            except LoRAAdapterError:
                raise
            except Exception as e:  # noqa: BLE001 -- no process here (spawn refused, killed): read in this one
                self.reader_failed = f"{type(e).__name__}: {e}"
                if self.reader is not None:
                    self.reader.close()
                    self.reader = None
        return fill_images(self.spec, path, name, flat)

    def _read(self, lora_int_id: int, name: str, path: str, in_reader: bool = False) -> HostImage:
        """The adapter's images for this rank's linears, from its folder (into the host LRU);
        ``in_reader``: the prefetch's read, made by the reader process."""
        t0 = time.perf_counter()
        flat = self._buffer()
        try:
            touched = self._fill(path, name, flat, in_reader)
        except BaseException:
            with self.lock:
                self.free.append(flat)
            raise
        views = self._views.get(flat.data_ptr())
        entry = HostImage(flat, {self.keys[i]: views[i] if views is not None else self.spec.linears[i].views(flat)
                                 for i in touched})
        with self.lock:
            self.disk_loads += 1
            old = self.host.pop(lora_int_id, None)
            if old is not None and self.pin:
                self.free.append(old.flat)
            self.host[lora_int_id] = entry
            while len(self.host) > self.cfg.cpu_capacity:  # (a pinned buffer is freed after its copies)
                self.host.popitem(last=False)
        self.reads.append((lora_int_id, threading.current_thread().name, t0, time.perf_counter()))
        return entry

    def prefetch(self, items) -> None:
        """Start reading these adapters (``(lora_int_id, name, path)``) on the prefetch thread."""
        for lora_int_id, name, path in items:
            if lora_int_id in self.reading:
                continue  # reported once read
            with self.lock:
                held = lora_int_id in self.host
            if held:
                self._unreported.append(lora_int_id)  # nothing to read: ready now
                continue
            if self._pool is None:
                # One torch thread there: a second OpenMP team of the rank's width, beside the
                # steps' own, slowed every later CPU step 2-5x (scripts/bench_lora_load.py on CPU).
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-prefetch",
                                                initializer=torch.set_num_threads, initargs=(1,))
                # Every torch op the step's thread calls releases the GIL and takes it back; with
                # the prefetch thread running Python, each take waits out the switch interval
                # (5 ms by default): a few ms of Python there cost a step tens of ms
                # (scripts/probe_lora_read_stall.py).  A short interval bounds each wait.
                sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self.reading[lora_int_id] = self._pool.submit(self._read, lora_int_id, name, path, True)

    def take_ready(self) -> list[int]:
        """The prefetches finished since the last call (a failed one too: its load reads the
        folder again in the step and raises there, where the request gets the error)."""
        done = [i for i, f in self.reading.items() if f.done()]
        for i in done:
            del self.reading[i]
        out, self._unreported = self._unreported + done, []
        return out

    def unready(self, ids: list[int]) -> None:
        """Report these with the next answer instead (this call had none)."""
        self._unreported[:0] = ids

    def _entry(self, lora_int_id: int, name: str, path: str) -> HostImage:
        fut = self.reading.get(lora_int_id)
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.result()  # still reading: this step waits for it (the driver had no report yet)
            except Exception:  # noqa: BLE001
                pass  # read again below, where the error reaches the step
            self.trace.append(("wait_read", (lora_int_id,), t0, time.perf_counter()))
        with self.lock:
            hit = self.host.get(lora_int_id)
            if hit is not None:
                self.host.move_to_end(lora_int_id)
                return hit
        return self._read(lora_int_id, name, path)

    def load(self, loads, stream=None) -> None:
        """Fill slots: ``(slot, lora_int_id, lora_name, lora_path)``, on the current stream or
        ``stream``."""
        t0 = time.perf_counter()
        for slot, lora_int_id, name, path in loads:
            entry = self._entry(lora_int_id, name, path)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for key, lin in self.linears.items():
                    lin.fill(slot, entry.images.get(key))
                if self.pin:  # the buffer is reused only once these copies are done
                    entry.copied = torch.cuda.Event()
                    entry.copied.record()
            self.slot_ids[slot] = lora_int_id
        self.trace.append(("load_ahead" if stream is not None else "load", tuple(ld[1] for ld in loads), t0,
                           time.perf_counter()))

    def begin_step(self, plan, loads, put) -> None:
        """Before the forward: the slots this step's rows use are loaded (a load ahead waited
        for, a load for a row of this step made now); loads for later steps wait for
        :meth:`after_forward`."""
        rows = getattr(plan, "lora_slots", None)
        if rows is not None and len(rows) and (rows.min() < -1 or rows.max() >= self.cfg.max_loras):
            raise ValueError(f"plan.lora_slots must lie in [-1, {self.cfg.max_loras})")
        for slot, *_ in loads or ():
            if not 0 <= slot < self.cfg.max_loras:
                raise ValueError(f"lora_loads: slot {slot} outside [0, {self.cfg.max_loras})")
        if self._ahead:  # owed by a step whose forward raised before after_forward: made now
            self.load(self._ahead)
            self._ahead = []
        if self._landed is not None:  # last step's loads ahead, for this step's rows
            torch.cuda.current_stream(self.copy_stream.device).wait_event(self._landed)
            self._landed = None
        used = set(np.unique(rows).tolist()) if rows is not None and len(rows) else set()
        now = [ld for ld in loads or () if ld[0] in used]
        self._ahead = [ld for ld in loads or () if ld[0] not in used]
        if now:
            self.load(now)
        if self._ahead and self.copy_stream is not None:
            # The slot's old adapter was last read by a step before this one: its copies start
            # after what is queued so far, and overlap this step's forward.
            self._step_began = torch.cuda.current_stream(self.copy_stream.device).record_event()
        self.ctx.set_step(rows, plan.query_lens, plan.num_tokens, put)

    def after_forward(self) -> None:
        """Make this step's loads ahead, once its forward is queued (see ``begin_step``)."""
        ahead, self._ahead = self._ahead, []
        if not ahead:
            return
        if self.copy_stream is None:  # CPU: the forward is done; copy now
            self.load(ahead)
            return
        self.copy_stream.wait_event(self._step_began)
        self.load(ahead, self.copy_stream)
        self._landed = self.copy_stream.record_event()

    def reset(self) -> None:
        self.slot_ids = [0] * self.cfg.max_loras
        self._ahead, self._landed = [], None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
