// ---- stage: qkv_proj ---- input norm, then q, k and v of every sequence in one GEMV over the packed
// [q; k; v] weight (+ bias where the model has one). Raw fp32 results go to ws_qkv[b][QKV_DIM]; q/k norm and RoPE
// happen in the attention stage, which needs whole heads.
#pragma once
#include "../gemv.cuh"
#include "norm.cuh"
__device__ void qkv_proj(const T* x, const T* ln_w, const T* ln_b, const T* w_qkv, const T* b_qkv, float* ws_qkv,
                         float* ws_split, unsigned* ws_count, unsigned char* smem) {
    T* xs = reinterpret_cast<T*>(smem + SMEM_XS);
    norm(x, ln_w, ln_b, xs, reinterpret_cast<float*>(smem + SMEM_RED));
    gemv<QKV_DIM, HIDDEN, XS_LD, QKV_NWG, QKV_U, QKV_KSPLIT, false, GEMV_PF>(w_qkv, xs,
        reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count,
        [&](int row0, auto tile, int gt) {
            for (int i = gt; i < 16 * BATCH; i += QKV_NWG * 32) {
                const int n = row0 + i / BATCH, b = i % BATCH;
                float v = tile(i / BATCH, b);
#if QKV_BIAS
                v += to_f(b_qkv[n]);
#endif
                ws_qkv[(size_t)b * QKV_DIM + n] = v;
            }
        });
}
