// ---- stage: down_proj (prefill) ---- down projection of every token plus the second residual: out = h + act @ Wd^T.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../../gemm.cuh"

__device__ void down_proj(const T* ws_act, const T* w_down, const unsigned char* w_tmaps, const float* ws_h, T* out,
    unsigned* ws_status, float* ws_split, unsigned* ws_count, unsigned char* smem) {
    down_gemm<DOWN_KSPLIT, DOWN_FULL>(ws_act, w_down, w_tmaps, ws_h, out, ws_status, ROWS, ws_split, ws_count, smem);
}
