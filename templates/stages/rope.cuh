// ---- stage: rope ---- rotary embedding, HF "rotate_half" convention: dims d and d + HEAD_DIM/2 form a pair,
// angle = position * inv_freq[d mod HEAD_DIM/2] (inv_freq is computed on the host, so scaled RoPE variants only
// change that table). v: one head in shared memory, one warp; the result is also multiplied by `scale`.
#pragma once
#include "../common.cuh"
__device__ __forceinline__ void rope(float* v, int position, const float* __restrict__ inv_freq, float scale, int lane) {
    constexpr int HALF = HEAD_DIM / 2;
    float out[(HALF + 31) / 32][2];
#pragma unroll
    for (int k = 0; k < (HALF + 31) / 32; ++k) {
        const int d = lane + 32 * k;
        if (d < HALF) {
            float s, c;
            sincosf((float)position * inv_freq[d], &s, &c);
            out[k][0] = (v[d] * c - v[d + HALF] * s) * scale;
            out[k][1] = (v[d + HALF] * c + v[d] * s) * scale;
        }
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < (HALF + 31) / 32; ++k) {
        const int d = lane + 32 * k;
        if (d < HALF) { v[d] = out[k][0]; v[d + HALF] = out[k][1]; }
    }
    __syncwarp();
}
