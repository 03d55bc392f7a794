"""Warm rank actors kept between the engines of one driver, for a driver that starts many (the
test suite); off unless ``enabled`` is set.

Starting a rank is a fresh Ray worker process importing torch and our model code: 1-2 s on two
cores, 4 on a slow day, and a test run starts some 60 TP groups one after another -- the largest
single wait of the whole run (``AttentionCluster._form_group``, measured with py-spy).  With the
pool on, a cluster that shuts down cleanly parks its ranks in their placement group instead of
killing them, and the next cluster of the same shape takes them and resets each in place
(``AttentionWorker.reset``): the process, its imports and its bundle are kept, nothing of the
last engine is.  It re-forms its TP group and loads its model as a new cluster does.

A parked group holds CPUs (or GPUs) that the next engine, a Serve replica or a script beside it
may need, so at most three quarters of the cluster's CPUs are parked, the oldest group goes
first, and a cluster that would not fit beside the parked groups drains them before reserving
its own bundles.  A server never turns it on: its ranks end with their engine.
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import remove_placement_group

log = logging.getLogger(__name__)

enabled = False  # set by the driver that wants it (tests/conftest.py); never read from the environment
PING_TIMEOUT_S = 30.0  # a parked rank that does not answer within this is killed, not reused
# At most this share of the cluster's CPUs is parked (a TP=4 and a TP=2 group of the tests' 8), and
# a cluster that would not fit beside what is parked drains the oldest first: others need the rest.
MAX_PARKED_SHARE = 0.75

_parked: list[tuple[tuple, object, list, float]] = []  # (key, placement group, workers, CPUs), oldest first


def key(cluster) -> tuple:
    """What two clusters must share for one to take the other's ranks: the Ray session (a handle
    is worthless in another), the worker class, the group's size and each rank's bundle."""
    p = cluster.config.parallel
    return (ray.get_runtime_context().get_job_id(), cluster.worker_cls, cluster.tp, p.num_cpus_per_worker,
            cluster.use_gpu)


def poolable(cluster) -> bool:
    """Only a plain cluster's ranks are parked: one that reserved its own bundles, loaded, and
    holds no adapter reader or host-tier threads (``reset`` would have to stop them)."""
    c = cluster.config
    return (enabled and cluster.owns_pg and getattr(cluster, "infos", None) is not None
            and c.lora_config is None and not (c.cache.host_cache_gib or c.cache.kv_sharing))


def _cpus(cluster) -> float:
    return cluster.tp * cluster.config.parallel.num_cpus_per_worker


def take(cluster) -> tuple[object, list] | None:
    """Parked (placement group, workers) of ``cluster``'s shape, every rank alive and reset to its
    config; None when none is parked (older groups are drained until the new one's bundles fit)."""
    if not enabled or not _parked:
        return None
    k = key(cluster)
    for i, (pk, pg, workers, _) in enumerate(_parked):
        if pk == k:
            del _parked[i]
            config = cluster.config.model_dump()
            try:
                ray.get([w.reset.remote(config, rank) for rank, w in enumerate(workers)], timeout=PING_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 -- a dead or stuck rank: start afresh
                log.warning("parked ranks could not be reset (%s); starting new ones", e)
                _kill(pg, workers)
                return None
            return pg, workers
    # Ray's view of free resources catches up with a removed group only later, so what each
    # drained group gives back is counted here: only as many go as the new bundles need.
    need = _cpus(cluster) + 1  # and a CPU for whatever else the caller starts
    free = ray.available_resources().get("CPU", 0)
    while _parked and free < need:
        _, pg, workers, cpus = _parked.pop(0)
        _kill(pg, workers)
        free += cpus
    return None


def park(cluster) -> bool:
    """Keep ``cluster``'s ranks and bundles for the next cluster of its shape; False (and nothing
    kept) when it is not poolable or a rank does not answer."""
    if not poolable(cluster):
        return False
    try:
        ray.get([w.ping.remote() for w in cluster.workers], timeout=PING_TIMEOUT_S)
    except Exception:  # noqa: BLE001 -- a rank died under the engine: nothing worth keeping
        return False
    _parked.append((key(cluster), cluster.pg, list(cluster.workers), _cpus(cluster)))
    limit = MAX_PARKED_SHARE * ray.cluster_resources().get("CPU", 0)
    while len(_parked) > 1 and sum(c for *_, c in _parked) > limit:
        _kill(*_parked.pop(0)[1:3])
    return True


def drain() -> None:
    """Kill what is parked and give its bundles back."""
    while _parked:
        _kill(*_parked.pop(0)[1:3])


def _kill(pg, workers) -> None:
    for w in workers:
        try:
            ray.kill(w)
        except Exception:  # noqa: BLE001 -- already gone, or Ray shut down under us
            pass
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001
        pass
