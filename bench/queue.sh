#!/usr/bin/env bash
# The experiments queued for the next GPU calls (bench/NOTES.md, "Next device calls"), kept in the repo so that a new
# checkout has them (a session's .dbg/ does not survive one). Not the check: bench/gpu_check.py is that. Parts that
# ran are taken out (git history keeps them; their results are in bench/NOTES.md).
#
#   bash bench/queue.sh build     # on the CPU: every A/B plan queued compiled into build-ab/<tag>/
#   bash bench/queue.sh dsmem     # one call (~3 min): DOWN_SMEM's and GU_SKIP's GPU tests, then their A/B at batch 1
#   bash bench/queue.sh xsplit    # (~4 min): batch 32-64's GEMVs with a block's groups on one split of K (L1-shared X)
#   bash bench/queue.sh fixes     # (~2 min): session 60's four mended GPU checks
#   bash bench/queue.sh pfdec     # (~3 min): decode at batch 32-64 as a chunk-1 prefill (the GEMM engine)
#   bash bench/queue.sh tunemha   # (~5 min): the tuner on three held-out rows under the bars
#   bash bench/queue.sh first     # a session's first call (~5 min on an H100, timeout_s 600, carry .whl): serve's
#                                 # GPU tests of the fallback, then the whole check in the time left (BUDGET s, 560)
#   bash bench/queue.sh seventh   # a seventh held-out set, default plans (carry .whl; ~1 min after `first`)
#   bash bench/queue.sh second    # the call after it (carry .whl): e2e (and on an undeclared yarn checkpoint), then
#                                 # the main GPU tests
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

part_tunemha() {  # sessions 59-60: the tuner (16 candidates each) on the held-out rows under issue 12's bars on the
  # H100 (session 60's check): the multi-head b5 (1.24x, 88.5 %; its attention at the floor of its cache, o_proj's
  # stage attention's tail), Yi-9B-like b1 (89.5 %: o_proj 16.9 us for 11.2 of bytes), the Qwen2.5-7B-like b24
  # (1.09x, 89.7 %). A winner that is a knob away from the default on all three is a planner rule to A/B
  step tune-mha timeout "${TUNE_S:-300}" python3 -m generator.cli tune --variants bench/heldout.yaml \
    --only 'ho-mha-b5*' --only 'ho-yi-9b*' --only 'ho-h3584-b24*' --limit 16 --out "$OUT/tune-mha.json" \
    --build-dir build-tune-mha
}

part_xsplit() {  # session 60: batch 32-64's GEMVs with a block's warp groups on one split of K (NWG 2 or 4, KSPLIT 4:
  # 132 blocks % 4 = 0, so every group of block b takes split b % 4 in every round, tasks g x 132 + b), TM 1, BS 1.
  # The groups' X reads are then the same k-range (64 x 1024 x 2 B = 128 KB at 8B qkv), read once from L2 into L1
  # for 8 tiles instead of once a task: X's L2 traffic ~1/4 of the default's (TM 2 reads the batch's rows at twice
  # the weight bytes; 8B b64 qkv 33.1 us for 16.8 of weights on the H100), plus partials of 16 x 64 x 4 B a task.
  # Session 58's smaller groups (NWG 2 / 4 / 8 unsplit: +91 / +24 / +4 %) had each group on a different tile over all
  # of K (X ranges that no L1 holds, 128 k-tiles a warp); here a warp walks 32 (NWG 2) or 16 (NWG 4).
  # Prediction (8B b64, H100): qkv and o_proj -25 ... -45 %, gate_up and down_proj -10 ... -25 %, the layer -5 ... -12 %;
  # 1B b64 more (its X is 2x / 4x the weight bytes); 8B b32 -2 ... -5 %. A loss would say L1 did not keep the range
  # between the groups (they drift apart) or the partials' round trips cost more than X's reads
  ab xsplit full,mix --variants bench/heldout.yaml \
    --case ho-l8b-b64_decode_b64_s1024_bf16 '{"QKV_NWG": 2, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1}' \
    --case ho-l8b-b64_decode_b64_s1024_bf16 '{"QKV_NWG": 4, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1}' \
    --case ho-l8b-b64_decode_b64_s1024_bf16 '{"O_NWG": 2, "O_KSPLIT": 4, "O_TM": 1, "O_BS": 1}' \
    --case ho-l8b-b64_decode_b64_s1024_bf16 '{"GU_NWG": 2, "GU_KSPLIT": 4, "GU_TM": 1, "GU_BS": 1}' \
    --case ho-l8b-b64_decode_b64_s1024_bf16 '{"DOWN_NWG": 2, "DOWN_KSPLIT": 4, "DOWN_TM": 1, "DOWN_BS": 1}' \
    --case ho-l8b-b64_decode_b64_s1024_bf16 '{"QKV_NWG": 2, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1, "O_NWG": 2, "O_KSPLIT": 4, "O_TM": 1, "O_BS": 1, "GU_NWG": 2, "GU_KSPLIT": 4, "GU_TM": 1, "GU_BS": 1, "DOWN_NWG": 2, "DOWN_KSPLIT": 4, "DOWN_TM": 1, "DOWN_BS": 1}' \
    --case ho-l1b-b64_decode_b64_s1024_bf16 '{"QKV_NWG": 2, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1, "O_NWG": 2, "O_KSPLIT": 4, "O_TM": 1, "O_BS": 1, "GU_NWG": 2, "GU_KSPLIT": 4, "GU_TM": 1, "GU_BS": 1, "DOWN_NWG": 2, "DOWN_KSPLIT": 4, "DOWN_TM": 1, "DOWN_BS": 1}' \
    --case ho-l1b-b64_decode_b64_s1024_bf16 '{"GU_NWG": 2, "GU_KSPLIT": 4, "GU_TM": 1, "GU_BS": 1}' \
    --case ho-l8b-b32_decode_b32_s4096_bf16 '{"QKV_NWG": 2, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1, "O_NWG": 2, "O_KSPLIT": 4, "O_TM": 1, "O_BS": 1}' \
    --case ho-l8b-b32_decode_b32_s4096_bf16 '{"QKV_NWG": 2, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1, "O_NWG": 2, "O_KSPLIT": 4, "O_TM": 1, "O_BS": 1, "GU_NWG": 2, "GU_KSPLIT": 4, "GU_TM": 1, "GU_BS": 1, "DOWN_NWG": 2, "DOWN_KSPLIT": 4, "DOWN_TM": 1, "DOWN_BS": 1}' \
    --case ho-h3584-b24_decode_b24_s4096_bf16 '{"QKV_NWG": 2, "QKV_KSPLIT": 4, "QKV_TM": 1, "QKV_BS": 1, "O_NWG": 2, "O_KSPLIT": 4, "O_TM": 1, "O_BS": 1, "GU_NWG": 2, "GU_KSPLIT": 4, "GU_TM": 1, "GU_BS": 1, "DOWN_NWG": 2, "DOWN_KSPLIT": 4, "DOWN_TM": 1, "DOWN_BS": 1}'
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

part_fixes() {  # session 60's four mended checks, never run on a GPU: the first-bad-stage fault at position 0, the
  # stage clock's 1 us slack, the sliding window's own rows, the padded batch's near-tie rule (tests/hf_util.py)
  step gputests-fixes timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_serve.py \
    -k "first_bad_stage or clock_rate or sliding or padded"
}

part_pfdec() {  # session 61: decode at batch 32-64 as a prefill of chunk 1 (the GEMM engine) against the decode variant,
  # same shape and positions, both verified (bench/pf_decode.py; bench/pf-decode.yaml built on the device)
  step pfdec-build python3 -m generator.cli build --variants bench/pf-decode.yaml --build-dir build-pf
  local set
  for set in "l8b_decode_b64_s1024_bf16 l8b_prefill_b64_s1_bf16" "l1b_decode_b64_s1024_bf16 l1b_prefill_b64_s1_bf16" \
      "l8b_decode_b32_s4096_bf16 l8b_prefill_b32_s1_bf16"; do
    step "pfdec-${set%%_*}-$(echo "$set" | grep -o 'b[0-9]*' | head -1)" timeout 150 python3 -m bench.pf_decode \
      build-pf bench/pf-decode.yaml $set
  done
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

case "${1:-}" in build|dsmem|xsplit|fixes|pfdec|tunemha|first|seventh|second|tests|serving|tp1|tp) mkdir -p "$OUT" ;; esac
case "${1:-}" in
  build) BUILD=--compile-only; rm -rf build-ab; part_dsmem; part_xsplit ;;  # (afresh: old builds would outgrow a
    # device call's 64 MiB carry)
  dsmem) part_dsmem ;;
  xsplit) part_xsplit ;;
  fixes) part_fixes ;;
  pfdec) part_pfdec ;;
  tunemha) part_tunemha ;;
  first) part_first ;;
  seventh) part_seventh ;;
  second) part_second ;;
  tests) part_tests ;;
  serving) part_serving ;;
  tp1) part_tp1 ;;
  tp) part_tp ;;
  *) echo "usage: bash bench/queue.sh build|dsmem|xsplit|fixes|pfdec|tunemha|first|seventh|second|tests|serving|tp1|tp" >&2; exit 2 ;;
esac
