// The served model's head in one launch (generator.lm_head): the final RMSNorm, the LM head and the greedy
// next token. logits[b][v] = sum_k h[b][k] * W[v][k] in fp32 (W row-major [V][HIDDEN], the checkpoint's own
// layout: no packed copy of the largest matrix), h = gain * T(x * rsqrt(mean(x^2) + eps)) rounded to T as
// transformers' LlamaRMSNorm rounds it; next[b] = the first index of the largest logit (torch.argmax).
// A streaming GEMV: at batch <= 8 the head is a read of V x HIDDEN x 2 bytes. Each warp takes R rows at a time, a
// lane 16-byte loads of up to 8 chunks a row with no L1 allocation; the normed rows sit in shared memory. Few
// registers, so many blocks an SM keep the bytes in flight.
// Config (generator.lm_head prepends it): HIDDEN, MAXB (rows a launch may have), T, T2, DTYPE_BF16, T_MAX.
#include "common.cuh"

#ifndef LMH_R  // rows a warp takes at a time (measured on the H200: bench/NOTES.md session 18)
#define LMH_R 2
#endif
#ifndef LMH_S  // chunks a lane loads of a row at once
#define LMH_S 8
#endif
constexpr int WARPS = 8, R = LMH_R;              // warps a block (generator.lm_head.WARPS); rows a warp takes
constexpr int CH = HIDDEN / 8;                   // 16-byte chunks a row
constexpr int NI = (CH + 31) / 32;               // chunks a lane loads a row
constexpr int S = NI < LMH_S ? NI : LMH_S;       // of them loaded at once (R x S x 4 registers)
static_assert(HIDDEN % 8 == 0, "HIDDEN must be a multiple of 8");

// A weight load the compiler may schedule freely (not volatile, unlike ld_weight). No L1 allocation: each weight
// is read once.
__device__ __forceinline__ uint4 ld_stream(const T* p) {
    uint4 u;
    asm("ld.global.nc.L1::no_allocate.v4.u32 { %0, %1, %2, %3 }, [%4];"
        : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
    return u;
}

// An fp32 logit and its row as one 64-bit key whose unsigned order is (value, then lowest row): the block and
// grid maxima are then integer max operations, and ties go to the first index as torch.argmax's do.
__device__ __forceinline__ unsigned long long argmax_key(float v, int row) {
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xFFFFFFFFu - (unsigned)row);
}
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long t = __shfl_xor_sync(0xffffffffu, k, o);
        k = t > k ? t : k;
    }
    return k;
}

// x [nb][HIDDEN] T, gain [HIDDEN] T, W [V][HIDDEN] T -> logits [nb][V] fp32, next [nb] int64 (nb <= MAXB).
// part [gridDim.x][MAXB] (scratch), counter: 0 before the first launch; the grid's last block resets it, so a
// CUDA graph replays the launch as is.
extern "C" __global__ void __launch_bounds__(WARPS * 32) lm_head(
    const T* __restrict__ x, const T* __restrict__ gain, const T* __restrict__ W, float* __restrict__ logits,
    long long* __restrict__ next, unsigned long long* __restrict__ part, unsigned* __restrict__ counter, int V,
    int nb, float eps) {
    extern __shared__ __align__(16) unsigned char smem[];  // the normed rows, [nb][HIDDEN] T
    T* h = reinterpret_cast<T*>(smem);
    __shared__ unsigned long long best[WARPS][MAXB];
    __shared__ bool last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // the norm, in every block (nb x HIDDEN x 2 bytes from L2): a warp a row
    for (int b = warp; b < nb; b += WARPS) {
        float ss = 0.f;
        for (int c = lane; c < CH; c += 32) {
            float f[8];
            load8(x + (size_t)b * HIDDEN + c * 8, f);
#pragma unroll
            for (int i = 0; i < 8; ++i) ss += f[i] * f[i];
        }
        const float rs = rsqrtf(warp_sum(ss) / HIDDEN + eps);
        for (int c = lane; c < CH; c += 32) {
            float f[8], g[8];
            load8(x + (size_t)b * HIDDEN + c * 8, f);
            load8(gain + c * 8, g);
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = g[i] * to_f(from_f(f[i] * rs));
            *reinterpret_cast<uint4*>(h + b * HIDDEN + c * 8) = pack8(f);
        }
    }
    __syncthreads();

    unsigned long long mine[MAXB];
#pragma unroll
    for (int b = 0; b < MAXB; ++b) mine[b] = 0ull;
    const int gw = blockIdx.x * WARPS + warp, nw = gridDim.x * WARPS;
    for (int r0 = gw * R; r0 < V; r0 += nw * R) {
        float acc[R][MAXB];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < MAXB; ++b) acc[r][b] = 0.f;
#pragma unroll
        for (int i0 = 0; i0 < NI; i0 += S) {
            uint4 w[R][S];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < S; ++i) {  // every load unconditional (clamped; unused ones discarded)
                    const int c = min(lane + 32 * (i0 + i), CH - 1);
                    w[r][i] = ld_stream(W + (size_t)min(r0 + r, V - 1) * HIDDEN + c * 8);
                }
#pragma unroll
            for (int i = 0; i < S; ++i) {
                const int c = lane + 32 * (i0 + i);
                if (i0 + i >= NI || c >= CH) break;
#pragma unroll
                for (int b = 0; b < MAXB; ++b) {
                    if (b >= nb) break;
                    float hv[8];
                    load8(h + b * HIDDEN + c * 8, hv);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float wv[8];
                        unpack8(w[r][i], wv);
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[r][b] = fmaf(wv[j], hv[j], acc[r][b]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r0 + r >= V) break;
#pragma unroll
            for (int b = 0; b < MAXB; ++b) {
                if (b >= nb) break;
                const float s = warp_sum(acc[r][b]);
                if (lane == b % 32) logits[(size_t)b * V + r0 + r] = s;
                const unsigned long long k = argmax_key(s, r0 + r);
                mine[b] = k > mine[b] ? k : mine[b];
            }
        }
    }

    // the block's maxima, then the grid's: the last block to finish reduces every block's
    if (lane == 0)
#pragma unroll
        for (int b = 0; b < MAXB; ++b) best[warp][b] = mine[b];
    __syncthreads();
    if (threadIdx.x < nb) {
        unsigned long long k = 0ull;
        for (int w2 = 0; w2 < WARPS; ++w2) k = best[w2][threadIdx.x] > k ? best[w2][threadIdx.x] : k;
        part[(size_t)blockIdx.x * MAXB + threadIdx.x] = k;
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int b = warp; b < nb; b += WARPS) {
        unsigned long long k = 0ull;
        for (int g = lane; g < (int)gridDim.x; g += 32) {
            const unsigned long long t = __ldcg(part + (size_t)g * MAXB + b);
            k = t > k ? t : k;
        }
        k = warp_max_key(k);
        if (lane == 0) next[b] = (long long)(0xFFFFFFFFu - (unsigned)(k & 0xFFFFFFFFull));
    }
    if (threadIdx.x == 0) *counter = 0u;
}
