"""What the serving numbers are set against: the issue's goals, each a ratio from one run, and
others' published figures, carried into the JSON and the README as context only (other models,
data and hardware: never a like-for-like comparison)."""

from __future__ import annotations

PUBLISHED = [
    dict(source="vLLM PR #8804", setup="vLLM, 1x H100, Llama-3-8B, 1000 ShareGPT prompts, rate inf",
         request_throughput=51.0, output_throughput=6567.0),
    dict(source="NVIDIA NIM", setup="NIM, Llama-3.1-8B, concurrency 1", itl_ms=4.63),
    dict(source="TensorRT-LLM", setup="TRT-LLM, 1x H200, FP8 weights, 1000 in / 1000 out",
         output_throughput=17591.0),
]
# The goals: >= for fractions of a bound, <= for itl_c1_over_roofline (median ITL at
# concurrency 1 over the batch-1 decode roofline: within 10%).
GOALS = {"offline_frac_of_roofline": 0.85, "itl_c1_over_roofline": 1.10, "chunked_prefill_frac_of_gemm": 0.70,
         "decode_256x1k_frac_of_mem_compute_roofline": 0.80, "tp_efficiency_64x4k": 0.85}


def goals(w: dict) -> dict:
    """Each goal of the issue as value, goal and met, where its workload ran."""
    def get(key, field):
        r = w.get(key) or {}
        return r.get(field)

    vals = {"offline_frac_of_roofline": (get("offline", "frac_of_roofline"), ">="),
            "itl_c1_over_roofline": (get("random_concurrency_1", "median_itl_over_roofline"), "<="),
            "chunked_prefill_frac_of_gemm": (get("chunked_prefill", "frac_of_gemm"), ">="),
            "decode_256x1k_frac_of_mem_compute_roofline": (get("decode_256x1k", "frac_of_mem_compute_roofline"), ">=")}
    out = {}
    for k, (v, op) in vals.items():
        if v is not None:
            out[k] = dict(value=v, goal=GOALS[k], met=v >= GOALS[k] if op == ">=" else v <= GOALS[k])
    return out


# Issue 25's goals for FP8 weights, each from the FP8-weights engine and, for the ratios, the bf16
# engine with the same KV dtype in the same run: <= for the two ITL ratios, >= for the others.
FP8_WEIGHT_GOALS = {"itl_c1_vs_bf16": (0.60, "<="), "itl_c1_over_roofline": (1.25, "<="),
                    "offline_throughput_vs_bf16": (1.40, ">="), "chunked_prefill_frac_of_fp8_gemm": (0.70, ">="),
                    "decode_256x1k_frac_of_mem_compute_roofline": (0.80, ">=")}


def fp8_weights_goals(configs: list[dict]) -> dict:
    """{engine name: {goal: value, goal, met}} for each FP8-weights engine of a run."""
    by = {(c.get("weights", "bf16"), c.get("kv_cache_dtype")): c for c in configs if c.get("workloads")}
    out = {}
    for (weights, kv), conf in by.items():
        if weights != "fp8":
            continue
        w, base = conf["workloads"], by.get(("bf16", kv), {}).get("workloads", {})

        def get(ws, key, field):
            return (ws.get(key) or {}).get(field)

        def ratio(a, b):
            return a / b if a is not None and b else None

        vals = {"itl_c1_vs_bf16": ratio(get(w, "random_concurrency_1", "median_itl_ms"),
                                        get(base, "random_concurrency_1", "median_itl_ms")),
                "itl_c1_over_roofline": get(w, "random_concurrency_1", "median_itl_over_roofline"),
                "offline_throughput_vs_bf16": ratio(get(w, "offline", "output_tokens_per_second"),
                                                    get(base, "offline", "output_tokens_per_second")),
                "chunked_prefill_frac_of_fp8_gemm": get(w, "chunked_prefill", "frac_of_gemm"),
                "decode_256x1k_frac_of_mem_compute_roofline": get(w, "decode_256x1k", "frac_of_mem_compute_roofline")}
        out[conf["name"]] = {k: dict(value=v, goal=FP8_WEIGHT_GOALS[k][0],
                                     met=v <= FP8_WEIGHT_GOALS[k][0] if FP8_WEIGHT_GOALS[k][1] == "<="
                                     else v >= FP8_WEIGHT_GOALS[k][0])
                             for k, v in vals.items() if v is not None}
    return out
