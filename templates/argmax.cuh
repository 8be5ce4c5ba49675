// An argmax as integer maxima (templates/lm_head.cu, templates/sample.cu: the served model's head and draw, not a
// layer's source): an fp32 value and its index as one 64-bit key whose unsigned order is (value, then lowest
// index), so block and grid maxima are max operations and ties go to the first index, as torch.argmax's do.
#pragma once

// a float's 32-bit key whose unsigned order is the float's (sample.cu's radix select too); key_float inverts it
__device__ __forceinline__ unsigned float_key(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned i) {
    return ((unsigned long long)float_key(v) << 32) | (0xFFFFFFFFu - i);
}
// the index of a key
__device__ __forceinline__ unsigned key_index(unsigned long long k) { return 0xFFFFFFFFu - (unsigned)k; }

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long t = __shfl_xor_sync(0xffffffffu, k, o);
        k = t > k ? t : k;
    }
    return k;
}
