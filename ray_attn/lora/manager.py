"""The driver's side of multi-LoRA: which adapters are known (checked once, by name), which
device slot holds which, and the slot loads the next step carries to the ranks.

One manager decides for every rank, as one ``BlockPool`` does for KV blocks: slots are the same
on every rank, and a load rides on the step message (``StepInput.lora_loads``) as the KV tiers'
copies do, so it reaches the ranks in step order under async scheduling and compiled graphs
alike, and a rank that was restarted reads the adapter again from its folder.

A slot is taken at admission (``Scheduler.schedule``): the adapter's own slot when it is
resident, else a free one, else the least recently used slot whose adapter no running request
(and no request admitted before it in the same step) uses.  With every slot busy the request
waits, first in line for the next slot that frees, while the requests behind it that need no new
slot are admitted past it (a full set of slots never stops the queue).

A read from disk never runs inside a step that other requests share.  An adapter that no rank
holds in its host LRU is first *prefetched*: the request names it on the next step message
(``StepInput.lora_prefetch``), each rank reads and shards it on a thread of its own while the
steps go on, and rank 0 reports it ready (``StepOutput.lora_ready``).  Until then the request
waits as for a slot; once ready, its load rides on the next step *ahead* of the request: the
ranks copy the host image into the slot (a few ms for an 8B model's rank-16 adapter) on a copy
stream while that step's forward runs, and the request is admitted in the step after.  With
nothing else running, waiting would gain no one anything: the step loads the adapter itself,
read and copy, and runs the request at once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from ray_attn.lora.config import LoRARequest
from ray_attn.lora.peft_format import LoRAAdapterError, check_adapter


class LoRAManager:
    def __init__(self, engine_config):
        self.cfg = engine_config.lora_config
        self.model = engine_config.model
        self.adapters: dict[int, LoRARequest] = {}  # checked adapters, by lora_int_id
        self.ranks: dict[int, int] = {}  # their rank
        self.targets: dict[int, list[str]] = {}  # their target modules
        self.slot_of: dict[int, int] = {}  # lora_int_id -> the slot holding it
        self.holder = [0] * self.cfg.max_loras  # slot -> lora_int_id (0: empty)
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(self.cfg.max_loras))
        self.pending: list[tuple[int, int, str, str]] = []  # (slot, id, name, path) for the next step
        self.num_loads = 0
        # What rank 0's host LRU holds, as far as its reports tell (its capacity, its order of use),
        # the adapters being read there now, and the reads the next step message asks for.
        self.host_ready: OrderedDict[int, None] = OrderedDict()
        self.warming: set[int] = set()
        self.prefetches: list[tuple[int, str, str]] = []
        self.num_prefetches = 0
        self.ahead: set[int] = set()  # adapters whose load the next step message carries, for later steps

    @staticmethod
    def of(engine) -> "LoRAManager":
        if engine.lora is None:
            raise ValueError("lora_request: this engine serves no adapters (EngineConfig.lora_config is unset)")
        return engine.lora

    # -- which adapters exist -------------------------------------------------------------------
    def add(self, req: LoRARequest) -> LoRARequest:
        """Check ``req`` (its folder read once, against the model and ``max_lora_rank``) and keep
        it; the same adapter again is a no-op.  LoRAAdapterError (a ValueError) names what is wrong."""
        if not isinstance(req, LoRARequest):
            raise LoRAAdapterError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        known = self.adapters.get(req.lora_int_id)
        if known is not None:
            if known != req:
                raise LoRAAdapterError(f"lora_request: lora_int_id {req.lora_int_id} already names adapter "
                                       f"{known.lora_name!r} at {known.lora_path!r}")
            return known
        for other in self.adapters.values():
            if other.lora_name == req.lora_name:
                raise LoRAAdapterError(f"lora_request: adapter name {req.lora_name!r} is already loaded with "
                                       f"lora_int_id {other.lora_int_id}")
        rank, targets = check_adapter(req.lora_path, req.lora_name, self.model, self.cfg.max_lora_rank)
        self.adapters[req.lora_int_id] = req
        self.ranks[req.lora_int_id] = rank
        self.targets[req.lora_int_id] = targets
        return req

    def by_name(self, name: str) -> LoRARequest | None:
        return next((r for r in self.adapters.values() if r.lora_name == name), None)

    def remove(self, lora_int_id: int, users: Iterable) -> bool:
        """Forget an adapter no request uses (``users``: the requests not finished); refuses, by
        name, one that some use -- never fails them."""
        req = self.adapters.get(lora_int_id)
        if req is None:
            raise LoRAAdapterError(f"unknown adapter lora_int_id={lora_int_id}")
        n = sum(1 for r in users if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id)
        if n:
            raise LoRAAdapterError(f"adapter {req.lora_name!r} is in use by {n} unfinished request(s); unload it "
                                   "once they finish")
        del self.adapters[lora_int_id], self.ranks[lora_int_id], self.targets[lora_int_id]
        self.host_ready.pop(lora_int_id, None)
        self.warming.discard(lora_int_id)
        self.prefetches = [p for p in self.prefetches if p[0] != lora_int_id]
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.holder[slot] = 0
            self.lru.move_to_end(slot, last=False)  # the first to be reused
            self.pending = [p for p in self.pending if p[1] != lora_int_id]
        self.ahead.discard(lora_int_id)
        return True

    # -- device slots ---------------------------------------------------------------------------
    def slot_for(self, lora_int_id: int, busy: Callable[[], set], shared: bool = False) -> int | None:
        """The slot ``lora_int_id`` runs in this step, loading it if needed; None when every slot
        holds an adapter in use (``busy()``: the ids the step's and the running requests use), or
        when the step is ``shared`` with other requests and the ranks have yet to read the adapter
        from disk (its prefetch is then asked for)."""
        slot = self.slot_of.get(lora_int_id)
        if slot is None:
            if shared and lora_int_id not in self.host_ready:
                if lora_int_id not in self.warming:
                    req = self.adapters[lora_int_id]
                    self.warming.add(lora_int_id)
                    self.prefetches.append((lora_int_id, req.lora_name, req.lora_path))
                    self.num_prefetches += 1
                return None
            in_use = busy()
            slot = next((s for s in self.lru if self.holder[s] not in in_use or self.holder[s] == 0), None)
            if slot is None:
                return None
            old = self.holder[slot]
            if old:
                del self.slot_of[old]
                self.ahead.discard(old)
            req = self.adapters[lora_int_id]
            self.holder[slot], self.slot_of[lora_int_id] = lora_int_id, slot
            self.pending = [p for p in self.pending if p[0] != slot]
            self.pending.append((slot, lora_int_id, req.lora_name, req.lora_path))
            self.num_loads += 1
            self._host_holds(lora_int_id)  # the load reads it into the ranks' host LRU if it was not
            if shared:
                # A step ahead: the ranks copy it into the slot while this step's forward runs,
                # off its critical path, and the request runs from the next step on.
                self.ahead.add(lora_int_id)
                self.lru.move_to_end(slot)
                return None
        elif shared and lora_int_id in self.ahead:
            # its load rides on this step: the slot is ready from the next (an idle engine runs
            # the request in this very step instead: the rank then loads the slot before it)
            return None
        self.lru.move_to_end(slot)
        return slot

    def take_loads(self) -> list | None:
        loads, self.pending = self.pending, []
        self.ahead.clear()  # loaded by the step these ride on: usable by the next
        return loads or None

    def take_prefetches(self) -> list | None:
        out, self.prefetches = self.prefetches, []
        return out or None

    def ready(self, ids) -> None:
        """Rank 0 holds these adapters in its host LRU now (``StepOutput.lora_ready``)."""
        for i in ids or ():
            self.warming.discard(i)
            if i in self.adapters:
                self._host_holds(i)

    def _host_holds(self, lora_int_id: int) -> None:
        self.host_ready[lora_int_id] = None
        self.host_ready.move_to_end(lora_int_id)
        while len(self.host_ready) > self.cfg.cpu_capacity:
            self.host_ready.popitem(last=False)

    def reset(self) -> None:
        """The ranks were restarted: their slots are empty."""
        self.slot_of.clear()
        self.holder = [0] * self.cfg.max_loras
        self.pending = []
        self.ahead.clear()
        self.host_ready.clear()
        self.warming.clear()
        self.prefetches = []
