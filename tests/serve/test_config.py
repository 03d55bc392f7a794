"""The app config, the shipped YAML files and the deployment options built from them (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from ray_attn.serve.app import build_app, deployment_options
from ray_attn.serve.schemas import GenerateRequest, ServeAppConfig, validation_errors

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def app_args(name: str) -> dict:
    data = yaml.safe_load((DEPLOY / name).read_text())
    (app,) = data["applications"]
    assert app["import_path"] == "ray_attn.serve.app:build_app"
    return data, app["args"]


def test_cpu_yaml_is_port_8000_and_fits_two_cores():
    data, args = app_args("serve_config.yaml")
    assert data["http_options"]["port"] == 8000
    cfg = ServeAppConfig.model_validate(args)
    opts = deployment_options(cfg)
    tp = cfg.engine.parallel.tensor_parallel_size
    assert tp == 2 and cfg.executor == "ray"
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}] + [{"CPU": 0.5}] * tp
    assert sum(b["CPU"] for b in opts["placement_group_bundles"]) <= 2
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}
    assert opts["max_ongoing_requests"] > cfg.max_in_flight  # room for /health and /stats
    assert build_app(args) is not None


def test_gpu_yaml_gives_each_rank_a_gpu():
    _, args = app_args("serve_config.gpu.yaml")
    cfg = ServeAppConfig.model_validate(args)
    opts = deployment_options(cfg)
    bundles = opts["placement_group_bundles"]
    assert bundles[0] == {"CPU": 1}
    assert bundles[1:] == [{"CPU": 2, "GPU": 1}] * cfg.engine.parallel.tensor_parallel_size
    assert opts["placement_group_strategy"] == "STRICT_PACK"


def test_in_process_executor_is_one_bundle():
    cfg = ServeAppConfig.model_validate({"executor": "in_process", "engine": {
        "parallel": {"tensor_parallel_size": 1, "device": "cpu"}}})
    opts = deployment_options(cfg)
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}]


@pytest.mark.parametrize("args,field", [
    ({"max_queue_depth": -1}, "max_queue_depth"),
    ({"max_body_bytes": 0}, "max_body_bytes"),
    ({"max_tokens_limt": 5}, "max_tokens_limt"),
    ({"executor": "in_process"}, "executor"),  # default engine is TP=2
    ({"engine": {"parallel": {"tensor_parallel_size": 3}}}, "tensor_parallel_size"),
])
def test_bad_app_config_names_the_field(args, field):
    with pytest.raises(ValidationError, match=field):
        ServeAppConfig.model_validate(args)


@pytest.mark.parametrize("body,field", [
    (b'{"prompt_token_ids": [1], "max_tokens": 1.5}', "max_tokens"),
    (b'{"prompt_token_ids": [1], "temperature": "hot"}', "temperature"),
    (b'{"prompt_token_ids": [1], "temperature": -1}', "temperature"),
    (b'{"prompt_token_ids": [1], "seed": -3}', "seed"),
    (b'{"prompt_token_ids": [1], "stop": [true]}', "stop[0]"),
    (b'{"prompt_token_ids": [1, "2"]}', "prompt_token_ids[1]"),
    (b'{"prompt_token_ids": [1], "prompt": "x"}', "prompt_token_ids"),
    (b'{"max_tokens": 3}', "prompt_token_ids"),
    (b'{"prompt_token_ids": [1], "top_k": -3}', "top_k"),
    (b'{"prompt_token_ids": [1], "beam_width": 3}', "beam_width"),
    (b'[1, 2]', "body"),
    (b'{"prompt_token_ids": [1', "body"),
])
def test_request_errors_start_with_the_field(body, field):
    with pytest.raises(ValidationError) as e:
        GenerateRequest.model_validate_json(body)
    errs = validation_errors(e.value)
    assert errs[0][0] == field
    assert errs[0][1].startswith(f"{field}: ")


def test_seed_zero_is_a_seed():
    # Only a missing seed means "unseeded"; 0 is as valid as any other.
    assert GenerateRequest.model_validate_json(b'{"prompt_token_ids": [1], "seed": 0}').seed == 0


# ------------------------------------------------------------------------ replicas and routing
def test_replicas_yaml_is_two_prefix_routed_replicas_on_two_cores():
    from ray._common.utils import import_attr

    from ray_attn.serve.router import PrefixAwareRequestRouter

    _, args = app_args("serve_config.replicas.yaml")
    cfg = ServeAppConfig.model_validate(args)
    opts = deployment_options(cfg)
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert cfg.executor == "in_process" and cfg.engine.parallel.tensor_parallel_size == 1
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}]
    cpus = opts["num_replicas"] * sum(b["CPU"] for b in opts["placement_group_bundles"])
    assert cpus + cfg.prefix_router.ingress_num_cpus <= 2
    router = opts["request_router_config"]
    assert import_attr(router["request_router_class"]) is PrefixAwareRequestRouter
    assert router["request_router_kwargs"] == {"imbalanced_threshold": 8, "min_match_blocks": 1,
                                               "max_blocks_per_replica": cfg.engine.cache.num_blocks,
                                               "shared_tier": False}
    assert build_app(args) is not None


def test_default_is_one_replica_and_the_default_router():
    opts = deployment_options(ServeAppConfig())
    assert opts["num_replicas"] == 1
    assert "request_router_config" not in opts and "autoscaling_config" not in opts


@pytest.mark.parametrize("tp,target", [(2, None), (2, 5.0), (1, 12.0)])
def test_autoscaling_replaces_a_fixed_count_and_keeps_a_placement_group_per_replica(tp, target):
    engine = {"parallel": {"tensor_parallel_size": tp, "device": "cpu", "num_cpus_per_worker": 0.5},
              "max_num_seqs": 12}
    auto = {"min_replicas": 0, "max_replicas": 3, "upscale_delay_s": 2.0, "downscale_delay_s": 60.0}
    if target is not None:
        auto["target_ongoing_requests"] = target
    cfg = ServeAppConfig.model_validate({"engine": engine, "autoscaling_config": auto,
                                         "replica_num_cpus": 0.5})
    opts = deployment_options(cfg)
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 3,
                                          "target_ongoing_requests": target or 12,
                                          "upscale_delay_s": 2.0, "downscale_delay_s": 60.0}
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}] + [{"CPU": 0.5}] * tp
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    # Serve accepts the options as they are.
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**opts["autoscaling_config"])
    assert build_app(cfg) is not None


@pytest.mark.parametrize("args,needles", [
    ({"num_replicas": 2, "autoscaling_config": {}}, ["num_replicas", "autoscaling_config"]),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, ["max_replicas", "min_replicas"]),
    ({"autoscaling_config": {"target_ongoing_requests": 1000}}, ["autoscaling_config.target_ongoing_requests"]),
    ({"autoscaling_config": {"target_ongoing_requests": 0}}, ["target_ongoing_requests"]),
    ({"autoscaling_config": {"max_replica": 2}}, ["max_replica"]),
    ({"num_replicas": 0}, ["num_replicas"]),
    ({"request_router": "round_robin"}, ["request_router"]),
    ({"prefix_router": {"imbalanced_threshold": -1}}, ["imbalanced_threshold"]),
    ({"prefix_router": {"min_match_blocks": 0}}, ["min_match_blocks"]),
])
def test_bad_scaling_config_names_the_fields(args, needles):
    with pytest.raises(ValidationError) as e:
        ServeAppConfig.model_validate(args)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
