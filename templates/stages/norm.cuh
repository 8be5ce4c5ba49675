// ---- stage: norm ---- RMSNorm (or LayerNorm) of the BATCH rows of src (HIDDEN values each, T or fp32) into
// shared memory as T, rows XS_LD apart (padded: the tensor-core B fragments read 8 rows without bank conflicts):
// the projection that follows reads its input from there. Every block normalises the whole
// (small) activation itself, so no grid barrier is needed between the norm and the projection.
// One pass over src (written by other blocks: L2, ~1 us a round trip) puts each row's raw values in dst as T: a T
// src by cp.async, all of it in flight at once without registers; an fp32 src (tensor parallel's all-reduced h)
// through registers, rounded to T (two roundings, as transformers' bf16 residual stream and its normalised output).
// Then the rows' sums from shared memory (a row split over WPR warps where the batch has fewer rows than warps),
// and dst scaled in place. Each thread copies, sums and scales the same chunks, so no block barrier stands between
// the copy and the sums (measured on the H200 against a copy by all threads then a barrier: 1B b32 -2.3 %,
// Qwen2.5-7B-like b24 -1.7 %, b1 equal; bench/NOTES.md session 17). NORM_FOLD: no scale pass; dst keeps the raw
// rows, gs gets the gain (HIDDEN T) and rs each row's 1/rms (BATCH floats): the projection multiplies its B
// fragments by the gain and its sums by 1/rms; NORM_FOLD 2: the same, the projection reading the gain from global
// memory (L1) instead, so the block needs HIDDEN x T less shared memory (gs is not written); NORM_FOLD 3: gs was
// copied by norm_gain_pre, and the sums pass leaves T(x x gain) in dst (the projection scales by 1/rms only)
// (session 9's ablation: the scale pass was the norm's largest part at batch 16, ~4 us a norm at hidden 5120).
// STATS (the decode plan's H_STATS, the second norm): src is h already multiplied by the gain (o_proj's epilogue)
// and hsq holds each row's sum of squares of h in HIDDEN/16 parts: dst gets src's rows as they are and rs each row's
// 1/rms (the parts summed in a fixed order), no pass over the rows at all.
#pragma once
#include "../common.cuh"
#include "../gemv.cuh"
// NORM_CLUSTER (the decode plan's knob; the kernel launched in clusters of that many blocks): the BATCH rows of src
// (T, HIDDEN each) into dst (rows XS_LD apart) of every block of the cluster, each block bulk-copying every
// NORM_CLUSTER-th row with .multicast::cluster (the TMA unit writes the row at the same offset in each block's shared
// memory and counts its bytes on each block's mbarrier): L2 -> SM traffic / NORM_CLUSTER. Measured (bench/NOTES.md
// session 17): the norms shrank only 14-21 %, the copy from L2 is not what they wait on; a tuner knob. Every block
// of the cluster calls it (each norm of each launch); the cluster barrier first makes every block's mbarrier
// initialised and its rows region free (its earlier generic accesses ordered before the peers' async-proxy writes).
__device__ __forceinline__ void norm_rows_multicast(const T* src, T* dst) {
#if __CUDA_ARCH__ >= 900
    static_assert((HIDDEN * sizeof(T)) % 16 == 0 && (XS_LD * sizeof(T)) % 16 == 0, "bulk copies of 16-byte units");
    __shared__ alignas(8) unsigned long long bar;
    const unsigned b_addr = (unsigned)__cvta_generic_to_shared(&bar);
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b_addr) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    // every block of the cluster: its barrier initialised, its rows region no longer read (the last stage's use)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                         :: "r"(b_addr), "r"(BATCH * HIDDEN * (int)sizeof(T)) : "memory");
        // the rows were written by other blocks (generic proxy, ordered by the grid barrier or the launch's wait):
        // ordered before this thread's bulk copies' reads (async proxy)
        asm volatile("fence.proxy.async.global;" ::: "memory");
        const unsigned short mask = (unsigned short)((1u << NORM_CLUSTER) - 1u);
        for (int b = (int)rank + NORM_CLUSTER * (int)threadIdx.x; b < BATCH; b += NORM_CLUSTER * 32)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                         "[%0], [%1], %2, [%3], %4;"
                         :: "r"((unsigned)__cvta_generic_to_shared(dst + (size_t)b * XS_LD)),
                            "l"(src + (size_t)b * HIDDEN), "r"(HIDDEN * (int)sizeof(T)), "r"(b_addr), "h"(mask)
                         : "memory");
    }
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                 "@!done bra WAIT_%=;\n}" :: "r"(b_addr) : "memory");
    __syncthreads();  // every thread past the wait: the barrier is invalidated for the next norm's init
    if (threadIdx.x == 0) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(b_addr) : "memory");
#endif
}
// H_STATS: each row's 1/rms (rs, BATCH floats) from o_proj's sums of squares of h per 16-row tile (hsq
// [HIDDEN/16][BATCH]): thread (part, b) sums tiles part, part + P, ... of row b (coalesced over b), then one thread a
// row sums the P parts, in a fixed order (deterministic); scratch: P x BATCH floats, at most 1 KB. Ends in a block
// barrier (rs ready).
__device__ void rows_rms(const float* hsq, float* rs, float* scratch) {
    static_assert(THREADS >= 256 && BATCH <= 256, "rows_rms: 256 threads, one part a row at least");
    constexpr int P = 256 / BATCH, NT = HIDDEN / 16;
    const int tid = threadIdx.x, b = tid % BATCH, part = tid / BATCH;
    if (part < P) {
        float q = 0.f;
#pragma unroll 8
        for (int t = part; t < NT; t += P) q += __ldcg(hsq + (size_t)t * BATCH + b);
        scratch[part * BATCH + b] = q;
    }
    __syncthreads();
    if (tid < BATCH) {
        float q = 0.f;
        for (int i = 0; i < P; ++i) q += scratch[i * BATCH + tid];
        rs[tid] = rsqrtf(q / HIDDEN + NORM_EPS);
    }
    __syncthreads();
}
// NORM_FOLD 3: the gain's copy into gs (SMEM_GS) started before the barrier (or the launch's wait) that precedes
// the norm, as the projections' <P>_PRE weights are: the gain does not depend on the rows, and its first read comes
// from HBM while the rows come from L2; one cp.async group, waited for by the norm's sums pass
__device__ __forceinline__ void norm_gain_pre(const T* __restrict__ w, unsigned char* smem) {
    if constexpr (NORM_FOLD == 3) {
        T* gs = reinterpret_cast<T*>(smem + SMEM_GS);
        for (int i = threadIdx.x; i < HIDDEN / 8; i += THREADS) cp_async16(gs + i * 8, w + i * 8, true);
        cp_async_commit();
    }
}
template <bool STATS = false, class S>
__device__ void norm(const S* src, const T* __restrict__ w, const T* __restrict__ bias, T* dst, float* scratch,
                     T* gs, float* rs, const float* hsq = nullptr, unsigned ll_e = 0u) {
    constexpr int NCH = HIDDEN / 8, NW = THREADS / 32;
    constexpr int RB = BATCH >= NW ? NW : (BATCH <= 1 ? 1 : BATCH <= 2 ? 2 : BATCH <= 4 ? 4 : BATCH <= 8 ? 8 : 16);
    constexpr int WPR = NW / RB;  // warps per row (RB rows at a time)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, part = warp % WPR;
    if constexpr (STATS) {
        static_assert(sizeof(S) == sizeof(T), "the statistics' norm copies T rows");
        for (int i = tid; i < BATCH * NCH; i += THREADS)
            cp_async16(dst + (size_t)(i / NCH) * XS_LD + (i % NCH) * 8, src + (size_t)i * 8, true);
        cp_async_commit();
        rows_rms(hsq, rs, scratch);  // while the rows are copied
        cp_async_wait<0>();
        __syncthreads();
        return;
    }
    // Each thread copies, sums and scales the same chunks: row b0 + r * RB (r < R), columns c0 + j * CS (j < NJ),
    // so no block barrier stands between the copy and the sums, and a T src's rows arrive in one cp.async group
    // each, the sums of the first row running while the next arrives (a thread waits only for its own copies).
    constexpr int R = (BATCH + RB - 1) / RB, CS = 32 * WPR, NJ = (NCH + CS - 1) / CS;
    const int b0 = warp / WPR, c0 = part * 32 + lane;
    constexpr bool GAIN_ROWS = NORM_FOLD == 3;  // the sums pass multiplies the rows by the gain (gs) in place
    if constexpr (NORM_FOLD == 1)  // (NORM_FOLD 3: norm_gain_pre copied it before the wait)
        for (int i = tid; i < NCH; i += THREADS) cp_async16(gs + i * 8, w + i * 8, true);
    if constexpr (std::is_same_v<S, LLWord>) {
        // H_LL: o_proj's words (gemv.cuh ll_store), a chunk of 8 in two 16-byte loads, G chunks' loads in flight
        // before any is tested; those not yet written are polled again, together (ll_poll; H_LL 2: ~256 ns apart,
        // every block polls the same few KB while o_proj's last tiles write them); their T values then go to dst
        constexpr int G = 4;
        const T* words = reinterpret_cast<const T*>(src);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = b0 + r * RB;
            if (b < BATCH)
                for (int c1 = c0; c1 < NCH; c1 += G * CS) {
                    uint4 u[G][2];
                    auto at = [&](int g, int k) { return ((size_t)b * HIDDEN + (c1 + g * CS) * 8) / 4 + k; };
                    unsigned sets = 0u;  // bit 2 g + k: chunk g's k-th load
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        if (c1 + g * CS < NCH) sets |= 3u << (2 * g);
                    auto reload = [&](unsigned m) {  // the named loads, then their tests
#pragma unroll
                        for (int i = 0; i < 2 * G; ++i)
                            if (m >> i & 1u) u[i / 2][i % 2] = ll_load4(words, at(i / 2, i % 2));
                        unsigned late = 0u;
#pragma unroll
                        for (int i = 0; i < 2 * G; ++i)
                            late |= (unsigned)(m >> i & 1u && !ll_ready(u[i / 2][i % 2], ll_e)) << i;
                        return late;
                    };
                    ll_poll<H_LL == 2 ? 256 : 0>(reload(sets), reload);
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        if (c1 + g * CS < NCH)
                            *reinterpret_cast<uint4*>(dst + (size_t)b * XS_LD + (c1 + g * CS) * 8) =
                                make_uint4(ll_pair(u[g][0].x, u[g][0].y), ll_pair(u[g][0].z, u[g][0].w),
                                           ll_pair(u[g][1].x, u[g][1].y), ll_pair(u[g][1].z, u[g][1].w));
                }
        }
        if constexpr (NORM_FOLD == 1) cp_async_commit();  // (the gain's copy above)
    } else if constexpr (sizeof(S) == sizeof(T) && NORM_CLUSTER > 1) {
        norm_rows_multicast(src, dst);  // every row, for the whole block
        if constexpr (NORM_FOLD == 1) cp_async_commit();
    } else if constexpr (sizeof(S) == sizeof(T)) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = b0 + r * RB;
            if (b < BATCH)
                for (int c = c0; c < NCH; c += CS)
                    cp_async16(dst + (size_t)b * XS_LD + c * 8, src + ((size_t)b * HIDDEN + c * 8), true);
            cp_async_commit();  // one group a row (empty past BATCH: the count stays R)
        }
    } else {
        constexpr int G = 4;  // chunks a thread loads before it stores any (the stores may alias src for nvcc)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = b0 + r * RB;
            if (b < BATCH)
                for (int c1 = c0; c1 < NCH; c1 += G * CS) {
                    float f[G][8];
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        if (c1 + g * CS < NCH) load8(src + ((size_t)b * HIDDEN + (c1 + g * CS) * 8), f[g]);
#pragma unroll
                    for (int g = 0; g < G; ++g)
                        if (c1 + g * CS < NCH)
                            *reinterpret_cast<uint4*>(dst + (size_t)b * XS_LD + (c1 + g * CS) * 8) = pack8(f[g]);
                }
        }
        if constexpr (NORM_FOLD == 1) cp_async_commit();
    }
    if constexpr (GAIN_ROWS) {  // the gain's chunks (norm_gain_pre) before the sums pass reads them: one row at a
        cp_async_wait<0>();     // time (RB 1), a thread reads only the chunks it copied; else other threads' too
        // (RB 1: c0 = tid and CS = THREADS, norm_gain_pre's own stride, so chunk c is thread c % THREADS's copy)
        static_assert(RB > 1 || (WPR == NW && CS == THREADS), "NORM_FOLD 3 at one row: the sums pass's chunks are "
                      "the ones this thread copied (no block barrier after the wait)");
        if constexpr (RB > 1) __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int b = b0 + r * RB;
        if constexpr (GAIN_ROWS) {
        } else if constexpr (sizeof(S) == sizeof(T) && NORM_CLUSTER == 1) cp_async_wait_le(R - 1 - r);  // row r is in
        else if (NORM_FOLD == 1 && r == 0) cp_async_wait<0>();
        if (b < BATCH) {  // (the whole warp or none: b depends on the warp)
            float s1[2] = {0.f, 0.f}, s2[2] = {0.f, 0.f};  // two chains: the FMAs of two chunks overlap
#pragma unroll 2
            for (int j = 0; j < NJ; ++j) {
                const int c = c0 + j * CS;
                if (c < NCH) {
                    float f[8];
                    uint4* px = reinterpret_cast<uint4*>(dst + (size_t)b * XS_LD + c * 8);
                    unpack8(*px, f);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if constexpr (NORM_LAYERNORM) s1[j & 1] += f[i];
                        s2[j & 1] = fmaf(f[i], f[i], s2[j & 1]);
                    }
                    if constexpr (GAIN_ROWS) {  // T(x * gain), as the B fragments' product of NORM_FOLD 1 rounds it
                        float g[8];
                        unpack8(*reinterpret_cast<const uint4*>(gs + c * 8), g);
#pragma unroll
                        for (int i = 0; i < 8; ++i) f[i] *= g[i];
                        *px = pack8(f);
                    }
                }
            }
            const float a = warp_sum(s1[0] + s1[1]), q = warp_sum(s2[0] + s2[1]);
            if (lane == 0) { scratch[2 * (b * WPR + part)] = a; scratch[2 * (b * WPR + part) + 1] = q; }
        }
    }
    __syncthreads();
    if constexpr (NORM_FOLD) {
        if (tid < BATCH) {
            float q = 0.f;
            for (int p = 0; p < WPR; ++p) q += scratch[2 * (tid * WPR + p) + 1];
            rs[tid] = rsqrtf(q / HIDDEN + NORM_EPS);
        }
    } else {  // the scale pass, over the same chunks; the gain (and bias) loaded once a column for all R rows
        float mean[R], rstd[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int b = min(b0 + r * RB, BATCH - 1);
            float a = 0.f, q = 0.f;
            for (int p = 0; p < WPR; ++p) { a += scratch[2 * (b * WPR + p)]; q += scratch[2 * (b * WPR + p) + 1]; }
#if NORM_LAYERNORM
            mean[r] = a / HIDDEN;
            rstd[r] = rsqrtf(fmaxf(q / HIDDEN - mean[r] * mean[r], 0.f) + NORM_EPS);
#else
            mean[r] = 0.f;
            rstd[r] = rsqrtf(q / HIDDEN + NORM_EPS);
#endif
        }
        constexpr int GB = NJ < 8 ? NJ : 8;  // gain chunks whose loads are in flight together
        for (int j0 = 0; j0 < NJ; j0 += GB) {
            uint4 g[GB], bb[GB];
#pragma unroll
            for (int jj = 0; jj < GB; ++jj) {
                const int c = c0 + (j0 + jj) * CS;
                if (c < NCH) {
                    g[jj] = __ldg(reinterpret_cast<const uint4*>(w + c * 8));
                    if constexpr (NORM_LAYERNORM) bb[jj] = __ldg(reinterpret_cast<const uint4*>(bias + c * 8));
                }
            }
#pragma unroll
            for (int jj = 0; jj < GB; ++jj) {
                const int c = c0 + (j0 + jj) * CS;
                if (c >= NCH) continue;
                float gf[8], bf[8];
                unpack8(g[jj], gf);
                if constexpr (NORM_LAYERNORM) unpack8(bb[jj], bf);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int b = b0 + r * RB;
                    if (b >= BATCH) continue;
                    float f[8];
                    uint4* px = reinterpret_cast<uint4*>(dst + (size_t)b * XS_LD + c * 8);
                    unpack8(*px, f);
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        f[k] = (f[k] - mean[r]) * rstd[r] * gf[k];
                        if constexpr (NORM_LAYERNORM) f[k] += bf[k];
                    }
                    *px = pack8(f);
                }
            }
        }
    }
    __syncthreads();
}

// NORM_GLOBAL (the decode plan's knob; where BATCH rows of HIDDEN do not fit in shared memory beside the projection's
// partial sums, or leave it too little L1): the norm as a step of its own. The BATCH rows of src (T, or fp32 h with
// tensor parallel) normalised (as the scale pass above: (x - mean) x rstd x gain (+ bias), rounded once to T) into
// xn in the tensor cores' B-fragment order (gemv.cuh x_at<true>; the GEMM engine's layout where the projection it
// feeds runs there: Engine, qkv_proj's QKV_GEMM by default, gate_up's GEMM_PROJ passed by the second norm; xg_at), read
// from there by the projection after a grid barrier, as o_proj and down_proj read theirs. Each row's statistics need the whole row, so a row is split over
// P = max(1, blocks / BATCH) blocks, each reading the row for its sums and writing 1/P of its columns.
// on: whether this step runs (NORM_GLOBAL; the second norm's call passes !NORM2_LOCAL: with H_STATS o_proj's
// epilogue writes xn and the statistics, templates/stages/o_proj.cuh).
template <class S, class On = std::bool_constant<NORM_GLOBAL != 0>, class Engine = std::bool_constant<QKV_GEMM != 0>>
__device__ void norm(const S* src, const T* __restrict__ w, const T* __restrict__ bias, T* xn, unsigned char* smem,
                     On = {}, Engine = {}) {
    if constexpr (On::value) {
        // two passes over the row (the second from L1/L2): the row held in registers between them took 48 more
        // (NPT x 8 values and gains a thread at hidden 5120) and the kernel spilled 80 B (bench/NOTES.md session 23)
        constexpr int NCH = HIDDEN / 8, NW = THREADS / 32;
        float* scratch = reinterpret_cast<float*>(smem + SMEM_RED);  // [NW][2], then mean and rstd
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
        const int P = max(1, (int)gridDim.x / BATCH);
        for (int u = blockIdx.x; u < BATCH * P; u += gridDim.x) {
            const int b = u / P, part = u % P;
            float a = 0.f, q = 0.f;
            for (int c = tid; c < NCH; c += THREADS) {
                float f[8];
                load8(src + (size_t)b * HIDDEN + c * 8, f);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float x = to_f(from_f(f[i]));  // fp32 h: as the T residual transformers normalises
                    a += x;
                    q = fmaf(x, x, q);
                }
            }
            a = warp_sum(a);
            q = warp_sum(q);
            if (lane == 0) { scratch[2 * warp] = a; scratch[2 * warp + 1] = q; }
            __syncthreads();
            float sa = 0.f, sq = 0.f;  // every thread sums the warps' parts in the same order
#pragma unroll
            for (int i = 0; i < NW; ++i) { sa += scratch[2 * i]; sq += scratch[2 * i + 1]; }
#if NORM_LAYERNORM
            const float mean = sa / HIDDEN, rstd = rsqrtf(fmaxf(sq / HIDDEN - mean * mean, 0.f) + NORM_EPS);
#else
            const float mean = 0.f, rstd = rsqrtf(sq / HIDDEN + NORM_EPS);
#endif
            for (int c = part * NCH / P + tid; c < (part + 1) * NCH / P; c += THREADS) {
                float f[8], g[8], bb[8];
                load8(src + (size_t)b * HIDDEN + c * 8, f);
                load8(w + c * 8, g);
                if constexpr (NORM_LAYERNORM) load8(bias + c * 8, bb);
#pragma unroll
                for (int i = 0; i < 8; i += 2) {  // a pair of columns is one 4-byte word of the fragment order
                    float y[2];
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        y[j] = (to_f(from_f(f[i + j])) - mean) * rstd * g[i + j];
                        if constexpr (NORM_LAYERNORM) y[j] += bb[i + j];
                    }
                    *reinterpret_cast<T2*>(xn + xg_at<Engine::value>(b, c * 8 + i, HIDDEN)) = from_f2(y[0], y[1]);
                }
            }
            __syncthreads();  // scratch is reused by the next row
        }
    }
}
// the second norm's input: h rounded to T where o_proj writes that copy (HB_COPY), else fp32 h
__device__ __forceinline__ auto norm_src(const T* hb, const float* h) {
    if constexpr (HB_COPY) return hb;
    else return h;
}
