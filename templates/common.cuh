// Helpers every stage uses: element conversions, 16-byte vector loads, warp reductions, cp.async.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // a generated kernel defines its config first; opened alone, a header uses this example
#include "example_config.cuh"
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#if DTYPE_BF16
__device__ __forceinline__ float to_f(T v) { return __bfloat162float(v); }
__device__ __forceinline__ T from_f(float v) { return __float2bfloat16(v); }
__device__ __forceinline__ float2 to_f2(T2 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ T2 from_f2(float a, float b) { return __floats2bfloat162_rn(a, b); }
#else
__device__ __forceinline__ float to_f(T v) { return __half2float(v); }
__device__ __forceinline__ T from_f(float v) { return __float2half(v); }
__device__ __forceinline__ float2 to_f2(T2 v) { return __half22float2(v); }
__device__ __forceinline__ T2 from_f2(float a, float b) { return __floats2half2_rn(a, b); }
#endif

// COOP 0 (a decode launch without the cooperative attribute): the grid barrier over one word (ws_gridbar, zeroed
// with the workspace), as cooperative groups' grid.sync does it: thread 0 of each block releases the block's writes
// (the block barrier makes them its own; the fence's cumulativity publishes them) and adds 1, block 0 adds
// 2^31 - (blocks - 1), so the last arrival flips the top bit and leaves the low bits at 0; each block's thread 0
// polls until the top bit differs from the one its add returned, then fences (acquire). No load before the arrival:
// session 47's two-word version read the generation first and measured ~0.3 us a barrier over grid.sync (H100);
// this one, at Llama-3.2-1B b8 (two barriers), timed level with grid.sync (session 52). It needs every block
// resident (the planner's grid, one block an SM); after 2^24 polls a trap, not a hang.
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
        unsigned old, now, polls = 0u;
        asm volatile("fence.acq_rel.gpu;\n\tatom.add.relaxed.gpu.global.u32 %0, [%1], %2;"
                     : "=r"(old) : "l"(bar), "r"(add) : "memory");
        do {
            if (++polls == 1u << 24) __trap();
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
        } while (((now ^ old) & 0x80000000u) == 0u);
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // (acquire: every block's release before its arrival)
    }
    __syncthreads();
}

// The GPU's global nanosecond timer (PTX %globaltimer): the stage clocks' rate is measured against it, since the SM
// clock (clock64) runs below the device's nominal ClockRate under load (~8-10 % on the H200).
__device__ __forceinline__ long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (long long)t;
}

// 8 elements = one 16-byte vector: the unit of every load in this kernel.
__device__ __forceinline__ void unpack8(const uint4 u, float (&f)[8]) {
    const T2* p = reinterpret_cast<const T2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 t = to_f2(p[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 u;
    T2* p = reinterpret_cast<T2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = from_f2(f[2 * i], f[2 * i + 1]);
    return u;
}
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) { unpack8(*reinterpret_cast<const uint4*>(p), f); }
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
// Weights are read once per launch and never written: read-only path, no L1 allocation (keeps L1 for activations);
// KEEP_L1: allocated in L1, for a line other warps of the block load too (templates/gemv.cuh's batch slices)
template <bool KEEP_L1 = false>
__device__ __forceinline__ uint4 ld_weight(const T* p) {
    uint4 u;
    if constexpr (KEEP_L1)
        asm volatile("ld.global.nc.v4.u32 { %0, %1, %2, %3 }, [%4];"
                     : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
    else
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 { %0, %1, %2, %3 }, [%4];"
                     : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
    return u;
}
// c += a (16x16, row-major fragment) x b (16x8): mma.sync m16n8k16 in T (MMA_AB), fp32 accumulators
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint4& a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 "
                 "{ %0, %1, %2, %3 }, { %4, %5, %6, %7 }, { %8, %9 }, { %0, %1, %2, %3 };"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Asynchronous 16-byte global->shared copy (zero-filled when !ok): loads in flight without holding registers.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
// at most n of this thread's groups still pending, n known once the caller's loop is unrolled (more than 7: 7)
__device__ __forceinline__ void cp_async_wait_le(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}
// Rings filled by the TMA unit (sm_90+: the prefill GEMM's weights and tokens, decode attention's K/V tiles): bulk and
// tensor copies, no thread issuing per 16 bytes, whose completion an mbarrier counts in bytes (PTX ISA:
// cp.async.bulk, cp.async.bulk.tensor, mbarrier).
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(count)
                 : "memory");
}
// the inits visible to the async proxy (the bulk copies' complete_tx) before any copy is issued
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// the arrival of this phase's one producer, with the bytes the phase's copies will bring
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
}
// waits for the phase of the given parity to complete
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n}\n" :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
}
// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), counted on `bar`
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
                    "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
}

// a box of a 3-D tensor (TMA tiled mode) from the tensor map at global `tmap` (cuTensorMapEncodeTiled, written by the
// host before the launch) to shared `dst` (128-byte aligned), at coordinates (c0 innermost, c1, c2); elements past
// the tensor's edges are zeros; the box's whole size is counted on `bar`
__device__ __forceinline__ void tensor_copy3(void* dst, const void* tmap, int c0, int c1, int c2,
                                             unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
                 "[%1, { %2, %3, %4 }], [%5];"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(c2),
                    "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
}

// a box of a 2-D tensor (TMA tiled mode) at coordinates (c0 innermost, c1), as tensor_copy3
__device__ __forceinline__ void tensor_copy2(void* dst, const void* tmap, int c0, int c1, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
                 "[%1, { %2, %3 }], [%4];"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(tmap), "r"(c0), "r"(c1),
                    "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
}
// the mbarrier's memory released for other use (PTX ISA: before an mbarrier's shared memory is repurposed)
__device__ __forceinline__ void mbar_inval(unsigned long long* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
}
// this thread's generic shared-memory accesses ordered before later copies by the async proxy (TMA) into it
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A value about to be stored as T that T cannot hold (fp16 above 65504) becomes inf: count it in status[0] so the
// host can say so (FusedDecoderLayer.overflows()). bf16 has fp32's range: the check compiles away.
__device__ __forceinline__ void count_overflow(float v, unsigned* status) {
    if (T_MAX < 3.0e38f && fabsf(v) > T_MAX) atomicAdd(status, 1u);
}
// The MLP's activation of the gate: SiLU (x * sigmoid(x)) or exact GELU (erf), as transformers' ACT2FN.
__device__ __forceinline__ float activation(float g) {
#if ACT_GELU
    return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
#else
    return g / (1.f + __expf(-g));
#endif
}

// The threads of warp group `group` (n threads, a multiple of 32) meet: a named barrier (id 1 + group; 0 is
// __syncthreads), so groups that do not take part are not waited for. At most 15 groups.
__device__ __forceinline__ void group_sync(int group, int n) {
    asm volatile("bar.sync %0, %1;" :: "r"(1 + group), "r"(n) : "memory");
}
