"""The accuracy gate's rows (``scripts/gpu_accuracy.py``): each names a feature, the checkpoint
family and prompts it runs on, the engine settings that turn the feature on, and ``expect``: the
check, on the engine's stats and the run's info, that the feature did run (a row whose cascade or
graphs silently stayed off fails however well its tokens agree).  ``rows`` gives the single-engine
rows, ``spec_rows`` the speculative ones (their tokens must equal the same engine's without drafts).
Kept apart from the runner so that a new feature's row is read and written in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import accuracy_lora as lora


@dataclass
class Row:
    name: str
    family: str = "llama"
    prompts: str = "mixed"
    what: str = ""
    cache: dict = field(default_factory=dict)
    parallel: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # ModelConfig overrides on top of config.json
    tp: int = 1
    warm_prefix: bool = False  # serve the shared prefix first, so that the batch hits the cache
    fp8: bool = False
    # FP8 weights (fp8_checkpoints.KINDS): the engine serves the checkpoint in that format; HF runs
    # the same weights dequantized with the format's activation quantization on its linears, in
    # the float32 reference and in the bf16 control alike (the format's definition of the model)
    weights: str = ""
    grammar: bool = False  # decode under SCHEMA (structured outputs), scored under the same mask
    # speculative_config: the engine speculates, and the same engine without it runs too -- the
    # row needs their greedy tokens equal, token for token (info["spec_identical"])
    spec: dict = field(default_factory=dict)
    lora: bool = False  # accuracy_lora's adapters and base requests in one batch, each against its HF model
    # RAY_ATTN_FP8_KERNEL for the row (fp8.FORCE): its rank then runs in this process, where it can be set
    fp8_kernel: str = ""
    # (stats, info) -> why the feature did not run, or None
    expect: Callable[[dict, dict], str | None] = lambda s, i: None


def need(cond: bool, why: str) -> str | None:
    return None if cond else why


def rows(gpu: bool, chunk: int, layers: int) -> list[Row]:
    fa = (lambda i: need(i["kernel"] == "fa3", f"kernel {i['kernel']}, not fa3")) if gpu else (lambda i: None)
    graphs = (lambda i: need(i["cuda_graphs"], "decode steps did not replay CUDA graphs")) if gpu else (lambda i: None)
    default = lambda s, i: fa(i) or graphs(i)
    fp8w = lambda i: need(i.get("fp8_linears", 0) > 0, "the rank holds no e4m3 weights")
    kinds = (["chunked_attention"] * 3 + ["full_attention"]) * layers  # Llama 4's 3:1 pattern
    return [
        Row("bf16", what="bf16, default engine", expect=default),
        Row("fp8", what="fp8 KV cache, scales 1.0", cache=dict(kv_cache_dtype="fp8"), fp8=True, expect=default),
        Row("fp8_calc_scales", what="fp8 KV cache, calculate_kv_scales",
            cache=dict(kv_cache_dtype="fp8", calculate_kv_scales=True), fp8=True, expect=default),
        Row("cascade_one_group", prompts="one_prefix", what="cascade forced, one shared prefix",
            engine=dict(cascade_min_saved_kv_tokens=0),
            expect=lambda s, i: default(s, i) or need(s["cascade_steps"] > 0, "no cascade step")),
        Row("cascade_multi_group", prompts="three_prefixes", what="cascade forced, three prefix groups",
            engine=dict(cascade_min_saved_kv_tokens=0),
            expect=lambda s, i: default(s, i) or need(s["multi_group_cascade_steps"] > 0, "no multi-group cascade step")),
        Row("sliding_window", family="mistral", what="Mistral, sliding window on every layer", expect=default),
        Row("chunked_local", what="chunked-local layers (3 of 4), HF Llama with chunk-masked attention",
            model=dict(layer_types=kinds[:layers], attention_chunk_size=chunk),
            expect=lambda s, i: default(s, i) or need(s["local_steps"] > 0, "no local-attention step")),
        Row("soft_cap", family="gemma2", what="Gemma-2: attention + final soft cap, sliding/full layers",
            expect=default),
        Row("qwen2", family="qwen2", what="Qwen2: q/k/v biases, tied embeddings", expect=default),
        Row("qwen3", family="qwen3", what="Qwen3: per-head q/k RMSNorm, q wider than hidden", expect=default),
        Row("alibi", family="mpt", what="MPT: ALiBi on flash-attn 2 (block 256)", cache=dict(block_size=256),
            expect=lambda s, i: need(i["kernel"] == "fa2", f"kernel {i['kernel']}, not fa2") if gpu else None),
        Row("prefix_cache", what="prefix-cache hits (shared prefix served first)", warm_prefix=True,
            expect=lambda s, i: default(s, i) or need(s["prefix_cache_hit_tokens"] > 0, "no prefix-cache hit")),
        Row("same_step_sharing", prompts="repeats", what="n=3 copies of 4 prompts admitted together "
            "share blocks in the step that computes them", engine=dict(cascade_min_saved_kv_tokens=0),
            expect=lambda s, i: default(s, i) or need(s["prefix_cache_hit_tokens"] > 0, "no in-step prefix hit")),
        Row("preemption", what="preemption by recompute (small KV pool)", cache=dict(num_blocks=200 if gpu else 60),
            expect=lambda s, i: default(s, i) or need(s["preemptions"] > 0, "no preemption")),
        # the preemption row's small pool with a host tier under it: a preempted request's cached
        # blocks are evicted to host memory and copied back when it resumes, instead of recomputed
        Row("host_tier", what="host-memory KV tier under a small pool (evicted prefixes copied back)",
            cache=dict(num_blocks=200 if gpu else 60, host_cache_gib=1.0), warm_prefix=True,
            expect=lambda s, i: default(s, i) or need(s.get("host_hit_blocks", 0) > 0, "no host-tier hit")),
        Row("async_off", what="async scheduling off", engine=dict(async_scheduling=False),
            expect=lambda s, i: fa(i) or need(not i["async"], "async still on")),
        Row("graphs_off", what="CUDA graphs off (eager decode)", parallel=dict(cuda_graphs="off"),
            expect=lambda s, i: fa(i) or need(not i["cuda_graphs"], "graphs still on")),
        Row("llama4", family="llama4", prompts="chunk_edges",
            what="Llama 4 text: chunked-local RoPE layers (decode crosses chunk boundaries), NoPE + temperature "
                 "tuning, L2 q/k norm, sigmoid top-1 MoE + shared expert",
            expect=lambda s, i: default(s, i) or need(s["local_steps"] > 0, "no local-attention step")),
        Row("llama4_cascade", family="llama4_onechunk", prompts="one_prefix",
            what="Llama 4, cascade forced where exact (every key in one chunk)",
            engine=dict(cascade_min_saved_kv_tokens=0),
            expect=lambda s, i: default(s, i) or need(s["cascade_steps"] > 0, "no cascade step")),
        # Issue 37.2's setting: chunk 512, the mixed prompts (8 on a shared 1,200-token prefix, two
        # of 1,500 and 2,400 tokens): long prefills through the grouped GEMM, decode batches of
        # up to 12 through both expert paths, chunk boundaries inside prefills and decodes.
        Row("llama4_moe_mixed", family="llama4_c512", prompts="mixed",
            what="Llama 4, chunk 512, shared 1,200-token prefix + long prompts: sigmoid top-1 MoE on every "
                 "2nd layer through prefill (grouped GEMM) and decode (small-batch kernels, grouped GEMM)",
            expect=lambda s, i: default(s, i) or need(s["local_steps"] > 0, "no local-attention step")),
        Row("mixtral", family="mixtral", what="Mixtral: softmax top-2 of 8 experts, renormalised", expect=default),
        Row("qwen3_moe", family="qwen3_moe", what="Qwen3-MoE: top-4 of 16 experts (norm_topk_prob), a dense "
            "layer, q/k norms", expect=default),
        Row("fp8_weights_online", what="FP8 weights quantized at load (quantization='fp8'): per-channel "
            "weights, dynamic per-token activations", weights="online", expect=lambda s, i: default(s, i) or fp8w(i)),
        Row("fp8_weights_compressed_tensors", what="compressed-tensors FP8_DYNAMIC checkpoint",
            weights="compressed_tensors", expect=lambda s, i: default(s, i) or fp8w(i)),
        Row("fp8_weights_block", what="block-wise FP8 checkpoint (128 x 128 weight blocks, per-group activations)",
            weights="block", expect=lambda s, i: default(s, i) or fp8w(i)),
        Row("fp8_weights_fp8_kv", what="compressed-tensors FP8 weights with the fp8 KV cache",
            weights="compressed_tensors", cache=dict(kv_cache_dtype="fp8"), fp8=True,
            expect=lambda s, i: default(s, i) or fp8w(i)),
        # one sequence a step, so every decode linear has one row: the weight-only GEMV (w8a16,
        # issue 39) on all of them, where a GPU's table puts it on some shapes of real models only
        Row("fp8_weights_w8a16", what="FP8 weights quantized at load, decoded one sequence at a time through "
            "the weight-only GEMV (bf16 activations)", weights="online", fp8_kernel="w8a16",
            engine=dict(max_num_seqs=1), expect=lambda s, i: default(s, i) or fp8w(i)),
        Row("json_schema", what="JSON-schema structured output (xgrammar mask on rank 0), byte vocabulary",
            grammar=True, expect=default),
        *spec_rows(default),
        Row("lora", what="four PEFT adapters (r4-r16, every target module) and the base model in one batch, "
            "each against HF on peft's merged model", lora=True,
            expect=lambda s, i: default(s, i) or need(i["lora_shift"] >= lora.MIN_SHIFT,
                                                      f"adapters moved agreement by {i['lora_shift']:.1f} points only")),
        Row("tp2_graphs", what="TP=2, CUDA graphs on (NCCL inside)", tp=2, parallel=dict(cuda_graphs="on"),
            expect=default),
        Row("tp2_eager", what="TP=2, CUDA graphs off", tp=2, parallel=dict(cuda_graphs="off"),
            expect=lambda s, i: fa(i)),
    ]


# n-gram drafts verified in the step (always on: the gate's batch is larger than the CPU default limit)
NGRAM = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
             disable_by_batch_size=None)
# a draft model: "target" stands for the row's own checkpoint folder (engine_config fills it in)
DRAFT = dict(method="draft_model", num_speculative_tokens=4, model="target", disable_by_batch_size=None)


def spec_rows(default) -> list[Row]:
    """Speculative greedy against non-speculative greedy, token for token: bf16 and fp8 KV, and
    with cascade forced over a shared prefix."""
    def ran(s, i):
        if i["spec_identical"] != i["num_prompts"]:
            return (f"speculative greedy differs from plain greedy in {i['num_prompts'] - i['spec_identical']} "
                    f"output(s) (first forks at {i['spec_forks']})")
        return (need(s["spec_num_accepted_tokens"] > 0, "no draft was accepted")
                or need(s["spec_num_draft_tokens"] > s["spec_num_accepted_tokens"], "no draft was rejected"))

    def drafted(s, i):
        if i["spec_identical"] != i["num_prompts"]:
            return ran(s, i)
        return need(s["spec_num_accepted_tokens"] > 0, "no draft was accepted")

    def cascaded(check):
        return lambda s, i: check(s, i) or need(s["cascade_steps"] > 0, "no cascade step")

    # Both runs of a row in batch-invariant mode (ParallelConfig.batch_invariant): a plain step runs
    # a request as one query row, a verifying one as 1 + k, and only kernels whose rows do not
    # depend on the batch round them alike in bf16 (without it, near-ties fork: issue 40's note).
    # The cascade rows cascade as the mode does, on a fixed grid of prefix boundaries
    # (planner/invariant.py); at 256 tokens the shared prefix spans several of its lines.
    inv = dict(batch_invariant=True)
    grid = inv | dict(batch_invariant_cascade_grid=256)
    rows = []
    # the draft model is the target's own checkpoint: its drafts are the target's argmax, so nearly
    # all are accepted (rejections: tests/spec/test_draft_model.py, with another draft)
    for name, spec, check, what in (("ngram", NGRAM, ran, "n-gram speculation (k=4)"),
                                    ("draft", DRAFT, drafted, "draft-model speculation (k=4, the target as its draft)")):
        expect = lambda s, i, check=check: default(s, i) or check(s, i)  # noqa: E731
        rows += [
            Row(f"spec_{name}", prompts="repeating", what=f"{what}: greedy equals plain greedy", spec=spec,
                parallel=inv, expect=expect),
            Row(f"spec_{name}_fp8", prompts="repeating", what=f"{what} with the fp8 KV cache", spec=spec,
                cache=dict(kv_cache_dtype="fp8"), fp8=True, parallel=inv, expect=expect),
            Row(f"spec_{name}_cascade", prompts="repeating_prefix", what=f"{what}, cascade on its grid", spec=spec,
                parallel=grid, expect=cascaded(expect)),
            Row(f"spec_{name}_fp8_cascade", prompts="repeating_prefix", spec=spec, cache=dict(kv_cache_dtype="fp8"),
                what=f"{what}, fp8 KV, cascade on its grid", fp8=True, parallel=grid, expect=cascaded(expect)),
        ]
    return rows
