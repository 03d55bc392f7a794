"""Serve options for how many LLMServer replicas run and how requests pick one.

Kept out of ``ray_attn/serve/app.py``'s deployment options so that the replica count (fixed, or Serve's
autoscaling) and the request router are decided in one place.  Whatever the count, each replica
still reserves its own placement group (its bundle plus one per TP rank, ``STRICT_PACK``), so a
replica Serve adds or removes comes and goes with its ranks.
"""

from __future__ import annotations

from typing import Any

from ray_attn.serve.router import DEFAULT_MAX_BLOCKS_PER_REPLICA
from ray_attn.serve.schemas import ServeAppConfig

PREFIX_AWARE_ROUTER = "ray_attn.serve.router:PrefixAwareRequestRouter"


def scaling_options(cfg: ServeAppConfig) -> dict[str, Any]:
    """``num_replicas`` or ``autoscaling_config``, plus ``request_router_config`` when prefix-aware."""
    out: dict[str, Any] = {}
    auto = cfg.autoscaling_config
    if auto is None:
        out["num_replicas"] = cfg.num_replicas or 1
    else:
        out["autoscaling_config"] = {
            "min_replicas": auto.min_replicas,
            "max_replicas": auto.max_replicas,
            "target_ongoing_requests": auto.target_ongoing_requests or cfg.engine.max_num_seqs,
            "upscale_delay_s": auto.upscale_delay_s,
            "downscale_delay_s": auto.downscale_delay_s,
        }
    if cfg.request_router == "prefix_aware":
        pr = cfg.prefix_router
        out["request_router_config"] = {
            "request_router_class": PREFIX_AWARE_ROUTER,
            "request_router_kwargs": {
                "imbalanced_threshold": pr.imbalanced_threshold,
                "min_match_blocks": pr.min_match_blocks,
                # A replica holds at most its KV cache's blocks; remembering more only keeps
                # prefixes it has already evicted.
                "max_blocks_per_replica": (pr.max_blocks_per_replica or cfg.engine.cache.num_blocks
                                           or DEFAULT_MAX_BLOCKS_PER_REPLICA),
                "shared_tier": cfg.engine.cache.kv_sharing,
            },
        }
    return out


__all__ = ["PREFIX_AWARE_ROUTER", "scaling_options"]
