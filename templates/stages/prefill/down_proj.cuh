// ---- stage: down_proj (prefill) ---- down projection of every token plus the second residual: out = h + act @ Wd^T.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../../gemm.cuh"

__device__ void down_proj(const T* ws_act, const T* w_down, const unsigned char* w_tmaps, const float* ws_h, T* out,
    unsigned* ws_status, float* ws_split, unsigned* ws_count, unsigned char* smem) {
    gemm<HIDDEN, INTER, DOWN_KSPLIT, DOWN_FULL>(w_down, w_tmaps + TMAP_DOWN * TMAP_BYTES, ws_act, ROWS, smem,
        ws_split, ws_count,
        [&](int n, int t) { return *reinterpret_cast<const float4*>(ws_h + (size_t)t * HIDDEN + n); },
        [&](int n, int t, float4 v, float4 res) {
        const float4 o = res + v;
        count_overflow(o.x, ws_status);
        count_overflow(o.y, ws_status);
        count_overflow(o.z, ws_status);
        count_overflow(o.w, ws_status);
        store4(out + (size_t)t * HIDDEN + n, o);
    });
}
