"""The prefix-aware front under LoRA (``serve/ingress.py``): a prompt's block hashes are chained
from its adapter's root and led by it, so equal prompts of two adapters never match each other's
blocks, and a replica that served an adapter matches its requests even when their prompts share
nothing (the router's ``PrefixIndex`` then prefers it)."""

from __future__ import annotations

import json

from ray_attn.serve.ingress import adapter_of, prefix_block_hashes
from ray_attn.serve.router import PrefixIndex

BASE = "served"


def hashes(model, prompt, block_size=4):
    return prefix_block_hashes(json.dumps({"model": model, "prompt": prompt}).encode(), block_size, BASE)


def test_adapter_names():
    body = lambda m: json.dumps({"model": m}).encode()  # noqa: E731
    assert adapter_of(body("served:a"), BASE) == "a" and adapter_of(body("a"), BASE) == "a"
    assert adapter_of(body(BASE), BASE) is None and adapter_of(body("other:a"), BASE) is None
    assert adapter_of(body("a"), None) is None  # a front with no adapters configured


def test_equal_prompts_of_two_adapters_never_share_blocks():
    p = list(range(12))
    a, b, base = hashes("served:a", p), hashes("a", p), hashes(BASE, p)
    assert a == b and len(a) == 4 and len(base) == 3  # the adapter's lead, then 3 blocks
    assert not set(hashes("served:c", p)) & set(a) and not set(base) & set(a)
    assert base == prefix_block_hashes(json.dumps({"model": BASE, "prompt": p}).encode(), 4)  # as before


def test_the_replica_that_served_an_adapter_is_preferred_for_it():
    index = PrefixIndex(64)
    index.record("r1", hashes("served:a", list(range(8))))
    index.record("r2", hashes(BASE, list(range(8))))
    other_prompt = hashes("served:a", [50, 51])  # no full block: only the adapter's lead
    assert index.match("r1", other_prompt) == 1 and index.match("r2", other_prompt) == 0
    assert index.match("r1", hashes(BASE, list(range(8)))) == 0  # and the base's blocks stay the base's
