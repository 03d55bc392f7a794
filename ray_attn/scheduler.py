"""Who runs in a step: the waiting queue, the running list, and the token budget between them.

Split from the engine as nano-vllm splits its ``Scheduler`` from its ``LLMEngine``: the engine
talks to the ranks and owns the tokens in flight; the scheduler only decides, from its queues and
what the planner already holds of each request, which requests a step carries and how many tokens
each gets.  It proposes a step (``schedule``) without committing it, because the planner may
still refuse it for want of KV blocks; the engine then asks again with fewer admissions or after
``preempt_one``, and ``admit`` commits the proposal the planner took.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from ray_attn.config import EngineConfig
from ray_attn.planner import Planner
from ray_attn.planner.invariant import grid_room
from ray_attn.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """One step's proposal, like vLLM's ``SchedulerOutput``.

    ``reqs`` in row order: running requests first, then ``num_admitted`` from the waiting queue,
    in its order (the last ``num_admitted`` of ``reqs``, ``admitted``; still waiting until
    ``admit``).  They are its front but for requests passed over because every adapter slot is
    in use (``Scheduler.schedule``).
    ``num_new_tokens[i]`` is what ``reqs[i]`` computes this step -- a parallel list rather than
    vLLM's dict by request id, since the planner consumes it in row order and a step should not
    hash every request id twice."""

    reqs: list[Request]
    num_new_tokens: list[int]
    num_admitted: int

    @property
    def admitted(self) -> list[Request]:
        return self.reqs[len(self.reqs) - self.num_admitted:]


class Scheduler:
    def __init__(self, config: EngineConfig, planner: Planner):
        # The planner is read for how far each request got (computed tokens, prefix-cache hits)
        # and written only to free the blocks of a request that leaves the running list.
        self.planner = planner
        self.max_num_batched_tokens = config.max_num_batched_tokens  # the config is frozen
        self.max_num_seqs = config.max_num_seqs
        # batch-invariant mode's cascade grid, the planner's (which refuses a query crossing one of
        # its lines): no chunk crosses one (planner/invariant.py)
        self.cascade_grid = planner.cascade_grid
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lora = None  # ray_attn.lora.manager.LoRAManager: admission takes each adapter's slot

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, admit: int | None = None) -> SchedulerOutput:
        """Fill the token budget: every running request first (a decode token, or its prompt's
        next chunk), then waiting ones in order -- at most ``admit`` of them (None: as many as
        fit).  Changes nothing: ``admit`` commits the admissions once the planner took the step."""
        budget = self.max_num_batched_tokens
        reqs: list[Request] = []
        num_new: list[int] = []
        planner = self.planner
        for req in self.running:
            if budget <= 0:
                break
            if req.last_token_in_flight:
                continue
            done = planner.num_computed_tokens(req.request_id)
            n = min(len(req.token_ids) - done, budget, grid_room(done, self.cascade_grid) or budget)
            reqs.append(req)
            num_new.append(n)
            budget -= n
        admitted = 0
        limit = len(self.waiting) if admit is None else min(admit, len(self.waiting))
        index = None  # the step's full blocks, for the prefix hits of the requests it admits
        for req in self.waiting:
            if admitted >= limit or budget <= 0 or len(reqs) >= self.max_num_seqs:
                break
            if req.pending:
                break  # preempted while its token was out: recompute once the token is back
            if req.lora_request is not None and not self._take_lora_slot(req, reqs):
                # Every adapter slot is in use, or the ranks are still reading its adapter: it
                # waits, first in line, but the requests behind it that need no new slot (the base
                # model, an adapter already resident) go ahead -- a load must not stop the queue.
                continue
            tokens = req.token_ids
            hit = 0
            if planner.enable_prefix_caching:
                # A hit counts blocks the pool holds and blocks a request before it in this step
                # computes (the n samples of one prompt compute it once), as the planner will.
                if index is None:
                    index = planner.step_prefix_index([r.request_id for r in reqs],
                                                      [r.token_ids for r in reqs], num_new)
                match = index.match(tokens, read=not req.sched.skip_prefix_cache, root=req.sched.cache_root)
                hit = match.num_tokens
            n = min(len(tokens) - hit, budget, grid_room(hit, self.cascade_grid) or budget)
            if index is not None:
                index.add_new(len(reqs), match, n)
            reqs.append(req)
            num_new.append(n)
            budget -= n
            admitted += 1
        return SchedulerOutput(reqs, num_new, admitted)

    def _take_lora_slot(self, req: Request, reqs: list[Request]) -> bool:
        """The device slot of ``req``'s adapter (loaded when not resident), kept on its planner
        row; False when every slot holds an adapter that a running request, or one admitted
        before it in this step, uses."""
        def busy():
            return {r.lora_request.lora_int_id for r in (*self.running, *reqs) if r.lora_request is not None}

        # a step that serves running requests must not wait for this adapter's read from disk
        # (requests admitted with it, from an idle engine, have no token out yet to delay)
        slot = self.lora.slot_for(req.lora_request.lora_int_id, busy, shared=bool(self.running))
        if slot is None:
            return False
        req.sched.lora_slot = slot
        return True

    def admit(self, admitted: list[Request] | int) -> None:
        """The planner took the step: its admissions (``SchedulerOutput.admitted``; an int: that
        many from the front) leave the queue for the running list."""
        if isinstance(admitted, int):
            for _ in range(admitted):
                self.running.append(self.waiting.popleft())
            return
        if all(a is w for a, w in zip(admitted, islice(self.waiting, len(admitted)))):
            for _ in admitted:  # the usual case: the front of the queue
                self.waiting.popleft()
        else:
            taken = {id(r) for r in admitted}
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        self.running.extend(admitted)

    def preempt_one(self) -> Request:
        """Free the newest running request's blocks and put it at the front of the queue, to be
        recomputed from its token history: the newest has the least work to redo."""
        victim = self.running.pop()
        if self.planner.has_request(victim.request_id):
            self.planner.free(victim.request_id)
        victim.num_preemptions += 1
        victim.num_draft_computed = 0  # its blocks go to others: the draft's KV in them too
        self.waiting.appendleft(victim)
        return victim

    def requeue_running(self) -> None:
        """The KV cache is gone (the ranks died): every running request frees its blocks and goes
        back to the front of the queue, in its old order, to be recomputed first."""
        for req in self.running:
            if self.planner.has_request(req.request_id):
                self.planner.free(req.request_id)
        self.waiting.extendleft(reversed(self.running))
        self.running = []

    def remove(self, req: Request) -> None:
        """A request ended: off whichever queue holds it, and its blocks back to the pool."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.planner.has_request(req.request_id):
            self.planner.free(req.request_id)
