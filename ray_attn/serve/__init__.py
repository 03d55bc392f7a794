"""Ray Serve deployment of ray_attn: ``serve run deploy/serve_config.yaml``.

``ray_attn.serve.app:build_app`` builds the app from a :class:`ray_attn.serve.schemas.ServeAppConfig`;
``ray_attn.serve.loop.EngineLoop`` is the single thread that owns the engine.
"""

from ray_attn.serve.schemas import GenerateRequest, ServeAppConfig

__all__ = ["GenerateRequest", "ServeAppConfig", "build_app"]


def build_app(args=None):
    from ray_attn.serve.app import build_app as _build

    return _build(args)
