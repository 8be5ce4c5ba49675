// ---- stage: kv_append (prefill) ---- per token and head: q/k norm, RoPE at the token's position (start + t),
// then q (scaled by SCORE_SCALE for the exp2 softmax; q and k by ROPE_ATTN) to ws_q, and k, v into the caches at that
// row. One warp per (token, head) item, items strided over the grid's warps; each warp works in its own HEAD_DIM
// floats of shared memory. A sequence whose chunk does not fit the cache (start < 0 or start + CHUNK > cache_len: the
// loader checks positions, this guards graph replays) writes no cache row; attention then makes its output NaN.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../qk_norm.cuh"
#include "../rope.cuh"

__device__ void kv_append(const int* __restrict__ pos, const float* ws_qkv, const T* __restrict__ q_norm_w,
                          const T* __restrict__ k_norm_w, const float* __restrict__ inv_freq, T* k_cache, T* v_cache,
                          int cache_len, T* ws_q, unsigned char* smem) {
    constexpr int NW = THREADS / 32, ITEMS = HEADS + 2 * KV_HEADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* v = reinterpret_cast<float*>(smem) + warp * HEAD_DIM;
    for (int item = blockIdx.x * NW + warp; item < ROWS * ITEMS; item += gridDim.x * NW) {
        const int row = item / ITEMS, h = item % ITEMS, b = row / CHUNK, t = row % CHUNK;
        const int p = pos[b] + t;
        const float* src = ws_qkv + (size_t)row * QKV_DIM + h * HEAD_DIM;
        for (int d = lane; d < HEAD_DIM; d += 32) v[d] = src[d];
        __syncwarp();
        if (h < HEADS) {                       // a query head
            qk_norm(v, q_norm_w, lane);
            rope(v, p, inv_freq, SCORE_SCALE * ROPE_ATTN, lane);
            for (int d = lane; d < HEAD_DIM; d += 32) ws_q[(size_t)row * Q_DIM + h * HEAD_DIM + d] = from_f(v[d]);
        } else if (pos[b] >= 0 && pos[b] + CHUNK <= cache_len) {
            const bool is_k = h < HEADS + KV_HEADS;
            const int kvh = is_k ? h - HEADS : h - HEADS - KV_HEADS;
            if (is_k) {
                qk_norm(v, k_norm_w, lane);
                rope(v, p, inv_freq, ROPE_ATTN, lane);
            }
            T* dst = (is_k ? k_cache : v_cache) + (((size_t)b * KV_HEADS + kvh) * cache_len + p) * HEAD_DIM;
            for (int d = lane; d < HEAD_DIM; d += 32) dst[d] = from_f(v[d]);
        }
        __syncwarp();  // v is rewritten by the warp's next item
    }
}
