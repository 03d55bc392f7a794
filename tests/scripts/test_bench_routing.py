"""scripts/bench_routing.py at a tiny size: both routers on fresh replicas, figures read back.

With one client the requests go one at a time, so the prefix-aware router's outcome is exact:
each prefix is missed once, on the replica that first gets it, and found by every later request
(no eviction at this size, no imbalance with one request in flight)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_prefix_aware_finds_every_repeated_prefix_and_default_at_most_as_many(tmp_path, shared_ray):
    """The script's main on the run's Ray (``shared_ray``: metrics every second, as the script
    starts its own), which it leaves up; a subprocess would start a Ray first (~10 s)."""
    import ray

    from scripts import bench_routing

    out = tmp_path / "routing.json"
    requests, prefixes, blocks, block_size = 12, 2, 2, 16
    argv = ["--requests", str(requests), "--clients", "1", "--prefixes", str(prefixes), "--prefix-blocks",
            str(blocks), "--tail-tokens", "8", "--max-tokens", "2", "--num-blocks", "0", "--out", str(out)]
    assert bench_routing.main(argv) == 0
    assert ray.is_initialized()
    report = json.loads(out.read_text())
    rows = {row["router"]: row for row in report["rows"]}
    assert set(rows) == {"default", "prefix_aware"}
    ideal = (requests - prefixes) * blocks * block_size
    for row in rows.values():
        assert row["completed"] == requests and not row["errors"]
        assert sum(v["requests"] for v in row["per_replica"].values()) == requests
        assert 0 <= row["prefix_cache_hits"] <= row["prefix_cache_queries"]
        assert row["prefix_cache_hit_rate"] == round(row["prefix_cache_hits"] / row["prefix_cache_queries"], 4)
    assert rows["prefix_aware"]["prefix_cache_hits"] == ideal
    assert rows["default"]["prefix_cache_hits"] <= ideal
    assert report["workload"]["requests"] == requests and report["replicas"] == 2
