// ---- stage: gate_up (prefill) ---- gate and up projections of every (normalised) token in one GEMM over the
// interleaved weight (gate_i, up_i): each pair of rows gives act(gate) * up directly.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
#include "../../gemm.cuh"

__device__ void gate_up(const T* ws_xn, const T* w_gu, T* ws_act, unsigned* ws_status, float* ws_split,
    unsigned* ws_count, unsigned char* smem) {
    gemm<2 * INTER, HIDDEN, GU_KSPLIT, GU_FULL, true>(w_gu, ws_xn, ROWS, smem, ws_split, ws_count, [](int, int) { return 0.f; },
        [&](int i, int t, float g, float u) {
        const float a = activation(g) * u;
        count_overflow(a, ws_status);
        ws_act[gemm_x(t, i, INTER)] = from_f(a);  // down_proj's input
    });
}
