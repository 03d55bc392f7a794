"""The driver's handle on one model replica: a placement group, one actor per TP rank, one message
per step.

The step is ``ray.put`` once and the same ref goes to every rank (no RPC per layer, ever).  The
steady-state loop can instead run through a Ray compiled graph, whose shared-memory channel also
writes the input once for all readers; the classic actor call is the simple path and the fallback.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.util.placement_group import placement_group as reserve_placement_group
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_attn.config import EngineConfig
from ray_attn.runtime import messages, rank_pool
from ray_attn.runtime.messages import StepInput, StepOutput
from ray_attn.runtime.worker import AttentionWorker

log = logging.getLogger(__name__)
PG_TIMEOUT_S = 120
# Ranks that do not start, join the group or load within this long raise instead of leaving the
# driver in an unbounded ray.get: spawning an actor takes seconds on an idle machine and
# minutes on a loaded one, so the bound is generous.
STARTUP_TIMEOUT_S = 900


class WorkerFailure(RuntimeError):
    """A rank died or its step failed; the cluster can ``recover()`` and the engine recompute."""

    def __init__(self, rank: int, cause: BaseException):
        self.rank, self.cause = rank, cause
        super().__init__(f"rank {rank} failed: {type(cause).__name__}: {cause}")


LOCAL_START_ATTEMPTS = 3


def init_local_ray(**kwargs) -> None:
    """``ray.init(address="local", **kwargs)``: a new cluster of our own, tried again when its node
    times out at start.  Ray gives a starting raylet a fixed 30 s to register with the GCS (not a
    setting in Ray 2.60); beside a CPU hog on two cores that is sometimes not enough, and
    ``ray.init`` raises "The current node timed out during startup" with nothing else at fault,
    so the start is tried again after shutting down what the failed one left."""
    for attempt in range(LOCAL_START_ATTEMPTS):
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as e:  # noqa: BLE001 -- Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == LOCAL_START_ATTEMPTS - 1:
                raise
            ray.shutdown()


def ensure_ray(address: str | None = None, min_cpus: int = 0) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``) if given, else start an embedded local cluster."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # Logical CPUs only gate scheduling; CPU ranks share the cores anyway, so ask for enough
        # slots that a TP group fits on a small machine.  address="local": a new cluster of our
        # own -- without it Ray joins whatever cluster another user started on this machine
        # (and refuses num_cpus there).
        init_local_ray(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=True)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


def worker_bundle(config: EngineConfig, use_gpu: bool) -> dict:
    """The resources of one rank's placement-group bundle."""
    return {"CPU": config.parallel.num_cpus_per_worker, **({"GPU": 1} if use_gpu else {})}


class AttentionCluster:
    """One model replica's ranks.

    By default it reserves its own STRICT_PACK placement group, a bundle per rank.  Under Ray
    Serve, pass ``placement_group=`` the replica's own group (``bundle_offset=1`` skips the
    replica's bundle) so that the replica and its GPUs come and go together.
    """

    step_timeout_s = 300.0  # a step longer than this is treated as a hung rank
    worker_cls = AttentionWorker  # benchmarks swap in a worker with a stub model

    def __init__(self, config: EngineConfig, placement_group=None, bundle_offset: int = 0,
                 use_gpu: bool | None = None):
        self.config = config
        self.tp = config.parallel.tensor_parallel_size
        cpus = config.parallel.num_cpus_per_worker
        ensure_ray(config.parallel.ray_address, min_cpus=int(self.tp * cpus) + 2)
        want = config.parallel.device
        if use_gpu is None:
            use_gpu = want == "cuda" or (want == "auto" and cluster_has_gpus())
        self.use_gpu = use_gpu
        self.bundle_offset = bundle_offset
        self.owns_pg = placement_group is None
        self._remote_cls = ray.remote(self.worker_cls)
        warm = rank_pool.take(self) if self.owns_pg else None  # a test run's parked ranks (rank_pool.py)
        if warm is not None:
            placement_group, self.workers = warm
        elif self.owns_pg:
            gpus = ray.cluster_resources().get("GPU", 0)
            if self.use_gpu and gpus < self.tp:
                # Fail now: the placement group would wait PG_TIMEOUT_S for GPUs that do not exist.
                raise RuntimeError(f"parallel.device='cuda' needs {self.tp} GPU(s) (one per rank), but the "
                                   f"Ray cluster has {gpus:g}; use device='cpu' or 'auto', or join a GPU cluster")
            bundle = worker_bundle(config, self.use_gpu)
            placement_group = reserve_placement_group([dict(bundle) for _ in range(self.tp)],
                                                           strategy="STRICT_PACK")
            try:
                ray.get(placement_group.ready(), timeout=PG_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(placement_group)
                raise RuntimeError(f"could not reserve {self.tp} bundles of {bundle} on one node "
                                   f"within {PG_TIMEOUT_S}s; cluster has {ray.cluster_resources()}") from None
        self.pg = placement_group
        self._compiled = None
        if warm is None:
            self.workers = [self._spawn(r) for r in range(self.tp)]
        try:
            self._form_group()
            self.infos = self._load()
        except BaseException:
            self.shutdown()  # no ranks or bundles left behind by a cluster that never came up
            raise
        self.num_blocks = min(i["num_blocks"] for i in self.infos)
        self.num_puts = 0
        self.restarts = 0
        self.last_recovery_s = None
        if config.parallel.use_compiled_graph:
            self.compile()

    def _spawn(self, rank: int):
        strategy = PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=self.bundle_offset + rank)
        opts = dict(num_cpus=self.config.parallel.num_cpus_per_worker, scheduling_strategy=strategy,
                    max_concurrency=2)  # a health ping must not queue behind a long step
        if self.use_gpu:
            opts["num_gpus"] = 1
        return self._remote_cls.options(**opts).remote(self.config.model_dump(), rank)

    def _form_group(self) -> None:
        host, port = self._startup(self.workers[0].address.remote(), "start")
        self._startup([w.init_distributed.remote(host, port) for w in self.workers], "join the TP group")

    def _load(self) -> list[dict]:
        return self._startup([w.load_model.remote() for w in self.workers], "load the model")

    def _startup(self, refs, what: str):
        try:
            return ray.get(refs, timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the {self.tp} rank(s) did not {what} within {STARTUP_TIMEOUT_S}s; "
                               f"cluster resources: {ray.available_resources()}") from None

    # -- steps --------------------------------------------------------------------------------
    def step(self, step: StepInput) -> StepOutput:
        msg = messages.dumps(step)
        if self._compiled is not None:
            try:
                return messages.loads(ray.get(self._compiled.execute(msg), timeout=self.step_timeout_s)[0])
            except Exception as e:  # a dead actor surfaces as one of several Ray error types
                raise WorkerFailure(-1, e) from e
        ref = ray.put(msg)
        self.num_puts += 1
        refs = [w.execute_step.remote([ref]) for w in self.workers]
        return messages.loads(self._gather(refs)[0])

    def _gather(self, refs: list, timeout: float | None = None) -> list:
        """Results of every rank, failing fast: a dead rank raises as soon as Ray knows, rather
        than after the survivors time out in a collective that will never complete."""
        timeout = self.step_timeout_s if timeout is None else timeout
        index = {r: i for i, r in enumerate(refs)}
        pending, results = list(refs), [None] * len(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                raise WorkerFailure(-1, TimeoutError(f"no rank answered within {timeout}s"))
            for r in ready:
                try:
                    results[index[r]] = ray.get(r)
                except Exception as e:
                    raise WorkerFailure(index[r], e) from e
        return results

    def recover(self) -> float:
        """Replace every rank in its own bundle and re-form the collective group.

        All ranks are restarted, not only the dead one: the survivors may be blocked in a
        collective with it, and their KV shards are useless without its heads anyway.  The engine
        rebuilds the KV cache by recomputing its requests.  Returns the seconds it took."""
        t0 = time.perf_counter()
        was_compiled = self._compiled is not None
        if was_compiled:
            try:
                self._compiled.teardown()
            except Exception:  # a graph with a dead actor may not tear down cleanly
                pass
            self._compiled = None
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = [self._spawn(r) for r in range(self.tp)]
        self._form_group()
        self.infos = self._load()
        if was_compiled:
            self.compile()
        self.restarts += 1
        self.last_recovery_s = time.perf_counter() - t0
        log.warning("recovered %d ranks in %.1fs", self.tp, self.last_recovery_s)
        return self.last_recovery_s

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise WorkerFailure if any rank does not answer a ping (used by Serve's health check)."""
        if self._compiled is not None:
            return  # compiled-graph actors run a loop; a dead one surfaces on the next step
        self._gather([w.ping.remote() for w in self.workers], timeout)

    def compile(self) -> None:
        """Switch the steady-state loop to a compiled graph (one shared-memory write per step)."""
        from ray.dag import InputNode, MultiOutputNode

        if self._compiled is not None:
            return
        with InputNode() as inp:
            dag = MultiOutputNode([w.execute_step.bind(inp) for w in self.workers])
        self._compiled = dag.experimental_compile()

    def uncompile(self) -> None:
        if self._compiled is not None:
            self._compiled.teardown()
            self._compiled = None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    # -- facts and lifetime -------------------------------------------------------------------
    @property
    def num_sms(self) -> int | None:
        sms = [i["num_sms"] for i in self.infos if i.get("num_sms")]
        return min(sms) if sms else None

    @property
    def kernel_name(self) -> str:
        return self.infos[0]["kernel"]

    def call_all(self, method: str, *args, timeout: float | None = None):
        """A classic call on every rank (tests and diagnostics; never per layer)."""
        return ray.get([getattr(w, method).remote(*args) for w in self.workers], timeout=timeout)

    def shutdown(self) -> None:
        self.uncompile()
        if rank_pool.park(self):  # kept for the next cluster of this shape (off unless a test run asks)
            self.workers = []
            return
        for w in self.workers:
            ray.kill(w)
        if self.owns_pg:
            remove_placement_group(self.pg)
        self.workers = []


class InProcessExecutor:
    """The same interface as AttentionCluster, in the driver's process, TP=1, no Ray."""

    worker_cls = AttentionWorker

    def __init__(self, config: EngineConfig):
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("InProcessExecutor runs tensor_parallel_size=1 only, got "
                             f"{config.parallel.tensor_parallel_size}")
        self.config = config
        self.worker = self.worker_cls(config, 0)
        self.worker.sample_on_thread = False  # see AttentionWorker.sample_on_thread
        self.infos = [self.worker.load_model()]
        self.num_blocks = self.infos[0]["num_blocks"]
        self.num_sms = self.infos[0]["num_sms"]
        self.kernel_name = self.infos[0]["kernel"]
        self.compiled = False

    def step(self, step: StepInput) -> StepOutput:
        return self.worker.execute_step(step)

    def shutdown(self) -> None:
        if self.worker is not None and self.worker.lora is not None:
            self.worker.lora.close()  # its adapter reader process
        self.worker = None
