// ---- stage: attention (prefill) ---- causal attention of the chunk's queries over cache rows 0 .. their own
// position (WINDOW: the last WINDOW rows up to it, a sliding window; the cache already holds the chunk's k and v:
// kv_append ran before the barrier), flash-attention 2
// style on the tensor cores. A task is (sequence, kv head, block of 16 x 16 query rows); query row r of a (sequence,
// kv head) is token r / GROUP, head r % GROUP, so a GQA group's heads share every K/V tile. Each warp owns 16 query
// rows (the M of mma m16n8k16): S = Q.K^T with K rows read by ldmatrix, an online softmax (fp32, exp2) per row,
// then O += P.V with P taken straight from the S accumulators and V read by ldmatrix.trans. The block streams
// 64-key tiles of K and V through a double-buffered cp.async ring (rows padded by 16 bytes); a warp skips tiles
// wholly past its rows' positions.
#pragma once
#ifndef MEGAKERNEL_CONFIG  // opened alone: the example prefill config (common.cuh would take decode's)
#include "../../example_config_prefill.cuh"
#endif
// gemm_x: o_proj's input layout
#include "../../gemm.cuh"

constexpr int PA_KT = 64;                  // keys per tile
constexpr int PA_RL = HEAD_DIM + 8;        // ring row length (elements)
constexpr int PA_TILE = PA_KT * PA_RL;     // one tile of K (or V)
constexpr int PA_QROWS = (THREADS / 32) * 16;                  // query rows per task
constexpr int PA_QBLOCKS = (CHUNK * GROUP + PA_QROWS - 1) / PA_QROWS;

__device__ __forceinline__ void pa_ldsm(unsigned (&r)[4], const void* p, bool trans) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3 }, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ unsigned pa_pack(float a, float b) {
    T2 h = from_f2(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ void attention_body(const int* __restrict__ pos, const T* ws_q, const T* k_cache,
                                               const T* v_cache, int cache_len, T* ws_attn, unsigned char* smem) {
    constexpr int KS = HEAD_DIM / 16, DT = HEAD_DIM / 8, CH = HEAD_DIM / 8;
    T* ring = reinterpret_cast<T*>(smem);   // [2 stages][K, V][PA_KT][PA_RL], then [16 warps][16 rows][PA_RL] of Q
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    for (int task = blockIdx.x; task < BATCH * KV_HEADS * PA_QBLOCKS; task += gridDim.x) {
        const int qb = task % PA_QBLOCKS, bk = task / PA_QBLOCKS, b = bk / KV_HEADS, kvh = bk % KV_HEADS;
        const int start = pos[b];
        const int r0 = qb * PA_QROWS + warp * 16;               // this warp's first query row
        if (start < 0 || start + CHUNK > cache_len) {           // guard (see kv_append): NaN output, nothing read
            for (int i = lane; i < 16 * HEAD_DIM; i += 32) {
                const int r = r0 + i / HEAD_DIM;
                if (r < CHUNK * GROUP)
                    ws_attn[gemm_x(b * CHUNK + r / GROUP, (kvh * GROUP + r % GROUP) * HEAD_DIM + i % HEAD_DIM,
                                   Q_DIM)] = from_f(__int_as_float(0x7fc00000));
            }
            continue;
        }
        // the block's last key: the position of its last valid query row
        const int last_row = min(CHUNK * GROUP, (qb + 1) * PA_QROWS) - 1;
        const int kend = start + last_row / GROUP + 1;          // keys kbeg .. kend-1
        // WINDOW: the block's first query row sees keys from its position - WINDOW + 1; a warp's from its own
        const int kbeg = WINDOW ? max(0, start + qb * PA_QROWS / GROUP + 1 - WINDOW) : 0;
        const int wbeg = WINDOW ? start + r0 / GROUP + 1 - WINDOW : 0;
        const int wlast = min(CHUNK * GROUP - 1, r0 + 15);
        const int wend = r0 < CHUNK * GROUP ? start + wlast / GROUP + 1 : 0;  // this warp's keys
        const size_t head = ((size_t)b * KV_HEADS + kvh) * cache_len * HEAD_DIM;
        const T* kc = k_cache + head;
        const T* vc = v_cache + head;
        auto issue = [&](int k0, int stage) {
            if (k0 < kend) {
                T* dk = ring + stage * 2 * PA_TILE;
                for (int c = tid; c < PA_KT * CH; c += THREADS) {
                    const int r = c / CH, off = (c % CH) * 8;
                    const bool ok = k0 + r < kend;
                    cp_async16(dk + r * PA_RL + off, ok ? kc + (size_t)(k0 + r) * HEAD_DIM + off : kc, ok);
                    cp_async16(dk + PA_TILE + r * PA_RL + off, ok ? vc + (size_t)(k0 + r) * HEAD_DIM + off : vc, ok);
                }
            }
            cp_async_commit();
        };
        issue(kbeg, 0);
        // queries: the warp's 16 rows to its own tile in shared memory (zeros past the chunk), read back as A
        // fragments by ldmatrix at every 16-key step (holding them in registers would spill at head_dim 128)
        T* qs = ring + 4 * PA_TILE + warp * 16 * PA_RL;
        for (int c = lane; c < 16 * CH; c += 32) {
            const int rr = r0 + c / CH, off = (c % CH) * 8;
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (rr < CHUNK * GROUP)
                val = *reinterpret_cast<const uint4*>(ws_q + ((size_t)b * CHUNK + rr / GROUP) * Q_DIM +
                                                      (kvh * GROUP + rr % GROUP) * HEAD_DIM + off);
            *reinterpret_cast<uint4*>(qs + (c / CH) * PA_RL + off) = val;
        }
        __syncwarp();
        int lim[2], low[2];  // keys each of the lane's two rows (gid, gid + 8) may see: low .. lim (lim -1: no row)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rr = r0 + gid + h * 8;
            lim[h] = rr < CHUNK * GROUP ? start + rr / GROUP : -1;
            low[h] = WINDOW ? lim[h] + 1 - WINDOW : 0;
        }
        float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
        for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
        for (int k0 = kbeg, it = 0; k0 < kend; k0 += PA_KT, ++it) {
            issue(k0 + PA_KT, (it + 1) & 1);
            cp_async_wait<1>();
            __syncthreads();
            const T* kt = ring + (it & 1) * 2 * PA_TILE;
            const T* vt = kt + PA_TILE;
            for (int s0 = 0; s0 < PA_KT && k0 + s0 < wend; s0 += 16) {   // 16 keys at a time
                if (WINDOW && k0 + s0 + 16 <= wbeg) continue;               // wholly before the warp's window
                float sc[2][4] = {};  // key n-tiles 0-7, 8-15
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    unsigned qa[4], kb[4];  // Q: (rows 0-7 | 8-15) x (dims 0-7 | 8-15); K: (keys ..) x (dims ..)
                    pa_ldsm(qa, qs + (lane & 15) * PA_RL + kk * 16 + (lane >> 4) * 8, false);
                    const uint4 qf = make_uint4(qa[0], qa[1], qa[2], qa[3]);
                    pa_ldsm(kb, kt + (s0 + (lane & 7) + ((lane >> 4) << 3)) * PA_RL + kk * 16 + ((lane >> 3) & 1) * 8,
                            false);
                    mma_bf16(sc[0], qf, kb[0], kb[1]);
                    mma_bf16(sc[1], qf, kb[2], kb[3]);
                }
                // causal mask and online softmax; element e: row gid + (e >> 1) * 8, key s0 + j * 8 + 2 tig + (e & 1)
                float f[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int j = 0; j < 2; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int key = k0 + s0 + j * 8 + 2 * tig + e;
                            float& s = sc[j][h * 2 + e];
                            if (key > lim[h] || (WINDOW && key < low[h])) s = -INFINITY;
                            mx = fmaxf(mx, s);
                        }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(m[h], mx);
                    f[h] = mn == -INFINITY ? 1.f : exp2f(m[h] - mn);
                    m[h] = mn;
                    float rs = 0.f;
#pragma unroll
                    for (int j = 0; j < 2; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& s = sc[j][h * 2 + e];
                            s = mn == -INFINITY ? 0.f : exp2f(s - mn);
                            rs += s;
                        }
                    l[h] = l[h] * f[h] + rs;   // lane-partial sums: reduced over the 4 lanes of a row at the end
                }
#pragma unroll
                for (int d = 0; d < DT; ++d) {
                    o[d][0] *= f[0]; o[d][1] *= f[0];
                    o[d][2] *= f[1]; o[d][3] *= f[1];
                }
                // P as the A operand: a0 (row gid, keys 2tig..+1), a1 (row gid+8), a2/a3 (keys + 8)
                const uint4 pa = make_uint4(pa_pack(sc[0][0], sc[0][1]), pa_pack(sc[0][2], sc[0][3]),
                                            pa_pack(sc[1][0], sc[1][1]), pa_pack(sc[1][2], sc[1][3]));
#pragma unroll
                for (int d = 0; d < DT; d += 2) {  // V^T tiles: (keys 0-7 | 8-15) x (dims d*8 .. +7 | +8 .. +15)
                    unsigned vb[4];
                    pa_ldsm(vb, vt + (s0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * PA_RL + d * 8 + ((lane >> 4) << 3),
                            true);
                    mma_bf16(o[d], pa, vb[0], vb[1]);
                    if (d + 1 < DT) mma_bf16(o[d + 1], pa, vb[2], vb[3]);
                }
            }
            __syncthreads();  // this stage is refilled by the next iteration's issue
        }
        cp_async_wait<0>();
        // normalise and write: row sums over the 4 lanes of a row
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + gid + h * 8;
            if (r >= CHUNK * GROUP) continue;
            const int t = b * CHUNK + r / GROUP, k0 = (kvh * GROUP + r % GROUP) * HEAD_DIM + 2 * tig;
            const float inv = 1.f / l[h];
#pragma unroll
            for (int d = 0; d < DT; ++d)  // a pair within an 8-element run: contiguous in o_proj's input (gemm_x)
                *reinterpret_cast<T2*>(ws_attn + gemm_x(t, k0 + d * 8, Q_DIM)) =
                    from_f2(o[d][h * 2] * inv, o[d][h * 2 + 1] * inv);
        }
    }
}

// ATT_INLINE 0 (the planner's default): a call, its own register allocation (inlined with the four wgmma GEMMs,
// head_dim 96 spilled 56 B; a call between stages, where no wgmma is in flight, leaves them unserialised: ptxas
// gives no advisory), at 1-5 µs a short chunk; 1: inlined, a tuner candidate
__device__ __noinline__ void attention_call(const int* __restrict__ pos, const T* ws_q, const T* k_cache,
                                            const T* v_cache, int cache_len, T* ws_attn, unsigned char* smem) {
    attention_body(pos, ws_q, k_cache, v_cache, cache_len, ws_attn, smem);
}

__device__ __forceinline__ void attention(const int* __restrict__ pos, const T* ws_q, const T* k_cache,
                                          const T* v_cache, int cache_len, T* ws_attn, unsigned char* smem) {
    if constexpr (ATT_INLINE) attention_body(pos, ws_q, k_cache, v_cache, cache_len, ws_attn, smem);
    else attention_call(pos, ws_q, k_cache, v_cache, cache_len, ws_attn, smem);
}
