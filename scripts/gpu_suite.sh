#!/usr/bin/env bash
# What we run on the lent GPU machine, in as few calls as possible (see shared/device/README.md):
#   run(carry=[".device"], command="source .device/env.sh && bash scripts/gpu_suite.sh kernels")
# Stages: tests | kernels (tests + attention/cascade/step-overhead benchmarks + decode profile) |
# benches (the benchmarks without the tests) | profile | cascade | e2e | tp | all |
# async (async-scheduling GPU tests + step overhead, tiny and 8B) | attention (+ profile) |
# accuracy (every feature through the engine against HF transformers; ACCURACY_ROWS=a,b and
# ACCURACY_SUFFIX=_tp2 pick rows and the result file) | serving (one H200: the KV-sizing GPU
# tests, then scripts/gpu_serving.py -- bf16 and fp8 KV engines, every serving workload, the
# token-budget sweep and kv_capacity on the bf16 engine) | serving_tp2 (nvidia-h200-x2: the same
# workloads at TP=2, bf16, and a TP=1 engine for the 64 x 4k efficiency) | serving_http (one H200:
# the same workloads over HTTP through the Serve app, scripts/gpu_http_serving.py; needs
# `bash scripts/device/stage_serve.sh` here first, for Serve's HTTP stack).  SERVING_DEADLINE_S
# (default 420 for serving, 480 for serving_tp2) stops starting workloads after that long, so the
# call ends inside its limit; SERVING_ARGS adds flags (e.g. "--scale 0.5").  moe_tiers: the MoE
# and KV-tier GPU tests, the small-batch MoE kernels against the grouped GEMM (bench_moe), the tier
# copies against a bare pinned copy (bench_kv_tiers --part copy), and their accuracy rows.
# fp8: the FP8-weight GPU tests, the fp8_weights_* accuracy rows (gpu_accuracy_fp8_weights.json) and
# bench_fp8 (FP8_PARTS, default error,kernels); fp8_serving: bf16 and FP8-weight engines through the
# serving suite's concurrency-1, offline, chunked-prefill and decode workloads.
# spec (issue 40): bench_spec_verify, the verify cost of k drafts against a plain step; draft: the
# draft model's GPU tests, its accuracy rows and its step cost (8B target, 1B draft).
# fp8_codes (issue 39): the codes-only FP8 SiLU-mul's GPU tests, FP8 rows and the FP8 prefill step's kernels.
# fusion (issue 39): the fused kernels' GPU tests, the decode kernel table of four presets, Inductor
# against our kernels (bench_fusion), the verify cost of drafts; fusion_rows: the bf16/FP8
# concurrency-1 ITL (NO_SERVING=1 skips it) and accuracy rows (ACCURACY_ROWS, result
# gpu_accuracy_fusion.json, --update: two calls fill it).
# lora (issue 41): the LoRA GPU tests, bench_lora (cost and kernel table), the lora accuracy row and
# the adapter loads under 32 streams (bench_lora_load; NO_LOAD=1 skips it).
# lora_tune: the LoRA kernels' launch settings tuned in CUDA graphs (bench_lora_kernels.py --write,
# TUNE_BUDGET_S, TUNE_ARGS), written to ray_attn/lora/configs/ and $OUT, then bench_lora with them.
# defects (issue 37): the grammar and GGUF wheels from .whl/ (stage them with
# scripts/device/stage_wheels.sh), the GPU tests the defects touch, the Llama 4 MoE probe and the
# rows of the features changed; real_model (issue 38): SmolLM2 from .gg1/ + .gg2/ (the GGUF in two
# parts, one a call: see that script) through the engine, scored against HF (gpu_real_model.py).
# issue39_tune: this GPU's decode tables (tune_decode_gemv --write: GEMV tiles, w8a16 where it beats
# the skinny kernel; tune_moe_small), the table to $OUT -- a card without a table runs the defaults;
# issue39: the ratios issue 39 states, on this code: the decode kernel table of the four presets
# (MoE at --memory-fraction 0.93 on 80 GB), then the bf16/FP8 serving suite's concurrency-1, offline
# and decode 256 x 1k. invariant (issue 40): the batch-invariant GPU tests, the spec rows, the mode's
# step cost (profile_decode --batch-invariant). pages (issue 39): the FA3 split/pack-GQA/page sweep, then decode
# 256 x 1k at the page sizes PAGES names (SPEC_PROFILE=1: and the verify cost's host profile). skinny (issue
# 40): the bf16 skinny kernel tuned against cuBLAS and written to the table, its GPU tests, the verify cost
# (ACCURACY_ROWS=a,b adds gate rows). offline (issue 39): the offline workload, bf16 and FP8 weights, at
# max_num_seqs 256 and at OFFLINE_SEQS (default 512, graphs to 512: vLLM's scale on this class of
# GPU; sim_offline_schedule.py predicts it), then one 8192-token prefill step profiled by kernel kind.
# kvfit (issue 39): the KV tier's working-set-fits ratio, FIT_REPEATS runs of each setting in one call.
# tunableop (issue 39): decode's GEMMs with cuBLAS's algorithms picked by TunableOp's timing against its heuristic.
# hostile (issue 42, a machine with cores to spare): the CPU app of deploy/serve_config.yaml under `serve run` with
# an API key and the proxy's refusal on, then HOSTILE_RUNS (default 3) runs of hostile_burst.py with the key: an
# unkeyed flood of 1,000 requests from 50 addresses against a keyed client's p99 (needs scripts/device/stage_serve.sh);
# once for each api_server_count in API_SERVERS (default "1"; e.g. "1 2 4").
# decode256 (issue 39): decode 256 x 1k's kernel table (PRESETS, default llama-3-8b; MEMORY_FRACTION, default
# 0.9: 256 x 1k of an 8B's KV is 34 GB, which half of an 80 GB card does not hold).
# Results land in benchmarks/results/ and, on the device tool, are copied to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
stage=${1:-all}
log=benchmarks/results/gpu_suite_${stage}.log
mkdir -p benchmarks/results
exec > >(tee "$log") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { echo "=== $* ($(date +%T))"; "$@"; }
bench() {  # run a benchmark script, then hand its JSON and PNG back through $OUT
  local name; name=$(basename "$1" .py)
  step python3 "$@"
  [[ -n ${OUT:-} ]] && cp "benchmarks/results/$name.json" "benchmarks/results/$name.png" "$OUT"/ 2>/dev/null
  return 0
}
if [[ $stage == tests || $stage == kernels || $stage == all ]]; then
  step python3 -m pytest -m gpu tests/backend tests/model tests/runtime/test_cuda_graphs.py -q -p no:cacheprovider || exit 1
fi
if [[ $stage == kernels || $stage == benches || $stage == all ]]; then
  bench scripts/bench_attention.py
  bench scripts/bench_cascade.py
  bench scripts/bench_step_overhead.py --batch 64 --steps 200
fi
if [[ $stage == profile || $stage == kernels || $stage == all ]]; then
  step python3 scripts/profile_decode.py
fi
if [[ $stage == async ]]; then  # async scheduling: its GPU tests, then the step cost with and without
  step python3 -m pytest -m gpu tests/runtime -q -p no:cacheprovider || exit 1
  bench scripts/bench_step_overhead.py --batch 64 --steps 200 --rounds 2
  bench scripts/bench_step_overhead.py --model 8b --batch 64 --steps 40 --rounds 2
  cp benchmarks/results/bench_step_overhead_8b.* "${OUT:-/tmp}"/ 2>/dev/null
fi
if [[ $stage == attention ]]; then
  bench scripts/bench_attention.py
  step python3 scripts/profile_decode.py
fi
if [[ $stage == cascade ]]; then
  bench scripts/bench_cascade.py
fi
if [[ $stage == accuracy || $stage == all ]]; then  # the correctness gate (scripts/gpu_accuracy.py)
  step python3 scripts/repro_fp8.py --json benchmarks/results/repro_fp8.json
  step python3 scripts/gpu_accuracy.py ${ACCURACY_ROWS:+--rows $ACCURACY_ROWS} ${ACCURACY_SUFFIX:+--suffix $ACCURACY_SUFFIX}
  [[ -n ${OUT:-} ]] && cp benchmarks/results/repro_fp8.json "$OUT"/ 2>/dev/null
fi
if [[ $stage == moe_tiers ]]; then
  step python3 -m pytest -m gpu tests/model/test_moe_small.py tests/model/test_moe.py tests/runtime/test_kv_tiers.py \
    -q -p no:cacheprovider
  step python3 scripts/bench_kv_tiers.py --device cuda --part copy --iters 30 --output benchmarks/results/bench_kv_tiers_cuda.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_kv_tiers_cuda.* "$OUT"/ 2>/dev/null
  bench scripts/bench_moe.py --scout-layers 12
  step python3 scripts/gpu_accuracy.py --rows host_tier,qwen3_moe,llama4,bf16
fi
if [[ $stage == fp8 ]]; then  # FP8 weights: the GPU tests, the accuracy rows, every FP8 GEMM path against bf16
  step python3 -m pytest -m gpu tests/model/test_fp8_weights.py -q -p no:cacheprovider --tb=line
  step python3 scripts/gpu_accuracy.py --suffix _fp8_weights \
    --rows fp8_weights_online,fp8_weights_compressed_tensors,fp8_weights_block,fp8_weights_fp8_kv
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_fp8_weights.json "$OUT"/
  bench scripts/bench_fp8.py --parts ${FP8_PARTS:-error,kernels} --rows ${FP8_ROWS:-1,2,4,8,16,32,64,128,256,1024,4096}
fi
if [[ $stage == fp8_codes ]]; then  # session 66's codes-only FP8 SiLU-mul: its GPU tests, the FP8 rows that run it
  # (online quantization) and the one-row path beside it, then the FP8 prefill step's kernels (compare
  # `_silu_mul_quant_kernel` and the step with profile_prefill_h100.json: 347 us a layer, 126 ms, before)
  step timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/model/test_fusions.py \
    tests/model/test_fp8_weights.py
  step timeout "${ROWS_TIMEOUT_S:-200}" python3 scripts/gpu_accuracy.py --suffix _fp8_codes \
    --rows "${ACCURACY_ROWS:-fp8_weights_online,fp8_weights_fp8_kv,fp8_weights_w8a16}"
  step timeout "${PROFILE_TIMEOUT_S:-130}" python3 scripts/profile_decode.py --points "" --prefill 8192 \
    --presets llama-3-8b:fp8 --top 14 --json benchmarks/results/profile_prefill_fp8_codes.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_fp8_codes.json benchmarks/results/profile_prefill_fp8_codes.json \
    "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == fusion ]]; then
  step timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/model/test_fusions.py tests/model/test_fused.py \
    tests/model/test_gemv.py "tests/model/test_fp8_weights.py::test_gpu_model_matches_cpu_float32"
  step timeout 150 python3 scripts/profile_decode.py --points 1x1024 --presets llama-3-8b,llama-3-8b:fp8,qwen3-30b-a3b,llama-4-scout \
    --json benchmarks/results/profile_decode_kernels_fused.json
  bench scripts/bench_fusion.py
  [[ -n ${OUT:-} ]] && cp benchmarks/results/profile_decode_kernels_fused.json "$OUT"/ 2>/dev/null
  step timeout 240 python3 scripts/bench_spec_verify.py --batch 1 8 32 --k 1 4 8 --steps 20 --rounds 3 --profile
  [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_spec_verify.json "$OUT"/ 2>/dev/null
fi
if [[ $stage == fusion_rows ]]; then
  [[ -z ${NO_SERVING:-} ]] && step python3 scripts/gpu_serving.py --weights bf16,fp8 --kv-dtypes auto --suffix _fusion \
    --no-capacity --budget-sweep "" --only random_concurrency_1 --deadline-s "${SERVING_DEADLINE_S:-240}" ${OUT:+--mirror-dir "$OUT"}
  step python3 scripts/gpu_accuracy.py --rows "$ACCURACY_ROWS" --suffix _fusion --update
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_fusion.json "$OUT"/ 2>/dev/null
fi
if [[ $stage == fp8_serving ]]; then  # FP8 weights against bf16 in the serving suite (issue 25's speed goals)
  step python3 scripts/gpu_serving.py --weights bf16,fp8 --kv-dtypes auto --suffix _fp8_weights --no-capacity \
    --budget-sweep "" --only random_concurrency_1,offline,chunked_prefill,decode_256x1k \
    --deadline-s "${SERVING_DEADLINE_S:-420}" ${OUT:+--mirror-dir "$OUT"} ${SERVING_ARGS:-}
fi
if [[ $stage == e2e || $stage == all ]]; then
  bench scripts/bench_e2e.py
fi
if [[ $stage == tp || $stage == all ]]; then
  bench scripts/bench_tp.py
fi
if [[ $stage == serving ]]; then
  step python3 -m pytest -m gpu tests/runtime/test_memory.py -q -p no:cacheprovider
  step python3 scripts/gpu_serving.py --deadline-s "${SERVING_DEADLINE_S:-420}" ${OUT:+--mirror-dir "$OUT"} \
    ${SERVING_ARGS:-}
fi
if [[ $stage == serving_tp2 ]]; then
  step python3 scripts/gpu_serving.py --tp 2 --kv-dtypes auto --no-capacity --budget-sweep "" \
    --deadline-s "${SERVING_DEADLINE_S:-480}" ${OUT:+--mirror-dir "$OUT"} ${SERVING_ARGS:-}
fi
if [[ $stage == serving_http ]]; then
  [[ -f .device/serve_env.sh ]] || { echo "run bash scripts/device/stage_serve.sh on the host first"; exit 1; }
  source .device/serve_env.sh || exit 1
  step python3 scripts/gpu_http_serving.py --deadline-s "${SERVING_DEADLINE_S:-420}" ${OUT:+--mirror-dir "$OUT"} \
    ${SERVING_ARGS:-}
fi
if [[ $stage == serving || $stage == serving_tp2 || $stage == serving_http ]]; then
  [[ -n ${OUT:-} ]] && cp "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == defects || $stage == real_model || $stage == rest || $stage == lora ]] && [[ -d .whl && ! -f /tmp/site/.wheels ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.wheels || exit 1
fi
if [[ $stage == defects ]]; then
  step timeout "${TESTS_TIMEOUT_S:-230}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_memory.py \
    tests/runtime/test_structured_output.py tests/runtime/test_grammar_backends.py tests/backend/test_flash_attn.py \
    tests/model/test_gpu.py tests/model/test_gemv.py tests/model/test_moe_small.py tests/model/test_gguf.py
  bench scripts/probe_llama4_moe.py --device cuda
  step timeout "${ROWS_TIMEOUT_S:-240}" python3 scripts/gpu_accuracy.py --suffix _defects \
    --rows "${ACCURACY_ROWS:-llama4_moe_mixed,llama4,json_schema,bf16}"
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_defects.json "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == real_model ]]; then
  gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  cat .gg1/part_* .gg2/part_* > $gguf && echo "$(cat .gg2/sha256)  $gguf" | sha256sum -c - || exit 1
  step python3 scripts/gpu_real_model.py --device cuda --gguf $gguf
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_real_model.json "$OUT"/ 2>/dev/null
  if [[ -n ${ACCURACY_ROWS:-} ]]; then
    step timeout "${ROWS_TIMEOUT_S:-300}" python3 scripts/gpu_accuracy.py --suffix _real_model --rows "$ACCURACY_ROWS"
    [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_real_model.json "$OUT"/ 2>/dev/null
  fi
  [[ -n ${OUT:-} ]] && cp "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == spec ]]; then  # issue 40: what verifying k drafts costs (k = 0..8; batch 1 and where it stops paying)
  bench scripts/bench_spec_verify.py --batch ${SPEC_BATCHES:-1 8 32 64}
fi
if [[ $stage == draft ]]; then  # issue 40: the draft model -- its GPU tests (captured graphs), its gate rows
  # (the target's checkpoint as its own draft) and its step against a plain one (8B target, 1B draft)
  step timeout "${TESTS_TIMEOUT_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
    tests/spec/test_draft_model.py tests/spec/test_spec_graphs.py
  step timeout "${ROWS_TIMEOUT_S:-200}" python3 scripts/gpu_accuracy.py --suffix _draft \
    --rows "${ACCURACY_ROWS:-spec_draft,spec_draft_fp8,spec_draft_cascade}"
  step timeout "${BENCH_TIMEOUT_S:-200}" python3 scripts/bench_spec_verify.py --draft-preset llama-3.2-1b \
    --k ${DRAFT_K:-0 2 4} --json benchmarks/results/bench_spec_verify_draft.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_draft.json benchmarks/results/bench_spec_verify_draft.json \
    "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == lora_tune ]]; then
  step timeout 420 python3 scripts/bench_lora_kernels.py --write --budget-s "${TUNE_BUDGET_S:-300}" \
    --out benchmarks/results/bench_lora_kernels.json ${TUNE_ARGS:-}
  [[ -n ${OUT:-} ]] && cp ray_attn/lora/configs/*.json benchmarks/results/bench_lora_kernels.json "$OUT"/ 2>/dev/null
  step timeout "${BENCH_TIMEOUT_S:-150}" python3 scripts/bench_lora.py --out benchmarks/results/bench_lora.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_lora.json "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == lora ]]; then  # issue 41: the LoRA GPU tests (punica kernels, engine vs peft) and the gate's lora row
  step timeout "${TESTS_TIMEOUT_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/lora/test_punica.py tests/lora/test_lora_gpu.py
  step timeout "${BENCH_TIMEOUT_S:-200}" python3 scripts/bench_lora.py --out benchmarks/results/bench_lora.json
  step timeout "${ROWS_TIMEOUT_S:-200}" python3 scripts/gpu_accuracy.py --suffix _lora --rows "${ACCURACY_ROWS:-lora}"
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_lora.json benchmarks/results/bench_lora.json "$log" "$OUT"/ 2>/dev/null
  [[ -z ${NO_LOAD:-} ]] && step timeout "${LOAD_TIMEOUT_S:-200}" python3 scripts/bench_lora_load.py \
    --json benchmarks/results/bench_lora_load_cuda.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_lora_load_cuda.json "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == issue39_tune ]]; then
  step timeout "${TUNE_TIMEOUT_S:-300}" python3 scripts/tune_decode_gemv.py --write
  step timeout "${TUNE_TIMEOUT_S:-200}" python3 scripts/tune_moe_small.py
  [[ -n ${OUT:-} ]] && cp ray_attn/model/configs/*.json benchmarks/results/tune_decode_gemv.json \
    benchmarks/results/tune_moe_small.json "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == issue39 ]]; then
  step timeout "${PROFILE_TIMEOUT_S:-200}" python3 scripts/profile_decode.py --points 1x1024 --memory-fraction 0.93 \
    --presets llama-3-8b,llama-3-8b:fp8,qwen3-30b-a3b,llama-4-scout --json benchmarks/results/profile_decode_issue39.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/profile_decode_issue39.json "$OUT"/ 2>/dev/null
  step python3 scripts/gpu_serving.py --weights bf16,fp8 --kv-dtypes auto --suffix _issue39 --no-capacity \
    --budget-sweep "" --only random_concurrency_1,offline,decode_256x1k \
    --deadline-s "${SERVING_DEADLINE_S:-330}" ${OUT:+--mirror-dir "$OUT"}
  [[ -n ${OUT:-} ]] && cp "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == invariant ]]; then
  step timeout "${TESTS_TIMEOUT_S:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
    tests/backend/test_batch_invariant.py
  step timeout "${ROWS_TIMEOUT_S:-240}" python3 scripts/gpu_accuracy.py --suffix _invariant \
    --rows "${ACCURACY_ROWS:-spec_ngram,spec_ngram_fp8,spec_draft,spec_draft_fp8,spec_ngram_cascade,spec_ngram_fp8_cascade,spec_draft_cascade,spec_draft_fp8_cascade,fp8_weights_w8a16}"
  step timeout "${PROFILE_TIMEOUT_S:-150}" python3 scripts/profile_decode.py --points 1x1024,64x1024 \
    --presets llama-3-8b --batch-invariant --json benchmarks/results/profile_decode_invariant.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_invariant.json benchmarks/results/profile_decode_invariant.json \
    "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == pages ]]; then  # issue 39's decode 256 x 1k: FA3 splits x pack-GQA x page size, then the
  # serving suite's decode workload at the page sizes PAGES names (bf16); SPEC_PROFILE=1 adds the verify cost's profile
  step timeout "${PROBE_TIMEOUT_S:-180}" python3 scripts/probe_fa3_splits.py --points 256x1024,64x1024,64x4096 \
    --pages 16,64,128 --pack-gqa auto,on,off
  [[ -n ${OUT:-} ]] && cp benchmarks/results/probe_fa3_splits.json "$OUT"/ 2>/dev/null
  for page in ${PAGES:-16 64}; do
    step timeout "${SERVING_TIMEOUT_S:-150}" python3 scripts/gpu_serving.py --weights bf16 --kv-dtypes auto \
      --suffix "_page$page" --block-size "$page" --no-capacity --budget-sweep "" --only decode_256x1k \
      ${OUT:+--mirror-dir "$OUT"}
  done
  if [[ -n ${SPEC_PROFILE:-} ]]; then
    step timeout "${BENCH_TIMEOUT_S:-150}" python3 scripts/bench_spec_verify.py --k 0 4 --steps 20 --rounds 3 --profile \
      --json benchmarks/results/bench_spec_verify_profile.json
    [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_spec_verify_profile.json "$OUT"/ 2>/dev/null
  fi
  [[ -n ${OUT:-} ]] && cp "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == skinny ]]; then  # issue 40: the bf16 skinny kernel for 2-16 rows -- tuned against cuBLAS on
  # the 8B's shapes (entries written only where it won), its GPU tests, then the verify cost with it
  # NO_TUNE=1 keeps the table this checkout has for the GPU (its entries are what the rest measures)
  [[ -z ${NO_TUNE:-} ]] && step timeout "${TUNE_TIMEOUT_S:-200}" python3 scripts/tune_decode_gemv.py \
    --presets "${TUNE_PRESETS:-llama-3-8b}" --kernels skinny --write --name tune_skinny
  [[ -n ${OUT:-} ]] && cp ray_attn/model/configs/*.json benchmarks/results/tune_skinny.json "$OUT"/ 2>/dev/null
  step timeout "${TESTS_TIMEOUT_S:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
    tests/model/test_skinny.py tests/model/test_gemv.py tests/model/test_kernel_configs.py ${SKINNY_TESTS:-}
  step timeout "${BENCH_TIMEOUT_S:-150}" python3 scripts/bench_spec_verify.py --k ${SPEC_K:-0 4} --batch ${SPEC_BATCHES:-1} \
    --steps 20 --rounds 3 --phases \
    --json benchmarks/results/bench_spec_verify_skinny.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_spec_verify_skinny.json "$OUT"/ 2>/dev/null
  if [[ -n ${ACCURACY_ROWS:-} ]]; then
    step timeout "${ROWS_TIMEOUT_S:-200}" python3 scripts/gpu_accuracy.py --suffix _skinny --rows "$ACCURACY_ROWS"
    [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_skinny.json "$OUT"/ 2>/dev/null
  fi
  [[ -n ${OUT:-} ]] && cp "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == offline ]]; then
  tag=${SUFFIX:-}
  for seqs in 256 "${OFFLINE_SEQS:-512}"; do
    step timeout "${OFFLINE_TIMEOUT_S:-170}" python3 scripts/gpu_serving.py --weights "${WEIGHTS:-bf16,fp8}" \
      --kv-dtypes auto --no-capacity --budget-sweep "" --only offline --max-num-seqs "$seqs" \
      --cuda-graph-max-batch "$(( seqs < 512 ? seqs : 512 ))" --suffix "_offline${seqs}${tag}" ${OUT:+--mirror-dir "$OUT"}
  done
  step timeout "${PROFILE_TIMEOUT_S:-130}" python3 scripts/profile_decode.py --points "" --prefill 8192 \
    --presets llama-3-8b,llama-3-8b:fp8 --top 14 --json "benchmarks/results/profile_prefill${tag}.json"
  [[ -n ${OUT:-} ]] && cp "benchmarks/results/profile_prefill${tag}.json" "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == verify ]]; then  # issue 40 on whatever card comes: the decode kernels' GPU tests, the card's
  # tables tuned when the checkout has none for it (TUNE=1 retunes; MARGIN: tune_decode_gemv's
  # --skinny-margin), then k=4 against plain, A/B over AB_VAR's values AB_VALUES in turn, PAIRS
  # times (default: the tables on and off), the last pair with --phases (host against GPU wait)
  [[ -z ${NO_TESTS:-} ]] && step timeout "${TESTS_TIMEOUT_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    --tb=short tests/model/test_skinny.py tests/model/test_gemv.py tests/model/test_fusions.py
  card=$(python3 -c "import torch; from ray_attn.model import kernel_configs as c
print(c.CONFIG_DIR / c.file_name(torch.cuda.get_device_name(0)))" 2>/dev/null)
  echo "table: $card"
  if [[ -n ${TUNE:-} || ! -f $card ]]; then
    step timeout "${TUNE_TIMEOUT_S:-240}" python3 scripts/tune_decode_gemv.py --presets llama-3-8b \
      --kernels gemv,skinny --write --skinny-margin "${MARGIN:-1.0}" --name tune_verify
    [[ -n ${OUT:-} ]] && cp "$card" benchmarks/results/tune_verify.json "$OUT"/ 2>/dev/null
  fi
  ab=${AB_VAR:-RAY_ATTN_KERNEL_CONFIGS}
  for i in $(seq "${PAIRS:-2}"); do
    phases=""; [[ $i == "${PAIRS:-2}" ]] && phases=--phases
    for v in ${AB_VALUES:-1 0}; do
      echo "--- $ab=$v pair $i"
      env "$ab=$v" timeout "${BENCH_TIMEOUT_S:-120}" python3 scripts/bench_spec_verify.py --k 0 4 --batch 1 \
        --steps 20 --rounds 3 $phases --json "benchmarks/results/bench_spec_verify_k4_${v}_$i.json"
    done
  done
  [[ -n ${OUT:-} ]] && cp "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == decode256 ]]; then  # issue 39: decode 256 x 1k's kernel table, one preset at a time (the JSON
  # is rewritten after each, so a call that runs out of time keeps what finished); PRESETS, STEPS
  step timeout "${PROFILE_TIMEOUT_S:-420}" python3 scripts/profile_decode.py --points 256x1024 \
    --presets "${PRESETS:-llama-3-8b}" --steps "${STEPS:-10}" --top 16 \
    --memory-fraction "${MEMORY_FRACTION:-0.9}" --json "benchmarks/results/profile_decode_256${SUFFIX:-}.json"
  [[ -n ${OUT:-} ]] && cp "benchmarks/results/profile_decode_256${SUFFIX:-}.json" "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == tunableop ]]; then  # issue 39: decode's GEMMs with cuBLAS's algorithm picked by timing (torch's
  # TunableOp) against its heuristic: the kernel table with TunableOp off, then a run that tunes (each GEMM
  # shape timed over the algorithms for TUNE_MS, before the graphs are captured; the CSV is written at
  # exit), then one that only reads the CSV, as a server would run -- the figure to compare with "off"
  tune_csv=benchmarks/results/tunableop_results.csv
  for mode in off tune tuned; do
    on=1; tuning=0
    [[ $mode == off ]] && on=0
    [[ $mode == tune ]] && tuning=1
    step env PYTORCH_TUNABLEOP_ENABLED=$on PYTORCH_TUNABLEOP_TUNING=$tuning PYTORCH_TUNABLEOP_FILENAME="$tune_csv" \
      PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS="${TUNE_MS:-30}" timeout "${PROFILE_TIMEOUT_S:-200}" \
      python3 scripts/profile_decode.py --points "${POINTS:-64x1024,256x1024}" --presets "${PRESETS:-llama-3-8b}" \
      --steps "${STEPS:-10}" --top 8 --memory-fraction "${MEMORY_FRACTION:-0.9}" \
      --json "benchmarks/results/profile_decode_tunableop_$mode.json"
  done
  [[ -n ${OUT:-} ]] && cp benchmarks/results/profile_decode_tunableop_*.json benchmarks/results/tunableop_results*.csv \
    "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == kvfit ]]; then  # issue 39's last item: the KV tier where the working set fits, tier on / off
  # >= 0.98, with FIT_REPEATS (default 5) runs of each setting in one call (the host part of bench_kv_tiers)
  step timeout "${KVFIT_TIMEOUT_S:-540}" python3 scripts/bench_kv_tiers.py --device cuda --part host --users 32 \
    --turns 6 --concurrency 10 --fit-users 8 --fit-repeats "${FIT_REPEATS:-5}" \
    --output benchmarks/results/bench_kv_tiers_fit.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/bench_kv_tiers_fit.* "$log" "$OUT"/ 2>/dev/null
fi
if [[ $stage == hostile ]]; then  # issue 42's flood where the server and the flood's client have cores of their own
  [[ -f .device/serve_env.sh ]] || { echo "run bash scripts/device/stage_serve.sh on the host first"; exit 1; }
  source .device/serve_env.sh || exit 1
  key=$(python3 -c "import secrets; print(secrets.token_urlsafe(24))")
  nproc
  # A `serve run` that outlived an earlier call (one cut by a timeout) keeps a proxy on port 8000 with its own
  # key: the new app's proxies would share the port with it (SO_REUSEPORT) and the keyed client would fail.
  port_taken() { python3 -c "import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', 8000)) != 0)"; }
  if port_taken; then
    echo "something already listens on port 8000 (an earlier call's serve run?): not measuring"; exit 1
  fi
  stop_serve() {  # SIGINT lets serve run shut Serve and its local cluster down; KILL only what is left after
    kill -INT -- -"$1" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -"$1" 2>/dev/null
    for _ in $(seq 30); do port_taken || break; sleep 1; done
  }
  for n in ${API_SERVERS:-1}; do  # HTTP proxies on the port: Serve's and n - 1 more (api_server_count)
    cfg=benchmarks/results/hostile_serve_config_$n.yaml
    python3 -c "import sys, yaml; c = yaml.safe_load(open('deploy/serve_config.yaml'))
c['applications'][0]['args']['api_server_count'] = int(sys.argv[2]); yaml.safe_dump(c, open(sys.argv[1], 'w'))" "$cfg" "$n"
    # A background job of a script starts with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt: serve run would sleep through stop_serve's SIGINT.  Restored before the exec.
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ray_attn.serve.proxy_auth:proxy_middlewares RAY_ATTN_API_KEY=$key \
      setsid python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' \
      python3 -m ray.serve.scripts run -a local "$cfg" > "benchmarks/results/hostile_serve_$n.log" 2>&1 &
    serve_pid=$!
    trap 'stop_serve "$serve_pid"' EXIT  # a timeout's TERM still stops it
    up=0
    for _ in $(seq 240); do  # up: this app, which takes this call's key
      python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/v1/models', timeout=2,
        headers={'Authorization': 'Bearer $key'}).status_code != 200)" 2>/dev/null && { up=1; break; }
      sleep 1
    done
    if [[ $up == 1 ]]; then
      sleep $(( n > 1 ? 15 : 0 ))  # the replica's keeper starts the extra proxies after the app is up
      for i in $(seq "${HOSTILE_RUNS:-3}"); do
        step timeout 150 python3 scripts/hostile_burst.py --api-key "$key" --requests 1000 --addresses 50 \
          --idle-s "${IDLE_S:-15}" --check --output "benchmarks/results/hostile_burst_keyed_device_s${n}_$i.json"
      done
      cat /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null | grep -c "by=proxy"  # refused in a proxy
      grep -h "api_server_count: started" /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null | cut -c1-160
    else
      echo "the app did not come up"; tail -40 "benchmarks/results/hostile_serve_$n.log"
    fi
    stop_serve "$serve_pid"; trap - EXIT
  done
  python3 - <<'PY'
import glob, json
for f in sorted(glob.glob("benchmarks/results/hostile_burst_keyed_device_s*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[1], "burst", d["wall_s"], "s; keyed p99 ratio", d["keyed_p99_ratio"], "p50 alone/burst",
          d["keyed_alone"]["p50_s"], d["keyed_during_burst"]["p50_s"], "proxy health p99", d["proxy_health_during_burst"]["p99_s"])
PY
  [[ -n ${OUT:-} ]] && tar czf "$OUT/hostile.tgz" benchmarks/results/hostile_burst_keyed_device_s*.json \
    benchmarks/results/hostile_serve_*.log "$log" 2>/dev/null
fi
echo "=== done ($(date +%T))"
if [[ $stage == rest ]]; then  # what the defects call left (issue 37), the sampling path spec decode touched, and
  # issue 39's before-table: each preset's kernels per decode step at batch 1
  step timeout "${TESTS_TIMEOUT_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
    tests/runtime/test_sampling_engine.py tests/runtime/test_sampling_params.py tests/runtime/test_prompt_logprobs.py \
    tests/runtime/test_async_scheduling.py tests/runtime/test_cuda_graphs.py tests/runtime/test_resume.py
  step timeout "${ROWS_TIMEOUT_S:-120}" python3 scripts/gpu_accuracy.py --suffix _rest --rows "${ACCURACY_ROWS:-json_schema}"
  step timeout "${PROFILE_TIMEOUT_S:-200}" python3 scripts/profile_decode.py --points 1x1024 \
    --presets llama-3-8b,llama-3-8b:fp8,qwen3-30b-a3b,llama-4-scout --json benchmarks/results/profile_decode_kernels.json
  [[ -n ${OUT:-} ]] && cp benchmarks/results/gpu_accuracy_rest.json benchmarks/results/profile_decode_kernels.json "$log" \
    "$OUT"/ 2>/dev/null
fi
