"""deploy/'s files against the schemas that read them (no Ray started): every Serve config against
Ray Serve's own ``ServeDeploySchema`` -- every key one of its fields, since it ignores unknown
ones silently -- and our app's ``args`` against ``ServeAppConfig``; the KubeRay ``RayService``
against the shape KubeRay reads, its ``serveConfigV2`` as a Serve config like the others."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from ray_attn.serve.app import deployment_options
from ray_attn.serve.schemas import ServeAppConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
IMPORT_PATH = "ray_attn.serve.app:build_app"
RAYSERVICE = DEPLOY / "rayservice.gpu.yaml"


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (through Optional, Union, List, Dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def unknown_keys(model: type[BaseModel], data, where: str = "") -> list[str]:
    """Keys of ``data`` that are no field of ``model`` (recursively, by field name or alias)."""
    if not isinstance(data, dict):
        return []
    out = []
    fields = {f.alias or name: f for name, f in model.model_fields.items()} | model.model_fields
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            out.append(f"{where}{key}")
            continue
        for sub in _models_in(field.annotation):
            for item in value if isinstance(value, list) else [value]:
                out += unknown_keys(sub, item, f"{where}{key}.")
    return out


def check_serve_config(data: dict) -> ServeAppConfig:
    """A Serve config Serve accepts key for key, with one application: ours, whose args we accept."""
    assert unknown_keys(ServeDeploySchema, data) == []
    schema = ServeDeploySchema.model_validate(data)
    (app,) = schema.applications
    assert app.import_path == IMPORT_PATH
    return ServeAppConfig.model_validate(app.args)


def rayservice() -> dict:
    return yaml.safe_load(RAYSERVICE.read_text())


def test_the_key_check_catches_a_misspelt_key():
    data = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    data["http_options"]["keep_alive_timeout"] = 5
    data["applications"][0]["num_replicas"] = 2  # a deployment option, not an application field
    assert unknown_keys(ServeDeploySchema, data) == ["http_options.keep_alive_timeout",
                                                     "applications.num_replicas"]


@pytest.mark.parametrize("name", sorted(p.name for p in DEPLOY.glob("serve_config*.yaml")))
def test_serve_yamls_fit_serves_schema_and_ours(name):
    cfg = check_serve_config(yaml.safe_load((DEPLOY / name).read_text()))
    assert deployment_options(cfg)["placement_group_bundles"]


def test_deploy_holds_configs_not_code():
    # The package is ray_attn/serve; a module here would be an importable top-level `deploy` again.
    assert not list(DEPLOY.rglob("*.py"))


def test_rayservice_has_kuberays_shape():
    doc = rayservice()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    assert doc["metadata"]["name"]
    spec = doc["spec"]
    assert isinstance(spec["serveConfigV2"], str)  # KubeRay takes the Serve config as one string
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"]
    head = cluster["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # ray start flags as strings
    assert head["template"]["spec"]["containers"][0]["image"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["groupName"] and group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["image"] == head["template"]["spec"]["containers"][0]["image"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"]


def test_rayservice_serves_the_gpu_app_in_one_pod_per_replica():
    doc = rayservice()
    served = yaml.safe_load(doc["spec"]["serveConfigV2"])
    cfg = check_serve_config(served)
    # The same app as serve_config.gpu.yaml: one GPU config to keep right, not two.
    gpu = yaml.safe_load((DEPLOY / "serve_config.gpu.yaml").read_text())
    assert served["applications"][0]["args"] == gpu["applications"][0]["args"]
    assert "runtime_env" not in served["applications"][0]  # ray_attn is installed in the image

    # STRICT_PACK puts a replica's whole placement group on one node: one GPU pod must hold it.
    bundles = deployment_options(cfg)["placement_group_bundles"]
    cluster = doc["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert sum(b.get("GPU", 0) for b in bundles) == int(limits["nvidia.com/gpu"])
    assert sum(b["CPU"] for b in bundles) <= float(limits["cpu"])
    assert group["maxReplicas"] >= cfg.num_replicas
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head


def test_every_rayservice_pod_gives_serves_proxy_our_key_filter():
    """A proxy runs on every node (proxy_location EveryNode or the head's): each container's
    environment names the filter, and the name imports to Serve's callback."""
    import importlib

    from ray_attn.serve.proxy_auth import CALLBACK, CALLBACK_ENV

    cluster = rayservice()["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        for c in pod["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in c.get("env", [])}
            assert env.get(CALLBACK_ENV) == CALLBACK, c["name"]
    module, _, attr = CALLBACK.partition(":")
    (mw,) = getattr(importlib.import_module(module), attr)()
    assert mw.cls.__name__ == "ProxyAuthMiddleware"
