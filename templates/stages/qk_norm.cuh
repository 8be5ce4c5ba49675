// ---- stage: qk_norm ---- per-head RMSNorm of q and k (Qwen3); a no-op for models without it.
// v: one head (HEAD_DIM fp32 values in shared memory), processed by one warp.
#pragma once
#include "../common.cuh"
__device__ __forceinline__ void qk_norm(float* v, const T* __restrict__ w, int lane) {
#if QK_NORM
    float ss = 0.f;
    for (int d = lane; d < HEAD_DIM; d += 32) ss = fmaf(v[d], v[d], ss);
    const float r = rsqrtf(warp_sum(ss) / HEAD_DIM + NORM_EPS);
    for (int d = lane; d < HEAD_DIM; d += 32) v[d] = v[d] * r * to_f(w[d]);
    __syncwarp();
#endif
}
