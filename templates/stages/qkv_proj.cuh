// ---- stage: qkv_proj ---- input norm, then q, k and v of every sequence in one GEMV over the packed
// [q; k; v] weight (+ bias where the model has one). Raw fp32 results go to ws_qkv[b][QKV_DIM]; q/k norm and RoPE
// happen in the attention stage, which needs whole heads.
// QKV_FLOW: no grid barrier follows; each finished 16-row tile counts in ws_ready[its KV head], and an attention task
// waits until its head's QKV_TILES_PER_HEAD tiles (its GROUP query heads, its k and v) are in. QKV_FLOW 2: no
// counters; each result is a 64-bit word carrying the launch's epoch (gemv.cuh ll_store8) that attention polls. The k
// and v tiles are computed first (TILE0), so whole heads are ready after the first round of tiles rather than the last.
// QKV_FLOW 2 with QKV_KSPLIT > 1: each split's partial sums are words of their own (split ks's at ks x BATCH x QKV_DIM,
// the bias in split 0's), and attention sums the splits as it polls them: no reduction pass, no counter, so a split qkv
// keeps the LL hand-off (a split balances qkv's 16-row tiles over the SMs: Llama-3.2-1B's 192 on 132).
#pragma once
#include "../gemv.cuh"
// (after gemv.cuh: opened alone, the decode example config, not gemm.cuh's prefill one)
#include "../gemm.cuh"
#include "norm.cuh"
constexpr int QKV_TILES_PER_HEAD = (GROUP + 2) * HEAD_DIM / 16;
__device__ __forceinline__ int qkv_tile_head(int tile) {  // the KV head whose q, k or v rows a 16-row tile holds
    const int r = tile * 16;
    return r < Q_DIM ? r / (GROUP * HEAD_DIM) : ((r - Q_DIM) % KV_DIM) / HEAD_DIM;
}
struct QkvReady {  // gemv's `done`: one more tile of its KV head is written (released by gemv's fence)
    unsigned* ready;
    static constexpr bool active = true, defer = false;
    __device__ void operator()(int tile) const {
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(ready + qkv_tile_head(tile)) : "memory");
    }
};
constexpr int QKV_TILE0 = QKV_FLOW && !QKV_QFIRST ? Q_DIM / 16 : 0;  // QKV_FLOW: the k and v tiles first (QKV_QFIRST:
// the q tiles, in order)
__device__ __forceinline__ GemvPre<QKV_U * QKV_TM> qkv_proj_pre(const T* w_qkv, const T* ln_w, unsigned char* smem) {
    if constexpr (!NORM_GLOBAL) norm_gain_pre(ln_w, smem);  // (NORM_FOLD 3) before the launch's wait, as QKV_PRE
    return gemv_pre<QKV_PRE, QKV_DIM, HIDDEN, QKV_NWG, QKV_U, QKV_KSPLIT, QKV_TILE0, QKV_TM>(w_qkv);
}
// NORM_GLOBAL: the norm was a step of its own (norm.cuh); xn holds the normalised rows in fragment order.
// QKV_GEMM (GEMM_PROJ; NORM_GLOBAL): on the GEMM engine (gemm.cuh), the norm's rows in its tiled layout; QKV_FLOW 0.
__device__ void qkv_proj(const T* x, const T* ln_w, const T* ln_b, const T* xn, const T* w_qkv,
                         const unsigned char* w_tmaps, const T* b_qkv, float* ws_qkv, float* ws_split,
                         unsigned* ws_count, unsigned* ws_ready, const unsigned* ws_epoch,
                         const GemvPre<QKV_U * QKV_TM>& pre, unsigned char* smem) {
    if constexpr (QKV_GEMM) {
        static_assert(!QKV_GEMM || (GEMM_PROJ && NORM_GLOBAL && QKV_FLOW == 0),
                      "QKV_GEMM: the engine (GEMM_PROJ), NORM_GLOBAL's rows, a grid barrier");
        gemm<QKV_DIM, HIDDEN, QKV_GSPLIT, QKV_GFULL>(w_qkv, w_tmaps + TMAP_QKV * TMAP_BYTES, xn, BATCH, smem,
            ws_split, ws_count,
            [&](int n, int) { return QKV_BIAS ? load4(b_qkv + n) : make_float4(0.f, 0.f, 0.f, 0.f); },
            [&](int n, int t, float4 v, float4 bias) {
                *reinterpret_cast<float4*>(ws_qkv + (size_t)t * QKV_DIM + n) = v + bias;
            });
        return;
    }
    const unsigned ll_e = QKV_FLOW == 2 ? ll_epoch(ws_epoch) : 0u;
    T* xs = reinterpret_cast<T*>(smem + SMEM_XS);
    T* gs = NORM_FOLD == 1 || NORM_FOLD == 3 ? reinterpret_cast<T*>(smem + SMEM_GS) : nullptr;  // the gain's copy
    // the gain the B fragments take: NORM_FOLD 2 from global memory (L1); 3: none (the norm applied it to the rows)
    const T* gain = NORM_FOLD == 2 ? ln_w : NORM_FOLD == 1 ? gs : nullptr;
    const float* rs = reinterpret_cast<const float*>(smem + SMEM_RS);
    if constexpr (!NORM_GLOBAL)
        norm(x, ln_w, ln_b, xs, reinterpret_cast<float*>(smem + SMEM_RED), gs, reinterpret_cast<float*>(smem + SMEM_RS));
    auto epi = [&](int row0, auto tile, int gt) {  // (QKV_FLOW 2, QKV_KSPLIT > 1: row0 = split x QKV_DIM + row)
        const int ks = row0 / QKV_DIM;
        for (int i = gt; i < 16 * BATCH; i += QKV_NWG * 32) {
            const int n = row0 % QKV_DIM + i / BATCH, b = i % BATCH;
            float v = tile(i / BATCH, b);
            if constexpr (NORM_FOLD) v *= rs[b];
#if QKV_BIAS
            if (ks == 0) v += to_f(b_qkv[n]);
#endif
            if constexpr (QKV_FLOW == 2) ll_store8(ws_qkv, ((size_t)ks * BATCH + b) * QKV_DIM + n, v, ll_e);
            else ws_qkv[(size_t)b * QKV_DIM + n] = v;
        }
    };
    const T* X = NORM_GLOBAL ? xn : xs;
    constexpr int LDX = NORM_GLOBAL ? HIDDEN : XS_LD;
    if constexpr (QKV_FLOW == 1)
        gemv<QKV_DIM, HIDDEN, LDX, QKV_NWG, QKV_U, QKV_KSPLIT, NORM_GLOBAL != 0, GEMV_PF, QKV_TILE0, QKV_PRE, RED_DB, QKV_TM,
             QKV_BS>(w_qkv,
            X, reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count, epi, QkvReady{ws_ready}, gain, &pre);
    else
        gemv<QKV_DIM, HIDDEN, LDX, QKV_NWG, QKV_U, QKV_KSPLIT, NORM_GLOBAL != 0, GEMV_PF, QKV_TILE0, QKV_PRE, RED_DB, QKV_TM,
             QKV_BS>(w_qkv,
            X, reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count, epi,
            std::conditional_t<QKV_FLOW == 2, RawSplits, NoDone>{}, gain, &pre);
}
