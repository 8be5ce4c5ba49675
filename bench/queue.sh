#!/usr/bin/env bash
# The experiments queued for the next GPU calls (bench/NOTES.md, "Next device calls"), kept in the repo so that a new
# checkout has them (a session's .dbg/ does not survive one). Not the check: bench/gpu_check.py is that. Parts that
# ran are taken out (git history keeps them; their results are in bench/NOTES.md).
#
#   bash bench/queue.sh build     # on the CPU: every plan below compiled into build-ab/<tag>/
#   bash bench/queue.sh next      # one device call: COOP 0 from batch 2, DOWN_FLOW 1 at Qwen2.5-7B, LL at hidden 5120
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

part_next() {  # session 51's leads, each against the default plan (full context / serving mix): COOP 0 + QKV_PRE 1
  # where batch 2-5 plans no grid barrier (batch 1's rule: -0.8 ... -2.9 % on the H100; Llama-3.2-1B b4 level there);
  # DOWN_FLOW 1 (gate_up's counters) at Qwen2.5-7B b1 (the tuner's pick on the H100, 172.4 -> 170.6 us) and b4, and
  # with COOP 0 (then no barrier left); the LL hand-offs at hidden 5120 (past LL_HIDDEN_MAX_BATCH, never timed)
  # (DOWN_FLOW 1 leaves Qwen2.5-7B b1 no grid barrier, so the planner adds COOP 0 + QKV_PRE 1 to it: COOP 1 times
  # the counters alone, as the tuner did)
  local c='{"COOP": 0, "QKV_PRE": 1}' d='{"DOWN_FLOW": 1, "COOP": 1}' l='{"ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1, "O_PRE": 0}'
  local q=--variants=bench/queue-variants.yaml
  ab next full,mix $q --case llama3.2-1b_decode_b4_s4096_bf16 "$c" --case ho-h1536-g6_decode_b2_s4096_bf16 "$c" \
    --case ho-mha-b5_decode_b5_s4096_bf16 "$c" --case llama3-8b_decode_b4_s1024_bf16 "$c" \
    --case qwen2.5-7b_decode_b1_s4096_bf16 "$d" --case qwen2.5-7b_decode_b1_s1024_bf16 "$d" \
    --case qwen2.5-7b_decode_b4_s4096_bf16 '{"DOWN_FLOW": 1}' --case qwen2.5-7b_decode_b1_s4096_bf16 '{"DOWN_FLOW": 1}' \
    --case q-nemo_decode_b2_s4096_bf16 "$l" --case q-nemo_decode_b4_s4096_bf16 "$l"
  # Llama-3.2-1B b8 (74.9 % of the H200's copy bandwidth, the target 80 %): attention takes 24.8 of its 60.1 µs for
  # 67 MB of cache (2.7 TB/s; 128 tasks of 2,048 rows, one a block). Where do the blocks' walks spend it (the ring's
  # depth against the per-tile work)? Its timeline at full context, default plan and a deeper ring
  step tl-1b8 python3 bench/timeline.py --variant llama3.2-1b_decode_b8_s4096_bf16 --row full \
    --out "$OUT/timeline-1b8.json"
  step tl-1b8-s3 python3 bench/timeline.py --variant llama3.2-1b_decode_b8_s4096_bf16 --row full \
    --overrides '{"ATT_STAGES": 3}' --out "$OUT/timeline-1b8-s3.json"
}

part_retune() {  # the declared batch 4-8 rows under issue 12's bar on the H200 (1.27-1.28x, 86-89.5 %; Llama-3.2-1B
  # b8 74.9 %), tuned again now that the LL rule takes the hand-offs (with O_PRE 0) at batch 2-5 (session 51) and the
  # tuner's LL candidates come with O_PRE 0 (on) / 1 (off). From an H200: merge the entries of retune.tgz's
  # tuned-*.json into tuning/nvidia-h200.json; from another GPU: keep them as results. One tune a variant (each writes
  # its own file: a call cut by its time limit keeps what finished), 16 candidates each; the files go into one
  # archive (a device call brings back only a few files)
  local n
  mkdir -p "$OUT/retune"
  for n in qwen2.5-7b_decode_b4_s1024_bf16 qwen2.5-7b_decode_b8_s4096_bf16 llama3.2-1b_decode_b8_s4096_bf16 \
      llama3.2-1b_decode_b4_s1024_bf16 llama3-8b_decode_b4_s1024_bf16 llama3-8b_decode_b8_s1024_bf16 \
      qwen2.5-7b_decode_b4_s4096_bf16 qwen2.5-7b_decode_b8_s1024_bf16 qwen2.5-7b_decode_b1_s4096_bf16; do
    step "retune/tune-$n" python3 -m generator.cli tune --only "$n" --limit 16 --out "$OUT/retune/tuned-$n.json"
    tar czf "$OUT/retune.tgz" -C "$OUT" retune
  done
  rm -rf "$OUT/retune"
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

case "${1:-}" in build|next|retune|gputests|tests|serving|tp1|tp) mkdir -p "$OUT" ;; esac
case "${1:-}" in
  build) BUILD=--compile-only; rm -rf build-ab; part_next ;;  # (afresh: old builds would outgrow a
    # device call's 64 MiB carry)
  next) part_next ;;
  retune) part_retune ;;
  gputests) part_gputests ;;
  tests) part_tests ;;
  serving) part_serving ;;
  tp1) part_tp1 ;;
  tp) part_tp ;;
  *) echo "usage: bash bench/queue.sh build|next|retune|gputests|tests|serving|tp1|tp" >&2; exit 2 ;;
esac
