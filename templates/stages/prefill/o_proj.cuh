// ---- stage: o_proj (prefill) ---- output projection of every token plus the residual: h = x + attn @ Wo^T, kept
// in fp32 (ws_h) for the second norm and the final residual.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../../gemm.cuh"

__device__ void o_proj(const T* ws_attn, const T* w_o, const unsigned char* w_tmaps, const T* x, float* ws_h,
    float* ws_split, unsigned* ws_count, unsigned char* smem) {
    gemm<HIDDEN, Q_DIM, O_KSPLIT, O_FULL>(w_o, w_tmaps + TMAP_O * TMAP_BYTES, ws_attn, ROWS, smem, ws_split,
        ws_count,
        [&](int n, int t) { return load4(x + (size_t)t * HIDDEN + n); },
        [&](int n, int t, float4 v, float4 res) { *reinterpret_cast<float4*>(ws_h + (size_t)t * HIDDEN + n) = res + v; });
}
