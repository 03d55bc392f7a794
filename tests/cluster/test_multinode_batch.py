"""Batch generation over several nodes (``EnginePool``, as ``scripts/batch_generate.py
--replicas N --replica-resource NAME`` runs it): the engines spread one per node, and removing a
node mid-run still hands over every record exactly once, with the tokens a single engine gives."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import REPLICA_RESOURCE
from tests.serve.helpers import engine_config
from tests.timescale import scaled

pytestmark = pytest.mark.slow


def items(n: int = 24):
    from ray_attn.engine import SamplingParams

    out = []
    for i in range(n):
        params = SamplingParams(max_tokens=40, ignore_eos=True, **({"temperature": 1.0, "seed": i} if i % 2 else {}))
        out.append((f"r{i}", [(5 * i + k) % 500 + 3 for k in range(12)], params))
    return out


def test_a_node_lost_mid_run_loses_and_repeats_no_record(sim_cluster, time_limit):
    import ray

    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor
    from ray_attn.serve.engine_pool import EnginePool

    time_limit(scaled(400))
    cfg = engine_config(tp=1, max_num_seqs=4)
    ref_engine = LLMEngine(cfg, InProcessExecutor(cfg))
    want = {key: o.output_token_ids for (key, _, _), o in zip(
        items(), ref_engine.generate([p for _, p, _ in items()], [sp for _, _, sp in items()]))}

    sim = sim_cluster.get(workers=2)
    pool = None
    try:
        pool = EnginePool(cfg, 2, executor="in_process", replica_num_cpus=1.0, max_in_flight=3,
                          replica_resource=REPLICA_RESOURCE)
        actors = {a["ActorID"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                  if a["State"] == "ALIVE" and a["ActorClassName"] == "EngineReplica"}
        assert len(set(actors.values())) == 2, f"both engines on one node: {actors}"
        got: dict[str, list] = {}
        order: list[str] = []

        def on_done(key, result):
            order.append(key)
            got.setdefault(key, []).append(result)
            if len(order) == 6:  # a third of the way: one node goes, with its engine
                sim.remove(sim.workers[0])

        pool.run(iter(items()), on_done)
        assert pool.lost and len(pool.lost) == 1, pool.lost
        assert sorted(order) == sorted(want), "a record lost or written twice"
        for key, results in got.items():
            (r,) = results
            assert r["finish_reason"] == "length" and r["token_ids"] == want[key], key
        assert len(pool.stats()) == 1
    finally:
        if pool is not None:
            pool.shutdown()
