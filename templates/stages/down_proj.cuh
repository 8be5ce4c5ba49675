// ---- stage: down_proj ---- down projection plus the second residual: out = h + act @ Wd^T. With tensor parallel
// each GPU writes its MLP columns' partial product (rank 0 adding h), all-reduced by the runtime after the launch.
#pragma once
#include "../gemv.cuh"
__device__ __forceinline__ GemvPre<DOWN_U * DOWN_TM> down_proj_pre(const T* w_down) {  // DOWN_PRE: before gate_up's barrier
    return gemv_pre<DOWN_PRE, HIDDEN, INTER, DOWN_NWG, DOWN_U, DOWN_KSPLIT, 0, DOWN_TM>(w_down);
}
__device__ void down_proj(const T* ws_act, const T* w_down, const float* ws_h, T* out, unsigned* ws_status,
                          int tp_rank, float* ws_split, unsigned* ws_count, const GemvPre<DOWN_U * DOWN_TM>& pre,
                          unsigned char* smem) {
    const bool residual = TP == 1 || tp_rank == 0;
    gemv<HIDDEN, INTER, INTER, DOWN_NWG, DOWN_U, DOWN_KSPLIT, X_FRAG, GEMV_PF, 0, DOWN_PRE, RED_DB, DOWN_TM>(w_down, ws_act,
        reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count,
        [&](int row0, auto tile, int gt) {
            for (int i = gt; i < 16 * BATCH; i += DOWN_NWG * 32) {
                const int n = row0 + i / BATCH, b = i % BATCH;
                const float o = (residual ? ws_h[(size_t)b * HIDDEN + n] : 0.f) + tile(i / BATCH, b);
                count_overflow(o, ws_status);
                out[(size_t)b * HIDDEN + n] = from_f(o);
            }
        }, NoDone{}, nullptr, &pre);
}
