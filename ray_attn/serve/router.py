"""A prefix-cache-aware request router for the LLMServer deployment (Ray Serve's RequestRouter API).

A replica's prefix cache only helps the requests that reach it.  Serve's default router picks the
less loaded of two random replicas, so with R replicas a shared prompt prefix ends up prefilled
and cached R times, and each replica's cache holds every prefix instead of 1/R of them.  This
router remembers, per replica, the chain hashes of the prompt blocks it sent there (the planner's
``prompt_hashes``: equal hashes mean equal prefixes) and sends a request to the replica holding the
longest run of its leading blocks -- unless that replica's queue is more than
``imbalanced_threshold`` requests longer than the least loaded one, when it falls back to
power-of-two choices by queue length, so affinity never piles load on one replica.

What the router sees of a request (Ray 2.60): ``PendingRequest.args`` are the arguments of the
handle call.  Behind Serve's HTTP proxy a FastAPI ingress replica gets one argument, a pickled
``StreamingHTTPRequest`` holding only the ASGI scope (path, headers); the replica pulls the body
from the proxy afterwards (``receive_asgi_messages``), after routing.  So the prompt is not
reachable there, and the prefix-aware app puts a front deployment before the replicas
(``ray_attn/serve/ingress.py``): it reads the body, hashes the prompt's blocks, and calls the LLMServer
handle with a ``RoutedHTTPRequest`` whose ``prefix_block_hashes`` this router reads.  Ray's own LLM
stack is built the same way (an OpenAI ingress calling LLMServer handles).

The table is per router instance, i.e. per front-deployment replica: with one front replica (as
shipped) it sees every request.  It is a model of the replicas' caches, not a copy: a replica may
have evicted a block the table still lists (a wasted preference, never a wrong answer).

With a shared KV tier (``cache.kv_sharing``) every block a replica computes is also published to
the stores every replica fetches from, so the table keeps those blocks under one more key,
``SHARED``.  When the shared tier holds a longer run of a prompt than any replica's own cache, no
replica is better placed than another (each fetches the same run), and the request goes by load.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Iterable, List, Optional, Sequence

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

DEFAULT_MAX_BLOCKS_PER_REPLICA = 65536
SHARED = "shared-kv-tier"  # the table's key for the blocks every replica can fetch


class PrefixIndex:
    """Per replica, a bounded LRU set of the prompt-block chain hashes routed to it."""

    def __init__(self, max_blocks_per_replica: int):
        if int(max_blocks_per_replica) < 1:
            raise ValueError(f"max_blocks_per_replica: must be >= 1, got {max_blocks_per_replica}")
        self.max_blocks = int(max_blocks_per_replica)
        self._blocks: dict[object, OrderedDict[int, None]] = {}

    def record(self, replica, hashes: Sequence[int]) -> None:
        """Remember that ``replica`` now holds these leading blocks (most recently used)."""
        lru = self._blocks.setdefault(replica, OrderedDict())
        # Last block first, so that the first block is the most recent: eviction then drops a
        # prompt's tail before its head, and a head is what every later match starts from (the
        # order vLLM frees blocks in, for the same reason).
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def match(self, replica, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` ``replica`` holds (a chain: stop at the first miss)."""
        lru = self._blocks.get(replica)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def drop(self, replica) -> None:
        self._blocks.pop(replica, None)

    def keep_only(self, replicas: Iterable) -> None:
        alive = set(replicas) | {SHARED}
        for r in [r for r in self._blocks if r not in alive]:
            del self._blocks[r]

    def num_blocks(self, replica) -> int:
        return len(self._blocks.get(replica, ()))


def request_block_hashes(pending_request: Optional[PendingRequest]) -> tuple[int, ...]:
    """The prompt-block hashes a handle caller attached to the request (empty when none)."""
    if pending_request is None:
        return ()
    for arg in list(pending_request.args or ()) + list((pending_request.kwargs or {}).values()):
        hashes = getattr(arg, "prefix_block_hashes", None)
        if hashes:
            return tuple(hashes)
    return ()


class PrefixAwareRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Prefix affinity while queues are balanced, power-of-two choices otherwise.

    No FIFOMixin: the replica chosen for one request's prefix must go to that request, not to
    the oldest one waiting (the base class matches by request id)."""

    def initialize_state(self, imbalanced_threshold: int = 8, min_match_blocks: int = 1,
                         max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA,
                         shared_tier: bool = False):
        if int(imbalanced_threshold) < 0:
            raise ValueError(f"imbalanced_threshold: must be >= 0, got {imbalanced_threshold}")
        if int(min_match_blocks) < 1:
            raise ValueError(f"min_match_blocks: must be >= 1, got {min_match_blocks}")
        self.imbalanced_threshold = int(imbalanced_threshold)
        self.min_match_blocks = int(min_match_blocks)
        self.index = PrefixIndex(max_blocks_per_replica)
        self.shared_tier = bool(shared_tier)
        # How each request with a prompt was decided (read by tests and logs).
        self.decisions = {"prefix": 0, "imbalanced": 0, "no_match": 0, "shared": 0}

    # -- replica set ---------------------------------------------------------------------------
    def update_replicas(self, replicas: List[RunningReplica]):
        super().update_replicas(replicas)
        self.index.keep_only(self._replica_id_set)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id)

    # -- routing -------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None,
                              ) -> List[List[RunningReplica]]:
        # Locality first (same node, then all), as the default router does; it also tells the
        # caller when to back off between rounds.
        ids = self.apply_locality_routing(pending_request)
        candidates = [r for r in candidate_replicas if r.replica_id in ids]
        if not candidates:
            return []
        two = random.sample(candidates, min(2, len(candidates)))
        hashes = request_block_hashes(pending_request)
        if not hashes:
            return [two]
        matched = {r.replica_id: self.index.match(r.replica_id, hashes) for r in candidates}
        best = max(matched.values())
        if self.shared_tier and self.index.match(SHARED, hashes) > max(best, self.min_match_blocks - 1):
            self.decisions["shared"] += 1  # any replica fetches the same run: go by load
            return [two]
        if best < self.min_match_blocks:
            self.decisions["no_match"] += 1
            return [two]
        queue = await self._queue_lens(candidates)
        known = [q for q in queue.values() if q is not None]
        least = min(known) if known else 0
        holders = [r for r in candidates if matched[r.replica_id] == best
                   and (queue[r.replica_id] or 0) - least <= self.imbalanced_threshold]
        if not holders:
            self.decisions["imbalanced"] += 1
            return [two]
        self.decisions["prefix"] += 1
        if len(holders) == 1 and self._use_replica_queue_len_cache:
            # Count the request against its holder now: in a burst, the decisions that follow
            # this one run before the holder's own answer refreshes Serve's cache, and with the
            # stale length every one of them would find the holder within the threshold (24 of
            # 24 to one replica, seen in tests/serve/test_routing.py).  The holder's next answer
            # overwrites the guess with its true length.
            h = holders[0].replica_id
            self._replica_queue_len_cache.update(h, (queue[h] or 0) + 1)
        # The holder first; if it refuses (full), the power-of-two pair is the next rank.
        return [holders, two]

    async def _queue_lens(self, replicas: List[RunningReplica]) -> dict:
        """Requests in flight per replica: from Serve's cache when fresh, else probed."""
        out, stale = {}, []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                stale.append(r)
            else:
                out[r.replica_id] = q
        if stale:
            for r, q in await self._probe_queue_lens(stale, 0):
                out[r.replica_id] = q
        return out

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes = request_block_hashes(pending_request)
        if hashes:
            self.index.record(replica_id, hashes)
            if self.shared_tier:
                self.index.record(SHARED, hashes)


__all__ = ["DEFAULT_MAX_BLOCKS_PER_REPLICA", "PrefixAwareRequestRouter", "PrefixIndex", "SHARED",
           "request_block_hashes"]
