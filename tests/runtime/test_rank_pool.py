"""The warm rank pool (ray_attn/runtime/rank_pool.py): a cluster of the same shape takes the last
one's parked ranks -- the same actor processes -- and gives what fresh ranks give; a rank that
died is never parked; ``drain`` gives the bundles back; a cluster of another shape starts its own."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor, rank_pool
from tests.runtime.test_engine_tp import config
from tests.timescale import wait_for

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=8)


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 384, int(rng.integers(5, 40))).tolist() for _ in range(4)]


def tokens(cfg, executor=None) -> tuple[list[list[int]], list]:
    eng = LLMEngine(cfg, executor)
    try:
        outs = eng.generate(prompts(cfg.model.seed), GREEDY)
        ids = [w._actor_id.hex() for w in getattr(eng.executor, "workers", [])]
        return [o.output_token_ids for o in outs], ids
    finally:
        eng.shutdown()


@pytest.fixture
def pool(ray_local):
    rank_pool.drain()
    was, rank_pool.enabled = rank_pool.enabled, True
    yield rank_pool
    rank_pool.drain()
    rank_pool.enabled = was


def test_the_next_engine_of_the_shape_runs_on_the_parked_ranks_as_on_fresh_ones(pool):
    # another model (seed, layers) on the same ranks: nothing of the first may remain in them
    first, second = config(2, seed=11), config(2, seed=12, num_hidden_layers=2)
    _, ids = tokens(first)
    assert len(pool._parked) == 1
    warm, warm_ids = tokens(second)
    assert warm_ids == ids  # the same two actor processes, reset
    single = config(1, seed=12, num_hidden_layers=2)
    want, _ = tokens(single, InProcessExecutor(single))
    assert warm == want


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


def settled_free_cpus() -> float:
    """The cluster's free CPUs once two readings half a second apart agree (bundles are given
    back asynchronously)."""
    def same() -> bool:
        before = free_cpus()
        time.sleep(0.5)
        return free_cpus() == before

    wait_for(same, 30, every=0)
    return free_cpus()


def test_a_cluster_of_another_shape_starts_its_own_and_drain_frees_the_bundles(pool):
    cpus = settled_free_cpus()
    _, ids = tokens(config(2, seed=3))
    assert settled_free_cpus() == cpus - 2  # parked: its bundles stay reserved
    _, other = tokens(config(1, seed=3))
    assert not set(other) & set(ids)
    assert len(pool._parked) == 2 and settled_free_cpus() == cpus - 3
    pool.drain()
    assert not pool._parked
    wait_for(lambda: free_cpus() >= cpus, 30)
    assert free_cpus() == cpus


def test_a_cluster_whose_rank_died_is_not_parked(pool):
    eng = LLMEngine(config(2, seed=5))
    try:
        eng.generate(prompts(5), GREEDY)
        dead = eng.executor.workers[1]
        ray.kill(dead)
        # the kill lands asynchronously: a ping sent before it does is still answered
        assert wait_for(lambda: ray._private.state.actors(actor_id=dead._actor_id.hex())["State"] == "DEAD", 30)
    finally:
        eng.shutdown()
    assert not pool._parked


def test_off_by_default_nothing_is_parked(ray_local):
    rank_pool.drain()
    was, rank_pool.enabled = rank_pool.enabled, False
    try:
        tokens(config(2, seed=4))
        assert not rank_pool._parked
    finally:
        rank_pool.enabled = was
