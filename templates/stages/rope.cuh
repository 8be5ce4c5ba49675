// ---- stage: rope ---- rotary embedding, HF "rotate_half" convention: dims d and d + HEAD_DIM/2 form a pair,
// angle = position * inv_freq[d mod HEAD_DIM/2] (inv_freq is computed on the host, so scaled RoPE variants change
// that table; yarn's attention factor comes in `scale`, ROPE_ATTN). v: one head in shared memory, one warp; the result
// is also multiplied by `scale`.
#pragma once
#include "../common.cuh"
constexpr int ROPE_K = (HEAD_DIM / 2 + 31) / 32;  // inv_freq values per lane (d = lane + 32 k)
// this lane's inv_freq values: a caller that rotates many heads loads them once (one round trip fewer per head)
__device__ __forceinline__ void rope_freqs(const float* __restrict__ inv_freq, int lane, float (&f)[ROPE_K]) {
#pragma unroll
    for (int k = 0; k < ROPE_K; ++k) f[k] = lane + 32 * k < HEAD_DIM / 2 ? inv_freq[lane + 32 * k] : 0.f;
}
__device__ __forceinline__ void rope(float* v, int position, const float (&f)[ROPE_K], float scale, int lane) {
    constexpr int HALF = HEAD_DIM / 2;
    float out[ROPE_K][2];
#pragma unroll
    for (int k = 0; k < ROPE_K; ++k) {
        const int d = lane + 32 * k;
        if (d < HALF) {
            float s, c;
            sincosf((float)position * f[k], &s, &c);
            out[k][0] = (v[d] * c - v[d + HALF] * s) * scale;
            out[k][1] = (v[d + HALF] * c + v[d] * s) * scale;
        }
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < ROPE_K; ++k) {
        const int d = lane + 32 * k;
        if (d < HALF) { v[d] = out[k][0]; v[d + HALF] = out[k][1]; }
    }
    __syncwarp();
}
__device__ __forceinline__ void rope(float* v, int position, const float* __restrict__ inv_freq, float scale,
                                     int lane) {
    float f[ROPE_K];
    rope_freqs(inv_freq, lane, f);
    rope(v, position, f, scale, lane);
}
