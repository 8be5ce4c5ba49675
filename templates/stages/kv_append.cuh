// ---- stage: kv_append ---- write the new token's k (normed, rotated) and v into the cache at its position.
// kv: cache base of this (sequence, kv head), rows of HEAD_DIM; src: the head's HEAD_DIM fp32 values.
#pragma once
#include "../common.cuh"
__device__ __forceinline__ void kv_append(T* kv, int position, const float* src, int lane) {
    for (int d = lane; d < HEAD_DIM; d += 32) kv[(size_t)position * HEAD_DIM + d] = from_f(src[d]);
}
// the same from the lane's values in registers, value j at dim lane + 32 j
template <int N>
__device__ __forceinline__ void kv_append(T* kv, int position, const float (&v)[N], int lane) {
#pragma unroll
    for (int j = 0; j < N; ++j)
        if (lane + 32 * j < HEAD_DIM) kv[(size_t)position * HEAD_DIM + lane + 32 * j] = from_f(v[j]);
}
