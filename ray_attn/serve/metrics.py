"""The Serve app's Prometheus metrics: the engine loop's hooks (``ray_attn.serve.loop.LoopHooks``) fed into
``ray.util.metrics``, which every Ray node's metrics agent exports, and into this replica's own
copy, which ``GET /metrics`` renders on the API port (``ray_attn/serve/prometheus.py``).  Kept
apart from the HTTP handlers in ``ray_attn/serve/app.py``: the loop calls them, the routes never do."""

import time

from ray_attn.serve.loop import LoopHooks
from ray_attn.serve.prometheus import Registry

STEP_LATENCY_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class RayMetricsHooks(LoopHooks):
    """Prometheus metrics through ``ray.util.metrics`` (exported by every Ray node's metrics agent)."""

    def __init__(self, replica: str, min_gauge_interval_s: float = 0.25):
        self.registry = metrics = Registry()
        tags = ("replica",)
        self.step_latency = metrics.histogram(
            "ray_attn_step_latency_s", description="Latency of one engine step (all layers, all ranks).",
            boundaries=STEP_LATENCY_BOUNDARIES_S, tag_keys=tags)
        self.tokens = metrics.counter("ray_attn_tokens_generated",
                                      description="Tokens generated.", tag_keys=tags)
        self.tokens_per_s = metrics.gauge("ray_attn_tokens_per_s",
                                          description="Tokens generated per second (recent window).",
                                          tag_keys=tags)
        self.kv_usage = metrics.gauge("ray_attn_kv_cache_usage",
                                      description="Share of KV blocks in use (0..1).", tag_keys=tags)
        self.kv_used = metrics.gauge("ray_attn_kv_blocks_used", description="KV blocks in use.",
                                     tag_keys=tags)
        self.queue_depth = metrics.gauge("ray_attn_queue_depth",
                                         description="Requests accepted but not yet running.",
                                         tag_keys=tags)
        self.running = metrics.gauge("ray_attn_running_requests",
                                     description="Requests in the running batch.", tag_keys=tags)
        self.finished = metrics.counter("ray_attn_requests_finished",
                                        description="Finished requests, by finish reason.",
                                        tag_keys=tags + ("finish_reason",))
        self.rejected = metrics.counter("ray_attn_requests_rejected",
                                        description="Requests refused, by HTTP status.",
                                        tag_keys=tags + ("status",))
        # Per replica, so that a router's effect shows: hits / queries is that replica's hit rate.
        self.prefix_hits = metrics.counter("ray_attn_prefix_cache_hits",
                                           description="Prompt tokens served from the prefix cache.",
                                           tag_keys=tags)
        self.prefix_queries = metrics.counter("ray_attn_prefix_cache_queries",
                                              description="Prompt tokens looked up in the prefix cache.",
                                              tag_keys=tags)
        for m in (self.step_latency, self.tokens, self.tokens_per_s, self.kv_usage, self.kv_used,
                  self.queue_depth, self.running, self.finished, self.rejected, self.prefix_hits,
                  self.prefix_queries):
            m.set_default_tags({"replica": replica})
        # KV tiers (when on): counters fed from the snapshot's running totals
        self.kv_tier_hits = metrics.counter("ray_attn_kv_tier_hit_tokens",
                                            description="Prompt tokens found in the KV cache, by tier "
                                            "(device, host, shared).", tag_keys=tags + ("tier",))
        self.kv_tier_bytes = metrics.counter("ray_attn_kv_tier_bytes",
                                             description="Bytes rank 0 moved between KV tiers, by direction "
                                             "(offload, onload, publish, fetch).", tag_keys=tags + ("direction",))
        self.kv_copy_s = metrics.counter("ray_attn_kv_copy_seconds",
                                         description="Rank 0's time copying between KV tiers.", tag_keys=tags)
        for m in (self.kv_tier_hits, self.kv_tier_bytes, self.kv_copy_s):
            m.set_default_tags({"replica": replica})
        # speculative decoding, as vLLM names them (vllm:spec_decode_*): fed from the snapshot's
        # running totals like the prefix counters, on every snapshot (the gauges' throttle would
        # leave a short run's last steps uncounted)
        self.spec_counters = {key: metrics.counter(f"ray_attn_{key}", description=text, tag_keys=tags)
                              for key, text in (
                                  ("spec_decode_num_drafts", "Request-steps that verified draft tokens."),
                                  ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                                  ("spec_decode_num_accepted_tokens", "Draft tokens accepted."))}
        self.spec_per_pos = metrics.counter("ray_attn_spec_decode_num_accepted_tokens_per_pos",
                                            description="Draft tokens accepted, by draft position (0 first).",
                                            tag_keys=tags + ("position",))
        for m in (*self.spec_counters.values(), self.spec_per_pos):
            m.set_default_tags({"replica": replica})
        self._tier_seen: dict[str, float] = {}
        self._spec_seen: dict = {}
        self.min_gauge_interval_s = min_gauge_interval_s
        self._last_gauges = 0.0
        self._prefix_seen = (0, 0)  # (hits, queries) already counted

    def on_step(self, latency_s: float, num_tokens: int, batch_size: int) -> None:
        self.step_latency.observe(latency_s)
        if num_tokens > 0:
            self.tokens.inc(num_tokens)

    def on_snapshot(self, snap: dict) -> None:
        if snap.get("spec_decode_num_drafts"):
            self._count_spec(snap)
        now = time.monotonic()
        if now - self._last_gauges < self.min_gauge_interval_s:
            return
        self._last_gauges = now
        self.kv_usage.set(snap["kv_usage"])
        self.kv_used.set(snap["kv_blocks_used"])
        self.queue_depth.set(snap["queue_depth"])
        self.running.set(snap["running"])
        self.tokens_per_s.set(snap["tokens_per_s"])
        hits, queries = snap["prefix_cache_hits"], snap["prefix_cache_queries"]
        if hits > self._prefix_seen[0]:
            self.prefix_hits.inc(hits - self._prefix_seen[0])
        if queries > self._prefix_seen[1]:
            self.prefix_queries.inc(queries - self._prefix_seen[1])
        self._prefix_seen = (max(hits, self._prefix_seen[0]), max(queries, self._prefix_seen[1]))
        if "kv_copy_s" in snap:
            self._count_tiers(snap)

    def _count_tiers(self, snap: dict) -> None:
        feeds = [(f"kv_hit_tokens_{t}", self.kv_tier_hits, {"tier": t}) for t in ("device", "host", "shared")]
        feeds += [(f"kv_{d}_bytes", self.kv_tier_bytes, {"direction": d})
                  for d in ("offload", "onload", "publish", "fetch")]
        feeds.append(("kv_copy_s", self.kv_copy_s, None))
        for key, counter, tags in feeds:
            grew = snap[key] - self._tier_seen.get(key, 0)
            if grew > 0:
                counter.inc(grew, tags=tags)
                self._tier_seen[key] = snap[key]

    def _count_spec(self, snap: dict) -> None:
        feeds = [(key, counter, None, snap[key]) for key, counter in self.spec_counters.items()]
        feeds += [(("pos", j), self.spec_per_pos, {"position": str(j)}, n)
                  for j, n in enumerate(snap["spec_decode_num_accepted_tokens_per_pos"])]
        for key, counter, tags, total in feeds:
            grew = total - self._spec_seen.get(key, 0)
            if grew > 0:
                counter.inc(grew, tags=tags)
                self._spec_seen[key] = total

    def on_request_done(self, finish_reason: str) -> None:
        self.finished.inc(tags={"finish_reason": finish_reason})

    def on_rejected(self, status: int) -> None:
        self.rejected.inc(tags={"status": str(status)})
