"""Per-request state in persistent numpy arrays, one row ("slot") per running request.

A step reads its block table rows and counts with a single fancy index instead of rebuilding them
from Python lists; the arrays double in size when they run out of rows or columns.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from .errors import InvalidRequestError


class RequestTable:
    def __init__(self, num_rows: int = 256, num_cols: int = 16):
        n = max(int(num_rows), 1)
        self.slot_of: dict[Hashable, int] = {}
        self.id_of_slot: list = [None] * n
        self._free: list[int] = list(range(n - 1, -1, -1))
        self.block_table = np.zeros((n, max(int(num_cols), 1)), dtype=np.int32)
        self.flat = self.block_table.reshape(-1)  # view: flat index = slot * width + column
        self.num_blocks = np.zeros(n, dtype=np.int32)
        self.num_computed = np.zeros(n, dtype=np.int32)  # tokens whose KV is (being) written
        self.num_hashed = np.zeros(n, dtype=np.int32)  # leading full blocks indexed for caching
        self.last_hash = np.zeros(n, dtype=np.uint64)  # chain hash of the last indexed block
        self.tokens: list = [None] * n  # the request's token_ids (a reference, for lazy hashing)
        self.lora_slot = np.full(n, -1, dtype=np.int32)  # the adapter slot it was admitted with

    @property
    def width(self) -> int:
        return self.block_table.shape[1]

    def lookup(self, ids: list) -> tuple[np.ndarray, list[int]]:
        """Slots of ``ids`` (-1 for unknown ones) and the positions of the unknown ones."""
        if len(set(ids)) != len(ids):
            seen, dup = set(), []
            for i in ids:
                if i in seen:
                    dup.append(i)
                seen.add(i)
            raise InvalidRequestError(f"request ids scheduled twice in one step: {dup[:8]!r}")
        slots = list(map(self.slot_of.get, ids))
        new = []
        if None in slots:
            new = [i for i, s in enumerate(slots) if s is None]
            for i in new:
                if ids[i] is None:
                    raise InvalidRequestError("request id None is not allowed")
                slots[i] = -1
        return np.array(slots, dtype=np.intp), new

    def add(self, req_id: Hashable) -> int:
        if not self._free:
            self._grow_rows()
        slot = self._free.pop()
        self.slot_of[req_id] = slot
        self.id_of_slot[slot] = req_id
        return slot

    def remove(self, req_id: Hashable) -> tuple[int, np.ndarray]:
        """Forget a request; returns its slot and the blocks it held (in table order)."""
        slot = self.slot_of.pop(req_id)
        n = int(self.num_blocks[slot])
        blocks = self.block_table[slot, :n].copy()
        self.block_table[slot, :n] = 0
        self.num_blocks[slot] = self.num_computed[slot] = self.num_hashed[slot] = 0
        self.last_hash[slot] = 0
        self.lora_slot[slot] = -1
        self.tokens[slot] = None
        self.id_of_slot[slot] = None
        self._free.append(slot)
        return slot, blocks

    def ensure_width(self, width: int) -> None:
        if width > self.width:
            new = np.zeros((self.block_table.shape[0], max(int(width), 2 * self.width)), dtype=np.int32)
            new[:, : self.width] = self.block_table
            self.block_table = new
            self.flat = new.reshape(-1)

    def _grow_rows(self) -> None:
        n = self.block_table.shape[0]
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.flat = self.block_table.reshape(-1)
        for name in ("num_blocks", "num_computed", "num_hashed", "last_hash"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        self.lora_slot = np.concatenate([self.lora_slot, np.full(n, -1, np.int32)])
        self.id_of_slot.extend([None] * n)
        self.tokens.extend([None] * n)
        self._free = list(range(2 * n - 1, n - 1, -1))
