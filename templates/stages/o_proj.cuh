// ---- stage: o_proj ---- output projection of the attention result plus the residual: h = x + attn @ Wo^T,
// kept in fp32 (ws_h) for the second norm and the final residual. With tensor parallel (TP > 1) each GPU writes its
// heads' partial product and rank 0 alone adds x, so the all-reduce of ws_h between launches gives h on every GPU.
// With HB_COPY (tp = 1, bf16) it also writes h rounded to T (ws_hb): the second norm's input.
#pragma once
#include "../gemv.cuh"
__device__ __forceinline__ GemvPre<O_U> o_proj_pre(const T* w_o) {  // O_PRE: before attention's grid barrier
    return gemv_pre<O_PRE, HIDDEN, Q_DIM, O_NWG, O_U, O_KSPLIT>(w_o);
}
__device__ void o_proj(const T* ws_attn, const T* w_o, const T* x, float* ws_h, T* ws_hb, int tp_rank, float* ws_split,
                       unsigned* ws_count, unsigned* ws_ready, const GemvPre<O_U>& pre, unsigned char* smem) {
    const bool residual = TP == 1 || tp_rank == 0;
    // QKV_FLOW's counters back to zero for the next launch: every attention task passed its wait before the grid
    // barrier that precedes this stage
    if (QKV_FLOW && blockIdx.x == 0)
        for (int h = threadIdx.x; h < KV_HEADS; h += THREADS) ws_ready[h] = 0u;
    gemv<HIDDEN, Q_DIM, Q_DIM, O_NWG, O_U, O_KSPLIT, X_FRAG, GEMV_PF, 0, O_PRE>(w_o, ws_attn,
        reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count,
        [&](int row0, auto tile, int gt) {
            for (int i = gt; i < 16 * BATCH; i += O_NWG * 32) {
                const int n = row0 + i / BATCH, b = i % BATCH;
                const float h = (residual ? to_f(x[(size_t)b * HIDDEN + n]) : 0.f) + tile(i / BATCH, b);
                ws_h[(size_t)b * HIDDEN + n] = h;
                if constexpr (HB_COPY) ws_hb[(size_t)b * HIDDEN + n] = from_f(h);
            }
        }, NoDone{}, nullptr, &pre);
}
