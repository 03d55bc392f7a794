"""``ray-attn serve``: a checkpoint folder (or a Serve YAML's app) on Ray Serve with the OpenAI API.

The top-level ``ray-attn`` parser hands this subcommand its arguments (``add_arguments``) and runs
it (``run``); a bad argument raises ``ValueError``, which the entry point prints as one line."""

from __future__ import annotations

import argparse
import os
import signal
import time

from ray_attn.serve.schemas import ServeAppConfig, app_args_from_file, default_engine_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="HF checkpoint folder (config.json, safetensors and, when "
                                            "present, the tokenizer) or GGUF file (config, tokenizer and "
                                            "chat template from its metadata); omitted: the embedded "
                                            "SmolLM2-135M-Instruct GGUF")
    p.add_argument("--config", help="a Serve YAML (deploy/serve_config*.yaml) whose app args the flags override")
    p.add_argument("--tokenizer", help="tokenizer folder or GGUF file (default: the checkpoint's own)")
    p.add_argument("--served-model-name", help="the `model` name clients send (default: the folder's name)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, as vLLM's flag: a JSON object of SpeculativeConfig's fields, "
                        "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'")
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="kernels whose rows do not depend on the rest of the step, so that speculative "
                        "greedy is plain greedy on GPUs (vLLM's VLLM_BATCH_INVARIANT=1); slower")
    p.add_argument("--host-cache-gib", type=float, default=None,
                   help="host-memory KV tier per rank, GiB (vLLM's --kv-offloading-size, per rank)")
    p.add_argument("--kv-sharing", action="store_true", default=None,
                   help="publish KV blocks to a store per node and fetch prefixes other replicas computed")
    p.add_argument("--num-replicas", type=int, default=None, help="engine replicas (each with its TP ranks)")
    p.add_argument("--resume-requests", action="store_true", default=None,
                   help="resume a request whose replica was lost on another one (resume_requests)")
    p.add_argument("--replica-resource", default=None,
                   help="a custom node resource each replica takes one unit of, to spread replicas over nodes")
    # LoRA adapters: vLLM's flags (and Ray Serve LLM's dynamic path)
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters (implied by the flags below)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapter folders served from the start, as name=path")
    p.add_argument("--max-loras", type=int, default=None, help="adapters resident on the device at once")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank served")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters each rank keeps in host memory")
    p.add_argument("--dynamic-lora-loading-path", default=None,
                   help="folder (or fsspec URL) of adapter folders loaded on first use by name")
    # Exposing it (docs/serving.md, "Exposing the server"): as vLLM's flags.
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' on every route but "
                        "/health; repeat for several (rotation). Visible in `ps`: prefer "
                        "RAY_ATTN_API_KEY or --api-key-file")
    p.add_argument("--api-key-file", default=None, help="a file of keys, one per line, re-read when it changes")
    p.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                   help="a key of the admin routes (/admin/...), which are off without one")
    p.add_argument("--admin-api-key-file", default=None, help="a file of admin keys")
    p.add_argument("--public-metrics", action="store_true", default=None,
                   help="with keys: /metrics and /stats answer without one")
    p.add_argument("--log-requests", choices=["off", "summary", "full"], default=None,
                   help="one log line per request (summary: no prompt or output; full: with them)")
    p.add_argument("--disable-log-requests", action="store_true", help="as vLLM's: --log-requests off")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="OpenTelemetry spans per request to this OTLP/HTTP endpoint (http://host:4318)")
    p.add_argument("--api-server-count", type=int, default=None,
                   help="HTTP proxies on each node's port, Serve's own included (as vLLM's): more "
                        "event loops parse and refuse a flood of connections")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")


DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def default_model_engine() -> dict:
    """The engine `ray-attn serve` runs with no checkpoint and no YAML: the embedded real model
    (SmolLM2-135M-Instruct, ``presets.default_gguf``), so that a first request gets words, on the
    small CPU engine's cache and step sizes.  One rank: on a few CPU cores TP ranks only add
    all-reduces (scripts/bench_cpu_vs_hf.py); ``--tp 3`` divides its heads."""
    from ray_attn.presets import default_gguf

    engine = default_engine_config().model_dump(mode="json", exclude={"model"})
    engine["parallel"] |= {"tensor_parallel_size": 1}
    return engine | {"checkpoint": default_gguf()}


def serve_config(args):
    """The Serve app's config: ``ray-attn serve``'s flags over a YAML's app ``args`` (or over the
    embedded SmolLM2).  A checkpoint folder brings its own shapes (config.json) and, when it holds
    one, its tokenizer; a GGUF file its config, tokenizer and chat template."""
    from ray_attn.gguf_file import gguf_path

    app: dict = {}
    if args.config:
        app = dict(app_args_from_file(args.config))
    engine = dict(app.get("engine") or ({} if args.model else default_model_engine()))
    if not args.model and not app.get("engine"):
        app.setdefault("served_model_name", DEFAULT_SERVED_NAME)
    if args.model:
        try:
            is_gguf = gguf_path(args.model) is not None
        except OSError as e:
            raise ValueError(f"model: {e}") from None
        if not is_gguf and not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"model: {args.model!r} is not a checkpoint folder (no config.json in it) "
                             "nor a GGUF file")
        engine.pop("model", None)  # the checkpoint's config is the model
        engine["checkpoint"] = args.model
    sections = {"model": {"dtype": args.dtype}, "cache": {"kv_cache_dtype": args.kv_cache_dtype, "host_cache_gib": args.host_cache_gib,
                                                   "kv_sharing": args.kv_sharing},
                "parallel": {"tensor_parallel_size": args.tp, "device": args.device,
                             "batch_invariant": getattr(args, "batch_invariant", None)}}
    for section, values in sections.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            engine[section] = dict(engine.get(section) or {}) | given
    if args.max_num_seqs:
        engine["max_num_seqs"] = args.max_num_seqs
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        engine["speculative_config"] = parse_speculative_config(spec)
    lora_flags = {"max_loras": getattr(args, "max_loras", None), "max_lora_rank": getattr(args, "max_lora_rank", None),
                  "max_cpu_loras": getattr(args, "max_cpu_loras", None)}
    lora_given = {k: v for k, v in lora_flags.items() if v is not None}
    modules = getattr(args, "lora_modules", None) or []
    if lora_given or modules or getattr(args, "enable_lora", None) or getattr(args, "dynamic_lora_loading_path", None):
        engine["lora_config"] = dict(engine.get("lora_config") or {}) | lora_given
    if modules:
        pairs = [m.partition("=") for m in modules]
        bad = [m for m, (n, eq, path) in zip(modules, pairs) if not (n and eq and path)]
        if bad:
            raise ValueError(f"--lora-modules: {bad[0]!r} is not name=path")
        app["lora_modules"] = dict(app.get("lora_modules") or {}) | {n: path for n, _, path in pairs}
    if getattr(args, "dynamic_lora_loading_path", None):
        app["dynamic_lora_loading_path"] = args.dynamic_lora_loading_path
    if args.device == "cpu":  # CPU ranks share the host's few cores: reserve half a core each
        engine["parallel"].setdefault("num_cpus_per_worker", 0.5)
        app.setdefault("replica_num_cpus", 0.5)
    app["engine"] = engine
    log_requests = "off" if getattr(args, "disable_log_requests", False) else getattr(args, "log_requests", None)
    for key, value in (("tokenizer", args.tokenizer), ("served_model_name", args.served_model_name),
                       ("num_replicas", args.num_replicas), ("resume_requests", args.resume_requests),
                       ("replica_resource", args.replica_resource),
                       ("api_keys", getattr(args, "api_key", None)), ("api_key_file", getattr(args, "api_key_file", None)),
                       ("admin_api_keys", getattr(args, "admin_api_key", None)),
                       ("admin_api_key_file", getattr(args, "admin_api_key_file", None)),
                       ("public_metrics", getattr(args, "public_metrics", None)), ("log_requests", log_requests),
                       ("otlp_traces_endpoint", getattr(args, "otlp_traces_endpoint", None)),
                       ("api_server_count", getattr(args, "api_server_count", None))):
        if value is not None:  # a flag not given; 0 given is checked by the config
            app[key] = value
    return ServeAppConfig.model_validate(app)


def parse_speculative_config(text: str) -> dict:
    """``--speculative-config``'s JSON object (its fields are checked by ``SpeculativeConfig``)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config: expected a JSON object, got {type(value).__name__}")
    return value


def keyed(cfg: ServeAppConfig) -> bool:
    """Whether the replicas will require a key (the environment variable as this process sees
    it: a Ray started here passes it on)."""
    return bool(cfg.api_keys or cfg.api_key_file or (cfg.api_key_env and os.environ.get(cfg.api_key_env, "").strip()))


def run(args) -> int:
    """Serve until Ctrl-C, on the cluster at ``--address`` or on a local Ray started here."""
    # Ray and the Serve app load here, not at import: ``ray-attn demo`` builds this parser too.
    import ray
    from ray import serve

    from ray_attn.runtime.cluster import init_local_ray
    from ray_attn.serve.app import build_app, deployment_options
    from ray_attn.serve.proxy_auth import CALLBACK, CALLBACK_ENV
    from ray_attn.serve.status import DeployReporter

    cfg = serve_config(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keyed(cfg):
        print(f"ray_attn: WARNING: serving on {args.host} without an API key: anyone who reaches "
              f"port {args.port} can generate (set RAY_ATTN_API_KEY or --api-key-file)", flush=True)
    # Serve's proxy refuses requests without a valid key itself (serve/proxy_auth.py): a Ray
    # started here passes this on to it; a cluster at --address needs it in its own environment.
    os.environ.setdefault(CALLBACK_ENV, CALLBACK)
    started = not ray.is_initialized()
    # Without --address, a Ray of our own ("local"): a bare ray.init() joins any cluster another
    # user started on this machine.
    if args.address:
        ray.init(address=args.address, include_dashboard=False)
    else:
        init_local_ray(include_dashboard=False)
    # SIGINT and SIGTERM both stop Serve and our Ray cleanly (below).  A process started in the
    # background by a shell (`ray-attn serve ... &`, a job runner) inherits SIGINT ignored, and
    # Python then never raises KeyboardInterrupt: a stop that was asked for would wait forever.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        bundles = deployment_options(cfg)["placement_group_bundles"]
        with DeployReporter("ray_attn", bundles, every_s=5.0):  # a replica no node can hold is named, not waited on in silence
            serve.run(build_app(cfg), name="ray_attn", route_prefix="/", blocking=False)
        print(f"ray_attn: serving '{cfg.model_id()}' on http://{args.host}:{args.port}/v1 "
              f"(OpenAI API; /v1/generate, /health, /stats); Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
