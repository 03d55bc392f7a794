"""One rank's side of the KV tiers (``planner/tiers.py``): its host pool, and the copies a step makes.

The host pool is one tensor ``[slots, layers, 2, block_size, kv_heads, head_size * itemsize]`` of
bytes (pinned on a GPU): one slot holds one block of every layer, contiguous, so a step's copies
are a few large transfers whatever the layer count -- one gather on the device (an index_select
over the model's one-tensor cache, ``model.kv_cache_stack``, seen block first), and one device <->
host copy per run of consecutive host slots -- never a copy per block and
layer (4,096 separate 64 KiB copies reach 3.6 GB/s on the H200 where one bulk pinned copy moves
55).  The same per-block bytes are what a store holds for this rank's shard (``kv_store.py``).
Everything is copied as bytes (uint8 views of the caches), so an fp8 cache travels as it is
and every block comes back byte-identical.

A step's copies are made before its forward, in the order the planner relies on: copies out of
device blocks (to host slots, and the blocks published to the node's store), then host slots into
device blocks, then blocks fetched from a store.  On a GPU the device side of each (the gather out
of the cache, the scatter into it) runs on the compute stream, so stream order places it after the
forward before and before this one; the transfers over the link run on two copy streams of their
own, one each way, so that they overlap compute:
- an offload's device -> host transfer starts once its blocks are gathered into a buffer of their
  own, so this step's forward may overwrite those blocks at once and runs beside the transfer;
- an onload's host -> device transfer into a buffer starts as soon as the step is sent -- under
  async scheduling while the step before still computes -- and only the scatter waits for it.
A host slot written by an offload still in flight is read only after it (``_pending_out``); a slot
is rewritten only after the step that read it has scattered (the gather that feeds the rewrite is
later on the compute stream).  Nothing here waits for the device; only a publish's thread waits
for its bytes to reach the host.
"""

from __future__ import annotations

import time

import numpy as np
import torch

COPY_THREADS = 4  # threads copying fetched rows out of the object store into the staging buffer


class RankKVTiers:
    """The host pool of one rank, the copies a step carries, and what they moved."""

    def __init__(self, model, host_cache_gib: float, rank: int, tp: int, device: torch.device,
                 store_bytes: int = 4 << 30):
        self.model, self.rank, self.tp, self.device = model, rank, tp, device
        self.store_bytes = store_bytes  # the capacity of the node's store, if this rank creates it
        stack = model.kv_cache_stack
        if stack is None:
            raise ValueError("KV tiers need the model's caches from allocate_kv_cache(): every layer's "
                             "cache a view of one tensor (model.kv_cache_stack)")
        stack = stack.view(torch.uint8)  # [L, 2, num_blocks, bs, H, D']
        self.block_shape = stack.shape[:2] + stack.shape[3:]  # [L, 2, bs, H, D']
        self.block_bytes = int(np.prod(self.block_shape))
        self.wide_dtype = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                               if self.block_shape[-1] % d.itemsize == 0)
        slots = int(host_cache_gib * (1 << 30)) // self.block_bytes
        pin = device.type == "cuda"
        self.host = torch.zeros((slots,) + self.block_shape, dtype=torch.uint8, pin_memory=pin) if slots else None
        self.num_host_slots = slots
        self._publisher = None  # a thread that hands published blocks to the store (GPU only)
        self.moved = {"offload_bytes": 0, "onload_bytes": 0, "publish_bytes": 0, "fetch_bytes": 0,
                      "copy_s": 0.0}
        gpu = self.host is not None and pin
        # device -> host and host -> device on copy streams of their own (the module's docstring)
        self._out_stream = torch.cuda.Stream(device) if gpu else None
        self._in_stream = torch.cuda.Stream(device) if gpu else None
        self._pending_out: list[tuple[torch.cuda.Event, np.ndarray]] = []  # offloads maybe in flight
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # copy-stream spans to read
        # fetched rows land here (pinned on a GPU, grown on demand) before their one transfer;
        # rewritten only once the transfer that read it last is done (``_staging_read``)
        self._staging: torch.Tensor | None = None
        self._staging_read: torch.cuda.Event | None = None
        self._copiers = None  # threads that copy fetched rows into the staging buffer

    def _blocks(self) -> torch.Tensor:
        """The cache seen block first, [num_blocks, L, 2, bs, H, D'] as the widest integers that
        tile a row (an index copy moves elements, and byte elements run at 1-2% of a bare copy,
        measured on CPU): a strided view, so n blocks of every layer are one index_select into the
        host slot layout, or one index_copy_ out of it -- one kernel, one pass over the bytes.
        Made per call (a view costs microseconds): it follows a cache allocated again."""
        return self.model.kv_cache_stack.view(torch.uint8).view(self.wide_dtype).permute(2, 0, 1, 3, 4, 5)

    def copy_seconds(self) -> float:
        """Time spent copying: on a GPU the copy streams' busy time of the transfers finished so
        far (read from events without waiting) plus the host's time issuing them; on CPU the
        copies' wall time."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.pop(0)
            self.moved["copy_s"] += start.elapsed_time(end) / 1e3
        return self.moved["copy_s"]

    def barrier(self) -> None:
        """The compute stream waits for every transfer issued so far (benchmarks: an event
        recorded after this marks the end of the copies)."""
        for stream in (self._out_stream, self._in_stream):
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)

    def fence(self) -> None:
        """The copy streams wait for the compute stream's work so far (benchmarks: an onload's
        transfer would otherwise start before an event recorded there, as it may in a step)."""
        for stream in (self._out_stream, self._in_stream):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))

    # -- checks -------------------------------------------------------------------------------
    def check(self, t, num_blocks: int) -> None:
        """Refuse, naming the field, a copy outside the cache or the host pool (before any runs)."""
        for name in ("offload_blocks", "onload_blocks", "fetch_blocks", "publish_blocks"):
            _in_range(name, getattr(t, name), num_blocks, "num_blocks")
        for name in ("offload_slots", "onload_slots"):
            a = getattr(t, name)
            if len(a) and self.host is None:
                raise ValueError(f"kv_transfers.{name}: this rank has no host tier (cache.host_cache_gib=0)")
            _in_range(name, a, self.num_host_slots, "host slots")
        pairs = (("offload_blocks", "offload_slots"), ("onload_slots", "onload_blocks"),
                 ("fetch_blocks", "fetch_hashes"), ("publish_blocks", "publish_hashes"))
        for a, b in pairs:
            if len(getattr(t, a)) != len(getattr(t, b)):
                raise ValueError(f"kv_transfers.{a} and .{b} differ in length")
        if len(t.fetch_stores) != len(t.fetch_blocks):
            raise ValueError("kv_transfers.fetch_stores and .fetch_blocks differ in length")

    # -- the copies ---------------------------------------------------------------------------
    def apply(self, t) -> None:
        t0 = time.perf_counter()
        if self._out_stream is not None:  # forget finished transfers here: only rank 0 reads the time
            self.copy_seconds()
            self._pending_out = [(e, w) for e, w in self._pending_out if not e.query()]
        n_off = len(t.offload_blocks)
        out = np.concatenate([t.offload_blocks, t.publish_blocks])
        if len(out):
            data = self.gather(out)  # on the device
            if n_off:
                self._to_slots(data[:n_off], t.offload_slots)
                self.moved["offload_bytes"] += n_off * self.block_bytes
            if len(t.publish_blocks):
                self._publish(t, data[n_off:])
        if len(t.onload_blocks):
            self.scatter(t.onload_blocks, self._from_slots(t.onload_slots))
            self.moved["onload_bytes"] += len(t.onload_blocks) * self.block_bytes
        if len(t.fetch_blocks):
            self._fetch(t)
        self.moved["copy_s"] += time.perf_counter() - t0  # on a GPU: issuing them (copy_seconds)

    def _index(self, blocks) -> torch.Tensor:
        """Block ids on the device, without a sync: ``torch.as_tensor(..., device=cuda)`` copies
        from pageable memory and so waits for the stream -- for the step still computing."""
        idx = torch.from_numpy(np.asarray(blocks, np.int64))
        if self.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def gather(self, blocks) -> torch.Tensor:
        """Blocks ``blocks`` of every layer, on the device: uint8 [n, L, 2, bs, H, D'], contiguous."""
        return self._blocks().index_select(0, self._index(blocks)).view(torch.uint8)

    def scatter(self, blocks, data: torch.Tensor) -> None:
        """Write ``data`` [n, L, 2, bs, H, D'] (bytes, host or device) into device blocks ``blocks``."""
        dev = data.to(self.device, non_blocking=data.is_pinned()).contiguous()
        self._blocks().index_copy_(0, self._index(blocks), dev.view(self.wide_dtype))

    def _to_slots(self, data: torch.Tensor, slots) -> None:
        """Device bytes into host slots: one copy per run of consecutive slots, straight into the
        pinned pool; on a GPU on the out-stream, after the gather that made ``data``."""
        if self._out_stream is None:
            for i, s, n in _runs(slots):
                self.host[s:s + n].copy_(data[i:i + n])
            return
        stream, start, done = self._out_stream, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the gather
        data.record_stream(stream)  # the allocator keeps it until the transfer is done
        with torch.cuda.stream(stream):
            start.record()
            for i, s, n in _runs(slots):
                self.host[s:s + n].copy_(data[i:i + n], non_blocking=True)
            done.record()
        self._timed.append((start, done))
        self._pending_out.append((done, np.asarray(slots)))

    def _from_slots(self, slots) -> torch.Tensor:
        """Host slots onto the device, one copy per run of consecutive slots."""
        if self._in_stream is not None:
            for written, wslots in self._pending_out:  # a slot an offload may still be writing
                if np.isin(slots, wslots).any():
                    self._in_stream.wait_event(written)
        return self._upload([(i, self.host[s:s + n]) for i, s, n in _runs(slots)], len(slots))[0]

    def _upload(self, parts, n: int):
        """Host pieces ``(first row, rows)`` into one device buffer of ``n`` blocks, and the event
        after the transfer (None on CPU).  On a GPU the transfer runs on the in-stream, and the
        compute stream waits for it before the scatter reads the buffer."""
        shape = (n,) + self.block_shape
        if self._in_stream is None:
            out = torch.empty(shape, dtype=torch.uint8, device=self.device)
            for i, rows in parts:
                out[i:i + len(rows)].copy_(rows)
            return out, None
        stream, start, done = self._in_stream, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            # from the in-stream's own pool: memory the compute stream freed may still be in use
            # by the step it has queued, which this transfer does not wait for
            out = torch.empty(shape, dtype=torch.uint8, device=self.device)
            out.record_stream(compute)  # the scatter reads it there
            start.record()
            for i, rows in parts:
                out[i:i + len(rows)].copy_(rows, non_blocking=True)
            done.record()
        compute.wait_event(done)  # the scatter reads ``out``
        self._timed.append((start, done))
        return out, done

    def _publish(self, t, data: torch.Tensor) -> None:
        """This rank's shard of each block to its node's store, never waited for: a store that is
        full or gone drops it.  On a GPU the bytes go to pinned memory without a sync, and a
        thread of ours hands them to the store once they are there, so the step goes on."""
        from ray_attn.runtime.kv_store import node_store

        store = node_store(capacity_bytes=self.store_bytes)
        args = (t.layout, self.rank, self.tp, list(t.publish_hashes))
        self.moved["publish_bytes"] += data.numel()
        if data.device.type != "cuda":
            store.put.remote(*args, data.reshape(len(args[3]), -1).numpy())
            return
        host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(data, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        if self._publisher is None:
            from concurrent.futures import ThreadPoolExecutor

            self._publisher = ThreadPoolExecutor(1, thread_name_prefix="kv-publish")
        self._publisher.submit(_put_when_ready, store, args, host, ready)

    def _fetch(self, t) -> None:
        stores = np.asarray(t.fetch_stores, dtype=object)
        hashes = np.asarray(t.fetch_hashes, dtype=object)
        for name in dict.fromkeys(t.fetch_stores):
            sel = np.flatnonzero(stores == name)
            data = self.fetched(name, t.layout, hashes[sel].tolist())
            dev, self._staging_read = self._upload([(0, data)], len(data))
            self.scatter(t.fetch_blocks[sel], dev)
            self.moved["fetch_bytes"] += data.numel()

    def fetched(self, name: str, layout: str, hashes: list[int]) -> torch.Tensor:
        """This rank's rows of ``hashes`` from store ``name``, in host memory [n, *block_shape]:
        a view of the staging buffer, valid until the next fetch.  The store answers with object
        refs; the rows are read-only views of this node's object store (no copy), and threads copy
        them into the buffer -- pinned on a GPU, so the upload is one asynchronous DMA."""
        import ray

        from ray_attn.runtime.kv_store import get_store

        rows = ray.get(ray.get(get_store(name).get.remote(layout, self.rank, hashes)))
        shapes = {np.shape(r) for r in rows}
        if len(rows) != len(hashes) or (rows and shapes != {(self.block_bytes,)}):
            raise RuntimeError(f"rank {self.rank}: store {name} returned {len(rows)} rows of shapes {sorted(shapes)}, "
                               f"expected {len(hashes)} of ({self.block_bytes},): another layout under this key?")
        out = self._staging_rows(len(rows))
        dst = out.numpy()
        if len(rows) <= 2:
            for i, r in enumerate(rows):
                dst[i] = r
        else:  # a single thread copies 5-10 GB/s; numpy lets go of the GIL for each row
            if self._copiers is None:
                from concurrent.futures import ThreadPoolExecutor

                self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kv-fetch")
            list(self._copiers.map(lambda i: np.copyto(dst[i], rows[i]), range(len(rows))))
        del rows  # the views pin the objects in the store's memory
        return out.view((len(out),) + self.block_shape)

    def _staging_rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the staging buffer [rows, block_bytes], once the last upload
        out of it is done; grown to the next power of two when too small."""
        if self._staging_read is not None:
            self._staging_read.synchronize()  # a step back at most: it is queued before this one
            self._staging_read = None
        if self._staging is None or len(self._staging) < n:
            rows = 1 << max(n - 1, 0).bit_length()
            self._staging = torch.empty((rows, self.block_bytes), dtype=torch.uint8,
                                        pin_memory=self.device.type == "cuda")
        return self._staging[:n]


def _put_when_ready(store, args, host: torch.Tensor, ready) -> None:
    ready.synchronize()
    store.put.remote(*args, host.reshape(len(args[3]), -1).numpy())


def _runs(slots) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of ``slots`` that goes up by one."""
    slots = np.asarray(slots, np.int64)
    if not len(slots):
        return []
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], cut])
    lens = np.diff(np.concatenate([starts, [len(slots)]]))
    return list(zip(starts.tolist(), slots[starts].tolist(), lens.tolist()))


def _in_range(name: str, a: np.ndarray, n: int, what: str) -> None:
    if len(a) and (int(np.min(a)) < 0 or int(np.max(a)) >= n):
        raise ValueError(f"kv_transfers.{name} must lie in [0, {n}) ({what}); got {np.asarray(a).tolist()[:8]}")


def layout_key(config) -> str:
    """What two replicas must share to mix KV blocks: the model (its config and weights' source),
    dtypes, block size and TP layout.  Random weights count by their seed (in the model config)."""
    import hashlib

    c = config.cache
    parts = [config.model.model_dump_json(), str(config.checkpoint), c.kv_cache_dtype, str(c.block_size),
             str(config.parallel.tensor_parallel_size)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def planner_tiers(config, executor):
    """The planner's ``KVTiers`` for an engine whose ranks are loaded (None when the tiers are
    off): host slots as the smallest rank reported, and the shared stores' client."""
    from ray_attn.planner.tiers import KVTiers

    c = config.cache
    if not (c.host_cache_gib or c.kv_sharing) or not c.enable_prefix_caching:
        return None
    infos = getattr(executor, "infos", None) or [{}]
    host_slots = min(int(i.get("host_slots") or 0) for i in infos)
    shared = layout = None
    if c.kv_sharing:
        import ray

        from ray_attn.runtime.kv_store import SharedKVClient

        if not ray.is_initialized():  # the stores are actors: without Ray the first lookup would fail
            raise RuntimeError("cache.kv_sharing needs a Ray cluster (the shared stores are Ray actors): "
                               "call ray.init() before building the engine")
        layout = layout_key(config)
        shared = SharedKVClient(layout, config.parallel.tensor_parallel_size, int(c.kv_store_gib * (1 << 30)))
    return KVTiers(host_slots, shared, layout, c.kv_share_min_tokens, c.block_size, c.kv_share_max_tokens)
