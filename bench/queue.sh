#!/usr/bin/env bash
# The experiments queued for the next GPU calls (bench/NOTES.md, "Next device calls"), kept in the repo so that a new
# checkout has them (a session's .dbg/ does not survive one). Not the check: bench/gpu_check.py is that. Parts that
# ran are taken out (git history keeps them; their results are in bench/NOTES.md).
#
#   bash bench/queue.sh build     # on the CPU: every A/B plan queued compiled into build-ab/<tag>/ (`build tl
#                                 # downgemm`: those parts' only)
#   bash bench/queue.sh dsmem     # one call (~3 min): DOWN_SMEM's and GU_SKIP's GPU tests, then their A/B at batch 1
#   bash bench/queue.sh first     # a session's first call (~5 min on an H100, timeout_s 600, carry .whl): serve's
#                                 # GPU tests of the fallback, then the whole check in the time left (BUDGET s, 560)
#   bash bench/queue.sh keyrows   # the H200 targets' rows only (~3-4 min, carry .whl): where `first` does not fit
#   bash bench/queue.sh seventh   # a seventh held-out set, default plans (carry .whl; ~1 min after `first`)
#   bash bench/queue.sh second    # the call after it (carry .whl): e2e (and on an undeclared yarn checkpoint), then
#                                 # the main GPU tests
#   bash bench/queue.sh tl        # four timelines at KV 4096: Yi-9B-like and Llama-3-8B b1, Llama-3.2-1B b1 at QKV_NWG
#                                 # 16 and 8 (~2 min; `bash bench/queue.sh build` compiles them here first: carry build-tl)
#   bash bench/queue.sh big       # batch 64-128 held-out rows against FlashInfer and the serving-style layer (carry
#                                 # .whl; ~3 min): never timed past batch 64 against a baseline
#   bash bench/queue.sh downgemm  # down_proj on the GEMM engine (DOWN_GEMM): its GPU test, then the A/B at b64-128 (~2 min; `build`
#                                 # compiles the A/B here first: carry build-ab)
#   bash bench/queue.sh tune191   # on an H200: the batch-1 entries of 0.5B and 1B tuned at full context and row 191
#                                 # together (`tune --positions full,191`; ~4 min), into $OUT/tune-191.json
#   bash bench/queue.sh tests     # the sampler's and the LM head's GPU tests
#   bash bench/queue.sh serving   # the serving-style layer's GPU tests (its FlashAttention varlen path, session 46)
#   bash bench/queue.sh tp1       # the TP kernels' ranks as threads on one GPU (tests/test_tp.py)
#   bash bench/queue.sh tp        # on 2 GPUs (kind nvidia-h200-x2): the TP tests, NORM_GLOBAL=1's cases among them
#
# Results go to $OUT (the device's; ./out here). A step that fails is said and the next one runs.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-out}
BUILD=${BUILD:-}  # "--compile-only" under `build`


step() {  # step NAME CMD...: runs CMD with its output in $OUT/NAME.log, a line of its outcome on stdout
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then echo "ok   $name ($((SECONDS - t0)) s)"; else
    echo "FAIL $name ($((SECONDS - t0)) s): $(tail -1 "$OUT/$name.log")"; fi
  tail -n 25 "$OUT/$name.log"
}

flashinfer() {  # FlashInfer (a baseline) from the carried wheels (carry .whl) into ./.site, on the path for what
  # follows; every part that times against it calls this (a part run in a call of its own has no earlier install:
  # session 60's seventh set ran once without it)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$(pwd)/.site" \
    .whl/*.whl && export PYTHONPATH="$(pwd)/.site:${PYTHONPATH:-}" FLASHINFER_USE_CUDA_NORM=1
}

ab() {  # ab TAG ROWS --case ... : one A/B run
  local tag=$1 rows=$2; shift 2
  step "ab-$tag" python3 bench/ab.py --rows "$rows" --build-dir "build-ab/$tag" --out "$OUT/ab-$tag.json" $BUILD "$@"
}

part_dsmem() {  # sessions 56-57: DOWN_SMEM 1 (down_proj's first task bulk-copied into shared memory from gate_up's
  # start) lost alone on an H100 (+4.8 % at 0.5B b1 row 191) and beside GU_SKIP (the planner's new default at
  # Qwen2.5-0.5B b1: down_proj's 56 blocks take no gate_up task) gave -2.0 % at KV 4096 (GU_SKIP alone -5.3 %) but
  # -7.4 % at KV 1024 (alone -5.5 %). On an H200, whose gate_up left the DRAM room (~2.7 of 4 TB/s), the copy may pay:
  # prediction -2 ... -6 % on top of GU_SKIP at 0.5B b1, +2 ... +6 % at SmolLM-360M-like b1 (no GU_SKIP there). First
  # the GPU tests (both bit-equal to the plan without them)
  [ -n "$BUILD" ] || step gputests-dsmem timeout 240 python3 -m pytest -q -m gpu tests/test_tune.py \
    -k "staged_in_shared or leaving_down_proj"
  local a='{"DOWN_SMEM": 1}' b='{"GU_SKIP": 0}'
  ab dsmem full,191 --case qwen2.5-0.5b_decode_b1_s4096_bf16 "$a" --case qwen2.5-0.5b_decode_b1_s4096_bf16 "$b" \
    --case qwen2.5-0.5b_decode_b1_s1024_bf16 "$a" --case qwen2.5-0.5b_decode_b1_s1024_bf16 "$b" \
    --case qwen2.5-0.5b_decode_b1_s32768_bf16 "$a" --case qwen2.5-0.5b_decode_b1_s32768_bf16 "$b" \
    --case ho-smol-360m_decode_b1_s2048_bf16 "$a" --case ho-smol-360m_decode_b1_s2048_bf16 '{"GU_SKIP": 1}'
}

part_first() {  # the call a session starts with (carry .whl; ~5 min on an H100: timeout_s 600): serve's unfused
  # path's GPU tests (session 55's bounded decode step among them; ran in session 56), then the whole check with its
  # held-out shapes. Logs in $OUT/logs.tgz
  local t0=$SECONDS logs="$OUT/logs"
  mkdir -p "$logs"
  flashinfer
  step logs/gputests-serve timeout 230 python3 -m pytest -q -m gpu tests/test_serve.py \
    -k "kv_bucket or cache_len_no_variant or graph_replay or fallback_numerics"
  step logs/check timeout $((${BUDGET:-560} - (SECONDS - t0))) python3 bench/gpu_check.py --no-tests \
    --serving-budget 100
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$logs"
}

part_keyrows() {  # session 61 (device time short): the H200 targets' rows only (declared b1 / b8 at KV 4096, the held-out
  # rows under the bars) with FlashInfer and the serving-style layer, in KEY_S s (~3-4 min)
  flashinfer
  step keyrows timeout "${KEY_S:-330}" python3 bench/gpu_check.py --no-tests --only '*_b1_s4096_*' \
    --only '*_b8_s4096_*' --only 'ho-yi-9b*' --only 'ho-mha-b5*' --only 'ho-l8b-b64*' --serving-budget 60
}

part_seventh() {  # session 60: a seventh held-out set (bench/results/gpu_check-s60-variants.yaml: odd batches of the
  # declared shapes, batch 48, a 65536-row cache, fp16 8B, Qwen2.5-32B-like), default plans, in the time left (S7 s)
  flashinfer
  step seventh timeout "${S7:-240}" python3 bench/gpu_check.py --no-tests --variants \
    bench/results/gpu_check-s60-variants.yaml --heldout '' --build-dir build-s60 --out "$OUT/s60" --serving-budget 0
}

part_second() {  # the call after `first` (carry .whl; ~6.5 min on an H100): e2e, e2e on a checkpoint of a shape
  # variants.yaml does not declare, then the main GPU tests in the time left
  local t0=$SECONDS
  flashinfer
  step e2e timeout 200 python3 -m bench.e2e --seq-len 4096
  # e2e on a checkpoint of a shape variants.yaml does not declare (session 55's variants_for: its from-hf entry's
  # decode b1/4/8 built with the default plans): a random Qwen2-style one (hidden 1536, 12/2 heads of 128, qkv bias,
  # tied embeddings, yarn), saved on the device
  step e2e-ckpt-make python3 -c "import torch, transformers as T; c = T.Qwen2Config(hidden_size=1536, \
intermediate_size=8960, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2, vocab_size=32000, \
max_position_embeddings=32768, tie_word_embeddings=True, rope_parameters={'rope_type': 'yarn', 'factor': 4.0, \
'original_max_position_embeddings': 8192, 'rope_theta': 1e6}, dtype='bfloat16'); \
T.Qwen2ForCausalLM(c).to(torch.bfloat16).save_pretrained('/tmp/qwen2-yarn-ckpt')"
  step e2e-ckpt timeout 240 python3 -m bench.e2e --ckpt /tmp/qwen2-yarn-ckpt --seq-len 2048 --new-tokens 32 \
    --reps 2 --skip hf-compile --build-dir build-e2e-ckpt --out "$OUT/e2e-ckpt.json"
  step gputests-main timeout $((${BUDGET:-560} - (SECONDS - t0))) python3 -m pytest -q -m gpu tests/test_gpu.py \
    tests/test_serve.py tests/test_hf_gpu.py
}

part_tl() {  # session 69: where Yi-9B-like b1's 5 us over its floor go (qkv -> attention 22.4 us against 16.9;
  # Llama-3-8B 25.1 / 22.4), and why QKV_NWG 16 pays at Llama-3.2-1B b1 (session 68: -3.1 ... -3.4 % at KV 1024,
  # not established). Each timeline verifies its plan against the reference first. $BUILD: compile only
  local i=0 a
  for a in "ho-yi-9b_decode_b1_s4096_bf16 {}" "llama3-8b_decode_b1_s4096_bf16 {}" \
           "llama3.2-1b_decode_b1_s4096_bf16 {}" 'llama3.2-1b_decode_b1_s4096_bf16 {"QKV_NWG":8}'; do
    i=$((i + 1)); set -- $a
    step "tl$i" timeout 150 python3 bench/timeline.py --variant "$1" --overrides "$2" --row full \
      --build-dir "build-tl/$i" --out "$OUT/tl$i.json" $BUILD
  done
}

part_big() {  # session 70: past batch 64 the decode kernel runs qkv, o_proj and gate_up on the GEMM engine
  # (GEMM_PROJ) and was timed only against itself (session 62: 1B b128 KV 1024 199 us, 65 % of the copy bandwidth);
  # batch 64 ran at 1.01-1.02x FlashInfer's layer (session 69). Held-out 1B-shape b128 KV 2048 and Qwen2.5-7B-like b96
  # beside the b64 rows, with FlashInfer and the serving-style layer. Prediction: 0.95-1.05x FlashInfer at b96-128
  flashinfer
  step big timeout "${BIG_S:-300}" python3 bench/gpu_check.py --no-tests --only 'ho-l1b-b128*' --only 'ho-q7b-b96*' \
    --only 'ho-l1b-b64*' --only 'ho-l8b-b64*' --serving 'ho-l1b-b128*' --serving 'ho-q7b-b96*' --serving-budget 150 \
    --out "$OUT/big"
}

part_downgemm() {  # session 71: past batch 64 down_proj ran as a GEMV in batch slices at 42-47 % of the copy bandwidth
  # (H100: Qwen2.5-7B-like b96 109.7 us for 136 MB, 1B-shape b128 26.9 us for 33.5 MB), the rows 0.82x / 0.96x
  # FlashInfer's layer; down_proj on the GEMM engine (DOWN_GEMM 1, built, an override until this runs; then the default
  # past one token tile: decode.DOWN_GEMM_BY_DEFAULT). First the engine's GPU test (its DOWN_GEMM cases), then
  # DOWN_GEMM 1 against the default at b64-128, and with the batch in one token tile (GEMM_TOKEN_TILE: each weight tile
  # read once, not twice; gate_up ran at 75 % at b96). Prediction: down_proj at ~80 % of the bandwidth, -12 ... -16 % a
  # layer at Qwen2.5-7B-like b96, -4 ... -6 % at 1B b128; b64 level; one token tile a further -2 ... -5 % at b96-128
  [ -n "$BUILD" ] || step gputests-downgemm timeout 240 python3 -m pytest -q -m gpu tests/test_tune.py \
    -k "gemm_projections_match"
  local on='{"DOWN_GEMM": 1}'
  ab downgemm full,mix --variants bench/heldout.yaml --case ho-q7b-b96_decode_b96_s1024_bf16 "$on" \
    --case ho-q7b-b96_decode_b96_s1024_bf16 '{"DOWN_GEMM": 1, "GEMM_TOKEN_TILE": 96}' \
    --case ho-q7b-b96_decode_b96_s1024_bf16 '{"GEMM_TOKEN_TILE": 96}' \
    --case ho-l1b-b128_decode_b128_s2048_bf16 "$on" \
    --case ho-l1b-b128_decode_b128_s2048_bf16 '{"DOWN_GEMM": 1, "GEMM_TOKEN_TILE": 128}' \
    --case ho-l1b-b64_decode_b64_s1024_bf16 "$on" --case ho-l8b-b64_decode_b64_s1024_bf16 "$on"
}

part_tune191() {  # session 70: e2e serves its b1 steps at rows ~128-160 with the KV-4096 variant, whose tuned plan
  # was timed at full context only (session 55's retune); a plan for both (the mean of full and row 191, losing at
  # neither by more than 1 %). The entries come back in $OUT/tune-191.json, merged by hand into tuning/<gpu>.json
  # after a look (the GPU named in each entry). Prediction: 0 ... -3 % at row 191 for 1B and 0.5B, full level
  step tune191 timeout "${TUNE_S:-420}" python3 -m generator.cli tune --only 'llama3.2-1b_decode_b1_s4096*' \
    --only 'qwen2.5-0.5b_decode_b1_s4096*' --positions full,191 --limit 20 --out "$OUT/tune-191.json"
}

part_tests() {
  step gputests python3 -m pytest -q -m gpu tests/test_sampler.py tests/test_lm_head.py
}

part_serving() {  # the serving-style layer's FlashAttention varlen path (session 46: not yet run as a whole layer on
  # a GPU; six shapes of max-autotune compiles, ~20-30 s each), FlashInfer's layer beside it
  step gputests-baselines python3 -m pytest -q -m gpu tests/test_baselines.py

}

part_tp1() {  # the TP kernels with their ranks as threads on this one GPU (NORM_GLOBAL=1 with tensor parallel, never
  # run; ~11 kernels compiled first)
  step gputests-tp1 python3 -m pytest -q -m gpu tests/test_tp.py -k one_gpu_equal
}

part_tp() {  # 2 GPUs: the TP layers against the whole layer's reference, NORM_GLOBAL=1 with tensor parallel new
  step gputests-tp python3 -m pytest -q -m gpu tests/test_tp.py
}

case "${1:-}" in build|dsmem|tl|first|keyrows|seventh|second|big|downgemm|tune191|tests|serving|tp1|tp) mkdir -p "$OUT" ;; esac
case "${1:-}" in
  build) BUILD=--compile-only; shift  # the parts named (all that compile, by default), each afresh: old builds would
    # outgrow a device call's 64 MiB carry
    for p in "${@:-dsmem tl downgemm}"; do for p in $p; do
      case $p in dsmem|downgemm) rm -rf "build-ab/$p" ;; tl) rm -rf build-tl ;;
        *) echo "build: $p compiles nothing here (one of dsmem, tl, downgemm)" >&2; exit 2 ;; esac
      "part_$p"; done; done ;;
  dsmem) part_dsmem ;;
  tl) part_tl ;;
  first) part_first ;;
  keyrows) part_keyrows ;;
  seventh) part_seventh ;;
  second) part_second ;;
  big) part_big ;;
  downgemm) part_downgemm ;;
  tune191) part_tune191 ;;
  tests) part_tests ;;
  serving) part_serving ;;
  tp1) part_tp1 ;;
  tp) part_tp ;;
  *) echo "usage: bash bench/queue.sh build [PART...]|dsmem|tl|first|keyrows|seventh|second|big|downgemm|tune191|tests|serving|tp1|tp" >&2; exit 2 ;;
esac
