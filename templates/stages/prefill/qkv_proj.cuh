// ---- stage: qkv_proj (prefill) ---- q, k and v of every token of the chunk in one GEMM over the packed [q; k; v]
// weight (+ bias): raw fp32 rows to ws_qkv[t][QKV_DIM] (q/k norm and RoPE follow in kv_append).
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../../gemm.cuh"

__device__ void qkv_proj(const T* ws_xn, const T* w_qkv, const unsigned char* w_tmaps, const T* b_qkv,
    float* ws_qkv, float* ws_split, unsigned* ws_count, unsigned char* smem) {
    gemm<QKV_DIM, HIDDEN, QKV_KSPLIT, QKV_FULL>(w_qkv, w_tmaps + TMAP_QKV * TMAP_BYTES, ws_xn, ROWS, smem,
        ws_split, ws_count,
        [&](int n, int t) { return QKV_BIAS ? load4(b_qkv + n) : make_float4(0.f, 0.f, 0.f, 0.f); },
        [&](int n, int t, float4 v, float4 bias) {
            *reinterpret_cast<float4*>(ws_qkv + (size_t)t * QKV_DIM + n) = v + bias;
        });
}
