"""N engine replicas as Ray actors, for batch generation over many engines.

Each replica is one actor owning one ``LLMEngine`` driven by an ``EngineLoop`` thread (continuous
batching, as in a Serve replica), in its own ``STRICT_PACK`` placement group: bundle 0 holds the
actor, bundles 1..tp its TP rank actors (``executor='ray'``), or the actor alone runs TP=1
(``executor='in_process'``).  The driver keeps at most ``max_in_flight`` requests on each replica,
sends the next one to the replica with the fewest, and hands every result over as it finishes.

Why an actor pool and not Ray Data's ``map_batches``: a callable class there gets one batch per
call and returns when the whole batch is done, so an engine idles on each batch's tail instead of
admitting the next requests as slots free up, and results surface a batch at a time rather than
one by one (the batch job writes each record as it finishes, so that a crash loses nothing).
Ray Data would also not see the placement groups its actors reserve for their TP ranks, and it
brings pyarrow and pandas into the install.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_attn.config import EngineConfig
from ray_attn.runtime.cluster import worker_bundle

PG_TIMEOUT_S = 120.0


class EngineReplica:
    """One engine (+ its TP ranks in this actor's placement group), fed through an EngineLoop."""

    def __init__(self, config: dict, executor: str, use_gpu: bool, max_in_flight: int):
        from ray_attn.engine import LLMEngine
        from ray_attn.serve.loop import EngineLoop

        cfg = EngineConfig.model_validate(config)
        if executor == "in_process":
            from ray_attn.runtime import InProcessExecutor

            self.executor = InProcessExecutor(cfg)
        else:
            from ray_attn.runtime import AttentionCluster

            self.executor = AttentionCluster(cfg, placement_group=ray.util.get_current_placement_group(),
                                             bundle_offset=1, use_gpu=use_gpu)
        self.engine = LLMEngine(cfg, self.executor)
        self.loop = EngineLoop(self.engine, max_in_flight).start()

    def ready(self) -> int:
        return self.executor.num_blocks

    async def generate(self, prompt_token_ids: list[int], params, lora_request=None) -> dict:
        from ray_attn.serve.loop import AsyncioSink, current_lora

        sink = AsyncioSink()
        current_lora.set(lora_request)  # read by submit (this call's own context)
        self.loop.submit(prompt_token_ids, params, sink)
        tokens, ev = [], await sink.get()
        if ev.kind in ("rejected", "failed"):
            return {"token_ids": [], "finish_reason": "error", "error": ev.error}
        while not ev.finished:
            ev = await sink.get()
            tokens += ev.token_ids
        return {"token_ids": tokens, "finish_reason": ev.finish_reason or "error", "error": ev.error}

    def stats(self) -> dict:
        return self.loop.stats()

    def shutdown(self) -> None:
        self.loop.stop()
        self.executor.shutdown()


class EnginePool:
    """``num_replicas`` EngineReplica actors, each in its own placement group."""

    def __init__(self, config: EngineConfig, num_replicas: int, executor: str = "ray",
                 replica_num_cpus: float = 0.5, use_gpu: Optional[bool] = None, max_in_flight: int = 64,
                 replica_resource: Optional[str] = None):
        if num_replicas < 1:
            raise ValueError(f"num_replicas: must be >= 1, got {num_replicas}")
        if executor not in ("ray", "in_process"):
            raise ValueError(f"executor: 'ray' or 'in_process', got {executor!r}")
        tp = config.parallel.tensor_parallel_size
        if executor == "in_process" and tp != 1:
            raise ValueError(f"executor='in_process' runs tensor_parallel_size=1 only, got {tp}")
        if use_gpu is None:
            want = config.parallel.device
            use_gpu = want == "cuda" or (want == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        self.max_in_flight = max_in_flight
        self.lost: list[str] = []  # replicas lost during run(), and why
        own = {"CPU": replica_num_cpus, **({"GPU": 1} if use_gpu and executor == "in_process" else {})}
        bundles = [own] + [worker_bundle(config, use_gpu) for _ in range(tp if executor == "ray" else 0)]
        if replica_resource:  # one unit per replica: a node's amount caps the replicas it holds
            bundles[0] = dict(own, **{replica_resource: 1})
        self.pgs = [placement_group([dict(b) for b in bundles], strategy="STRICT_PACK")
                    for _ in range(num_replicas)]
        self.actors: list = []
        try:
            try:
                ray.get([pg.ready() for pg in self.pgs], timeout=PG_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"could not reserve {num_replicas} placement groups of {bundles} "
                                   f"within {PG_TIMEOUT_S:.0f}s; cluster has "
                                   f"{ray.cluster_resources()}") from None
            cls = ray.remote(EngineReplica)
            self.actors = [cls.options(
                num_cpus=own["CPU"], num_gpus=own.get("GPU", 0), max_concurrency=max_in_flight + 4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(config.model_dump(mode="json"), executor, use_gpu, max_in_flight) for pg in self.pgs]
            self.num_blocks = ray.get([a.ready.remote() for a in self.actors])
            self.alive = [True] * len(self.actors)
        except BaseException:
            self.shutdown()
            raise

    def run(self, items: Iterable[tuple], on_done: Callable[[object, dict], None]) -> None:
        """Generate ``(key, prompt_token_ids, SamplingParams[, LoRARequest])`` items; ``on_done(key, result)`` is
        called on this thread as each finishes, once per key.

        A replica that dies (its process, its node) takes none of the work with it: its
        unfinished items go to the replicas left, and the run goes on; what it had finished
        was handed over already.  Only when no replica is left does it raise."""
        todo: Iterator[tuple] = iter(items)
        retry: list[tuple] = []  # items of a lost replica, sent again first
        busy = [0] * len(self.actors)
        alive = self.alive
        refs: dict = {}  # ObjectRef -> (replica index, item)
        exhausted = False
        while True:
            while any(alive) and min(b for b, a in zip(busy, alive) if a) < self.max_in_flight:
                item = retry.pop() if retry else (None if exhausted else next(todo, None))
                if item is None:
                    exhausted = True
                    break
                i = min((b, j) for j, (b, a) in enumerate(zip(busy, alive)) if a)[1]
                refs[self.actors[i].generate.remote(*item[1:])] = (i, item)
                busy[i] += 1
            if not refs:
                if retry or not exhausted:
                    raise RuntimeError(f"every engine replica was lost; {len(retry)} requests unfinished")
                return
            ray.wait(list(refs), num_returns=1, timeout=None)
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)  # all that are ready
            for ref in done:
                i, item = refs.pop(ref)
                busy[i] -= 1
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # died, or unavailable with its node
                    if alive[i]:
                        alive[i] = False
                        self.lost.append(f"replica {i}: {type(e).__name__}")
                    retry.append(item)
                    continue
                on_done(item[0], result)

    def stats(self) -> list[dict]:
        """Each live replica's loop stats (a lost one has none)."""
        return ray.get([a.stats.remote() for a, ok in zip(self.actors, self.alive) if ok], timeout=30)

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - best effort: the actor may be dead already
                pass
            ray.kill(a)
        self.actors = []
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []


__all__ = ["EnginePool", "EngineReplica"]
