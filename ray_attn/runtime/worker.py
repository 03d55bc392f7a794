"""One tensor-parallel rank: a KV-cache shard, a model shard, and the whole step in one call.

The driver sends each rank one message per step (no RPC per layer), so everything a step does on
a rank -- inputs to the device, the forward, sampling, the answer -- happens inside
``execute_step``; ``_run`` is its outline.  ``AttentionWorker`` is a plain class;
``AttentionCluster`` runs it as a Ray actor (one per GPU, or per CPU slot), and
``InProcessExecutor`` runs it in the driver's own process.  What a rank needs but is not the
step lives beside it: forming the TP group (``rendezvous``), deferred answers and their pinned
host buffers (``deferred``), the input buffers (``buffers``), decode graphs (``cuda_graphs``),
the cache's sizing and the graphs' capture (``rank_setup``), a step's host checks
(``step_checks``), the draft model (``draft_runner``) and the kernel-time split (``profiling``).
"""

from __future__ import annotations

import collections
import gc
import os
import time

import numpy as np
import torch

from ray_attn.config import EngineConfig
from ray_attn.backend import batch_invariant
from ray_attn.runtime import messages, rank_setup, rendezvous
from ray_attn.runtime.buffers import StepBuffers
from ray_attn.runtime.deferred import DeferredOutput, SamplingThread, TokenStaging, pack_output, unpack_output
from ray_attn.runtime.grammars import RankGrammars
from ray_attn.runtime.messages import StepInput, StepOutput
from ray_attn.runtime.profiling import time_by_kernel_kind
from ray_attn.runtime.sampling import SamplingTensors, prompt_logprobs_on_device, sample_on_device
from ray_attn.runtime.step_checks import check_step


def unnice() -> int:
    """Run this process at niceness 0 where the OS lets us (lowering it needs CAP_SYS_NICE, which
    root has); returns the niceness it runs at.  Ray starts every worker at niceness 15
    (``RAY_worker_niceness``) to keep its daemons responsive, but a rank is the step's critical
    path: at 15 beside any busy process at 0 it gets a few percent of a core (seen: ranks restarted
    beside two CPU hogs ran at 4% each and took minutes to load)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:  # not permitted: keep what Ray gave us
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


class AttentionWorker:
    """One rank.  Its public methods are what the driver calls on the actor (``cluster.py``,
    scripts, tests): ``reset``, ``address``, ``init_distributed``, ``load_model``, ``device_info``,
    ``ping``, ``execute_step``, ``profile_step``, ``refs_seen``, ``read_kv``."""

    def __init__(self, config: EngineConfig | dict, rank: int = 0):
        unnice()
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.model_validate(config)
        self.rank = rank
        self.tp = self.config.parallel.tensor_parallel_size
        want = self.config.parallel.device
        cuda = torch.cuda.is_available() and want != "cpu"
        if want == "cuda" and not cuda:
            raise RuntimeError(f"rank {rank}: parallel.device='cuda' but this worker sees no GPU")
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always device 0 here.
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        # per process: a rank in the driver's process (InProcessExecutor) sets it for each engine
        batch_invariant.set_enabled(self.config.parallel.batch_invariant)
        if not cuda:
            # Several CPU ranks share few cores: their share each avoids oversubscription stalls.
            # RAY_ATTN_CPU_THREADS overrides it (beside other work, 1 runs far faster: OpenMP
            # threads wait on each other, and one descheduled thread stalls the rest).
            own = max(1, (os.cpu_count() or 1) // max(self.tp, 1))
            torch.set_num_threads(int(os.environ.get("RAY_ATTN_CPU_THREADS", own)))
        self.model = None
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.model.seed + 7919)
        # Bounded, so that a long-running server does not grow it forever (see ``refs_seen``).
        self.seen_refs: collections.deque[str] = collections.deque(maxlen=1024)
        self.buffers = StepBuffers(self.device)
        self.graphs = None  # DecodeGraphs once the model and its cache exist (GPU only)
        self.spec_graphs = None  # and for verifying steps: every row 1 + k tokens (speculative decoding)
        self.tiers = None  # RankKVTiers: the host pool and the copies a step carries, when on
        self.lora = None  # RankLoRA: adapter slots on every targeted linear, with lora_config
        self.draft = None  # RankDraft: speculative decoding's draft model and its KV cache
        self.drafts: torch.Tensor | None = None  # the step's drafts, once proposed
        self.memory_profile = None  # how the KV cache was sized, when sized on a GPU
        self.graph_pool_bytes: int | None = None  # what the decode graphs' capture took
        self.steps = 0
        # Async scheduling: the last step's sampled tokens, kept on the device for the next
        # step's inputs, and the deferred step whose output rank 0 has not answered yet.
        self.last_tokens: torch.Tensor | None = None
        self.deferred: DeferredOutput | None = None
        self.token_staging = TokenStaging(self.device)
        self.grammars = RankGrammars(self.config.model.vocab_size)  # rank 0's matchers
        self.grammar_s: float | None = None
        self._tail: SamplingThread | None = None  # a deferred constrained step's sampling, on its thread
        # A rank in the driver's own process (InProcessExecutor) samples in line: there a thread
        # would share the interpreter with the driver's planning instead of running beside it
        # (measured on an H200: +16% step time at 256 constrained rows, against +1% in line).
        self.sample_on_thread = True

    # -- set-up -----------------------------------------------------------------------------
    def reset(self, config: EngineConfig | dict, rank: int) -> None:
        """Become rank ``rank`` of a new engine in this same process (``rank_pool``: a test run's
        warm ranks): the last engine's model, cache, graphs and sampling thread go, and the
        rank starts over as a new actor would -- its TP group is formed again by the driver."""
        try:
            self._join_tail()
        except BaseException:  # noqa: BLE001 -- the last engine's failure is not the next one's
            pass
        self.__dict__.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.__init__(config, rank)

    def address(self) -> tuple[str, int]:
        """Where rank 0 serves the collective group's rendezvous."""
        return rendezvous.group_address()

    def init_distributed(self, host: str, port: int) -> None:
        """Join the TP group at rank 0's address; a single rank has no group to join."""
        if self.tp == 1:
            return
        rendezvous.join_group(host, port, self.rank, self.tp, self.device)

    def load_model(self) -> dict:
        """This rank's model shard and its KV cache, then the decode graphs that hold the cache's
        addresses.  Called after ``init_distributed``: a TP shard is built on the group."""
        from ray_attn.model import build_model

        cfg = self.config
        group = rendezvous.tp_group(self.tp)
        with torch.device(self.device):
            self.model = build_model(
                cfg.model, tp_rank=self.rank, tp_size=self.tp, tp_group=group, device=self.device,
                block_size=cfg.cache.block_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
                kernel=cfg.parallel.kernel)
        if cfg.checkpoint:
            self.model.load_weights(cfg.checkpoint)
        else:
            self.model.init_random_weights(cfg.model.seed)
        if cfg.lora_config is not None:  # before sizing the cache: the slots are weights
            from ray_attn.lora.layers import RankLoRA

            self.lora = RankLoRA(self.model, cfg, self.device)
        spec = cfg.speculative_config
        if spec is not None and spec.method == "draft_model":  # its weights count before sizing too
            from ray_attn.runtime.draft_runner import RankDraft

            self.draft = RankDraft(cfg, self.rank, self.tp, group, self.device)
        self.num_blocks = cfg.cache.num_blocks or rank_setup.blocks_from_memory(self)
        self.model.allocate_kv_cache(self.num_blocks)
        if self.draft is not None:
            self.draft.allocate_kv_cache(self.num_blocks)
        c = cfg.cache
        if c.host_cache_gib or c.kv_sharing:  # below the device cache: planner/tiers.py
            from ray_attn.runtime.kv_tiers import RankKVTiers

            self.tiers = RankKVTiers(self.model, c.host_cache_gib, self.rank, self.tp, self.device,
                                     int(c.kv_store_gib * (1 << 30)))
        self.graphs = self._capture_graphs()
        if cfg.cache.calculate_kv_scales:
            self.model.set_calculate_kv_scales()  # after capture: its warm-ups must not set them
            if self.draft is not None:
                self.draft.model.set_calculate_kv_scales()
        return self.device_info()

    def _capture_graphs(self):
        """The decode graphs over this KV cache, or None (``rank_setup.capture_graphs``); tests
        override it to run the graphs' padded paths on CPU."""
        return rank_setup.capture_graphs(self)

    def device_info(self) -> dict:
        """What the driver learns of this rank; it sizes the planner by the smallest ``num_blocks``.
        ``memory``: how the KV cache was sized on a GPU (``MemoryProfile``, bytes) and the graph
        pool the capture took; None when ``cache.num_blocks`` was given or on CPU."""
        info = {"rank": self.rank, "device": str(self.device), "pid": os.getpid(),
                "niceness": os.getpriority(os.PRIO_PROCESS, 0),
                "kernel": self.model.kernel_name if self.model else None,
                "num_blocks": getattr(self, "num_blocks", None), "cuda_graphs": self.graphs is not None,
                "memory": None, "host_slots": self.tiers.num_host_slots if self.tiers else 0,
                "kv_block_bytes": self.tiers.block_bytes if self.tiers else None,
                # how many linear layers hold e4m3 weights once loaded: proof that a quantized
                # config really runs FP8 on the rank (the accuracy gate's fp8_weights rows check it)
                "fp8_linears": sum(1 for m in self.model.modules() if getattr(m, "weight", None) is not None
                                   and m.weight.dtype == torch.float8_e4m3fn) if self.model else 0}
        if self.memory_profile is not None:
            info["memory"] = self.memory_profile.as_dict() | {"graph_pool_bytes": self.graph_pool_bytes}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            info.update(name=p.name, num_sms=p.multi_processor_count, total_memory=p.total_memory)
        else:
            info.update(name="cpu", num_sms=None,
                        total_memory=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        return info

    def ping(self) -> int:
        """Health check: the actor answers it even during a long step (``max_concurrency=2``)."""
        return self.rank

    # -- the step -----------------------------------------------------------------------------
    def execute_step(self, step) -> StepOutput | bytes | None:
        """Run every layer for one step.  ``step`` is a StepInput, or ``[ObjectRef]`` of one: the
        driver wraps the ref in a list so that each rank fetches the one shared object itself.
        A step that arrives as ``messages.dumps`` bytes (directly or behind the ref) is answered
        in bytes too: Ray passes bytes through as they are, while an object costs it a pickling."""
        t0 = time.perf_counter()
        if isinstance(step, list):
            import ray

            self.seen_refs.append(step[0].hex())
            step = ray.get(step[0])
        wire = isinstance(step, bytes)
        if wire:
            step = messages.loads(step)
        out = self._run(step)
        ready = self.lora.take_ready() if self.lora is not None else None
        if self.rank != 0:
            return None  # the driver reads rank 0's answer only
        if ready:
            if out is None:  # a deferred step's first call: the next answer carries them
                self.lora.unready(ready)
            else:
                out.lora_ready = ready
        if out is not None:
            out.timings["worker_s"] = time.perf_counter() - t0
            if self.tiers is not None:  # the copies between KV tiers so far
                out.timings["kv_copy_s"] = self.tiers.copy_seconds()
            if self.grammar_s is not None:  # this step's mask fill (benchmarks read it)
                out.timings["grammar_s"], self.grammar_s = self.grammar_s, None
        return messages.dumps(out) if wire else out

    def _run(self, step: StepInput) -> StepOutput | None:
        """The step's output -- or, for a deferred step, the previous deferred step's (see
        ``StepInput``): this step is queued on the device before we wait for that one."""
        self._join_tail()
        if self.lora is not None and step.lora_prefetch:
            self.lora.prefetch(step.lora_prefetch)
        if step.plan is None:  # a flush: nothing to run, but maybe copies to make
            if step.kv_transfers is not None and self.tiers is not None:
                self.tiers.check(step.kv_transfers, self.num_blocks)
                self.tiers.apply(step.kv_transfers)
            return self._collect_deferred()
        self._check(step)
        if step.plan.kv_transfers is not None:  # before the forward: it may reuse those blocks
            self.tiers.apply(step.plan.kv_transfers)
        self.buffers.begin()  # ended by _forward, once the last input is on its way
        if self.lora is not None:  # slot loads first, then each token's slot
            self.lora.begin_step(step.plan, step.lora_loads, self.buffers.put)
        logits_indices, sampling = self._stage_sampling_inputs(step)
        prompt_rows = self._stage_prompt_logprobs(step)
        with torch.inference_mode():
            hidden = self._forward(step)
            if self.drafts is not None and sampling is not None:  # rank 0 verifies the ranks' drafts
                sampling.spec_draft_ids = self.drafts
            if self.lora is not None:  # the loads for later steps, while this forward runs
                self.lora.after_forward()
            self.steps += 1
            rest = (step, hidden, logits_indices, sampling, prompt_rows)
            if not step.defer or not self._fills_grammar(step, sampling):
                return self._finish(*rest)
            # Rank 0 with constrained rows under async scheduling: answer the previous step now,
            # and fill this step's masks from its tokens, sample and defer on a thread of ours
            # while the driver plans the next step (``_join_tail`` waits for it first).
            previous = [self._collect_deferred()]
            if not self.sample_on_thread:
                return self._finish(*rest, previous=previous)
            self._tail = SamplingThread(self._finish, *rest, previous=previous)
            return previous[0]

    def _finish(self, step: StepInput, hidden, logits_indices, sampling, prompt_rows,
                previous: list | None = None) -> StepOutput | None:
        """The step after its forward: its constrained rows' masks (``previous``: ``[output]`` of
        the step before, already collected, whose tokens fill placeholders), sampling, the tokens
        broadcast for the next step's inputs, and rank 0's answer."""
        if self._fills_grammar(step, sampling):
            self._fill_grammar(step, sampling, previous[0] if previous else None)
        tokens, logits, logprobs = self._sample(hidden, logits_indices, sampling)
        if step.defer and self.tp > 1:
            tokens = self._broadcast_tokens(tokens, step.plan.attn.num_reqs)
        self.last_tokens = tokens
        if self.rank != 0:
            return None
        prompt_lp = None
        if prompt_rows is not None:
            prompt_lp = prompt_logprobs_on_device(self.model.compute_logits, hidden, *prompt_rows,
                                                  step.prompt_logprobs.num_logprobs)
        return self._answer(step, tokens, logits, logprobs, prompt_lp, previous)

    def _join_tail(self) -> None:
        """Wait for the last step's thread (see ``_run``); what it raised is raised here."""
        tail, self._tail = self._tail, None
        if tail is not None:
            tail.join()

    def _check(self, step: StepInput) -> None:
        """Refuse a step that would lose an answer or read outside the cache (``step_checks``)."""
        check_step(self, step)

    def _stage_sampling_inputs(self, step: StepInput) -> tuple[torch.Tensor, SamplingTensors | None]:
        """Send what sampling reads: the hidden-state rows to turn into logits, and rank 0's
        sampling parameters (the other ranks do not sample)."""
        buf = self.buffers
        spec = step.spec  # speculative decoding: a logits row per draft position too
        idx = buf.put("logits_indices", step.plan.logits_indices if spec is None else spec.logits_indices).long()
        st = SamplingTensors.stage(step.temperatures, step.seeds, step.sample_index, self.device, buf.put,
                                   step.sampling, spec) if self.rank == 0 else None
        return idx, st

    def _stage_prompt_logprobs(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rank 0's prompt rows and their target tokens (``PromptLogprobsInputs``), or None."""
        p = step.prompt_logprobs
        if self.rank != 0 or p is None or not len(p.indices):
            return None
        put = self.buffers.put
        return put("prompt_lp_indices", p.indices).long(), put("prompt_lp_targets", p.targets).long()

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The step's hidden states: a captured decode graph replayed when one fits the step,
        else the model run eagerly."""
        plan, buf = step.plan, self.buffers
        m = plan.attn
        graphs = next((g for g in (self.graphs, self.spec_graphs) if g is not None and g.can_run(plan)), None)
        if graphs is not None:
            n = graphs.load(plan)
            self._fill_previous_tokens(graphs.input_ids, step)
            self._fill_drafts(graphs.input_ids, step)
            buf.end()
            return graphs.replay(n, m.num_reqs, m.use_cascade)
        dm = m.to_device(self.device, put=buf.put)
        ids = buf.put("input_token_ids", plan.input_token_ids).long()
        self._fill_previous_tokens(ids, step)
        self._fill_drafts(ids, step)
        pos = buf.put("positions", plan.positions).long()
        buf.end()
        return self.model(ids, pos, dm)

    def _fills_grammar(self, step: StepInput, sampling: SamplingTensors | None) -> bool:
        return sampling is not None and step.sampling is not None and step.sampling.grammar_keys is not None

    def _fill_grammar(self, step: StepInput, sampling: SamplingTensors, previous: StepOutput | None) -> None:
        """Rank 0's constrained rows: their bitmask, from this rank's matchers, once the forward
        is queued (``runtime/grammars.py`` says why here); ``previous`` is the step before's
        output, whose tokens fill the placeholders."""
        t0 = time.perf_counter()
        drafts = None if self.drafts is None else self.drafts.cpu().numpy()  # the matchers take them
        bitmask = self.grammars.bitmask(step, previous, drafts)
        sampling.grammar_bitmask = self.buffers.put("grammar_bitmask", bitmask)
        self.buffers.end()  # the next step's begin() waits for this copy too
        self.grammar_s = time.perf_counter() - t0

    def _fill_previous_tokens(self, ids: torch.Tensor, step: StepInput) -> None:
        """Write the previous step's sampled tokens into this step's placeholder inputs, on the
        device: the driver planned this step without them, and need not wait for them."""
        if step.prev_token_index is None or not len(step.prev_token_index):
            return
        if self.last_tokens is None:
            raise RuntimeError(f"rank {self.rank}: step {step.step_id} reads the previous step's tokens, "
                               "but this rank has run no step since it started")
        i = self.buffers.put("prev_token_index", step.prev_token_index).long()
        r = self.buffers.put("prev_token_rows", step.prev_token_rows).long()
        ids[i] = self.last_tokens[r].to(ids.dtype)

    def _fill_drafts(self, ids: torch.Tensor, step: StepInput) -> None:
        """A draft model's work: run it (``runtime/draft_runner.py``) and write its drafts into
        this step's inputs at the draft positions, where the driver put token 0."""
        d, self.drafts = step.draft, None
        if d is None:
            return
        drafts = self.draft.propose(d, self.buffers.put)
        if len(d.target_index):  # else it only computed prompt chunks alongside the target
            ids[self.buffers.put("draft.target_index", d.target_index).long()] = drafts.to(ids.dtype)
            self.drafts = drafts

    def _sample(self, hidden: torch.Tensor, logits_indices: torch.Tensor, sampling: SamplingTensors | None):
        """Rank 0's (tokens, logits, logprobs), on the device; Nones on the other ranks: their
        logits would be the same (the LM head is replicated), and only rank 0 answers.  Sampling
        runs eagerly after the forward (a replayed decode graph ends at the hidden states), and
        reads ``last_tokens`` -- the previous step's, not yet replaced -- for penalty histories."""
        if self.rank != 0:
            return None, None, None
        logits = self.model.compute_logits(hidden, logits_indices)
        tokens, logprobs = sample_on_device(logits, sampling, self.generator, self.last_tokens)
        return tokens, logits, logprobs

    def _broadcast_tokens(self, tokens: torch.Tensor | None, num_reqs: int) -> torch.Tensor:
        """Rank 0's tokens on every rank.  The step after a deferred one reads them on the
        device (``_fill_previous_tokens``), and every rank embeds that step's inputs."""
        import torch.distributed as dist

        if tokens is None:
            tokens = torch.empty(num_reqs, dtype=torch.int32, device=self.device)
        dist.broadcast(tokens, src=0)
        return tokens

    def _answer(self, step: StepInput, tokens: torch.Tensor, logits: torch.Tensor,
                logprobs, prompt_logprobs=None, previous: list | None = None) -> StepOutput | None:
        """Rank 0's answer: this step's output, or, for a deferred step, the previous deferred
        step's, waited for only now that this step is queued behind it (``previous``: already
        collected, as ``[output]``)."""
        logits_np = logits.float().cpu().numpy() if step.return_logits else None
        if not step.defer:
            packed, layout = pack_output(tokens, logprobs)  # one copy to the host
            token_ids, lp = unpack_output(packed.cpu().numpy(), len(tokens), layout)
            return StepOutput(token_ids=token_ids, step_id=step.step_id, logits=logits_np, logprobs=lp,
                              prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs.to_numpy())
        previous = previous[0] if previous is not None else self._collect_deferred()
        self.deferred = self.token_staging.defer(tokens, step.step_id, logits_np, logprobs, prompt_logprobs)
        return previous

    def _collect_deferred(self) -> StepOutput | None:
        """The deferred step's output (waiting for its tokens), which is then answered."""
        deferred, self.deferred = self.deferred, None
        return None if deferred is None else deferred.collect()

    # -- diagnostics --------------------------------------------------------------------------
    def profile_step(self, step: StepInput) -> dict:
        """Run one step under the torch profiler; its time by kind of kernel, in microseconds
        (``profiling.time_by_kernel_kind``).  The TP benchmark calls it on every rank."""
        return time_by_kernel_kind(lambda: self._run(step), self.device)

    def refs_seen(self) -> list[str]:
        """The step refs this rank read (tests check that every rank reads the same one)."""
        return list(self.seen_refs)

    def read_kv(self, layer: int, block_ids: list[int]) -> np.ndarray:
        """A copy of some KV blocks (tests compare caches across ranks and after recovery)."""
        self._join_tail()
        return self.model.kv_caches[layer][:, block_ids].float().cpu().numpy()
