"""Continuous batching on the driver: schedule, plan, one message to the ranks, sample, repeat.

Each step the scheduler fills a token budget -- running requests first (a decode token each, or
the next chunk of a long prompt), then waiting ones -- and the planner turns that into one
``StepPlan``.  When the KV pool cannot hold the step, the newest running request is preempted:
its blocks are freed and it is recomputed later from its token history, so nothing is dropped.

The parts live apart, as in nano-vllm: what a request is (``request.py``), who runs in a step
(``scheduler.py``), when a cascade pays (``planner/cascade.py``), what a step sends and what its
answer does (``engine_inputs.py``, ``engine_outputs.py``).  This module is what is left
to drive them: it owns the steps in flight to the ranks and their tokens, recovers from ranks
that die, and offers the batch API.  The names that moved stay importable from here.
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Sequence

from ray_attn.config import EngineConfig
from ray_attn.engine_stats import EngineDeadError, EngineStats, SubmittedStep
from ray_attn.planner import OutOfBlocksError, Planner
from ray_attn.planner.cascade import (  # noqa: F401  (re-exported: scripts import them from here)
    CASCADE_BREAK_EVEN_BYTES,
    CASCADE_BREAK_EVEN_BYTES_GRAPHED,
    cascade_threshold,
)
from ray_attn.planner.invariant import cascade_grid
from ray_attn.request_checks import check_new_request
from ray_attn.request import PLACEHOLDER, Request, RequestOutput, SamplingParams, TokenLogprobs  # noqa: F401
from ray_attn.runtime.cluster import WorkerFailure
from ray_attn.runtime.kv_tiers import planner_tiers
from ray_attn.runtime.messages import StepInput
from ray_attn.engine_inputs import build_step_input
from ray_attn.engine_outputs import apply_step_output
from ray_attn.lora.manager import LoRAManager
from ray_attn.scheduler import Scheduler
from ray_attn.spec.decoder import SpecDecoder
from ray_attn.structured_output import GrammarSync

MAX_FAILURES_PER_MINUTE = 3  # a rank dying this often is not transient: stop instead of looping


def _workers_use_graphs(executor) -> bool | None:
    """What the ranks reported after loading (a capture can fail and fall back to eager)."""
    infos = getattr(executor, "infos", None)
    return infos[0].get("cuda_graphs") if infos else None


class LLMEngine:
    def __init__(self, config: EngineConfig, executor=None):
        self.config = config
        if executor is None:
            from ray_attn.runtime import AttentionCluster

            executor = AttentionCluster(config)
        self.executor = executor
        m, tp = config.model, config.parallel.tensor_parallel_size
        kinds = set(m.layer_kinds())
        self.planner = Planner(
            num_blocks=executor.num_blocks, block_size=config.cache.block_size,
            # The cascade cost model counts the CTAs one GPU runs: this rank's heads.
            num_query_heads=m.num_attention_heads // tp,
            num_kv_heads=max(m.num_key_value_heads // tp, 1), use_alibi=m.use_alibi,
            sliding_window=m.sliding_window if "sliding_attention" in kinds else None,
            attention_chunk_size=m.attention_chunk_size if "chunked_attention" in kinds else None,
            num_sms=config.num_sms or executor.num_sms or 132,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            # cascade makes a row's attention depend on which others share its prefix this step;
            # batch-invariant mode cascades on a fixed grid instead (planner/invariant.py)
            enable_cascade=config.enable_cascade and not config.parallel.batch_invariant,
            cascade_grid=cascade_grid(config),
            max_model_len=m.max_position_embeddings,
            max_num_reqs_hint=config.max_num_seqs, tiers=planner_tiers(config, executor),
            cascade_min_saved_kv_tokens=config.cascade_min_saved_kv_tokens
            if config.cascade_min_saved_kv_tokens is not None else cascade_threshold(
                config, executor.kernel_name, _workers_use_graphs(executor)))
        self.requests: dict[str, Request] = {}
        self.scheduler = Scheduler(config, self.planner)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._step_id = 0
        # speculative decoding: drafts proposed and read back around each step (spec/decoder.py)
        self.spec = None if config.speculative_config is None else SpecDecoder(
            config, self.planner, str((getattr(executor, "infos", None) or [{}])[0].get("device", config.parallel.device)))
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            infos = getattr(executor, "infos", None) or [{}]
            self.async_scheduling = str(infos[0].get("device", "")).startswith("cuda")
        self._submitted: SubmittedStep | None = None  # async: the step whose tokens are still out
        self._eos = frozenset(config.model.eos_token_ids)
        self._failures: list[float] = []  # on the clock that stops during recoveries
        self._recovering_s = 0.0  # seconds spent in recover(), kept off that clock
        self.dead: str | None = None
        # ray_attn.structured_output.GrammarCompiler for the served tokenizer, set by whoever
        # has one (a server, a script): requests with structured_outputs need it.
        self.grammar_compiler = None
        self.grammar_sync = GrammarSync()  # what rank 0 holds of the requests' grammars
        self.lora = LoRAManager(config) if config.lora_config is not None else None  # adapters' slots
        self.scheduler.lora = self.lora

    # The scheduler's queues, read by servers (ray_attn/serve/loop.py) and tests.
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, output_token_ids: Sequence[int] = (),
                    lora_request=None) -> str:
        """Queue a request; rejects one that could never run, leaving every other untouched.

        ``output_token_ids`` resumes a request another engine began (a replica lost mid-stream):
        they are its first outputs, as after a preemption -- prefilled with the prompt, counted
        against ``max_tokens`` and by the penalties, and a seeded request's next draw is its
        ``len(output_token_ids)``-th, so greedy and seeded sampling continue as they would have.
        ``lora_request`` (a ``ray_attn.lora.LoRARequest``, as vLLM's) runs it under that adapter,
        checked (and remembered) on first use."""
        if self.dead:
            raise EngineDeadError(f"engine stopped after repeated worker failures: {self.dead}")
        params = params or SamplingParams()
        prompt, resumed = check_new_request(self.config, self.planner.pool.num_blocks, prompt_token_ids,
                                            params, output_token_ids)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None:
            self.add_lora(lora_request)
        grammar = None
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured_outputs: this engine has no grammar compiler (it needs the "
                                 "tokenizer: set LLMEngine.grammar_compiler)")
            spec = params.structured_outputs
            grammar = self.grammar_compiler.matcher(self.grammar_compiler.compile(spec), spec)
            bad = [t for t in resumed if not grammar.accept(t)]
            if bad or (resumed and grammar.terminated):
                raise ValueError(f"output_token_ids: they do not continue the request's grammar "
                                 f"(at token {bad[0] if bad else resumed[-1]})")
        req = Request(request_id, prompt + resumed, len(prompt), params, grammar=grammar, lora_request=lora_request)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self._finish(req, "abort")

    # -- adapters: vLLM's add_lora / remove_lora / list_loras (ray_attn/lora/manager.py) -------
    def add_lora(self, lora_request) -> bool:
        """Check and keep an adapter (a LoRAAdapterError, a ValueError, names what is wrong)."""
        return LoRAManager.of(self).add(lora_request) is not None

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; refused, by name, while unfinished requests use it."""
        return LoRAManager.of(self).remove(lora_int_id, (r for r in self.requests.values() if not r.finished))

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else set(self.lora.adapters)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -----------------------------------------------------------------------------
    def _plan(self, speculate: bool = False):
        """Plan the step, preempting (by recompute) until the pool can hold it.

        The retry loop lives here, not in the Scheduler, because it is where the scheduler's
        proposal meets the planner's verdict: the Scheduler proposes from its queues and never
        sees an OutOfBlocksError or a StepPlan, and a preemption counts in the engine's stats."""
        scheduler, admit = self.scheduler, None
        spec = wanted = self.spec if speculate else None
        while True:
            out = scheduler.schedule(admit)
            if not out.reqs:
                return None
            drafted = spec is not None and spec.propose(out, len(scheduler.running))
            sched = []
            for r, n in zip(out.reqs, out.num_new_tokens):
                r.sched.num_new_tokens = n
                sched.append(r.sched)
            try:
                plan = self.planner.plan(sched)
            except OutOfBlocksError:
                if drafted:  # the drafts go first: the same step again without any
                    spec.undo(out)
                    spec = None
                    continue
                # The planner changed nothing: first admit one request fewer from the queue, and
                # only with none left to drop preempt a running one.
                admitted = out.num_admitted
                if admitted > 1 or (admitted and scheduler.running):
                    admit = admitted - 1
                    continue
                if not scheduler.running:
                    raise
                scheduler.preempt_one()
                self.stats.preemptions += 1
                admit = 0  # else the victim would be re-admitted into the same step
                spec = wanted  # drafts again, for the smaller batch
                continue
            except BaseException:
                if drafted:
                    spec.undo(out)
                raise
            return self._admit(out, plan)

    def _admit(self, out, plan):
        if out.num_admitted:
            self._note_cached_tokens(out)
        self.scheduler.admit(out.admitted)
        return plan

    def _note_cached_tokens(self, out) -> None:
        """Each admitted request's prefix-cache hit (vLLM's ``num_cached_tokens``): what the
        planner had computed for it before this step's tokens.  Set on the first admission only,
        so a preempted request keeps the hit its client was first served with."""
        k = out.num_admitted
        for r, n in zip(out.reqs[-k:], out.num_new_tokens[-k:]):
            if r.num_cached_tokens is None:
                r.num_cached_tokens = self.planner.num_computed_tokens(r.request_id) - n

    def step(self) -> list[RequestOutput]:
        """Plan and run one step; returns what the requests gained.

        With ``async_scheduling`` the step returned is the *previous* one: the ranks queue this
        step on the GPU before they wait for that one's tokens, and the driver plans the next step
        while this one runs.  Its inputs that depend on the previous step's tokens travel as
        placeholders, which the ranks fill on the device.  The price: a request that stops on a
        stop token has already been scheduled once more, and that token is thrown away.  Under
        speculative decoding, only steps that cannot speculate are deferred (``SpecDecoder.wants``:
        batches above ``disable_by_batch_size``)."""
        t0 = time.perf_counter()
        # A step that may speculate is not deferred (spec/decoder.py says why): the one still out
        # is collected first, so that its rows' tokens are known to propose from and plan after.
        speculate = self.spec is not None and self.spec.wants(len(self.scheduler.running))
        early = self.flush() if speculate else []
        plan = self._plan(speculate)
        if plan is None:
            return early + self.flush()
        self.stats.prefix_cache_hit_tokens += plan.num_prefix_cache_hit_tokens
        sub, step_in = self._submit(plan, defer=self.async_scheduling and not speculate)
        try:
            out = self.executor.step(step_in)
        except WorkerFailure as e:
            return self._on_worker_failure(e)
        if out is not None and "kv_copy_s" in out.timings:
            self.stats.kv_copy_s = out.timings["kv_copy_s"]
        self._note_lora_ready(out)
        if step_in.defer:
            done, self._submitted = self._submitted, sub
        else:
            done = sub
        outputs = early + ([] if done is None else self._apply(done, out))
        tiers = self.planner.kv.tiers
        if tiers is not None and tiers.has_pending_publish() and not self.scheduler.has_unfinished():
            outputs += self.flush()
            self._publish_idle()
        self.stats.busy_s += time.perf_counter() - t0
        return outputs

    def _publish_idle(self) -> None:
        """With no step to come, publish the blocks the last steps filled (the shared KV tier,
        planner/tiers.py) in a step of their own: nothing else would carry them."""
        tiers = self.planner.kv.tiers
        tiers.begin_plan()
        transfers = tiers.take_transfers()
        if transfers is not None and self._submitted is None:
            step = StepInput.flush(self._step_id)
            step.kv_transfers = transfers
            self._step_id += 1
            try:
                self.executor.step(step)
            except WorkerFailure as e:
                self._on_worker_failure(e)

    def flush(self) -> list[RequestOutput]:
        """Collect the step still out under async scheduling (a no-op otherwise), so that the
        ranks hold nothing of this engine's; returns what that step made."""
        if self._submitted is None:
            return []
        done, self._submitted = self._submitted, None
        try:
            out = self.executor.step(StepInput.flush(self._step_id))
        except WorkerFailure as e:
            return self._on_worker_failure(e)
        self._note_lora_ready(out)
        return self._apply(done, out)

    def _note_lora_ready(self, out) -> None:
        if out is not None and out.lora_ready and self.lora is not None:
            self.lora.ready(out.lora_ready)  # adapters rank 0 has read: their requests may be admitted

    def set_async_scheduling(self, on: bool) -> None:
        self.flush()  # a rank refuses a plain step while a deferred answer is waiting
        self.async_scheduling = on

    def _submit(self, plan, defer: bool) -> tuple[SubmittedStep, StepInput]:
        """The step's message (``engine_inputs.py``)."""
        return build_step_input(self, plan, defer)

    def _apply(self, done: SubmittedStep, out) -> list[RequestOutput]:
        """Write a step's sampled tokens over their placeholders and finish what is done."""
        return apply_step_output(self, done, out)

    def _on_worker_failure(self, failure: WorkerFailure) -> list[RequestOutput]:
        """Restart the ranks and recompute every running request from its token history; after
        MAX_FAILURES_PER_MINUTE failures within a minute of running, end the requests with the
        error instead.

        The minute is counted without the recoveries themselves: a recovery (spawning ranks,
        loading the model) takes 5 s on an idle machine and minutes on a loaded one, and a rank
        that dies right after each restart must count as dying three times in a row however
        slowly the restarts go."""
        now = time.monotonic() - self._recovering_s
        self._failures = [t for t in self._failures if now - t < 60] + [now]
        # The tokens still out died with the ranks; the requests go on from what came back.
        for req in itertools.chain(self.running, self.waiting):
            req.drop_pending()
        self._submitted = None
        if self.spec is not None:
            self.spec.forget()
        # The KV cache died with the ranks: nothing held in blocks can be trusted any more.
        # The running requests go first in line again, in their old order.
        self.scheduler.requeue_running()
        self.planner.reset_prefix_cache()
        self.grammar_sync.reset()  # new ranks hold no matchers
        if self.lora is not None:
            self.lora.reset()  # nor adapters
        if len(self._failures) >= MAX_FAILURES_PER_MINUTE:
            self.dead = str(failure)
            msg = (f"{len(self._failures)} worker failures within a minute; last: {failure}")
            outs = []
            for req in list(self.waiting):  # the running ones first, as they were requeued
                self._finish(req, "error", msg)
                outs.append(self.output(req.request_id))
            return outs
        t0 = time.monotonic()
        try:
            self.stats.last_recovery_s = self.executor.recover()
        finally:
            self._recovering_s += time.monotonic() - t0
        self.stats.recoveries += 1
        return []

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        req.drop_pending()
        if self.spec is not None:
            self.spec.finished(req)
        if req.grammar is not None:
            self.grammar_sync.drop(req.request_id)
        self.scheduler.remove(req)

    # -- batch API ----------------------------------------------------------------------------
    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None) per prompt, as vLLM's."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        ids = [self.add_request(p, sp, lora_request=lr) for p, sp, lr in zip(prompts, params, loras)]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(sp.max_tokens for sp in params), desc="generate", unit="tok")
        while any(not self.requests[i].finished for i in ids):
            new = self.step()
            if bar is not None:
                bar.update(len(new))
        if bar is not None:
            bar.close()
        outs = [self.output(i) for i in ids]
        for i in ids:
            self.release(i)  # a long-lived engine must not keep every finished request
        return outs

    def output(self, request_id: str, new_token_ids: list[int] | None = None,
               new_logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        r = self.requests[request_id]
        asked = r.logprobs is not None
        return RequestOutput(r.request_id, r.prompt_token_ids, r.output_token_ids,
                             new_token_ids or [], r.finished, r.finish_reason, r.error,
                             new_logprobs=(new_logprobs or []) if asked else None,
                             logprobs=list(r.logprobs) if asked else None,
                             num_cached_tokens=r.num_cached_tokens or 0,
                             prompt_logprobs=None if r.prompt_logprobs is None else list(r.prompt_logprobs))

    def release(self, request_id: str) -> None:
        """Forget a finished request (servers call this once the client has its result)."""
        if self.requests.get(request_id) is not None and self.requests[request_id].finished:
            del self.requests[request_id]

    def shutdown(self) -> None:
        self.executor.shutdown()
