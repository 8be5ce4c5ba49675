// ---- GEMM engine of the prefill projections (not a stage itself) ----
// C[n][t] = sum_k W[n][k] * X[t][k] for N weight rows and `rows` tokens on the tensor cores (mma.sync m16n8k16):
// weight rows are M, tokens are N. A block task is a GEMM_BM x GEMM_BN tile (weight rows x tokens) over the whole
// of K, walked in GEMM_BK-wide chunks through a GEMM_STAGES-deep cp.async ring in shared memory: the packed
// weights (fragment order, so a chunk of one 16-row tile is 2 KB contiguous) and the token rows (padded by 16
// bytes: ldmatrix reads them without bank conflicts). The warps form a GEMM_WM x GEMM_WN grid; a warp owns GEMM_TM
// 16-row tiles x GEMM_TN 8-token tiles (larger warp tiles read fewer fragments per mma). The epilogue runs from
// registers.
// Split-K (KSPLIT > 1, for projections with fewer tiles than SMs, e.g. a short chunk): a tile's K range is split
// over KSPLIT tasks that run on different blocks; each writes its fp32 partial sums to `part`, and the last of them
// to finish (found through a per-tile counter, reset by that task for the next launch: no barrier) adds the others'
// partials to its own and runs the epilogue.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (the GEMM is prefill's)
#include "example_config_prefill.cuh"
#endif
#include "gemv.cuh"

constexpr int GEMM_WN = (THREADS / 32) / GEMM_WM;   // warp columns
constexpr int GEMM_BN = GEMM_WN * GEMM_TN * 8;     // tokens per block tile
constexpr int GEMM_BM = GEMM_WM * GEMM_TM * 16;    // weight rows per block tile
static_assert(GEMM_TN % 2 == 0, "tokens are read 16 at a time (ldmatrix.x4)");
constexpr int GEMM_XLD = GEMM_BK + 8;              // padded token row (elements)
constexpr int GEMM_A_STAGE = GEMM_BM * GEMM_BK;    // elements of one weight chunk
constexpr int GEMM_B_STAGE = GEMM_BN * GEMM_XLD;   // elements of one token chunk

__device__ __forceinline__ void ldsm_x4_gemm(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// W: packed [N/16][K/16][32][8]; X: `rows` token rows of K elements (global). epi(n, t, v) for every result with
// n < N and t < rows (PAIR: epi(n/2, t, v_even_row, v_odd_row) once per pair of rows 2p, 2p+1). part: KSPLIT x rows
// x N floats, count: one counter per output tile (both unused when KSPLIT == 1).
template <int N, int K, int KSPLIT, bool PAIR = false, class Epi>
__device__ __forceinline__ void gemm(const T* __restrict__ W, const T* X, int rows, unsigned char* smem, float* part,
                                     unsigned* count, Epi epi) {
    static_assert(N % 16 == 0 && K % 16 == 0 && GEMM_BK % 16 == 0, "bad GEMM shape");
    constexpr int NT16 = N / 16, KT16 = K / 16, KCH = (K + GEMM_BK - 1) / GEMM_BK, BKT = GEMM_BK / 16;
    constexpr int MB = (N + GEMM_BM - 1) / GEMM_BM;
    T* As = reinterpret_cast<T*>(smem);
    T* Bs = As + GEMM_STAGES * GEMM_A_STAGE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int wm = warp % GEMM_WM, wn = warp / GEMM_WM;
    const int nb_count = (rows + GEMM_BN - 1) / GEMM_BN;
    const uint4* Wv = reinterpret_cast<const uint4*>(W);
    __shared__ int last_split;
    for (int task = blockIdx.x; task < MB * nb_count * KSPLIT; task += gridDim.x) {
        const int ks = task % KSPLIT, tile = task / KSPLIT, mb = tile % MB, nb = tile / MB;
        const int kc0 = ks * KCH / KSPLIT, kc1 = (ks + 1) * KCH / KSPLIT;  // this task's K chunks
        const int mt0 = mb * (GEMM_BM / 16), t0 = nb * GEMM_BN;
        auto issue = [&](int kc, int stage) {
            if (kc < kc1) {
                T* a = As + stage * GEMM_A_STAGE;
                // weights: (BM/16 tiles) x (BKT k-tiles) x 32 lanes x 16 B, contiguous per tile in the packing
                for (int c = tid; c < (GEMM_BM / 16) * BKT * 32; c += THREADS) {
                    const int mt = c / (BKT * 32), rem = c % (BKT * 32), kt = kc * BKT + rem / 32;
                    const bool ok = mt0 + mt < NT16 && kt < KT16;
                    cp_async16(a + (size_t)c * 8, ok ? Wv + ((size_t)(mt0 + mt) * KT16 + kt) * 32 + rem % 32 : Wv, ok);
                }
                T* b = Bs + stage * GEMM_B_STAGE;
                for (int c = tid; c < GEMM_BN * (GEMM_BK / 8); c += THREADS) {
                    const int r = c / (GEMM_BK / 8), k = kc * GEMM_BK + (c % (GEMM_BK / 8)) * 8;
                    const bool ok = t0 + r < rows && k < K;
                    cp_async16(b + r * GEMM_XLD + (c % (GEMM_BK / 8)) * 8, ok ? X + (size_t)(t0 + r) * K + k : X, ok);
                }
            }
            cp_async_commit();  // an empty group past the end keeps the wait count uniform
        };
#pragma unroll
        for (int s = 0; s < GEMM_STAGES - 1; ++s) issue(kc0 + s, s);
        float c[GEMM_TM][GEMM_TN][4];
#pragma unroll
        for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
            for (int j = 0; j < GEMM_TN; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.f;
        const bool active = t0 + wn * GEMM_TN * 8 < rows && mt0 + wm * GEMM_TM < NT16;  // warp-uniform: skip padding
        for (int kc = kc0; kc < kc1; ++kc) {
            cp_async_wait<GEMM_STAGES - 2>();
            __syncthreads();  // chunk kc is in; every warp is done with the stage about to be refilled
            issue(kc + GEMM_STAGES - 1, (kc - kc0 + GEMM_STAGES - 1) % GEMM_STAGES);
            if (active) {
                const T* a = As + ((kc - kc0) % GEMM_STAGES) * GEMM_A_STAGE;
                const T* b = Bs + ((kc - kc0) % GEMM_STAGES) * GEMM_B_STAGE;
#pragma unroll
                for (int kk = 0; kk < BKT; ++kk) {
                    uint4 af[GEMM_TM];
#pragma unroll
                    for (int i = 0; i < GEMM_TM; ++i)
                        af[i] = *reinterpret_cast<const uint4*>(
                            a + ((size_t)((wm * GEMM_TM + i) * BKT + kk) * 32 + lane) * 8);
                    unsigned bf[GEMM_TN * 2];  // per 16 tokens: (tokens 0-7 | 8-15) x (k 0-7 | 8-15)
#pragma unroll
                    for (int j = 0; j < GEMM_TN; j += 2)
                        ldsm_x4_gemm(*reinterpret_cast<unsigned(*)[4]>(bf + 2 * j),
                                     b + (wn * GEMM_TN * 8 + j * 8 + (lane & 7) + ((lane >> 4) << 3)) * GEMM_XLD +
                                         kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
                        for (int j = 0; j < GEMM_TN; ++j) mma_bf16(c[i][j], af[i], bf[2 * j], bf[2 * j + 1]);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the ring is reused by the next task
        if constexpr (KSPLIT > 1) {
            auto at = [&](int s, int n, int t) { return part + ((size_t)s * rows + t) * N + n; };
            if (active)
#pragma unroll
                for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
                    for (int j = 0; j < GEMM_TN; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int n = (mt0 + wm * GEMM_TM + i) * 16 + gid + (e >> 1) * 8;
                            const int t = t0 + (wn * GEMM_TN + j) * 8 + 2 * tig + (e & 1);
                            if (n < N && t < rows) *at(ks, n, t) = c[i][j][e];
                        }
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) {
                last_split = atomicAdd(count + tile, 1u) == KSPLIT - 1;
                if (last_split) count[tile] = 0u;  // every split has counted: ready for the next launch
            }
            __syncthreads();
            if (!last_split) continue;
            __threadfence();
            if (active)
#pragma unroll
                for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
                    for (int j = 0; j < GEMM_TN; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int n = (mt0 + wm * GEMM_TM + i) * 16 + gid + (e >> 1) * 8;
                            const int t = t0 + (wn * GEMM_TN + j) * 8 + 2 * tig + (e & 1);
                            if (n < N && t < rows)
                                for (int s = 0; s < KSPLIT; ++s)
                                    if (s != ks) c[i][j][e] += __ldcg(at(s, n, t));
                        }
        }
        if (active) {
#pragma unroll
            for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
                for (int j = 0; j < GEMM_TN; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int n = (mt0 + wm * GEMM_TM + i) * 16 + gid + (e >> 1) * 8;
                        const int t = t0 + (wn * GEMM_TN + j) * 8 + 2 * tig + (e & 1);
                        if constexpr (PAIR) {  // rows 2p (this lane, gid even) and 2p+1 (the lane 4 above)
                            const float odd = __shfl_down_sync(0xffffffffu, c[i][j][e], 4);
                            if ((gid & 1) == 0 && n < N && t < rows) epi(n / 2, t, c[i][j][e], odd);
                        } else {
                            if (n < N && t < rows) epi(n, t, c[i][j][e]);
                        }
                    }
        }
    }
}
