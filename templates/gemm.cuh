// ---- GEMM engine of the prefill projections and of decode's GEMM_PROJ (gate_up, qkv_proj / o_proj / down_proj where
// QKV_GEMM / O_GEMM / DOWN_GEMM; not a stage) ----
// C[n][t] = sum_k W[n][k] * X[t][k] for N weight rows and `rows` tokens on the tensor cores (mma.sync m16n8k16):
// weight rows are M, tokens are N. A block task is a GEMM_BM x GEMM_BN tile (weight rows x tokens) over the whole
// of K, walked in GEMM_BK-wide chunks through a GEMM_STAGES-deep ring in shared memory (cp.async; on sm_90a the
// TMA unit, each stage's bytes counted on an mbarrier: a weight chunk one tensor copy, a token chunk one bulk
// copy): the packed weights (fragment order, so a chunk of one 16-row tile is 2 KB contiguous) and the token rows
// (mma.sync: padded by 16 bytes, so ldmatrix reads them without bank conflicts; wgmma: swizzled, not padded). The
// warps form a GEMM_WM x GEMM_WN grid; a warp owns GEMM_TM 16-row tiles x GEMM_TN 8-token tiles (larger warp tiles
// read fewer fragments per mma). A whole tile's epilogue goes through shared memory (fp32, [token][row]) so that
// each token's results are stored by consecutive lanes.
// On sm_90a (GEMM_WGMMA) the tensor-core work is Hopper's asynchronous warpgroup mma (wgmma.cuh): each warpgroup
// owns 64 weight rows (its warps' 16-row tiles: GEMM_WM = 4 x warpgroups, GEMM_TM = 1) and every token of the tile
// (GEMM_WN = 1, GEMM_BN <= 128), the weights' fragments from shared memory into registers and the tokens read by the
// tensor cores straight from the ring (rows of 64 elements in the 128-byte swizzle, not padded), a chunk of them
// one bulk copy from the tiled inputs (gemm_x) on the weights' mbarrier. Other archs keep mma.sync.
// Split-K (KSPLIT > 1, for projections with fewer tiles than SMs, e.g. a short chunk, or for the tiles past the last
// full wave, FULL, where there are more): a tile's K range is split over KSPLIT tasks that run on different blocks;
// each stores its fp32 partial tile to `part`; where all of a tile's splits are resident together each then sums and
// finishes 1/KSPLIT of the tile (a per-tile counter), else the last to finish sums all (the counter is reset by the
// task that empties it: no barrier).
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (the GEMM is prefill's)
#include "example_config_prefill.cuh"
#endif
#include "gemv.cuh"
#include "wgmma.cuh"
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
static_assert(!GEMM_WGMMA, "GEMM_WGMMA needs sm_90a (the build compiles sm_90 as sm_90a)");
#endif

// (gemm_x, the GEMMs' token-input layout: gemv.cuh)

// The epilogues' unit (gemm's pre and epi): 4 consecutive T as fp32, and back, one 8-byte access each.
__device__ __forceinline__ float4 load4(const T* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = to_f2(*reinterpret_cast<const T2*>(&u.x)), b = to_f2(*reinterpret_cast<const T2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store4(T* p, float4 v) {
    uint2 u;
    *reinterpret_cast<T2*>(&u.x) = from_f2(v.x, v.y);
    *reinterpret_cast<T2*>(&u.y) = from_f2(v.z, v.w);
    *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ float4 operator+(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

constexpr int GEMM_WN = (THREADS / 32) / GEMM_WM;   // warp columns
constexpr int GEMM_BN = GEMM_WN * GEMM_TN * 8;     // tokens per block tile
constexpr int GEMM_BM = GEMM_WM * GEMM_TM * 16;    // weight rows per block tile
static_assert(GEMM_TN % 2 == 0, "tokens are read 16 at a time (ldmatrix.x4)");
constexpr int GEMM_XLD = GEMM_WGMMA ? GEMM_BK : GEMM_BK + 8;  // token row (elements): swizzled, or padded for ldmatrix
constexpr int GEMM_A_STAGE = GEMM_BM * GEMM_BK;    // elements of one weight chunk
constexpr int GEMM_B_STAGE = GEMM_BN * GEMM_XLD;   // elements of one token chunk
static_assert(!GEMM_WGMMA || (GEMM_WN == 1 && GEMM_TM == 1 && GEMM_WM % 4 == 0 && GEMM_BK == 64 &&
                              GEMM_BN % 16 == 0 && GEMM_BN <= 128 && GEMM_XROWS % GEMM_BN == 0),
              "wgmma tiles: one 64-row tile per warpgroup, every token of the tile, one 64-element swizzled block "
              "a chunk, whole token tiles in the tiled inputs");

__device__ __forceinline__ void ldsm_x4_gemm(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// threadIdx.x read afresh (volatile): the four GEMM stages of a layer do not share (and keep live between them) the
// index arithmetic the compiler would otherwise hoist once for all of them (it spilled)
__device__ __forceinline__ int gemm_tid() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// x as the compiler cannot see through: what is derived from it is computed here, not kept live from earlier
__device__ __forceinline__ int opaque(int x) {
    int r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// A split task's second half (gemm's split-K): wait for the tile's other splits (scatter: every split resident, at
// most one split task a block) or count this one's arrival (else: the last to arrive sums all), then sum this
// split's share of the tile's partials `tp` and run the epilogue on it. Inlined: not inlined (its own register
// allocation) the call itself spilled 8-32 B on three shapes.
template <int N, int KSPLIT, class Pre, class Epi>
__device__ __forceinline__ void gemm_finish_split(const float* tp, unsigned* count, int tile, int ks, int n0, int t0,
                                               int rows, bool scatter, Pre pre, Epi epi) {
    constexpr int TILE = GEMM_BM * GEMM_BN, U = TILE / 4;
    __shared__ int last_split;
    // Every split of a tile resident at once (one task per block): each waits for all and finishes 1/KSPLIT
    // of the tile, summing the splits in split order (deterministic); the counter counts arrivals then
    // departures and the last to leave resets it. Else (a GPU with fewer blocks than tasks: a split may
    // wait for a task queued behind it on its own block) the last split to arrive finishes the whole tile.
    if (threadIdx.x == 0) {
        const unsigned arrived = atomicAdd(count + tile, 1u);
        if (scatter) {
            // backing off: the spinning blocks share the counters' cache line with the arriving ones
            while (*reinterpret_cast<volatile unsigned*>(count + tile) < KSPLIT) __nanosleep(100);
        } else {
            last_split = arrived == KSPLIT - 1;
            if (last_split) count[tile] = 0u;  // every split has counted: ready for the next launch
        }
        __threadfence();
    }
    __syncthreads();
    if (!scatter && !last_split) return;
    // float4 a thread a round, at most 2 (2 x KSPLIT loads in flight; a share of 2 splits in one round held 64
    // registers of sums and inputs, 4 a round 32, and the kernel spilled on one shape or another)
    constexpr int UPT_ALL = ((U + KSPLIT - 1) / KSPLIT + THREADS - 1) / THREADS, UPT = UPT_ALL < 2 ? UPT_ALL : 2;
    // (a share in whole quads of units: 4 lanes of a quad hold 16 rows of one token, which decode's o_proj epilogue sums
    // over the quad, templates/stages/o_proj.cuh)
    const int lo = scatter ? ks * (U / 4) / KSPLIT * 4 : 0, hi = scatter ? (ks + 1) * (U / 4) / KSPLIT * 4 : U;
    for (int base = lo + (int)threadIdx.x; base < hi; base += UPT * THREADS) {
        float4 v[UPT], in[UPT];
#pragma unroll
        for (int u = 0; u < UPT; ++u) {
            const int idx = base + u * THREADS, n = n0 + idx * 4 % GEMM_BM, t = t0 + idx * 4 / GEMM_BM;
            v[u] = in[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (idx >= hi || n >= N || t >= rows) continue;  // N % 16 == 0: all 4 rows or none
#pragma unroll
            for (int s = 0; s < KSPLIT; ++s) {
                const float4 w = __ldcg(reinterpret_cast<const float4*>(tp + (size_t)s * TILE) + idx);
                v[u].x += w.x; v[u].y += w.y; v[u].z += w.z; v[u].w += w.w;
            }
            in[u] = pre(n, t);
        }
#pragma unroll
        for (int u = 0; u < UPT; ++u) {
            const int idx = base + u * THREADS, n = n0 + idx * 4 % GEMM_BM, t = t0 + idx * 4 / GEMM_BM;
            if (idx >= hi || n >= N || t >= rows) continue;
            epi(n, t, v[u], in[u]);
        }
    }
    if (scatter) {
        __syncthreads();  // this block's reads of the partials are done
        if (threadIdx.x == 0 && atomicAdd(count + tile, 1u) == 2 * KSPLIT - 1) count[tile] = 0u;
    }
}

// The staged epilogue's row pitch (floats): 4 past the tile's rows puts the 32 lanes' fragment writes in 32 banks.
constexpr int GEMM_ELD = GEMM_BM + 4;
// whole tiles' epilogue goes through the ring in shared memory (a 192 x 128 tile takes 82 % of the planner's
// fewest stages, 3; <= 62 % of the rings planned today)
static_assert(GEMM_BN * GEMM_ELD * 4 <= GEMM_STAGES * (GEMM_A_STAGE + GEMM_B_STAGE) * (int)sizeof(T),
              "the staged epilogue's tile must fit in the ring");

// A whole tile's epilogue from its fp32 results staged in shared memory `ts` ([token][row], pitch GEMM_ELD):
// consecutive threads take consecutive groups of 4 rows of a token, so the stores and pre's loads of a warp are
// contiguous and vectors; 4 groups a thread a round, their inputs loaded before any is stored. (One element a
// thread a call was issue-bound: its index arithmetic and scalar accesses took ~8,500 SM clocks a gate_up tile and
// ~21,000 an o_proj tile against ~112,000 for the tile's main loop; clock stamps, bench/NOTES.md session 20.)
template <int N, class Pre, class Epi>
__device__ __forceinline__ void gemm_epilogue_smem(const float* ts, int n0, int t0, int rows, Pre pre, Epi epi) {
    constexpr int W = GEMM_BM / 4, TOTAL = W * GEMM_BN, U = 4;
    const int tid = (int)threadIdx.x;
    for (int base = tid; base < TOTAL; base += U * THREADS) {
        float4 v[U], w[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int idx = base + u * THREADS, tl = idx / W, n = n0 + idx % W * 4;
            v[u] = w[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (idx >= TOTAL || n >= N || t0 + tl >= rows) continue;  // N % 16 == 0: all 4 rows or none
            v[u] = *reinterpret_cast<const float4*>(ts + tl * GEMM_ELD + (n - n0));
            w[u] = pre(n, t0 + tl);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int idx = base + u * THREADS, tl = idx / W, n = n0 + idx % W * 4;
            if (idx >= TOTAL || n >= N || t0 + tl >= rows) continue;
            epi(n, t0 + tl, v[u], w[u]);
        }
    }
}

// W: packed [N/16][K/16][32][8]; tmap (sm_90a; else unused): W's TMA tensor map in global memory, a 3-D tensor
// [N/16][K/16][256] elements with a box of [GEMM_BM/16][GEMM_BK/16][256] (the loader's _tensor_maps); X: `rows`
// token rows of K elements (global, laid out by gemm_x). epi(n, t, v, pre(n, t)) for every group of 4 results,
// rows n .. n + 3 (n % 4 == 0, n < N) of token t < rows, as float4s: pre loads what the epilogue reads. The first
// FULL tiles are computed whole, the others split (KSPLIT).
// part: KSPLIT x GEMM_BM x GEMM_BN floats per split tile, count: one counter per output tile (both unused when
// KSPLIT == 1).
template <int N, int K, int KSPLIT, int FULL = 0, class Pre, class Epi>
__device__ __forceinline__ void gemm(const T* __restrict__ W, const unsigned char* tmap, const T* X, int rows,
                                     unsigned char* smem, float* part, unsigned* count, Pre pre, Epi epi) {
    static_assert(N % 16 == 0 && K % 16 == 0 && GEMM_BK % 16 == 0, "bad GEMM shape");
    constexpr int NT16 = N / 16, KT16 = K / 16, KCH = (K + GEMM_BK - 1) / GEMM_BK, BKT = GEMM_BK / 16;
    constexpr int MB = (N + GEMM_BM - 1) / GEMM_BM;
    // the token ring first, at a 1024-byte boundary (the swizzle's atom; the plan counts the slack), then the weights'
    T* Bs = reinterpret_cast<T*>(smem + ((1024u - ((unsigned)__cvta_generic_to_shared(smem) & 1023u)) & 1023u));
    T* As = Bs + GEMM_STAGES * GEMM_B_STAGE;
    const int tid = gemm_tid(), lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int wm = warp % GEMM_WM, wn = warp / GEMM_WM;
    const int nb_count = (rows + GEMM_BN - 1) / GEMM_BN;
    const uint4* Wv = reinterpret_cast<const uint4*>(W);
    // wgmma: one mbarrier a ring stage for its bulk copies (weights and tokens; their phase parity a bit of `phase`,
    // flipped at each wait: every fill is waited on once), initialised by each GEMM of a launch before its first copy
    __shared__ unsigned long long bar[GEMM_WGMMA ? GEMM_STAGES : 1];
    unsigned phase = 0;
    if constexpr (GEMM_WGMMA) {
        // the bulk copies read through the async proxy what generic stores wrote: the token inputs (other blocks'
        // stores, before the grid barrier that precedes this stage) and the ring's shared memory (the previous
        // stage's, e.g. attention's K/V ring): ordered before them by every thread
        asm volatile("fence.proxy.async;" ::: "memory");
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < GEMM_STAGES; ++s) mbar_init(bar + s, 1);
            mbar_init_fence();
            // the tensor map was written to global memory by a host copy: acquired by the tensormap proxy before the
            // thread's first copy uses it (CUDA C++ Programming Guide, "Using TMA to transfer multi-dimensional
            // arrays"); a freed layer's maps may have sat at the same address
            asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;" :: "l"(tmap) : "memory");
        }
        __syncthreads();
    }
    // the first FULL tiles whole (full waves of tasks), the rest in KSPLIT splits each (the last, partial wave
    // spread over the SMs); FULL = 0: every tile split
    const int split_tiles = MB * nb_count - FULL;
    for (int task = blockIdx.x; task < FULL + split_tiles * KSPLIT; task += gridDim.x) {
        const bool whole = KSPLIT == 1 || (FULL > 0 && task < FULL);  // FULL == 0: the whole-tile path compiled out
        const int nsplit = whole ? 1 : KSPLIT, ks = whole ? 0 : (task - FULL) % KSPLIT;
        const int tile = whole ? task : FULL + (task - FULL) / KSPLIT;
        // tiles in groups of GEMM_GM weight tiles x every token tile, the weight tile fastest: the blocks at work
        // at once share ~GEMM_GM weight tiles and ~SMs / GEMM_GM token tiles in L2 (weight tile fastest over all
        // MB, a long chunk read every weight tile from HBM once per token tile)
        const int first_mb = tile / (GEMM_GM * nb_count) * GEMM_GM, gm = min(MB - first_mb, GEMM_GM);
        const int mb = first_mb + tile % (GEMM_GM * nb_count) % gm, nb = tile % (GEMM_GM * nb_count) / gm;
        const int kc0 = ks * KCH / nsplit, kc1 = (ks + 1) * KCH / nsplit;  // this task's K chunks
        const int mt0 = mb * (GEMM_BM / 16), t0 = nb * GEMM_BN;
        auto issue = [&](int kc, int stage) {
            if (kc < kc1) {
                T* a = As + stage * GEMM_A_STAGE;
                if constexpr (GEMM_WGMMA) {
                    // a chunk of the weight tile (its GEMM_BM/16 row tiles' BKT k-tiles, 2 KB runs KT16 x 512 B
                    // apart in the packing) as ONE tensor copy: one bulk copy per row tile (12 a chunk) left the
                    // main loop waiting on the TMA unit (x1.26-1.31 slower, bench/NOTES.md session 21). Row tiles
                    // past N and k-tiles past K are zeros. And the token tile's chunk: one contiguous run in the
                    // tiled layout (gemm_x). Both by one thread, the stage's mbarrier counting the bytes.
                    if (tid == 0) {
                        mbar_expect_tx(bar + stage, (unsigned)(GEMM_A_STAGE * sizeof(T) + GEMM_BN * 128));
                        bulk_copy(Bs + stage * GEMM_B_STAGE, X + ((size_t)kc * GEMM_XROWS + t0) * 64,
                                  (unsigned)(GEMM_BN * 128), bar + stage);
                        tensor_copy3(a, tmap, 0, kc * BKT, mt0, bar + stage);
                    }
                } else {
                    // weights: (BM/16 tiles) x (BKT k-tiles) x 32 lanes x 16 B, contiguous per tile in the packing
                    for (int c = tid; c < (GEMM_BM / 16) * BKT * 32; c += THREADS) {
                        const int mt = c / (BKT * 32), rem = c % (BKT * 32), kt = kc * BKT + rem / 32;
                        const bool ok = mt0 + mt < NT16 && kt < KT16;
                        cp_async16(a + (size_t)c * 8, ok ? Wv + ((size_t)(mt0 + mt) * KT16 + kt) * 32 + rem % 32 : Wv,
                                   ok);
                    }
                }
                if constexpr (!GEMM_WGMMA) {
                    T* b = Bs + stage * GEMM_B_STAGE;
                    // tokens: a compile-time count of 16-byte copies a thread (unrolled: no loop arithmetic per copy)
                    constexpr int XCH = GEMM_BK / 8, XN = (GEMM_BN * XCH + THREADS - 1) / THREADS;
#pragma unroll
                    for (int i = 0; i < XN; ++i) {
                        const int c = tid + i * THREADS, r = c / XCH, ch = c % XCH, k = kc * GEMM_BK + ch * 8;
                        if (XN * THREADS != GEMM_BN * XCH && c >= GEMM_BN * XCH) break;
                        const bool ok = t0 + r < rows && k < K;
                        cp_async16(b + r * GEMM_XLD + ch * 8, ok ? X + gemm_x(t0 + r, k, K) : X, ok);
                    }
                }
            }
            if constexpr (!GEMM_WGMMA) cp_async_commit();  // an empty group past the end keeps the wait count uniform
        };
        // chunks in flight ahead of the one computed: wgmma keeps the previous chunk's mma running while this one's
        // are issued, so the stage refilled is the one of two chunks back
        constexpr int AHEAD = GEMM_WGMMA ? GEMM_STAGES - 2 : GEMM_STAGES - 1;
#pragma unroll
        for (int s = 0; s < AHEAD; ++s) issue(kc0 + s, s);
        float c[GEMM_TM][GEMM_TN][4];
#pragma unroll
        for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
            for (int j = 0; j < GEMM_TN; ++j) c[i][j][0] = c[i][j][1] = c[i][j][2] = c[i][j][3] = 0.f;
        // skip padding: warp-uniform (mma.sync) or warpgroup-uniform (wgmma: its four warps issue it together)
        uint4 af[BKT];  // wgmma: the weights' fragments of a chunk, read by the mma in flight
        const bool active = GEMM_WGMMA ? t0 < rows && mt0 + (wm & ~3) < NT16
                                       : t0 + wn * GEMM_TN * 8 < rows && mt0 + wm * GEMM_TM < NT16;
        for (int kc = kc0; kc < kc1; ++kc) {
            const int st = (kc - kc0) % GEMM_STAGES;
            if constexpr (!GEMM_WGMMA) cp_async_wait<AHEAD - 1>();  // this thread's copies of chunk kc are in
            if constexpr (GEMM_WGMMA) {  // wgmma: the chunk's bulk copies (weights and tokens)
                mbar_wait(bar + st, (phase >> st) & 1u);
                phase ^= 1u << st;
            }
            __syncthreads();  // chunk kc is in; every warp is done with the stage about to be refilled
            issue(kc + AHEAD, (kc - kc0 + AHEAD) % GEMM_STAGES);
            // wgmma: every warpgroup (a divergent wgmma is serialised; padding tokens are zeros from the workspace's
            // allocation (gemm_x), weight rows past N zeros: each gives only its own, unused, result rows)
            if (GEMM_WGMMA || active) {
                const T* a = As + st * GEMM_A_STAGE;
                const T* b = Bs + st * GEMM_B_STAGE;
                if constexpr (GEMM_WGMMA) {
                    // one commit group per k16 step; fragment kk + 1 read from shared memory before mma kk is issued
                    // (its slot's previous mma, step kk + 1 of the chunk before, is done once 2 groups remain). The
                    // wgmma fence waits for every register write before it, so the read's latency is not hidden
                    // (ncu: short scoreboard on WARPGROUP.ARRIVE); reading a whole chunk's fragments ahead takes 16
                    // more registers and spilled on 8 shapes (bench/NOTES.md, session 7)
                    wgmma_wait<BKT - 1>();
                    af[0] = *reinterpret_cast<const uint4*>(a + ((size_t)(wm * BKT) * 32 + lane) * 8);
#pragma unroll
                    for (int kk = 0; kk < BKT; ++kk) {
                        if (kk + 1 < BKT) {
                            wgmma_wait<BKT - 2>();
                            af[kk + 1] =
                                *reinterpret_cast<const uint4*>(a + ((size_t)(wm * BKT + kk + 1) * 32 + lane) * 8);
                        }
                        wgmma_fence();  // the fragment is written: order it before the async mma that reads it
                        // a k16 step of a 64-wide block starts 32 bytes (2 descriptor units) further
                        wgmma_mma<GEMM_BN>(c[0], af[kk], wgmma_desc(b + (kk / 4) * (GEMM_BN * 64)) + (kk % 4) * 2);
                        wgmma_commit();
                    }
                } else {
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
        }
        if constexpr (GEMM_WGMMA) {
            wgmma_wait<0>();
            wgmma_fence_regs(c[0]);
        }
        cp_async_wait<0>();
        __syncthreads();  // the ring is reused by the staged epilogue and the next task
        if constexpr (KSPLIT > 1) if (FULL == 0 || opaque(task) >= FULL) {
            // split-K: every split stores its partial tile (tile-local, [token][row], rows fastest; padding tokens'
            // and rows' values are never read), then the tile is summed and finished in float4 units of 4 rows, from a rolled loop
            // whose loads are all in flight together: unrolled per accumulator element (a branch each for the
            // owning split) the combine was ~7,000 instructions of a GEMM and most of a 128-token chunk's qkv and
            // o_proj time went to instruction fetch (ncu: stall no_inst)
            constexpr int TILE = GEMM_BM * GEMM_BN;
            // the split and tile from the task afresh (opaque): kept live through the main loop they spilled (8B,
            // 4 x 64 tokens, whole tiles first)
            const int st = opaque(task) - FULL, sks = st % KSPLIT, stile = FULL + st / KSPLIT;
            float* tp = part + (size_t)(stile - FULL) * KSPLIT * TILE;
#pragma unroll
            for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
                for (int j = 0; j < GEMM_TN; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int nl = (wm * GEMM_TM + i) * 16 + gid + (e >> 1) * 8;
                        const int tl = (wn * GEMM_TN + j) * 8 + 2 * tig + (e & 1);
                        __stcg(tp + (size_t)sks * TILE + tl * GEMM_BM + nl, c[i][j][e]);
                    }
            __threadfence();
            __syncthreads();
            gemm_finish_split<N, KSPLIT>(tp, count, stile, sks, mt0 * 16, t0, rows,
                                               split_tiles * KSPLIT <= (int)gridDim.x, pre, epi);
            continue;  // the tile is finished: the staged epilogue below is for whole tiles
        }
        // a whole tile's epilogue: the tile through shared memory (the ring is idle: drained above), [token][row],
        // then each token's rows are written by consecutive lanes (full 32-byte sectors; from the fragments' layout a
        // warp's bf16 store touched 4 token rows x <= 16 bytes: ~100 us of the 8B 512-token gate_up, bench/NOTES.md)
        float* ts = reinterpret_cast<float*>(Bs);
#pragma unroll
        for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
            for (int j = 0; j < GEMM_TN; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    ts[((wn * GEMM_TN + j) * 8 + 2 * tig + (e & 1)) * GEMM_ELD + (wm * GEMM_TM + i) * 16 + gid +
                       (e >> 1) * 8] = c[i][j][e];
        __syncthreads();
        gemm_epilogue_smem<N>(ts, mt0 * 16, t0, rows, pre, epi);
        // the staged tile's generic reads and writes ordered before the next task's bulk copies refill the ring
        if constexpr (GEMM_WGMMA) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
    }
}

// down_proj on the engine (prefill's; decode's DOWN_GEMM): out = h + act @ Wd^T for `rows` tokens, act tiled (gemm_x),
// h the fp32 residual after o_proj
template <int KSPLIT, int FULL>
__device__ __forceinline__ void down_gemm(const T* ws_act, const T* w_down, const unsigned char* w_tmaps,
                                          const float* ws_h, T* out, unsigned* ws_status, int rows, float* ws_split,
                                          unsigned* ws_count, unsigned char* smem) {
    gemm<HIDDEN, INTER, KSPLIT, FULL>(w_down, w_tmaps + TMAP_DOWN * TMAP_BYTES, ws_act, rows, smem, ws_split, ws_count,
        [&](int n, int t) { return *reinterpret_cast<const float4*>(ws_h + (size_t)t * HIDDEN + n); },
        [&](int n, int t, float4 v, float4 res) {
            const float4 o = res + v;
            count_overflow(o.x, ws_status);
            count_overflow(o.y, ws_status);
            count_overflow(o.z, ws_status);
            count_overflow(o.w, ws_status);
            store4(out + (size_t)t * HIDDEN + n, o);
        });
}
