"""LoRA adapters through the Serve app (in process, ``app_harness``): /v1/models lists them,
``model="<served>:<adapter>"`` and ``model="<adapter>"`` run under them (peft's tokens), the
dynamic path loads on first use, the load/unload routes are admin routes with paths under
admin_root, and every bad adapter input is a 400 that names it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ray_attn.engine import SamplingParams
from ray_attn.serve.loop import current_lora
from tests.lora.peft_fixture import engine_config, hf_logits, lora_models, peft_model, write_adapter  # noqa: F401
from tests.serve.app_harness import ADMIN_KEY, MODEL_ID, bearer, client, in_replica, served_app  # noqa: F401

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


@pytest.fixture(scope="module")
def lora_server(lora_models, tmp_path_factory):
    base, adapters = lora_models
    root = tmp_path_factory.mktemp("adapters")  # admin_root and the dynamic path
    shutil.copytree(adapters["mlp"], root / "mlp")
    shutil.copytree(adapters["all"], root / "big")  # rank 16, over this server's limit of 8
    shutil.copytree(adapters["qv"], root / "broken")
    with open(root / "broken" / "adapter_model.safetensors", "wb") as f:
        f.write(b"garbage")
    eng = engine_config(base, max_loras=2, max_lora_rank=8).model_dump(mode="json")
    eng["max_num_seqs"] = 4
    srv = served_app(engine=eng, lora_modules={"attn": adapters["attn"]}, dynamic_lora_loading_path=str(root),
                     admin_api_keys=[ADMIN_KEY], admin_root=str(root))
    return srv, base, adapters, root


def greedy_peft(base, adapter, n=4):
    model, toks = peft_model(base, adapter), list(PROMPT)
    for _ in range(n):
        toks.append(int(hf_logits(model, toks)[-1].argmax()))
    return toks[len(PROMPT):]


def complete(c, model, n=4):
    return c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0.0})


def test_models_list_and_requests_run_under_their_adapter(lora_server, in_replica):
    srv, base, adapters, _ = lora_server
    in_replica(srv)
    with client() as c:
        ids = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert ids["attn"]["parent"] == MODEL_ID and ids["attn"]["root"] == adapters["attn"]
        for model, ad in ((f"{MODEL_ID}:attn", adapters["attn"]), ("attn", adapters["attn"]), (MODEL_ID, None)):
            r = complete(c, model)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == greedy_peft(base, ad), model
        # the dynamic path: loaded on first use, then listed
        r = complete(c, f"{MODEL_ID}:mlp")
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy_peft(base, adapters["mlp"])
        assert "mlp" in {m["id"] for m in c.get("/v1/models").json()["data"]}


@pytest.mark.parametrize("model,why", [(f"{MODEL_ID}:nope", "'nope'"), ("nope", "'nope'"),
                                       ("big", "over max_lora_rank=8"), ("broken", "not a readable safetensors"),
                                       ("../mlp", "plain folder name")])
def test_bad_adapters_are_400s_naming_them(lora_server, in_replica, model, why):
    in_replica(lora_server[0])
    with client() as c:
        r = complete(c, model)
    assert r.status_code == 400 and r.json()["field"] == "model" and why in r.json()["detail"], r.text


def test_other_models_stay_404(lora_server, in_replica):
    in_replica(lora_server[0])
    with client() as c:
        assert complete(c, "other:attn").status_code == 404


def test_load_and_unload_are_admin_routes_under_admin_root(lora_server, in_replica, tmp_path):
    srv, base, adapters, root = lora_server
    in_replica(srv)
    shutil.copytree(adapters["qv"], root / "qv_folder")
    outside = write_adapter(base, tmp_path / "outside", ["q_proj"], 2, 4)
    admin = bearer(ADMIN_KEY)
    with client() as c:
        for path in ("/v1/load_lora_adapter", "/admin/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert c.post(path, json={"lora_name": "x", "lora_path": "qv_folder"}).status_code == 401
        load = "/admin/v1/load_lora_adapter"
        r = c.post(load, json={"lora_name": "qv2", "lora_path": outside}, headers=admin)
        assert r.status_code == 400 and r.json()["field"] == "lora_path" and "not under the admin root" in r.text
        r = c.post(load, json={"lora_name": "qv2", "lora_path": "missing"}, headers=admin)
        assert r.status_code == 400 and "'qv2'" in r.json()["detail"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "qv2", "lora_path": "qv_folder"}, headers=admin)
        assert r.status_code == 200, r.text
        r = complete(c, "qv2")
        assert r.json()["choices"][0]["token_ids"] == greedy_peft(base, adapters["qv"])
        assert c.post(load, json={"lora_name": "qv2", "lora_path": "qv_folder"},
                      headers=admin).json()["detail"].endswith("'qv2' is already loaded")
        # in use: a request queued first holds it, and the unload (behind it in the engine's
        # inbox) is refused by name; the request goes on
        events = []
        token = current_lora.set(srv.adapters.by_name["qv2"])
        try:
            rid = srv.loop.inner.submit(PROMPT, SamplingParams(max_tokens=200), type("S", (), {"push": events.append})())
        finally:
            current_lora.reset(token)
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "qv2"}, headers=admin)
        assert r.status_code == 400 and "'qv2' is in use by 1" in r.json()["detail"], r.text
        assert events[0].kind == "accepted" and not any(e.kind in ("rejected", "failed") for e in events)
        srv.loop.inner.abort(rid)  # once it is gone, the adapter unloads
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "qv2"}, headers=admin)
        assert r.status_code == 200, r.text
        assert complete(c, "qv2").status_code == 400  # the dynamic path has no folder of that name
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "qv2"}, headers=admin).status_code == 400
