"""The replica's Prometheus hooks (ray_attn/serve/metrics.py) fed from loop snapshots, without Serve."""

from __future__ import annotations

from types import SimpleNamespace

from ray_attn.serve.loop import kv_tier_stats
from ray_attn.serve.metrics import RayMetricsHooks

BASE = dict(kv_usage=0.1, kv_blocks_used=3, queue_depth=0, running=0, tokens_per_s=0.0,
            prefix_cache_hits=10, prefix_cache_queries=20)


def rendered(hooks, *names):
    return sorted(ln for ln in hooks.registry.render().splitlines()
                  if not ln.startswith("#") and any(n in ln for n in names))


def test_kv_tier_counters_follow_the_snapshots_running_totals():
    planner = dict(prefix_cache_hits=160, host_hit_blocks=4, shared_hit_blocks=2, offloaded_blocks=5,
                   onloaded_blocks=4, published_blocks=7, fetched_blocks=2, host_tier_blocks=5)
    eng = SimpleNamespace(config=SimpleNamespace(cache=SimpleNamespace(block_size=16)),
                          executor=SimpleNamespace(infos=[{"kv_block_bytes": 1000}]),
                          stats=SimpleNamespace(kv_copy_s=0.25))
    snap = kv_tier_stats(planner, eng)
    assert snap["kv_hit_tokens_device"] == 160 - 6 * 16 and snap["kv_hit_tokens_shared"] == 32
    assert (snap["kv_offload_bytes"], snap["kv_publish_bytes"]) == (5000, 7000)
    hooks = RayMetricsHooks("r0", min_gauge_interval_s=0)
    hooks.on_snapshot(BASE | snap)
    hooks.on_snapshot(BASE | snap | {"kv_hit_tokens_host": 100, "kv_copy_s": 0.75})  # totals grew
    hooks.on_snapshot(BASE | snap | {"kv_hit_tokens_host": 100, "kv_copy_s": 0.75})  # and did not
    assert rendered(hooks, "kv_tier_hit", "kv_copy") == [
        'ray_attn_kv_copy_seconds_total{replica="r0"} 0.75',
        'ray_attn_kv_tier_hit_tokens_total{replica="r0",tier="device"} 64',
        'ray_attn_kv_tier_hit_tokens_total{replica="r0",tier="host"} 100',
        'ray_attn_kv_tier_hit_tokens_total{replica="r0",tier="shared"} 32']
    assert 'ray_attn_kv_tier_bytes_total{replica="r0",direction="fetch"} 2000' in rendered(hooks, "kv_tier_bytes")


def test_no_tier_counters_without_tiers():
    hooks = RayMetricsHooks("r0", min_gauge_interval_s=0)
    hooks.on_snapshot(dict(BASE))
    assert rendered(hooks, "kv_tier", "kv_copy") == []
