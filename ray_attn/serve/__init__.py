"""Ray Serve deployment of ray_attn: ``serve run deploy/serve_config.yaml``.

``deploy.app:build_app`` builds the app from a :class:`deploy.schemas.ServeAppConfig`;
``deploy.loop.EngineLoop`` is the single thread that owns the engine.
"""

from deploy.schemas import GenerateRequest, ServeAppConfig

__all__ = ["GenerateRequest", "ServeAppConfig", "build_app"]


def build_app(args=None):
    from deploy.app import build_app as _build

    return _build(args)
