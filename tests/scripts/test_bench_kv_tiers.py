"""scripts/bench_kv_tiers.py at a tiny size on CPU, its main called here (no interpreter start and
imports per run; the share and breakeven parts on the run's Ray, ``shared_ray``, with a node store
of the script's own making, as in a Ray of its own): the JSON's shape,
greedy tokens identical between the runs of a part, and the tiers hit where they should be (the
device cache is capped below the working set, so the tier-off runs recompute what the tier-on
runs copy back or fetch).  The report renders the section from what the script wrote."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
from tests.timescale import wait_for

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--users", "6", "--turns", "2", "--doc-tokens", "64", "--question-tokens", "8", "--answer-tokens", "4",
        "--concurrency", "2", "--quiet"]


def run_script(out: Path, *args) -> str:
    """The script's main in this process (it returns 0 or raises); what it printed.  It sets
    torch's thread count (``--threads``, 1): this process's is put back after."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kv_tiers

    threads, text = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            assert bench_kv_tiers.main([*TINY, "--output", str(out), *args]) == 0
    except BaseException:
        print(text.getvalue()[-3000:])  # shown with the failure
        raise
    finally:
        torch.set_num_threads(threads)
    return text.getvalue()


def kill_node_store() -> None:
    """This node's KV store, if any, killed and forgotten: the next ``node_store`` call makes one
    with the caller's capacity (an earlier test's store would have its own; this one's would be
    found by a later test)."""
    import ray

    from ray_attn.runtime import kv_store

    name = kv_store.store_name(ray.get_runtime_context().get_node_id())
    kv_store.forget_store(name)
    try:
        ray.kill(ray.get_actor(name, namespace=kv_store.STORE_NAMESPACE))
    except ValueError:
        return

    def gone():
        try:
            ray.get_actor(name, namespace=kv_store.STORE_NAMESPACE)
        except ValueError:
            return True
        return False

    assert wait_for(gone, 30), f"store {name} still registered after ray.kill"


@pytest.fixture
def own_node_store(shared_ray):
    kill_node_store()
    yield
    kill_node_store()


def rows_of(data: dict, part: str) -> dict:
    return {r.get("run", r.get("blocks")): r for r in data["rows"] if r["part"] == part}


def test_host_and_copy_parts(tmp_path, monkeypatch):
    out = tmp_path / "kv.json"
    stdout = run_script(out, "--part", "host,copy", "--copy-blocks", "1,8", "--iters", "2", "--fit-repeats", "1")
    data = json.loads(out.read_text())
    assert set(data["parts"]) == {"host", "copy"} and data["machine"]["cpus"] >= 1
    h = data["parts"]["host"]
    assert h["tokens_identical"] and h["compared_requests"] == 12 and h["compared_tokens"] == 48
    assert "greedy tokens identical (12 requests, 48 tokens compared)" in stdout
    assert 2 <= h["working_set_over_cache"] <= 4 and h["fit_num_blocks"] >= h["working_set_blocks"]
    runs = rows_of(data, "host")
    assert set(runs) == {"capped, tier off", "capped, tier on", "fits, tier off", "fits, tier on"}
    for r in runs.values():
        assert r["requests"] == 12 and r["out_tok_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["hit_tokens"] == r["hit_tokens_device"] + r["hit_tokens_host"] + r["hit_tokens_shared"]
    off, on = runs["capped, tier off"], runs["capped, tier on"]
    # every turn's document left the device cache before the user came back: only the tier has it
    assert off["hit_tokens_host"] == 0 and off["offloaded_MB"] == 0
    assert on["hit_tokens_host"] >= 6 * 64 and on["onloaded_MB"] > 0 and on["offloaded_MB"] > 0 and on["copy_s"] > 0
    assert on["hit_tokens"] > off["hit_tokens"]
    assert runs["fits, tier on"]["hit_tokens_host"] == 0  # nothing evicted: the tier is idle
    assert h["fit_throughput_ratio"] > 0 and set(h["ttft_s"]) == {"capped, tier off", "capped, tier on"}
    assert all(len(v) == 12 for v in h["ttft_s"].values())
    copies = rows_of(data, "copy")
    assert set(copies) == {1, 8}
    for r in copies.values():
        for k in ("gather", "scatter", "offload", "onload"):
            assert r[f"{k}_GBps"] > 0 and r[f"{k}_frac_of_bare"] > 0
        assert r["bytes"] == r["blocks"] * data["parts"]["copy"]["block_bytes"]
    assert out.with_suffix(".png").stat().st_size > 10_000

    sys.path.insert(0, str(ROOT / "scripts"))
    import report

    monkeypatch.setattr(report, "R", tmp_path)
    (tmp_path / "bench_kv_tiers.json").write_text(out.read_text())
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        report.kv_tiers()
    assert "### KV tiers" in text.getvalue() and "| capped, tier on |" in text.getvalue()
    assert "Copies of n blocks" in text.getvalue()


@pytest.mark.slow
def test_share_and_breakeven_parts(tmp_path, own_node_store):
    """On the run's Ray (the stores are actors)."""
    out = tmp_path / "kv.json"
    stdout = run_script(out, "--part", "share,breakeven", "--share-min-tokens", "16",
                        "--breakeven-blocks", "1,4", "--reps", "1")
    data = json.loads(out.read_text())
    assert set(data["parts"]) == {"share", "breakeven"}
    sh = data["parts"]["share"]
    assert sh["tokens_identical"] and sh["compared_requests"] == 12
    runs = rows_of(data, "share")
    off, on = runs["sharing off"], runs["sharing on"]
    assert off["hit_tokens_shared"] == 0 and off["published_MB"] == 0
    # each later turn goes to the replica that did not compute the one before: only the store has it
    assert on["hit_tokens_shared"] > 0 and on["fetched_MB"] > 0 and on["published_MB"] > 0
    assert on["hit_rate"] > off["hit_rate"]
    be = rows_of(data, "breakeven")
    assert set(be) == {1, 4}
    for r in be.values():
        assert r["fetch_s"] >= r["lookup_s"] > 0 and r["get_s"] > 0 and r["prefill_ttft_s"] > 0
        assert r["fetched_ttft_s"] > 0 and r["tokens"] == 16 * r["blocks"]
    b = data["parts"]["breakeven"]
    assert b["measured_kv_share_min_tokens"] in (None, 16, 64)
    assert "[breakeven] fetching wins from" in stdout
    assert out.with_suffix(".png").stat().st_size > 10_000


def multiturn():
    sys.path.insert(0, str(ROOT / "scripts"))
    import multiturn

    return multiturn


def test_same_tokens_allows_a_fork_only_at_a_near_tie():
    """A user's conversation may fork where both runs' top two logprobs were within the margin;
    the turns after a fork are not compared (their history differs); a fork where either run was
    sure of its token fails, as does any difference with no gaps given (exact, as on CPU)."""
    same = multiturn().same_tokens
    x = {(0, 0): [1, 2, 3], (0, 1): [4, 5], (1, 0): [7, 8, 9], (1, 1): [6, 6]}
    y = {(0, 0): [1, 2, 9], (0, 1): [5, 5], (1, 0): [7, 8, 9], (1, 1): [6, 6]}
    gx = {k: [1.0] * len(v) for k, v in x.items()}
    gy = {k: [1.0] * len(v) for k, v in y.items()}
    gx[(0, 0)][2], gy[(0, 0)][2] = 0.01, 0.02  # user 0 forks at its third token, a near-tie
    c = same(x, y, "t", (gx, gy), 0.1)
    assert not c["tokens_identical"] and c["forks_at_near_ties"] and c["fork_gaps"] == [0.02]
    assert c["compared_requests"] == 3 and c["differing_requests"] == 1  # (0, 1) follows the fork
    gy[(0, 0)][2] = 0.5  # run y was sure of the token it chose: not rounding
    assert not same(x, y, "t", (gx, gy), 0.1)["forks_at_near_ties"]
    assert not same(x, y, "t")["forks_at_near_ties"]
    assert same(x, dict(x), "t")["tokens_identical"]


def test_tie_margin_reads_the_top_two_logprobs(tmp_path):
    """``--tie-margin`` asks each answer token's top two logprobs (the path the GPU default takes)."""
    out = tmp_path / "kv.json"
    stdout = run_script(out, "--part", "host", "--fit-repeats", "1", "--tie-margin", "0.1")
    h = json.loads(out.read_text())["parts"]["host"]
    assert h["forks_at_near_ties"] and h["tokens_identical"] and h["forks"] == 0
    assert "greedy tokens identical (12 requests, 48 tokens compared)" in stdout
