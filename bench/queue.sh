#!/usr/bin/env bash
# The experiments queued for the next GPU calls (bench/NOTES.md, "Next device calls"), kept in the repo so that a new
# checkout has them (a session's .dbg/ does not survive one). Not the check: bench/gpu_check.py is that. Parts that
# ran are taken out (git history keeps them; their results are in bench/NOTES.md).
#
#   bash bench/queue.sh build     # on the CPU: every plan below compiled into build-ab/<tag>/
#   bash bench/queue.sh rule      # one device call (carry build-ab): the LL rule's and DOWN_FLOW 2's A/B, to repeat on an H200
#   bash bench/queue.sh retune    # the batch 4-8 rows under the bar, tuned again (one call)
#   bash bench/queue.sh llb       # one device call (build-ab): the LL hand-offs at batch 2-8 with O_PRE 0
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

part_rule() {  # session 48: each batch-1 default under the LL rule (decode.LL_HIDDEN_MAX) against its barriers and
  # counters (the base is the rule's plan; Qwen2.5-0.5B b1 KV 4096's tuned ATT_COMBINE 4 against the default 2)
  local off='{"ATT_LL": 0, "QKV_FLOW": 1, "H_LL": 0}'
  ab rule full,191 --case $B1 "$off" --case llama3.2-1b_decode_b1_s1024_bf16 "$off" \
    --case llama3.2-1b_decode_b1_s32768_bf16 "$off" --case qwen3-1.7b_decode_b1_s4096_bf16 "$off" \
    --case qwen2.5-0.5b_decode_b1_s1024_bf16 "$off" --case $HALF "$off" --case $HALF '{"ATT_COMBINE": 2}' \
    --case ho-h1440-hd80_decode_b1_s4096_bf16 "$off" --case ho-smol-360m_decode_b1_s2048_bf16 "$off" \
    --case ho-h3072-g3_decode_b1_s4096_bf16 "$off" --case ho-hd80-mha_decode_b1_s4096_bf16 "$off" \
    --case $B1 '{"QKV_FLOW": 1}' --case $HALF '{"QKV_FLOW": 1}' \
    --case qwen2.5-7b_decode_b1_s4096_bf16 "$off" \
    --case $HALF '{"DOWN_FLOW": 0}' --case qwen2.5-0.5b_decode_b1_s1024_bf16 '{"DOWN_FLOW": 0}' \
    --case ho-smol-360m_decode_b1_s2048_bf16 '{"DOWN_FLOW": 0}' --case ho-h1440-hd80_decode_b1_s4096_bf16 '{"DOWN_FLOW": 0}'
  # (DOWN_FLOW 2 by default under the rule where the counters are not taken, session 49: measured on an H100 only,
  # -0.9 ... -5.8 % against DOWN_FLOW 0; here the other way round, the default as base)
  # (ATT_LL + H_LL with qkv's counters: "qkv in" came ~1 µs later with QKV_FLOW 2's words than with the counter in
  # session 47's timeline; Qwen2.5-7B b1, hidden 3584, just past the rule's bound: the three never timed there)
}

part_llb() {  # session 50: the LL hand-offs at batch 2-5 won where they compiled clean (-0.5 ... -3.3 %, H200) but
  # spilled beside O_PRE 1 on most shapes; with O_PRE 0 they compile clean. Each against the default, and O_PRE 0
  # alone (to tell the two apart): a rule needs {LL, O_PRE 0} ahead of the default on (nearly) all of them
  local l='{"ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1, "O_PRE": 0}' o='{"O_PRE": 0}' q=--variants=bench/queue-variants.yaml
  ab llb full,mix $q --case llama3.2-1b_decode_b8_s4096_bf16 "$l" --case llama3.2-1b_decode_b8_s4096_bf16 "$o" \
    --case qwen3-1.7b_decode_b4_s4096_bf16 "$l" --case qwen3-1.7b_decode_b4_s4096_bf16 "$o" \
    --case ho-h2560-g5_decode_b3_s4096_bf16 "$l" --case ho-h2560-g5_decode_b3_s4096_bf16 "$o" \
    --case ho-h1536-g6_decode_b2_s4096_bf16 "$l" --case ho-h1536-g6_decode_b2_s4096_bf16 "$o" \
    --case ho-h576-g3_decode_b3_s4096_bf16 "$l" --case ho-h576-g3_decode_b3_s4096_bf16 "$o" \
    --case ho-hd96-g4_decode_b5_s4096_bf16 "$l" --case ho-hd96-g4_decode_b5_s4096_bf16 "$o" \
    --case q-l32-3b_decode_b2_s4096_bf16 "$l" --case q-l32-3b_decode_b2_s4096_bf16 "$o" \
    --case q-l32-3b_decode_b5_s4096_bf16 "$l" --case q-tinyl_decode_b2_s2048_bf16 "$l" \
    --case q-smol17_decode_b3_s4096_bf16 "$l" --case q-h960-g3_decode_b2_s2048_bf16 "$l" \
    --case ho-mha-b5_decode_b5_s4096_bf16 '{"ATT_LL": 0, "QKV_FLOW": 1, "H_LL": 0}'
  # (the held-out MHA b5 plans ATT_DYN 2, so no O_PRE: the three by default there since session 50, -3.3 / -3.1 %;
  # here the other way round)
}

part_retune() {  # session 50: the declared batch 4-8 rows under issue 12's bar on the H200 (1.27-1.28x, 86-89.5 %;
  # Llama-3.2-1B b8 74.9 %), tuned again now that the tuner's LL candidate comes with O_PRE 0 from batch 2 (it won
  # -2.0 ... -3.2 % at Llama-3.2-1B / Qwen2.5-7B b4 KV 4096). From an H200: merge $OUT/tuned.json's entries into
  # tuning/nvidia-h200.json; from another GPU: keep it as a result. 16 candidates a variant, for the call's 600 s
  step tune-b48 python3 -m generator.cli tune --only 'llama3-8b_decode_b[48]_s1024_bf16' \
    --only 'qwen2.5-7b_decode_b[48]_s[14]*' --only 'llama3.2-1b_decode_b8_s4096_bf16' --limit 16 --out "$OUT/tuned.json"
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

case "${1:-}" in build|rule|llb|retune|gputests|tests|serving|tp1|tp) mkdir -p "$OUT" ;; esac
case "${1:-}" in
  build) BUILD=--compile-only; rm -rf build-ab; part_rule; part_llb ;;  # (afresh: old builds would outgrow a
    # device call's 64 MiB carry)
  rule) part_rule ;;
  llb) part_llb ;;
  retune) part_retune ;;
  gputests) part_gputests ;;
  tests) part_tests ;;
  serving) part_serving ;;
  tp1) part_tp1 ;;
  tp) part_tp ;;
  *) echo "usage: bash bench/queue.sh build|rule|llb|retune|gputests|tests|serving|tp1|tp" >&2; exit 2 ;;
esac
