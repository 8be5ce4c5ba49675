// ---- stage: down_proj ---- down projection plus the second residual: out = h + act @ Wd^T. With tensor parallel
// each GPU writes its MLP columns' partial product (rank 0 adding h), all-reduced by the runtime after the launch.
#pragma once
// (gate_up.cuh: DOWN_FLOW's counters and act_known)
#include "../gemv.cuh"
// (after gemv.cuh: opened alone, the decode example config, not gemm.cuh's prefill one)
#include "../gemm.cuh"
#include "gate_up.cuh"
__device__ __forceinline__ GemvPre<DOWN_U * DOWN_TM> down_proj_pre(const T* w_down) {  // DOWN_PRE: before gate_up's barrier
    return gemv_pre<DOWN_PRE, HIDDEN, INTER, DOWN_NWG, DOWN_U, DOWN_KSPLIT, 0, DOWN_TM>(w_down);
}
// DOWN_FLOW: no grid barrier precedes this stage; a warp waits for the gate_up tiles of its step's act chunk
// (gate_up.cuh ActReady). One warp a block polls the counters (the block's warp 0: it reads every chunk), 32 chunks
// a poll from the one needed (lane i: chunk + i), and publishes how many in a row it saw complete in the block's
// act_known (release); the other warps wait on act_known in shared memory (acquire), so the L2 sees one poller a
// block, as with QKV_FLOW. `seen`: what this warp already knows, so a chunk costs a poll or a shared load once.
// With H_LL the counters are never reset (no barrier would order a reset before gate_up's first counts): they count
// on across launches, and a chunk is complete in launch n (act_launch) at n x its tiles (modulo 2^32).
struct ActWait {
    const unsigned* ready;
    mutable int seen = 0;  // chunks [0, seen) known complete to this warp
    static constexpr bool active = DOWN_FLOW == 1;
    __device__ void operator()(int chunk) const {
        if constexpr (active) {
            if (chunk < seen) return;
            constexpr int CHUNK_KT = DOWN_NWG * DOWN_U, KT = INTER / 16;  // act k-tiles a chunk, in all
            const unsigned known_at = (unsigned)__cvta_generic_to_shared(&act_known);
            unsigned known;
            if (threadIdx.x >= 32) {  // every lane acquires the poller's release itself
                while (true) {
                    asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(known) : "r"(known_at)
                                 : "memory");
                    if ((unsigned)chunk < known) break;
                    __nanosleep(32);
                }
                seen = (int)known;
                return;
            }
            const int lane = threadIdx.x, c = chunk + lane;
            for (unsigned polls = 0u;; ++polls) {
                if (H_LL && polls == 1u << 24) __trap();  // (H_LL: counts and epoch out of step: a trap, not a hang)
                bool complete = true;
                if (c < ACT_CHUNKS) {
                    unsigned got;
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(got)
                                 : "l"(ready + KV_HEADS + c * ACT_STRIDE) : "memory");
                    const unsigned tiles = 2u * (unsigned)min(CHUNK_KT, KT - c * CHUNK_KT);  // its gate_up tiles
                    if constexpr (H_LL) complete = (int)(got - act_launch * tiles) >= 0;
                    else complete = got >= tiles;
                }
                const unsigned open = __ballot_sync(0xffffffffu, !complete);
                if (!(open & 1u)) {
                    seen = chunk + (open ? __ffs(open) - 1 : 32);
                    break;
                }
                __nanosleep(64);
            }
            __syncwarp();  // every lane's acquire before lane 0's release and every lane's loads of act
            if (lane == 0)
                asm volatile("red.release.cta.shared::cta.max.u32 [%0], %1;" :: "r"(known_at), "r"(seen) : "memory");
        }
    }
};
// DOWN_SMEM: the block's first-round task (one group a block: task blockIdx.x), its first DW_KT k-tiles in shared
// memory (SMEM_DW), copied there from gate_up's start (gate_up.cuh down_weights_to_smem) and counted on the mbarrier
// at SMEM_DWBAR (phase 0: one copy a launch)
struct DownStaged {
    static constexpr bool active = DOWN_SMEM != 0;
    static constexpr int kt = DW_KT;
    const uint4* w;
    unsigned long long* bar;
    __device__ bool covers(int task) const { return active && task == (int)blockIdx.x; }
    __device__ void wait() const { mbar_wait(bar, 0u); }
    __device__ uint4 load(int k, int lane) const { return w[k * 32 + lane]; }
};
__device__ void down_proj(const T* ws_act, const T* w_down, const unsigned char* w_tmaps, const float* ws_h, T* out,
                          unsigned* ws_status, int tp_rank, float* ws_split, unsigned* ws_count, unsigned* ws_ready,
                          unsigned* ws_epoch, const GemvPre<DOWN_U * DOWN_TM>& pre, unsigned char* smem) {
    if constexpr (DOWN_GEMM) {  // (GEMM_PROJ, one GPU: gate_up's grid barrier before it; act tiled, gate_up.cuh)
        static_assert(!DOWN_GEMM || (GEMM_PROJ && DOWN_FLOW == 0 && !H_LL && !DOWN_SMEM && TP == 1),
                      "DOWN_GEMM: the engine (GEMM_PROJ), a grid barrier after gate_up, one GPU");
        down_gemm<DOWN_GSPLIT, DOWN_GFULL>(ws_act, w_down, w_tmaps, ws_h, out, ws_status, BATCH, ws_split, ws_count,
                                           smem);
        return;
    }
    const bool residual = TP == 1 || tp_rank == 0;
    // DOWN_FLOW 2: no grid barrier and no per-round barrier of ActReady's: the block's own gate_up epilogue must be
    // done with the partial sums' shared memory (SMEM_RED) before down_proj's first round writes it (as o_proj under
    // ATT_LL, gate_up under H_LL)
    if constexpr (DOWN_FLOW == 2) __syncthreads();
    // DOWN_FLOW 2: act's words polled (gemv XF 2) with the epoch gate_up's thread 0 read (act_epoch: the block's
    // gate_up barriers published it; a read now could see block 0's advance)
    gemv<HIDDEN, INTER, INTER, DOWN_NWG, DOWN_U, DOWN_KSPLIT, DOWN_FLOW == 2 ? 2 : X_FRAG, GEMV_PF, 0, DOWN_PRE, RED_DB,
         DOWN_TM, DOWN_BS>(w_down, ws_act,
        reinterpret_cast<float*>(smem + SMEM_RED), ws_split, ws_count,
        [&](int row0, auto tile, int gt) {
            for (int i = gt; i < 16 * BATCH; i += DOWN_NWG * 32) {
                const int n = row0 + i / BATCH, b = i % BATCH;
                const float o = (residual ? ws_h[(size_t)b * HIDDEN + n] : 0.f) + tile(i / BATCH, b);
                count_overflow(o, ws_status);
                out[(size_t)b * HIDDEN + n] = from_f(o);
            }
        }, NoDone{}, nullptr, &pre, ActWait{ws_ready}, DOWN_FLOW == 2 ? act_epoch : 0u,
        DownStaged{reinterpret_cast<const uint4*>(smem + SMEM_DW),
                   reinterpret_cast<unsigned long long*>(smem + SMEM_DWBAR)});
    if constexpr (DOWN_SMEM) {  // (every warp past its waits: the mbarrier's memory may go back to other use)
        __syncthreads();
        if (threadIdx.x == 0 && blockIdx.x < HIDDEN / 16) mbar_inval(reinterpret_cast<unsigned long long*>(smem + SMEM_DWBAR));
    }
    if constexpr (H_LL) {
        __syncthreads();  // (every warp's waits before thread 0's advance of the epoch)
        next_launch(ws_ready, ws_epoch);
    }
}
