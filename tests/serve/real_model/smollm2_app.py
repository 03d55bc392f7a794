"""``ray-attn serve``'s own app -- no checkpoint: the embedded SmolLM2-135M-Instruct GGUF, one rank
on CPU -- deployed next to any other Serve app on this cluster, for the real-model tests and
``scripts/lm_eval_real_model.py``.

The deployment runs in a thread (``Deploying``): the replica loads the GGUF (~20 s on 2 cores)
while the caller does other work -- HF transformers reading the same GGUF for the lm-eval
reference takes about as long -- and ``url()`` waits for it.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from typing import Optional

from ray_attn.serve.cli import DEFAULT_SERVED_NAME, add_arguments, serve_config

MODEL_ID = DEFAULT_SERVED_NAME  # what `ray-attn serve` with no checkpoint calls it
APP, ROUTE = "smollm2", "/smollm2"


def app_config():
    """The config ``ray-attn serve --device cpu`` runs: no checkpoint, no YAML (its health
    deadlines, 30 s a check, are already loose enough for a busy machine)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return serve_config(p.parse_args(["--device", "cpu"]))


def http_port(host: str = "127.0.0.1", port: Optional[int] = None) -> tuple[int, bool]:
    """The port of the Serve proxy on this cluster, starting Serve there when none runs (then
    ``True``: the caller shuts it down)."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    started = _get_global_client(raise_if_no_controller_running=False) is None
    if started:
        if port is None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        serve.start(http_options={"host": host, "port": port})
    return ray.get(_get_global_client()._controller.get_http_config.remote()).port, started


class Deploying:
    """``serve.run`` of the app in a thread; ``url()`` waits for it (re-raising its error)."""

    def __init__(self, cfg, port: int, app: str = APP, route: str = ROUTE):
        self.app, self.base = app, f"http://127.0.0.1:{port}{route}"
        self.error: Optional[BaseException] = None
        self.t0 = time.perf_counter()
        self.ready_s: Optional[float] = None
        self.thread = threading.Thread(target=self._run, args=(cfg, route), daemon=True)
        self.thread.start()

    def _run(self, cfg, route):
        from ray import serve

        from ray_attn.serve.app import build_app

        try:
            serve.run(build_app(cfg), name=self.app, route_prefix=route, blocking=False)
            self.ready_s = time.perf_counter() - self.t0
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self.error = e

    def url(self, timeout_s: float = 300.0) -> str:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"app {self.app!r} not up within {timeout_s:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"app {self.app!r} failed to deploy") from self.error
        return self.base

    def delete(self) -> None:
        from ray import serve

        self.thread.join()
        serve.delete(self.app)
