// The served model's head in one launch (generator.lm_head): the final RMSNorm, the LM head and the greedy
// next token. logits[b][v] = T(sum_k h[b][k] * W[v][k]) summed in fp32 and rounded to T as transformers' T
// lm_head returns them (W row-major [V][HIDDEN], the checkpoint's own layout: no packed copy of the largest
// matrix), h = gain * T(x * rsqrt(mean(x^2) + eps)) rounded to T as transformers' LlamaRMSNorm rounds it;
// next[b] = the first index of the largest logit (torch.argmax). Within one rounding of torch's head's logits.
// A streaming GEMV: at batch <= 8 the head is a read of V x HIDDEN x 2 bytes, 16-byte loads with no L1 allocation,
// the normed rows in shared memory. MAXB 1: FMAs, R rows of W a warp at a time; MAXB 8 (1..8 rows of x): the
// tensor cores, 16 rows of W a warp (FMAs would bound it: measured 0.5-0.66x torch's head at 8 rows).
// Config (generator.lm_head prepends it): HIDDEN, MAXB, T, T2, DTYPE_BF16, T_MAX, MMA_AB.
#include "common.cuh"
#include "argmax.cuh"

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
// MAXB 8: 32-wide k steps loaded at once: 16 above hidden 2048 (hidden 3584/4096: 1.05-1.09x torch's head against
// 0.95-1.06x with 8), else 8 (hidden 896: 1.34-1.39x against 1.23-1.27x; 2048: either)
constexpr int KS_MAX = HIDDEN > 2048 ? 16 : 8;
constexpr int KS = (HIDDEN + 31) / 32 < KS_MAX ? (HIDDEN + 31) / 32 : KS_MAX;
constexpr int HP = HIDDEN + 8;  // x's rows' pitch in shared memory: 8 rows' 16-byte reads fall 4 banks apart
static_assert(HIDDEN % 8 == 0, "HIDDEN must be a multiple of 8");
static_assert(MAXB == 1 || MAXB == 8, "MAXB 1 (FMAs) or 8 (the tensor cores' n-tile)");

// A weight load the compiler may schedule freely (not volatile, unlike ld_weight). No L1 allocation: each weight
// is read once.
__device__ __forceinline__ uint4 ld_stream(const T* p) {
    uint4 u;
    asm("ld.global.nc.L1::no_allocate.v4.u32 { %0, %1, %2, %3 }, [%4];"
        : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
    return u;
}

// x [nb][HIDDEN] T, gain [HIDDEN] T, W [V][HIDDEN] T -> logits [nb][V] fp32, next [nb] int64 (nb <= MAXB).
// part [gridDim.x][MAXB] (scratch), counter: 0 before the first launch; the grid's last block resets it, so a
// CUDA graph replays the launch as is.
// The served step's advance where hist is not null (generator.serve: a greedy decode step ends here instead of in
// more launches): hist[*step][b] = next[b] (the generation's tokens, [steps][nb], which the host copies on another
// stream), pos[b] += 1, x_next[b] = embed[next[b]] (embed [>= V][HIDDEN] T; x_next is the next step's input, not
// x), then *step += 1.
extern "C" __global__ void __launch_bounds__(WARPS * 32) lm_head(
    const T* __restrict__ x, const T* __restrict__ gain, const T* __restrict__ W, float* __restrict__ logits,
    long long* __restrict__ next, unsigned long long* __restrict__ part, unsigned* __restrict__ counter, int V,
    int nb, float eps, long long* __restrict__ hist, long long* __restrict__ step, int* __restrict__ pos,
    const T* __restrict__ embed, T* __restrict__ x_next) {
    extern __shared__ __align__(16) unsigned char smem[];  // the normed rows, [nb][HP] T
    T* h = reinterpret_cast<T*>(smem);
    __shared__ unsigned long long best[WARPS][MAXB];
    __shared__ bool last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#if __CUDA_ARCH__ >= 900
    // programmatic dependent launch (generator.lm_head launches with it on sm_90+): this launch was scheduled while
    // the last layer ran; wait until it has finished and its writes (x) are visible (a no-op without PDL)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif

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
            *reinterpret_cast<uint4*>(h + b * HP + c * 8) = pack8(f);
        }
    }
    __syncthreads();

    const int gw = blockIdx.x * WARPS + warp, nw = gridDim.x * WARPS;
    unsigned long long mine[MAXB];  // this lane's largest key per row of x (MAXB 8: rows 2t, 2t + 1 only)
#pragma unroll
    for (int b = 0; b < MAXB; ++b) mine[b] = 0ull;
    if constexpr (MAXB == 1) {
        // one row of x: FMAs, a lane 16-byte chunks c = lane + 32 i of R rows of W at a time, then a warp sum
        for (int r0 = gw * R; r0 < V; r0 += nw * R) {
            float acc[R] = {};
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
                    float hv[8];
                    load8(h + c * 8, hv);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        float wv[8];
                        unpack8(w[r][i], wv);
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[r] = fmaf(wv[j], hv[j], acc[r]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r0 + r >= V) break;
                const float s = to_f(from_f(warp_sum(acc[r])));  // rounded to T, as torch's T GEMM returns it
                if (lane == 0) logits[r0 + r] = s;
                const unsigned long long k = argmax_key(s, r0 + r);
                mine[0] = k > mine[0] ? k : mine[0];
            }
        }
    } else {
        // up to 8 rows of x: mma.sync m16n8k16, 16 rows of W a warp task, x's rows as the n-tile. The sum over k
        // is order-free, so a lane's A fragment is two 16-byte loads (rows g and g + 8, k 8t .. 8t + 7 of a
        // 32-wide step) and its B fragment the same k of x's row g: k 8t + {0..3} feed one mma, 8t + {4..7} the
        // next, in A's and B's fragment slots alike.
        const int g = lane >> 2, t = lane & 3;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        for (int r0 = gw * 16; r0 < V; r0 += nw * 16) {
            const T* wlo = W + (size_t)min(r0 + g, V - 1) * HIDDEN + 8 * t;
            const T* whi = W + (size_t)min(r0 + g + 8, V - 1) * HIDDEN + 8 * t;
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int k0 = 0; k0 < HIDDEN; k0 += 32 * KS) {
                uint4 lo[KS], hi[KS];
#pragma unroll
                for (int j = 0; j < KS; ++j) {
                    const bool ok = k0 + 32 * j + 8 * t < HIDDEN;
                    lo[j] = ok ? ld_stream(wlo + k0 + 32 * j) : zero;
                    hi[j] = ok ? ld_stream(whi + k0 + 32 * j) : zero;
                }
#pragma unroll
                for (int j = 0; j < KS; ++j) {
                    const int k = k0 + 32 * j + 8 * t;
                    const uint4 hv = (g < nb && k < HIDDEN) ? *reinterpret_cast<const uint4*>(h + g * HP + k) : zero;
                    mma_bf16(c, make_uint4(lo[j].x, hi[j].x, lo[j].y, hi[j].y), hv.x, hv.y);
                    mma_bf16(c, make_uint4(lo[j].z, hi[j].z, lo[j].w, hi[j].w), hv.z, hv.w);
                }
            }
            // c[0], c[1]: W row r0 + g, x rows 2t, 2t + 1; c[2], c[3]: W row r0 + g + 8
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + g + 8 * (e >> 1), b = 2 * t + (e & 1);
                if (row < V && b < nb) {
                    const float v = to_f(from_f(c[e]));  // rounded to T, as torch's T GEMM returns it
                    logits[(size_t)b * V + row] = v;
                    const unsigned long long k = argmax_key(v, row);
                    mine[e & 1] = k > mine[e & 1] ? k : mine[e & 1];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // over the lanes of one t (the rows g): lane t then holds x rows 2t, 2t + 1's
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                const unsigned long long k = __shfl_xor_sync(0xffffffffu, mine[e], o);
                mine[e] = k > mine[e] ? k : mine[e];
            }
        }
    }

    // the block's maxima, then the grid's: the last block to finish reduces every block's
    if (MAXB == 1 && lane == 0) best[warp][0] = mine[0];
    if (MAXB > 1 && lane < 4) {
        best[warp][2 * lane] = mine[0];
        best[warp][2 * lane + 1] = mine[1];
    }
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
    const long long st = hist != nullptr ? *step : 0;  // (every thread reads it before thread 0's increment below)
    for (int b = warp; b < nb; b += WARPS) {
        unsigned long long k = 0ull;
        for (int g = lane; g < (int)gridDim.x; g += 32) {
            const unsigned long long t = __ldcg(part + (size_t)g * MAXB + b);
            k = t > k ? t : k;
        }
        k = warp_max_key(k);  // (every lane's)
        const int t = (int)(0xFFFFFFFFu - (unsigned)(k & 0xFFFFFFFFull));
        if (lane == 0) next[b] = t;
        if (hist != nullptr) {
            if (lane == 0) {
                hist[st * nb + b] = t;
                pos[b] += 1;
            }
#pragma unroll 1  // (unrolled, it spilled 8 B at hidden 2048, one row)
            for (int c = lane; c < CH; c += 32)
                *reinterpret_cast<uint4*>(x_next + (size_t)b * HIDDEN + c * 8) =
                    *reinterpret_cast<const uint4*>(embed + (size_t)t * HIDDEN + c * 8);
        }
    }
    if (hist != nullptr) {
        __syncthreads();
        if (threadIdx.x == 0) *step = st + 1;
    }
    if (threadIdx.x == 0) *counter = 0u;
}
