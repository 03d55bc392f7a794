"""Speculative decoding served: ``ray-attn serve --speculative-config`` and the app config take it,
the served tokens are the non-speculative server's, and ``/metrics`` and ``/stats`` report the
engine's counters (vLLM's ``spec_decode_*`` names, accepted tokens by position).  Through the
in-process app harness (one TP=1 engine per config, about a second each)."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from tests.serve.app_harness import base_config, client, in_replica, served_app

__all__ = ["in_replica"]

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
# prompts that repeat: the random model continues them with repeats often enough that drafts get
# accepted, and rejected (the test checks both happen)
PROMPTS = [[11, 12, 13, 14, 15, 16] * 4, [40, 41, 42, 43] * 5, [7, 300, 9, 301, 11, 302] * 3]


def cli_config(*argv):
    from ray_attn.serve.cli import add_arguments, serve_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    return serve_config(p.parse_args(list(argv)))


def test_the_cli_flag_reaches_the_engine_config():
    cfg = cli_config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    spec = cfg.engine.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_bounds) == ("ngram", 5, (4, 4))
    assert cli_config().engine.speculative_config is None


def test_the_cli_flag_takes_a_draft_model_checkpoint(tmp_path):
    from ray_attn.config import ModelConfig
    from ray_attn.model.registry import save_random_checkpoint

    draft = ModelConfig(vocab_size=cli_config().engine.model.vocab_size, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    save_random_checkpoint(draft, str(tmp_path), seed=3)
    cfg = cli_config("--speculative-config", json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                                                          "model": str(tmp_path)}))
    spec = cfg.engine.speculative_config
    assert spec.method == "draft_model" and spec.draft_config().hidden_size == 64
    with pytest.raises(ValueError, match="speculative_config.model='/no/such/draft'"):
        cli_config("--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3, '
                                           '"model": "/no/such/draft"}')


@pytest.mark.parametrize("text, names", [
    ('{"num_speculative_tokens": 4', "--speculative-config: not JSON"),
    ("[4]", "expected a JSON object, got list"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens=0 is out of range"),
    ('{"num_speculative_tokens": 2, "lookahead": 3}', "lookahead"),
])
def test_a_bad_flag_is_refused_naming_the_field(text, names):
    with pytest.raises(ValueError, match=re.escape(names)):
        cli_config("--speculative-config", text)


def test_the_app_config_takes_it():
    from ray_attn.serve.schemas import ServeAppConfig

    cfg = ServeAppConfig.model_validate(base_config(engine=spec_engine()))
    assert cfg.engine.speculative_config.num_speculative_tokens == 3


def spec_engine() -> dict:
    return base_config()["engine"] | {"speculative_config": SPEC}


def metric_values(text: str, name: str) -> dict[str, float]:
    """{labels: value} of the samples of counter ``name`` in a Prometheus text."""
    out = {}
    for ln in text.splitlines():
        m = re.fullmatch(rf"{name}_total(\{{.*\}}) (\S+)", ln)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def generate(c, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        r = c.post("/v1/generate", json={"prompt_token_ids": p, "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["token_ids"])
    return out


def test_served_speculation_gives_the_plain_servers_tokens_and_reports_its_counters(in_replica):
    plain = served_app()
    in_replica(plain)
    with client() as c:
        want = generate(c, PROMPTS)
        assert c.get("/stats").json()["spec_decode_num_drafts"] == 0
    srv = in_replica(served_app(engine=spec_engine()))
    with client() as c:
        assert generate(c, PROMPTS) == want
        stats = c.get("/stats").json()
        text = c.get("/metrics").text
    est = srv.engine.stats
    assert est.spec_num_accepted_tokens > 0 and est.spec_num_draft_tokens > est.spec_num_accepted_tokens, est
    assert stats["spec_decode_num_drafts"] == est.spec_num_drafts
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == est.spec_num_accepted_tokens_per_pos
    assert stats["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + est.spec_num_accepted_tokens / est.spec_num_drafts)
    rep = '{replica="test-replica"}'
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert metric_values(text, f"ray_attn_spec_decode_{key}") == {rep: getattr(est, f"spec_{key}")}, key
    per_pos = metric_values(text, "ray_attn_spec_decode_num_accepted_tokens_per_pos")
    assert per_pos == {f'{{replica="test-replica",position="{j}"}}': n
                       for j, n in enumerate(est.spec_num_accepted_tokens_per_pos) if n}
    assert sum(per_pos.values()) == est.spec_num_accepted_tokens
