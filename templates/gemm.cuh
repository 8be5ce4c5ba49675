// ---- GEMM engine of the prefill projections (not a stage itself) ----
// C[n][t] = sum_k W[n][k] * X[t][k] for N weight rows and `rows` tokens on the tensor cores (mma.sync m16n8k16):
// weight rows are M, tokens are N. A block task is a GEMM_BM x GEMM_BN tile (weight rows x tokens) over the whole
// of K, walked in GEMM_BK-wide chunks through a GEMM_STAGES-deep cp.async ring in shared memory: the packed
// weights (fragment order, so a chunk of one 16-row tile is 2 KB contiguous) and the token rows (padded by 16
// bytes: ldmatrix reads them without bank conflicts). The 16 warps form a GEMM_WM x GEMM_WN grid; a warp owns 32
// weight rows x 16 tokens (2 x 2 mma tiles). The epilogue runs from registers.
#pragma once
#include "gemv.cuh"

constexpr int GEMM_WN = (THREADS / 32) / GEMM_WM;   // warp columns
constexpr int GEMM_BN = GEMM_WN * 16;              // tokens per block tile
constexpr int GEMM_BM = GEMM_WM * 32;              // weight rows per block tile
constexpr int GEMM_XLD = GEMM_BK + 8;              // padded token row (elements)
constexpr int GEMM_A_STAGE = GEMM_BM * GEMM_BK;    // elements of one weight chunk
constexpr int GEMM_B_STAGE = GEMM_BN * GEMM_XLD;   // elements of one token chunk

__device__ __forceinline__ void ldsm_x4_gemm(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// W: packed [N/16][K/16][32][8]; X: `rows` token rows of K elements (global). epi(n, t, v) for every result with
// n < N and t < rows (PAIR: epi(n/2, t, v_even_row, v_odd_row) once per pair of rows 2p, 2p+1).
template <int N, int K, bool PAIR = false, class Epi>
__device__ __forceinline__ void gemm(const T* __restrict__ W, const T* X, int rows, unsigned char* smem, Epi epi) {
    static_assert(N % 16 == 0 && K % 16 == 0 && GEMM_BK % 16 == 0, "bad GEMM shape");
    constexpr int NT16 = N / 16, KT16 = K / 16, KCH = (K + GEMM_BK - 1) / GEMM_BK, BKT = GEMM_BK / 16;
    constexpr int MB = (N + GEMM_BM - 1) / GEMM_BM;
    T* As = reinterpret_cast<T*>(smem);
    T* Bs = As + GEMM_STAGES * GEMM_A_STAGE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int wm = warp % GEMM_WM, wn = warp / GEMM_WM;
    const int nb_count = (rows + GEMM_BN - 1) / GEMM_BN;
    const uint4* Wv = reinterpret_cast<const uint4*>(W);
    for (int task = blockIdx.x; task < MB * nb_count; task += gridDim.x) {
        const int mb = task % MB, nb = task / MB;
        const int mt0 = mb * (GEMM_BM / 16), t0 = nb * GEMM_BN;
        auto issue = [&](int kc, int stage) {
            if (kc < KCH) {
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
        for (int s = 0; s < GEMM_STAGES - 1; ++s) issue(s, s);
        float c[2][2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.f;
        const bool active = t0 + wn * 16 < rows && mt0 + wm * 2 < NT16;  // warp-uniform: skip padding
        for (int kc = 0; kc < KCH; ++kc) {
            cp_async_wait<GEMM_STAGES - 2>();
            __syncthreads();  // chunk kc is in; every warp is done with the stage about to be refilled
            issue(kc + GEMM_STAGES - 1, (kc + GEMM_STAGES - 1) % GEMM_STAGES);
            if (active) {
                const T* a = As + (kc % GEMM_STAGES) * GEMM_A_STAGE;
                const T* b = Bs + (kc % GEMM_STAGES) * GEMM_B_STAGE;
#pragma unroll
                for (int kk = 0; kk < BKT; ++kk) {
                    uint4 af[2];
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        af[i] = *reinterpret_cast<const uint4*>(a + ((size_t)((wm * 2 + i) * BKT + kk) * 32 + lane) * 8);
                    unsigned bf[4];  // (tokens 0-7 | 8-15 of the warp) x (k 0-7 | 8-15)
                    ldsm_x4_gemm(bf, b + (wn * 16 + (lane & 7) + ((lane >> 4) << 3)) * GEMM_XLD + kk * 16 +
                                          ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int i = 0; i < 2; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j) mma_bf16(c[i][j], af[i], bf[2 * j], bf[2 * j + 1]);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the ring is reused by the next task
        if (active) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int n = (mt0 + wm * 2 + i) * 16 + gid + (e >> 1) * 8;
                        const int t = t0 + wn * 16 + j * 8 + 2 * tig + (e & 1);
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
