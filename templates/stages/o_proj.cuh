// ---- stage: o_proj ---- output projection of the attention result plus the residual: h = x + attn @ Wo^T,
// kept in fp32 (ws_h) for the second norm and the final residual. With tensor parallel (TP > 1) each GPU writes its
// heads' partial product and rank 0 alone adds x, so the all-reduce of ws_h between launches gives h on every GPU.
// With HB_COPY (tp = 1, bf16) it also writes h rounded to T (ws_hb): the second norm's input. With H_STATS it writes
// that input already multiplied by the second norm's gain (ln2_w) and, per 16-row tile and row, the sum of squares of
// h rounded to T (ws_hsq [HIDDEN/16][BATCH], in a fixed order: deterministic): the norm then makes no pass over its
// rows (templates/stages/norm.cuh), gate_up scales its sums by 1/rms. With NORM_GLOBAL that input goes to ws_xn in the
// tensor cores' fragment order (gemv.cuh x_at<true>; GEMM_PROJ: the GEMM engine's tiled layout, gate_up's) instead,
// and the second norm is no step at all: no grid barrier and no pass over the rows between o_proj and gate_up.
#pragma once
#include "../gemv.cuh"
// (after gemv.cuh: opened alone, the decode example config, not gemm.cuh's prefill one)
#include "../gemm.cuh"
// GU_SKIP: the epoch of this launch as thread 0 read it before its h word's store (gate_up.cuh gu_skip)
__shared__ unsigned o_epoch;
__device__ __forceinline__ GemvPre<O_U * O_TM> o_proj_pre(const T* w_o) {  // O_PRE: before attention's grid barrier
    return gemv_pre<O_PRE, HIDDEN, Q_DIM, O_NWG, O_U, O_KSPLIT, 0, O_TM>(w_o);
}
// O_GEMM (GEMM_PROJ; one GPU, NORM_GLOBAL): on the GEMM engine (gemm.cuh), attention's output in its tiled layout. The
// epilogue's 4 rows of a token: h, then with H_STATS gate_up's input (h rounded to T, times the gain) in its tiled
// layout and the 16-row tile's sum of squares, summed over the quad of lanes that holds the tile's 16 rows of the
// token (gemm.cuh hands whole quads, a tile's 16 rows of one token, to consecutive lanes, all or none active), in a
// fixed order; without it the T copy of h (HB_COPY) for the second norm's step.
__device__ __forceinline__ void o_proj_gemm(const T* ws_attn, const T* w_o, const unsigned char* w_tmaps, const T* x,
                                            const T* __restrict__ ln2_w, float* ws_h, T* ws_hb, T* ws_xn,
                                            float* ws_hsq, float* ws_split, unsigned* ws_count, unsigned char* smem) {
    gemm<HIDDEN, Q_DIM, O_GSPLIT, O_GFULL>(w_o, w_tmaps + TMAP_O * TMAP_BYTES, ws_attn, BATCH, smem, ws_split, ws_count,
        [&](int n, int t) { return load4(x + (size_t)t * HIDDEN + n); },
        [&](int n, int t, float4 v, float4 res) {
            const float4 h = res + v;
            *reinterpret_cast<float4*>(ws_h + (size_t)t * HIDDEN + n) = h;
            if constexpr (H_STATS) {
                // h as the norm reads it (transformers: the T residual, upcast)
                const float4 f = make_float4(to_f(from_f(h.x)), to_f(from_f(h.y)), to_f(from_f(h.z)), to_f(from_f(h.w)));
                const float4 g = load4(ln2_w + n);
                store4(ws_xn + gemm_x(t, n, HIDDEN), make_float4(f.x * g.x, f.y * g.y, f.z * g.z, f.w * g.w));
                float s = f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
                const unsigned quad = 0xfu << (threadIdx.x & 28u);
                s += __shfl_xor_sync(quad, s, 1);
                s += __shfl_xor_sync(quad, s, 2);
                if ((n & 15) == 0) ws_hsq[(size_t)(n / 16) * BATCH + t] = s;
            } else if constexpr (HB_COPY) {
                store4(ws_hb + (size_t)t * HIDDEN + n, h);
            }
        });
}
__device__ void o_proj(const T* ws_attn, const T* w_o, const unsigned char* w_tmaps, const T* x,
                       const T* __restrict__ ln2_w, float* ws_h, T* ws_hb, T* ws_xn, float* ws_hsq, int tp_rank,
                       float* ws_split, unsigned* ws_count, unsigned* ws_ready, const unsigned* ws_epoch,
                       const GemvPre<O_U * O_TM>& pre, unsigned char* smem) {
    if constexpr (O_GEMM) {
        static_assert(!O_GEMM || (GEMM_PROJ && QKV_FLOW != 1),
                      "O_GEMM: gate_up on the engine too (the epilogue writes its tiled rows); QKV_FLOW 1's counters "
                      "are reset by o_proj's GEMV");
        o_proj_gemm(ws_attn, w_o, w_tmaps, x, ln2_w, ws_h, ws_hb, ws_xn, ws_hsq, ws_split, ws_count, smem);
        return;
    }
    const bool residual = TP == 1 || tp_rank == 0;
    static_assert(!H_STATS || (HB_COPY && THREADS / (O_NWG * 32) <= 15 &&
                               (NORM_GLOBAL || THREADS / (O_NWG * 32) * O_TM * 16 * BATCH * 4 <= SMEM_RED)),
                  "H_STATS: the T copy of h, at most 15 warp groups (named barriers), their squares before SMEM_RED");
    // ATT_LL: no grid barrier before this stage (the gemv polls attention's words): the block's own attention
    // tasks are done with the shared memory the partial sums reuse
    if constexpr (ATT_LL) __syncthreads();
    // QKV_FLOW 1's counters back to zero for the next launch: every attention task passed its wait before the grid
    // barrier that precedes this stage (ATT_LL: none; gate_up zeroes them); DOWN_FLOW's for this launch's gate_up
    // (the last launch's down_proj is done waiting on them: this launch's wait orders that, and gate_up's first count
    // comes after o_proj's barrier)
    // (H_LL: no barrier orders a reset before gate_up's first counts: DOWN_FLOW's counters count on across launches,
    // down_proj.cuh ActWait)
    constexpr bool QKV_RESET = QKV_FLOW == 1 && !ATT_LL, DOWN_RESET = DOWN_FLOW == 1 && !H_LL;
    if ((QKV_RESET || DOWN_RESET) && blockIdx.x == 0)
        for (int h = threadIdx.x; h < KV_HEADS + ACT_CHUNKS; h += THREADS)
            if (h >= KV_HEADS ? DOWN_RESET : QKV_RESET)
                ws_ready[h < KV_HEADS ? h : KV_HEADS + (h - KV_HEADS) * ACT_STRIDE] = 0u;
    const unsigned ll_e = ATT_LL || H_LL ? ll_epoch(ws_epoch) : 0u;
    if (GU_SKIP && threadIdx.x == 0) o_epoch = ll_e;
    gemv<HIDDEN, Q_DIM, Q_DIM, O_NWG, O_U, O_KSPLIT, ATT_LL ? 1 + ATT_LL : X_FRAG, GEMV_PF, 0, O_PRE, RED_DB, O_TM,
         O_BS>(w_o, ws_attn,
        reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count,
        [&](int row0, auto tile, int gt) {
            // H_STATS: the group's squares [16][BATCH] for each of its O_TM tiles (the group barrier before the
            // next task's epilogue orders its reads before their reuse) at SMEM_SQ: the rows' region, idle in this
            // stage, or with NORM_GLOBAL after the partial sums
            const int group = threadIdx.x / (O_NWG * 32);
            float* sq = reinterpret_cast<float*>(smem + SMEM_SQ) + (group * O_TM + row0 / 16 % O_TM) * 16 * BATCH;
            for (int i = gt; i < 16 * BATCH; i += O_NWG * 32) {
                const int n = row0 + i / BATCH, b = i % BATCH;
                const float h = (residual ? to_f(x[(size_t)b * HIDDEN + n]) : 0.f) + tile(i / BATCH, b);
                ws_h[(size_t)b * HIDDEN + n] = h;
                if constexpr (HB_COPY && H_STATS) {
                    const float f = to_f(from_f(h));  // h as the norm reads it (transformers: the T residual, upcast)
                    sq[i] = f * f;
                    (NORM_GLOBAL ? ws_xn[xg_at<GEMM_PROJ != 0>(b, n, HIDDEN)] : ws_hb[(size_t)b * HIDDEN + n]) =
                        from_f(f * to_f(ln2_w[n]));
                } else if constexpr (H_LL) {  // (the word gate_up's norm polls; ws_h above is down_proj's, ordered
                    ll_store(ws_hb, (size_t)b * HIDDEN + n, from_f(h), ll_e);  // by gate_up's release or barrier)
                } else if constexpr (HB_COPY) {
                    ws_hb[(size_t)b * HIDDEN + n] = from_f(h);
                }
            }
            if constexpr (HB_COPY && H_STATS) {
                group_sync(group, O_NWG * 32);
                for (int b = gt; b < BATCH; b += O_NWG * 32) {
                    float s = 0.f;
#pragma unroll
                    for (int r = 0; r < 16; ++r) s += sq[r * BATCH + b];
                    ws_hsq[(size_t)(row0 / 16) * BATCH + b] = s;
                }
            }
        }, NoDone{}, nullptr, &pre, NoWait{}, ll_e);
}
