// ---- stage: gate_up ---- post-attention norm, then gate and up projections in one GEMV over a weight whose rows
// are interleaved (gate_i, up_i), so a 16-row tile holds both halves of act(gate) * up and writes it directly.
#pragma once
#include "../gemv.cuh"
// (after gemv.cuh: opened alone, the decode example config, not gemm.cuh's prefill one)
#include "../gemm.cuh"
#include "norm.cuh"
// (o_proj.cuh: GU_SKIP's o_epoch)
#include "o_proj.cuh"
// GU_SKIP (H_LL, DOWN_FLOW 2, down_proj one unsplit group a block): the blocks of down_proj's HIDDEN / 16 tasks take
// no gate_up task (where the grid has blocks left for gate_up), so their down_proj tiles stream (or, with DOWN_SMEM,
// are copied into shared memory) while the other blocks run gate_up. Each such block also held an o_proj tile (its
// HIDDEN / 16 tasks, one a block in the first round), so the epoch it keeps for act's words is the one its thread 0
// read before storing that tile's h word, which gate_up's blocks wait for: read before block 0's advance at its
// down_proj end (a read at gate_up's start could come after it)
static_assert(!GU_SKIP || (H_LL && DOWN_FLOW == 2 && O_TM == 1 && O_KSPLIT == 1 && DOWN_NWG * 32 == THREADS &&
                            DOWN_KSPLIT == 1 && DOWN_TM == 1),
              "GU_SKIP: H_LL, DOWN_FLOW 2, an o_proj tile on each skipped block, down_proj one unsplit group a block");
__device__ __forceinline__ int gu_skip() {
    return GU_SKIP && HIDDEN / 16 < (int)gridDim.x ? HIDDEN / 16 : 0;
}
__device__ __forceinline__ GemvPre<GU_U * GU_TM> gate_up_pre(const T* w_gu, const T* ln_w, unsigned char* smem) {
    if constexpr (!NORM_GLOBAL && !H_STATS) norm_gain_pre(ln_w, smem);  // (NORM_FOLD 3) before o_proj's barrier, as GU_PRE
    return gemv_pre<GU_PRE, 2 * INTER, HIDDEN, GU_NWG, GU_U, GU_KSPLIT, 0, GU_TM, GU_SKIP != 0>(w_gu, gu_skip());
}
// DOWN_FLOW: no grid barrier follows; each finished 16-row tile (8 columns of act) counts in its chunk's counter,
// ws_ready[KV_HEADS + chunk x ACT_STRIDE], a chunk being the act k-tiles of one down_proj step (DOWN_NWG x DOWN_U),
// and a down_proj warp waits for its step's chunk (down_proj.cuh); o_proj zeroes the counters for the launch (H_LL:
// they count on across launches).
constexpr int ACT_CHUNK_TILES = 2 * DOWN_NWG * DOWN_U;  // gate_up tiles a chunk (the last may have fewer)
__shared__ unsigned act_known;  // DOWN_FLOW: chunks [0, act_known) seen complete by one of the block's warps
__shared__ unsigned act_launch;  // DOWN_FLOW with H_LL: this launch's count (ll_launch), read before any count
// DOWN_FLOW 2: this launch's epoch (ll_epoch) for act's words, read by thread 0 before any of the block's act is
// written (so before block 0's advance at its down_proj end, which follows its polls of every block's act words)
__shared__ unsigned act_epoch;
// The next launch's epoch (ATT_LL, QKV_FLOW 2, H_LL, ATT_COMBINE 4) and, with ATT_LL, QKV_FLOW 1's counters
// back to zero: by block 0 once every block has read the epoch and every attention task has passed its wait —
// after o_proj's grid barrier (gate_up's start), or with H_LL at block 0's down_proj end (with DOWN_FLOW its waits
// saw every gate_up tile counted, so every block had read the epoch before its first count; else gate_up's barrier
// precedes it)
__device__ __forceinline__ void next_launch(unsigned* ws_ready, unsigned* ws_epoch) {
    if (blockIdx.x == 0) {
        if constexpr (ATT_LL && QKV_FLOW == 1)
            for (int h = threadIdx.x; h < KV_HEADS; h += THREADS) ws_ready[h] = 0u;
        if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned*>(ws_epoch) += 1u;
    }
}
struct ActReady {  // gemv's `done`: one more gate_up tile of its chunk is written (released by gemv's fence)
    unsigned* ready;
    static constexpr bool active = DOWN_FLOW == 1, defer = true;  // (gemv's DEFER: the release after the next loads)
    __device__ void operator()(int tile) const {
        if constexpr (active)
            asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;"
                         :: "l"(ready + KV_HEADS + tile / ACT_CHUNK_TILES * ACT_STRIDE) : "memory");
    }
};
// DOWN_SMEM: the block's first down_proj task's first DW_KT k-tiles (tile blockIdx.x: one down_proj group a block;
// packed contiguously) copied into shared memory (SMEM_DW) by thread 0's bulk copies, counted on one mbarrier
// (SMEM_DWBAR); the region was attention's (its ring): every thread's accesses to it are ordered before the copies
// (a proxy fence, then the block barrier). down_proj.cuh DownStaged reads them.
__device__ __forceinline__ void down_weights_to_smem(const T* w_down, unsigned char* smem) {
    if constexpr (DOWN_SMEM) {
        fence_proxy_async_smem();
        __syncthreads();
        if (threadIdx.x == 0 && blockIdx.x < HIDDEN / 16) {
            auto* bar = reinterpret_cast<unsigned long long*>(smem + SMEM_DWBAR);
            mbar_init(bar, 1);
            mbar_init_fence();
            constexpr unsigned BYTES = DW_KT * 512u, PIECE = 32768u;  // (pieces of 32 KB: one instruction each)
            mbar_expect_tx(bar, BYTES);
            const unsigned char* src =
                reinterpret_cast<const unsigned char*>(w_down + (size_t)blockIdx.x * (INTER / 16) * 256);
            for (unsigned at = 0; at < BYTES; at += PIECE)
                bulk_copy(smem + SMEM_DW + at, src + at, min(PIECE, BYTES - at), bar);
        }
    }
}
// NORM_GLOBAL: the norm was a step of its own (norm.cuh), or with H_STATS o_proj's epilogue; xn holds the (H_STATS:
// not yet scaled by 1/rms) rows in fragment order.
__device__ void gate_up(const float* ws_h, const T* ws_hb, const float* ws_hsq, const T* ln_w, const T* ln_b,
                        const T* xn, const T* w_gu, const unsigned char* w_tmaps, const T* w_down, T* ws_act, unsigned* ws_status, float* ws_split,
                        unsigned* ws_count, unsigned* ws_ready, unsigned* ws_epoch, const GemvPre<GU_U * GU_TM>& pre,
                        unsigned char* smem) {
    static_assert(!H_STATS || HB_COPY, "H_STATS: o_proj writes the norm's input (ws_hb) and its statistics");
    if constexpr ((ATT_LL || QKV_FLOW == 2 || ATT_COMBINE == 4) && !H_LL) next_launch(ws_ready, ws_epoch);
    // H_LL: no grid barrier before this stage (the norm polls o_proj's words): the block's own o_proj epilogue is
    // done with the shared memory the norm writes
    if constexpr (H_LL) __syncthreads();
    down_weights_to_smem(w_down, smem);
    if (DOWN_FLOW == 1 && H_LL && threadIdx.x == 0) act_launch = ll_launch(ws_epoch);
    const int skip = gu_skip();
    if (DOWN_FLOW == 2 && threadIdx.x == 0)  // (the norm's barriers publish it; GU_SKIP's blocks: o_proj's epoch)
        act_epoch = blockIdx.x < (unsigned)skip ? o_epoch : ll_epoch(ws_epoch);
    if (blockIdx.x < (unsigned)skip) {
        __syncthreads();  // (act_epoch to the block's down_proj warps)
        return;
    }
    if (DOWN_FLOW == 1 && threadIdx.x == 0) act_known = 0u;  // (gemv's block barriers order it before down_proj's
                                                              // reads)
    if constexpr (GEMM_PROJ) {  // on the GEMM engine (gemm.cuh): xn in its tiled layout, act in down_proj's (tiled
                                // where DOWN_GEMM)
        static_assert(!GEMM_PROJ || (NORM_GLOBAL && DOWN_FLOW == 0), "GEMM_PROJ: NORM_GLOBAL's rows, a grid barrier");
        // H_STATS: each row's 1/rms past the GEMM's ring (SMEM_RS), before the ring's first copy
        float* rs = reinterpret_cast<float*>(smem + SMEM_RS);
        if constexpr (H_STATS) rows_rms(ws_hsq, rs, reinterpret_cast<float*>(smem + SMEM_RED));
        gemm<2 * INTER, HIDDEN, GU_GSPLIT, GU_GFULL>(w_gu, w_tmaps + TMAP_GU * TMAP_BYTES, xn, BATCH, smem, ws_split,
            ws_count, [](int, int) { return make_float4(0.f, 0.f, 0.f, 0.f); },
            [&](int n, int t, float4 v, float4) {  // rows n .. n + 3: (gate, up) of act columns n / 2 and n / 2 + 1
                const float r = H_STATS ? rs[t] : 1.f;
                const float a0 = activation(v.x * r) * (v.y * r), a1 = activation(v.z * r) * (v.w * r);
                count_overflow(a0, ws_status);
                count_overflow(a1, ws_status);
                *reinterpret_cast<T2*>(ws_act + (DOWN_GEMM ? gemm_x(t, n / 2, INTER) : x_at<X_FRAG>(t, n / 2, INTER))) =
                    from_f2(a0, a1);
            });
        return;
    }
    T* xs = reinterpret_cast<T*>(smem + SMEM_XS);
    T* gs = (NORM_FOLD == 1 || NORM_FOLD == 3) && !H_STATS ? reinterpret_cast<T*>(smem + SMEM_GS)
                                                          : nullptr;  // H_STATS: in ws_hb
    // NORM_FOLD 2: read from global memory (L1); 3: none (the norm applied it to the rows)
    const T* gain = NORM_FOLD == 2 && !H_STATS ? ln_w : NORM_FOLD == 1 ? gs : nullptr;
    float* rs = reinterpret_cast<float*>(smem + SMEM_RS);
    if constexpr (NORM_GLOBAL && H_STATS) {  // o_proj wrote xn (times the gain) and the sums of squares
        rows_rms(ws_hsq, rs, reinterpret_cast<float*>(smem + SMEM_RED));
    } else if constexpr (NORM_GLOBAL) {
    } else if constexpr (H_LL) {
        norm(reinterpret_cast<const LLWord*>(ws_hb), ln_w, ln_b, xs, reinterpret_cast<float*>(smem + SMEM_RED), gs,
             rs, nullptr, ll_epoch(ws_epoch));
    } else if constexpr (HB_COPY) {
        norm<H_STATS>(ws_hb, ln_w, ln_b, xs, reinterpret_cast<float*>(smem + SMEM_RED), gs, rs, ws_hsq);
    } else {  // tensor parallel (ws_h all-reduced between launches) or fp16 (h may exceed its range): fp32 h
        norm(ws_h, ln_w, ln_b, xs, reinterpret_cast<float*>(smem + SMEM_RED), gs, rs);
    }
    gemv<2 * INTER, HIDDEN, NORM_GLOBAL ? HIDDEN : XS_LD, GU_NWG, GU_U, GU_KSPLIT, NORM_GLOBAL != 0, GEMV_PF, 0, GU_PRE,
         RED_DB, GU_TM, GU_BS>(w_gu, NORM_GLOBAL ? xn : xs,
        reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count,
        [&](int row0, auto tile, int gt) {
            for (int i = gt; i < 8 * BATCH; i += GU_NWG * 32) {
                const int pr = i / BATCH, b = i % BATCH;
                const float r = NORM_FOLD || H_STATS ? rs[b] : 1.f;
                const float g = tile(2 * pr, b) * r;
                const float u = tile(2 * pr + 1, b) * r;
                const float a = activation(g) * u;
                count_overflow(a, ws_status);
                if constexpr (DOWN_FLOW == 2)
                    ll_store(ws_act, x_at<true>(b, row0 / 2 + pr, INTER), from_f(a), act_epoch);
                else
                    ws_act[x_at<X_FRAG>(b, row0 / 2 + pr, INTER)] = from_f(a);
            }
        }, ActReady{ws_ready}, gain, &pre, NoWait{}, 0u, NoStaged{}, [&] {
            if constexpr (GU_SKIP != 0) return BlockSkip{skip};
            else return NoSkip{};
        }());
}
