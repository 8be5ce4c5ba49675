// ---- stage: norm ---- RMSNorm (or LayerNorm) of the BATCH rows of src (HIDDEN values each, T or fp32) into
// shared memory as T, rows XS_LD apart (padded: the tensor-core B fragments read 8 rows without bank conflicts):
// the projection that follows reads its input from there. Every block normalises the whole
// (small) activation itself, so no grid barrier is needed between the norm and the projection.
#pragma once
#include "../common.cuh"
template <class S>
__device__ void norm(const S* src, const T* __restrict__ w, const T* __restrict__ bias, T* dst, float* scratch) {
    constexpr int NCH = HIDDEN / 8, NW = THREADS / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // rows inner: a chunk's loads of every row are issued together, one L2 round trip per pass rather than one
    // per row (src was written by other blocks: each round trip is ~1 us)
    float s1[BATCH], s2[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) s1[b] = s2[b] = 0.f;
    for (int c = tid; c < NCH; c += THREADS) {
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            float f[8];
            load8(src + (size_t)b * HIDDEN + c * 8, f);
#pragma unroll
            for (int i = 0; i < 8; ++i) { s1[b] += f[i]; s2[b] = fmaf(f[i], f[i], s2[b]); }
        }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        s1[b] = warp_sum(s1[b]);
        s2[b] = warp_sum(s2[b]);
        if (lane == 0) { scratch[warp * 2 * BATCH + b] = s1[b]; scratch[warp * 2 * BATCH + BATCH + b] = s2[b]; }
    }
    __syncthreads();
    float mean[BATCH], rstd[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        float a = 0.f, q = 0.f;
        for (int i = 0; i < NW; ++i) { a += scratch[i * 2 * BATCH + b]; q += scratch[i * 2 * BATCH + BATCH + b]; }
#if NORM_LAYERNORM
        mean[b] = a / HIDDEN;
        rstd[b] = rsqrtf(fmaxf(q / HIDDEN - mean[b] * mean[b], 0.f) + NORM_EPS);
#else
        mean[b] = 0.f;
        rstd[b] = rsqrtf(q / HIDDEN + NORM_EPS);
#endif
    }
    for (int c = tid; c < NCH; c += THREADS) {
        float g[8];
        load8(w + c * 8, g);
#if NORM_LAYERNORM
        float bb[8];
        load8(bias + c * 8, bb);
#endif
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            float f[8];
            load8(src + (size_t)b * HIDDEN + c * 8, f);
#if NORM_LAYERNORM
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = (f[i] - mean[b]) * rstd[b] * g[i] + bb[i];
#else
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = f[i] * rstd[b] * g[i];
#endif
            *reinterpret_cast<uint4*>(dst + (size_t)b * XS_LD + c * 8) = pack8(f);
        }
    }
    __syncthreads();
}
