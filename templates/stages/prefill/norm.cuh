// ---- stage: norm (prefill) ---- RMSNorm (or LayerNorm) of every token row of src (T or fp32, HIDDEN values)
// into dst (T, rows of HIDDEN in the GEMMs' input layout, gemm_x): one warp per row, rows strided over the grid's
// warps. The GEMM that follows reads dst from global memory (L2), since a whole chunk's rows do not fit in one
// block's shared memory.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
// gemm_x: the GEMMs' input layout
#include "../../gemm.cuh"

template <class S>
__device__ void norm(const S* src, const T* __restrict__ w, const T* __restrict__ bias, T* dst) {
    constexpr int NCH = HIDDEN / 8, NW = THREADS / 32;
    const int lane = threadIdx.x & 31;
    for (int row = blockIdx.x * NW + (threadIdx.x >> 5); row < ROWS; row += gridDim.x * NW) {
        const S* x = src + (size_t)row * HIDDEN;
        float s1 = 0.f, s2 = 0.f;
        for (int c = lane; c < NCH; c += 32) {
            float f[8];
            load8(x + c * 8, f);
#pragma unroll
            for (int i = 0; i < 8; ++i) { s1 += f[i]; s2 = fmaf(f[i], f[i], s2); }
        }
        s1 = warp_sum(s1);
        s2 = warp_sum(s2);
#if NORM_LAYERNORM
        const float mean = s1 / HIDDEN, rstd = rsqrtf(fmaxf(s2 / HIDDEN - mean * mean, 0.f) + NORM_EPS);
#else
        const float mean = 0.f, rstd = rsqrtf(s2 / HIDDEN + NORM_EPS);
#endif
        for (int c = lane; c < NCH; c += 32) {
            float f[8], g[8];
            load8(x + c * 8, f);
            load8(w + c * 8, g);
#if NORM_LAYERNORM
            float bb[8];
            load8(bias + c * 8, bb);
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = (f[i] - mean) * rstd * g[i] + bb[i];
#else
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = (f[i] - mean) * rstd * g[i];
#endif
            *reinterpret_cast<uint4*>(dst + gemm_x(row, c * 8, HIDDEN)) = pack8(f);
        }
    }
}
