#!/usr/bin/env bash
# The experiments queued for the next GPU calls (bench/NOTES.md, "Next device calls"), kept in the repo so that a new
# checkout has them (a session's .dbg/ does not survive one). Not the check: bench/gpu_check.py is that.
#
#   bash bench/queue.sh build     # on the CPU: every plan below compiled into build-ab/<tag>/, build-timeline/<tag>/
#   bash bench/queue.sh wide      # first (session 47): the LL hand-offs' held-out A/B, for the planner rule
#   bash bench/queue.sh a         # one device call each (carry build-ab and build-timeline); a's steps in priority
#                                 # order: what a 600 s call cuts is the least needed
#   bash bench/queue.sh b
#   bash bench/queue.sh tests     # the GPU tests not run on the current code (sampler, LM head)
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
B8=llama3.2-1b_decode_b8_s4096_bf16
L8=llama3-8b_decode_b1_s4096_bf16
Q7=qwen2.5-7b_decode_b4_s4096_bf16
ALL='"ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1'

step() {  # step NAME CMD...: runs CMD with its output in $OUT/NAME.log, a line of its outcome on stdout
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then echo "ok   $name ($((SECONDS - t0)) s)"; else
    echo "FAIL $name ($((SECONDS - t0)) s): $(tail -1 "$OUT/$name.log")"; fi
  tail -n 25 "$OUT/$name.log"
}

timeline() {  # timeline TAG VARIANT ROW OVERRIDES
  step "tl-$1" python3 bench/timeline.py --variant "$2" --row "$3" --overrides "$4" \
    --build-dir "build-timeline/$1" --out "$OUT/timeline-$1.json" $BUILD
}

ab() {  # ab TAG ROWS --case ... : one A/B run
  local tag=$1 rows=$2; shift 2
  step "ab-$tag" python3 bench/ab.py --rows "$rows" --build-dir "build-ab/$tag" --out "$OUT/ab-$tag.json" $BUILD "$@"
}

part_a() {  # in priority order: the decisions first, a step cut by the call's time limit the least needed
  # ATT_COMBINE 4 (session 47): the split partials as tagged words, no fence or counter before the combine (5: one
  # warp polls the m words first, less L2 traffic while the last splits walk, one round trip more)
  # and with the LL hand-offs: at full context the chain from the last split's walk to o_proj's start would be the
  # tagged partials' hop and ATT_LL's, not the combine's fence, counter and loads and a grid barrier (NOTES session 47)
  ab c4-small full --case $B1 '{"ATT_COMBINE": 4}' --case $B1 '{"ATT_COMBINE": 3}' --case $HALF '{"ATT_COMBINE": 4}' \
    --case $B1 '{"ATT_COMBINE": 4, "ATT_LL": 1}' --case $B1 "{\"ATT_COMBINE\": 4, $ALL}" \
    --case $HALF '{"ATT_COMBINE": 4, "ATT_LL": 1}' --case $HALF "{\"ATT_COMBINE\": 4, $ALL}" \
    --case $B1 '{"ATT_COMBINE": 5}' --case $B1 '{"ATT_COMBINE": 5, "ATT_LL": 1}' --case $HALF '{"ATT_COMBINE": 5}'
  # COOP 0: does the next layer's grid now enter as the previous one's blocks leave (the launch boundary)?
  ab 1b1-coop full,191 \
    --case $B1 '{"COOP": 0}' --case $B1 '{"COOP": 0, "QKV_PRE": 1}' --case $B1 '{"COOP": 0, "QKV_PRE": 2}' \
    --case $B1 '{"QKV_PRE": 2}' --case $B1 "{\"COOP\": 0, \"QKV_PRE\": 1, $ALL}"
  # the LL hand-offs with the batched polls (session 43), COOP 0 beside them, on the two smallest layers
  ab ll-small full,191 \
    --case $B1 '{"ATT_LL": 1}' --case $B1 '{"H_LL": 1}' --case $B1 "{$ALL}" \
    --case $HALF '{"ATT_LL": 1}' --case $HALF "{$ALL}" --case $HALF '{"COOP": 0}' --case $HALF '{"COOP": 0, "QKV_PRE": 1}'
  [ -z "$BUILD" ] && step gputest-ll python3 -m pytest -q -m gpu tests/test_tune.py -k "ll_hand_offs or coop or combine_over"
  timeline 1b1-base $B1 191 '{}'
  timeline 1b1-all $B1 191 "{$ALL}"
  timeline 1b1-coop $B1 191 '{"COOP": 0, "QKV_PRE": 2}'
  # the same plans' GPU time only (the host's graph launch not charged: NOTES session 44): against the run above,
  # the launch's share of the µs a layer, and whether COOP 0's gain is the layers' or the timing's
  ab 1b1-queued full,191 --queued --case $B1 '{"COOP": 0}' --case $B1 '{"COOP": 0, "QKV_PRE": 2}'
}

part_b() {
  # (full context only: at row 191 most of these have one split, no combine)
  ab c4-large full --case $L8 '{"ATT_COMBINE": 4}' --case $L8 '{"ATT_COMBINE": 5}' --case $Q7 '{"ATT_COMBINE": 4}' --case qwen2.5-7b_decode_b1_s4096_bf16 '{"ATT_COMBINE": 4}' \
    --case $B8 '{"ATT_COMBINE": 4}' --case qwen2.5-0.5b_decode_b1_s32768_bf16 '{"ATT_COMBINE": 4}'
  # the LL hand-offs and COOP 0 on the larger shapes
  ab ll-large full,191 \
    --case $L8 '{"ATT_LL": 1}' --case $L8 '{"COOP": 0}' \
    --case $Q7 '{"ATT_LL": 1}' --case $Q7 '{"QKV_FLOW": 2}' --case $Q7 '{"COOP": 0}' \
    --case $B8 '{"ATT_LL": 1}' --case $B8 "{$ALL}" --case $B8 '{"COOP": 0}'
  timeline 1b1-c4-full $B1 full '{"ATT_COMBINE": 4, "ATT_LL": 1}'  # where the combine's chain went (NOTES session 47)
  timeline 1b8-full $B8 full '{}'
  timeline half-191 $HALF 191 '{}'  # 2 blocks carry attention (2 KV heads): 6 µs of 23 in session 34's stamps
  timeline q7b4-full $Q7 full '{}'
  # batch 32 (issue 12: >= 1.1x; 1.06x at 91.6 % of copy BW in session 45): where its ~20 µs above the bytes go
  timeline l8b32-full ho-l8b-b32_decode_b32_s4096_bf16 full '{}'
}

part_wide() {  # the LL hand-offs' rule, its domain (session 47: they won at 1B b1 and 0.5B b1 on an H100)
  ab wide full,191 --case $B1 '{"ATT_LL": 1, "H_LL": 1}' --case $HALF '{"ATT_COMBINE": 4, "ATT_LL": 1, "H_LL": 1}' \
    --case llama3.2-1b_decode_b1_s1024_bf16 "{$ALL}" --case llama3.2-1b_decode_b1_s32768_bf16 "{$ALL}" \
    --case qwen3-1.7b_decode_b1_s4096_bf16 "{$ALL}" --case qwen2.5-0.5b_decode_b1_s1024_bf16 "{$ALL}" \
    --case ho-h1440-hd80_decode_b1_s4096_bf16 "{$ALL}" --case ho-smol-360m_decode_b1_s2048_bf16 "{$ALL}" \
    --case ho-h3072-g3_decode_b1_s4096_bf16 "{$ALL}" --case $L8 "{$ALL}" \
    --case llama3.2-1b_decode_b4_s4096_bf16 '{"ATT_LL": 1, "QKV_FLOW": 2}' --case $B8 "{$ALL}"
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

case "${1:-}" in build|wide|a|b|tests|serving|tp1|tp) mkdir -p "$OUT" ;; esac
case "${1:-}" in
  build) BUILD=--compile-only; rm -rf build-ab build-timeline; part_wide; part_a; part_b ;;  # (afresh: old builds would
    # outgrow a device call's 64 MiB carry; ~2 min on 2 cores)
  wide) part_wide ;;
  a) part_a ;;
  b) part_b ;;
  tests) part_tests ;;
  serving) part_serving ;;
  tp1) part_tp1 ;;
  tp) part_tp ;;
  *) echo "usage: bash bench/queue.sh build|wide|a|b|tests|serving|tp1|tp" >&2; exit 2 ;;
esac
