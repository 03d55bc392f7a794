"""The adapters a replica serves, by the names requests put in ``model``, and the admin routes
that load and unload them (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``;
Ray Serve LLM's ``dynamic_lora_loading_path``).

A request names an adapter as ``model="<adapter>"`` or ``model="<served model>:<adapter>"``.
``resolve`` answers its ``LoRARequest`` (None for the base model), loading it from
``dynamic_lora_loading_path/<adapter>`` on first use when that is configured, and puts it where
``EngineLoop.submit`` reads it (``current_lora``, a context variable, as the request id travels in
``request_log.current_request_id``): the OpenAI handlers need not carry it through every call.
Every problem with an adapter -- unknown, a rank over the limit, a missing folder, a corrupt
file -- is a 400 that names it; the adapter is read and checked here, before the engine sees a
request of it.  Unloading goes to the engine thread between steps and is refused, by name,
while a request uses the adapter: it never fails one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
import threading
from typing import Optional

from ray_attn.lora import LoRAAdapterError, LoRARequest
from ray_attn.serve.auth import resolve_under
from ray_attn.serve.http import HTTPError
from ray_attn.serve.loop import current_lora


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class ServedAdapters:
    def __init__(self, cfg, model_id: str, engine_config):
        self.model_id = model_id
        self.lora_config, self.model = engine_config.lora_config, engine_config.model
        self.dynamic = cfg.dynamic_lora_loading_path
        if self.dynamic and self.dynamic.startswith("file://"):
            self.dynamic = self.dynamic[len("file://"):]
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._downloads: Optional[str] = None
        for name, path in cfg.lora_modules.items():  # a bad one stops the replica, naming it
            self._add(name, path, "lora_modules")

    @property
    def enabled(self) -> bool:
        return self.lora_config is not None

    def _add(self, name: str, path: str, field: str) -> LoRARequest:
        try:
            # checked here, off the engine thread; the engine's own check of the same files is
            # then a stat each (check_adapter remembers), and the ranks read their own shards
            from ray_attn.lora.peft_format import check_adapter  # torch: only a replica that loads adapters

            check_adapter(path, name, self.model, self.lora_config.max_lora_rank)
        except LoRAAdapterError as e:
            raise HTTPError(400, [(field, f"{field}: {e}")]) from None
        with self._lock:
            if name in self.by_name:
                raise HTTPError(400, [(field, f"{field}: adapter {name!r} is already loaded")])
            req = LoRARequest(name, next(self._ids), path)
            self.by_name[name] = req
        return req

    def cards(self) -> list[tuple[str, str]]:
        return [(r.lora_name, r.lora_path) for r in self.by_name.values()]

    # -- per request ----------------------------------------------------------------------------
    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter ``model`` names (None: the base), set as the request's ``current_lora``."""
        req = None
        if model is not None and model != self.model_id:
            base, sep, name = model.partition(":")
            if sep and base != self.model_id:
                self._unknown(model)
            name = name if sep else model
            req = self.by_name.get(name)
            if req is None:
                if not self.enabled or (not sep and not self.dynamic):
                    self._unknown(model)
                if not self.dynamic:
                    raise HTTPError(400, [("model", f"model: adapter {name[:128]!r} is not loaded (GET /v1/models "
                                                    "lists the adapters)")])
                req = self.by_name.get(name) or self._load_dynamic(name)
        current_lora.set(req)
        return req

    def _unknown(self, model: str):
        names = ", ".join(repr(n) for n in [self.model_id, *list(self.by_name)[:8]])
        raise HTTPError(404, [("model", f"model: '{model[:128]}' does not exist; this server serves {names} "
                                        "(GET /v1/models)")])

    def _load_dynamic(self, name: str) -> LoRARequest:
        if not name or "/" in name or "\\" in name:
            raise HTTPError(400, [("model", f"model: adapter name {name[:128]!r} must be a plain folder name")])
        if _is_url(self.dynamic):
            path = self._download(name)
        else:
            path = str(resolve_under(self.dynamic, name, "model"))
        try:
            return self._add(name, path, "model")
        except HTTPError as e:
            if name in self.by_name:  # loaded meanwhile by another request: the same adapter
                return self.by_name[name]
            raise e

    def _download(self, name: str) -> str:
        """``<url>/<name>`` copied into a local folder of this replica (fsspec)."""
        try:
            import fsspec
        except ImportError:
            raise HTTPError(400, [("model", "model: dynamic_lora_loading_path is a URL, and fsspec is not "
                                            "installed")]) from None
        if self._downloads is None:
            self._downloads = tempfile.mkdtemp(prefix="ray_attn_lora_")
        url = self.dynamic.rstrip("/") + "/" + name
        local = os.path.join(self._downloads, name)
        try:
            fs, root = fsspec.core.url_to_fs(url)
            if not fs.isdir(root):
                raise FileNotFoundError(url)
            os.makedirs(local, exist_ok=True)
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                if fs.exists(f"{root}/{f}"):
                    fs.get(f"{root}/{f}", os.path.join(local, f))
        except Exception as e:  # noqa: BLE001 -- any fsspec backend's error
            raise HTTPError(400, [("model", f"model: adapter {name!r} could not be fetched from {url!r} "
                                            f"({type(e).__name__}: {e})")]) from None
        return local

    # -- admin routes ---------------------------------------------------------------------------
    async def load_route(self, server, request) -> dict:
        body = await _json_body(request, server.cfg.max_body_bytes)
        name, path = body.get("lora_name"), body.get("lora_path")
        self._need_lora()
        if not isinstance(name, str) or not name or ":" in name or name == self.model_id:
            raise HTTPError(400, [("lora_name", "lora_name: must be a non-empty name without ':', not the "
                                                "served model's")])
        real = str(server.auth.admin_path(path, "lora_path"))
        req = await asyncio.to_thread(self._add, name, real, "lora_path")
        return {"lora_name": req.lora_name, "lora_int_id": req.lora_int_id}

    async def unload_route(self, server, request) -> dict:
        body = await _json_body(request, server.cfg.max_body_bytes)
        name = body.get("lora_name")
        self._need_lora()
        req = self.by_name.get(name) if isinstance(name, str) else None
        if req is None:
            raise HTTPError(400, [("lora_name", f"lora_name: adapter {str(name)[:128]!r} is not loaded")])

        def remove(engine):
            if req.lora_int_id in engine.list_loras():
                engine.remove_lora(req.lora_int_id)  # refused while a request uses it

        try:
            await asyncio.wrap_future(server.loop.inner.call(remove))
        except LoRAAdapterError as e:
            raise HTTPError(400, [("lora_name", f"lora_name: {e}")]) from None
        with self._lock:
            self.by_name.pop(name, None)
        return {"lora_name": name, "unloaded": True}

    def _need_lora(self):
        if not self.enabled:
            raise HTTPError(400, [("lora_name", "lora_name: this server serves no adapters (engine.lora_config "
                                                "is unset)")])


async def _json_body(request, limit: int) -> dict:
    from ray_attn.serve.http import read_body

    raw = await read_body(request, limit)
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise HTTPError(400, [("body", f"body: not valid JSON ({e})")]) from None
    if not isinstance(body, dict):
        raise HTTPError(400, [("body", "body: must be a JSON object")])
    return body


def adapter_route(kind: str):
    """The handler of ``/v1/{load,unload}_lora_adapter`` for ``LLMServer._openai``."""
    async def handler(server, request):
        adapters = server.adapters
        if adapters is None:
            raise HTTPError(400, [("lora_name", "lora_name: this server serves no adapters (engine.lora_config "
                                                "is unset)")])
        return await (adapters.load_route if kind == "load" else adapters.unload_route)(server, request)
    return handler
