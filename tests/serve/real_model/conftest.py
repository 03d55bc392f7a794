"""One Serve app for every real-model test: ``ray-attn serve``'s own (no checkpoint: the embedded
SmolLM2-135M-Instruct GGUF, one rank on CPU), at ``/smollm2`` on the serve tests' Ray cluster,
next to whatever other test app runs there.  ``smollm2`` starts the deployment and returns at
once; ``smollm2.url()`` waits for it, so a module can load its own reference meanwhile."""

from __future__ import annotations

import os

import pytest

from ray_attn.presets import DEFAULT_GGUF_INSTALL, default_gguf
from tests.timescale import scaled

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # HF transformers reads the local GGUF: no hub


@pytest.fixture(scope="package")
def gguf_path() -> str:
    try:
        return default_gguf()
    except FileNotFoundError:  # pragma: no cover - `make install` installs it
        pytest.skip(f"the embedded model is not installed ({DEFAULT_GGUF_INSTALL})")


@pytest.fixture(scope="package")
def smollm2(ray_session, gguf_path):
    from tests.serve.real_model.smollm2_app import Deploying, app_config, http_port

    port, started = http_port()
    app = Deploying(app_config(), port)
    try:
        yield app
    finally:
        print(f"\nSmolLM2 app was up {app.ready_s or float('nan'):.1f}s after its deployment began")
        if started:  # ours alone: shutting Serve down deletes it
            from ray import serve

            app.thread.join()
            serve.shutdown()
        else:
            app.delete()


@pytest.fixture(scope="package")
def smollm2_url(smollm2) -> str:
    return smollm2.url(scaled(300))
