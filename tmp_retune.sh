#!/usr/bin/env bash
# (session 56, not committed) only on an H200: retune the rows closest to issue 12's bars, then check them
set -u
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0 ;; esac
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ "${1:-tune}" = tune ]; then
  timeout 480 python3 -m generator.cli tune --only 'llama3.2-1b_decode_b8_s4096_bf16' \
    --only 'qwen2.5-7b_decode_b4_s1024_bf16' --only 'qwen2.5-7b_decode_b8_s1024_bf16' \
    --only 'llama3.2-1b_decode_b4_s32768_bf16' -j 16 2>&1 | tail -40
  cp tuning/nvidia-h200.json "$OUT/nvidia-h200-tuning.json"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$(pwd)/.site" \
    .whl/*.whl && export PYTHONPATH="$(pwd)/.site:${PYTHONPATH:-}" FLASHINFER_USE_CUDA_NORM=1
  timeout 500 python3 bench/gpu_check.py --no-tests --heldout '' --serving-budget 60 \
    --only 'llama3.2-1b_decode_b8_s4096_bf16' --only 'qwen2.5-7b_decode_b4_s1024_bf16' \
    --only 'qwen2.5-7b_decode_b8_s1024_bf16' --only 'llama3.2-1b_decode_b4_s32768_bf16' 2>&1 | tail -15
fi
