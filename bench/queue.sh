#!/usr/bin/env bash
# The experiments queued for the next GPU calls (bench/NOTES.md, "Next device calls"), kept in the repo so that a new
# checkout has them (a session's .dbg/ does not survive one). Not the check: bench/gpu_check.py is that. Parts that
# ran are taken out (git history keeps them; their results are in bench/NOTES.md).
#
#   bash bench/queue.sh build     # on the CPU: every plan below compiled into build-ab/<tag>/
#   bash bench/queue.sh coop      # COOP 0 (and QKV_PRE) where no grid barrier is left (batch-1 small layers)
#   bash bench/queue.sh retune    # the batch 4-8 rows under the bar, tuned again (one call)
#   bash bench/queue.sh gputests  # the sampler's and the LL GPU tests (session 49), then those cut in session 48
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

B1=llama3.2-1b_decode_b1_s4096_bf16
HALF=qwen2.5-0.5b_decode_b1_s4096_bf16

step() {  # step NAME CMD...: runs CMD with its output in $OUT/NAME.log, a line of its outcome on stdout
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then echo "ok   $name ($((SECONDS - t0)) s)"; else
    echo "FAIL $name ($((SECONDS - t0)) s): $(tail -1 "$OUT/$name.log")"; fi
  tail -n 25 "$OUT/$name.log"
}

ab() {  # ab TAG ROWS --case ... : one A/B run
  local tag=$1 rows=$2; shift 2
  step "ab-$tag" python3 bench/ab.py --rows "$rows" --build-dir "build-ab/$tag" --out "$OUT/ab-$tag.json" $BUILD "$@"
}

part_coop() {  # session 51: the small batch-1 layers (and Llama-3.2-1B b4) now plan no grid barrier at all, so COOP 0
  # (a plain launch under PDL) no longer pays its workspace barrier (session 47: +3.9 ... +11 % with barriers; with the
  # three hand-offs and QKV_PRE 1 -1.4 % / +0.7 % against them, not a direct A/B). Here each against the default plan:
  # COOP 0 alone, with the first qkv step loaded before the wait (QKV_PRE 1), and with the rest of it into L2 (2)
  local c='{"COOP": 0}' p1='{"COOP": 0, "QKV_PRE": 1}' p2='{"COOP": 0, "QKV_PRE": 2}'
  ab coop full,191 --case $B1 "$c" --case $B1 "$p1" --case $B1 "$p2" \
    --case llama3.2-1b_decode_b1_s1024_bf16 "$c" --case llama3.2-1b_decode_b1_s1024_bf16 "$p1" \
    --case $HALF "$c" --case $HALF "$p1" --case qwen3-1.7b_decode_b1_s4096_bf16 "$p1" \
    --case ho-smol-360m_decode_b1_s2048_bf16 "$p1" --case llama3.2-1b_decode_b4_s4096_bf16 "$p1"
}

part_retune() {  # the declared batch 4-8 rows under issue 12's bar on the H200 (1.27-1.28x, 86-89.5 %; Llama-3.2-1B
  # b8 74.9 %), tuned again now that the LL rule takes the hand-offs (with O_PRE 0) at batch 2-5 (session 51) and the
  # tuner's LL candidates come with O_PRE 0 (on) / 1 (off). From an H200: merge $OUT/tuned-*.json's entries into
  # tuning/nvidia-h200.json; from another GPU: keep them as results. One tune a variant (each writes its own file: a
  # call cut by its time limit keeps what finished), 16 candidates each
  local n
  for n in qwen2.5-7b_decode_b4_s1024_bf16 qwen2.5-7b_decode_b8_s4096_bf16 llama3.2-1b_decode_b8_s4096_bf16 \
      llama3.2-1b_decode_b4_s1024_bf16 llama3-8b_decode_b4_s1024_bf16 llama3-8b_decode_b8_s1024_bf16 \
      qwen2.5-7b_decode_b4_s4096_bf16 qwen2.5-7b_decode_b8_s1024_bf16; do
    step "tune-$n" python3 -m generator.cli tune --only "$n" --limit 16 --out "$OUT/tuned-$n.json"
  done
}

part_gputests() {  # session 49: the sampler's two-pass top-p cut (nucleus_draw) and the LL test with DOWN_FLOW 2's
  # default (its Qwen2.5-0.5B b1 case); then the tests cut in session 48
  step gputests-sampler python3 -m pytest -q -m gpu tests/test_sampler.py
  step gputests-ll python3 -m pytest -q -m gpu tests/test_tune.py -k "ll_hand_offs_match or down_flow_matches"
  step gputests-s48 python3 -m pytest -q -m gpu tests/test_tune.py -k "h_stats_matches or split_parallel"
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

case "${1:-}" in build|coop|retune|gputests|tests|serving|tp1|tp) mkdir -p "$OUT" ;; esac
case "${1:-}" in
  build) BUILD=--compile-only; rm -rf build-ab; part_coop ;;  # (afresh: old builds would outgrow a
    # device call's 64 MiB carry)
  coop) part_coop ;;
  retune) part_retune ;;
  gputests) part_gputests ;;
  tests) part_tests ;;
  serving) part_serving ;;
  tp1) part_tp1 ;;
  tp) part_tp ;;
  *) echo "usage: bash bench/queue.sh build|coop|retune|gputests|tests|serving|tp1|tp" >&2; exit 2 ;;
esac
