// ---- stage: gate_up (prefill) ---- gate and up projections of every (normalised) token in one GEMM over the
// interleaved weight (gate_i, up_i): each pair of rows gives act(gate) * up directly.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../../gemm.cuh"

__device__ void gate_up(const T* ws_xn, const T* w_gu, const unsigned char* w_tmaps, T* ws_act,
    unsigned* ws_status, float* ws_split, unsigned* ws_count, unsigned char* smem) {
    gemm<2 * INTER, HIDDEN, GU_KSPLIT, GU_FULL>(w_gu, w_tmaps + TMAP_GU * TMAP_BYTES, ws_xn, ROWS, smem, ws_split,
        ws_count,
        [](int, int) { return make_float4(0.f, 0.f, 0.f, 0.f); },
        [&](int n, int t, float4 v, float4) {  // rows n .. n + 3: (gate, up) of act columns n / 2 and n / 2 + 1
        const float a0 = activation(v.x) * v.y, a1 = activation(v.z) * v.w;
        count_overflow(a0, ws_status);
        count_overflow(a1, ws_status);
        *reinterpret_cast<T2*>(ws_act + gemm_x(t, n / 2, INTER)) = from_f2(a0, a1);  // down_proj's input
    });
}
