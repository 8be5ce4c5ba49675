// ---- stage: attention ---- decode attention of each query head over its KV head's cache rows 0..pos[b] (WINDOW:
// the last WINDOW rows up to pos[b], a sliding window).
// Tasks are (split, sequence, kv head) with ATT_C cache rows each, so long caches spread over all blocks
// (flash-decoding). Inside a task each of ATT_WARPS warps walks its own 16-key tiles with its own online softmax
// (fp32, exp2) and no block barrier. The group's query heads are the N of tensor-core products (mma m16n8k16):
// scores^T = K_tile . Q^T (keys as M) and out^T += V_tile^T . P^T (head dims as M), so GQA groups of up to 8 heads
// cost one n-tile. K and V tiles stream through a per-warp ATT_STAGES-deep ring in shared memory (cp.async, rows
// padded by 16 bytes so ldmatrix is conflict-free; ATT_TMA: TMA tensor copies in the 128-byte swizzle, att_at).
// Before the walk the task prepares its GROUP query heads (qk_norm, rope, scale) in shared memory; the task that
// holds row pos also appends the new k and v (ATT_KVLAST: two warps that do not walk take them during the walk, and
// the new row joins the combine as one more warp's state, so the walk waits for the queries only).
// Splits of one (sequence, kv head) meet through a counter: the last to finish combines the partial results
// (max-rescaled sums) and writes the attention output, so no extra grid barrier is needed.
// ATT_DYN 1: the rows per task are chosen at run time from this launch's positions (att_schedule), so sequences at
// mixed positions spread their actual rows over the blocks; at full context it picks ATT_C (the planner's choice).
// ATT_DYN 2 (stream-K): the launch's 16-row tiles of every (sequence, KV head), laid end to end (each pair behind a
// fixed cost in tiles), are cut into equal runs, one a block (att_stream_schedule); a block walks the pieces of its
// run in turn, so a count of pairs that is no multiple of the SMs leaves no block idle or a second round behind.
#pragma once
#include "../gemv.cuh"
#include "qk_norm.cuh"
#include "rope.cuh"
#include "kv_append.cuh"
// QKV_FLOW: the tiles of a KV head that qkv_proj counts in ws_ready
#include "qkv_proj.cuh"
// The walk addresses the ring's tiles as shared-space byte addresses with ATT_TMA (asm loads and stores), else as
// generic pointers (plain C++): each is the form that compiles without spills for its walk (bench/NOTES.md session 25:
// the TMA walk on generic pointers spilled 4 B on a Mistral-Nemo-like b18, the cp.async walk on shared-space
// addresses 32 B on Qwen3-1.7B b1's tuned plan)
using AttAddr = std::conditional_t<ATT_TMA != 0, unsigned, T*>;
__device__ __forceinline__ unsigned smem_u32(unsigned a) { return a; }
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], AttAddr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(a)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], AttAddr a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(a)));
}
__device__ __forceinline__ void st16(unsigned a, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], { %1, %2, %3, %4 };" :: "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ void st16(T* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
// Key row r, dims d..d+7 (d a multiple of 8) of a K or V tile of the ring at `tile`. cp.async (ATT_TMA 0): rows of
// HEAD_DIM + 8 elements (16 bytes of pad: ldmatrix's 8 rows of one column fall in 8 different bank groups).
// ATT_TMA (bytes): as the tensor copy lays out its boxes in the 128-byte swizzle, the tile 1024-byte aligned: one box
// a 64-dim part (16 rows x 128 B, 2 KB), the 16-byte chunk c of row r at chunk c ^ (r % 8) (PTX ISA, "Tensor copy
// swizzle modes"; the same pattern as templates/wgmma.cuh's operands).
__device__ __forceinline__ unsigned att_at(unsigned tile, int r, int d) {
    return tile + (d >> 6) * 2048 + r * 128 + ((((d & 63) >> 3) ^ (r & 7)) << 4);
}
__device__ __forceinline__ T* att_at(T* tile, int r, int d) { return tile + r * (HEAD_DIM + 8) + d; }
template <class A = AttAddr>
__device__ __forceinline__ A att_addr(T* p) {
    if constexpr (std::is_same_v<A, unsigned>) return smem_u32(p);
    else return p;
}
// element i of the ring at a
__device__ __forceinline__ unsigned att_plus(unsigned a, int i) { return a + i * (unsigned)sizeof(T); }
__device__ __forceinline__ T* att_plus(T* a, int i) { return a + i; }

__device__ __forceinline__ unsigned pack2(float a, float b) {
    T2 h = from_f2(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}

// ATT_DYN: warp 0 picks the rows per task C (a multiple of 16 x ATT_WARPS) for this launch's positions, as
// generator/modes/decode.py attention_split does (the same integer arithmetic): a (sequence, KV head) of L rows makes
// ceil(L / C) tasks (one for an empty or refused position); C is the smallest with at most one task a block (every
// task in one round: a second round costs a task's fixed latency again and lost on the H200, bench/NOTES.md session
// 15), else the one that gives each (sequence, KV head) one task. Candidates: C for 1 .. smax splits of the longest
// sequence (32 spread over them), then 32 between the smallest that fits and the next (within a few steps of the
// smallest where those two are more than 31 steps apart). Writes sched[0] = C,
// sched[1] = the task count, sched[2 + b] = sequence b's first task / KV_HEADS (b <= BATCH), sched[3 + BATCH + b] =
// its rows (position + 1; 0: refused).
__device__ __forceinline__ int att_ceil_div(int a, int c, float rc) {  // ceil(a / c) for 0 <= a < 2^24, exact
    int q = __float2int_ru((float)a * rc);
    if (q * c < a) ++q;
    else if (q > 0 && (q - 1) * c >= a) --q;
    return q;
}
// The rows a query at row count L (position + 1) attends to: all, or the last WINDOW (a sliding window)
__device__ __forceinline__ int att_rows(int L) { return WINDOW ? min(L, WINDOW) : L; }
__device__ void att_schedule(const int* pos, int* sched) {
    static_assert(!ATT_DYN || BATCH <= 32, "ATT_DYN: one warp holds a sequence a lane");
    static_assert(!ATT_DYN || SEQ_LEN < (1 << 24), "ATT_DYN: att_ceil_div is exact below 2^24 rows");
    constexpr int STEP = 16 * ATT_WARPS;
    const int lane = threadIdx.x & 31;
    int* lens = sched + 3 + BATCH;
    int L = 0;
    if (lane < BATCH) {
        int p;
        asm volatile("ld.global.s32 %0, [%1];" : "=r"(p) : "l"(pos + lane));
        L = p >= 0 && p < SEQ_LEN ? p + 1 : 0;
        lens[lane] = L;
    }
    __syncwarp();
    const int lmax = (int)__reduce_max_sync(0xffffffffu, (unsigned)att_rows(L));
    const int klo = max(1, (max(1, (lmax + ATT_NSPLIT - 1) / ATT_NSPLIT) + STEP - 1) / STEP);
    const int khi = max(klo, (lmax + STEP - 1) / STEP);
    const int smax = max(1, min(ATT_NSPLIT, (lmax + STEP - 1) / STEP));
    auto clamp_k = [&](int s) { return min(khi, max(klo, ((lmax + s - 1) / s + STEP - 1) / STEP)); };
    auto fits = [&](int k) {  // every task in one round
        const int c = k * STEP;
        const float rc = __frcp_rn((float)c);
        int t = 0;
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int l = att_rows(lens[b]);
            t += l > 0 ? att_ceil_div(l, c, rc) : 1;
        }
        return t * KV_HEADS <= (int)gridDim.x;
    };
    // round 1: k falls with the lane, so the lanes that fit are a prefix
    const int k1 = clamp_k(1 + lane * (smax - 1) / 31);
    const unsigned f1 = __ballot_sync(0xffffffffu, fits(k1));
    int k = khi;
    if (f1) {
        const int j = 31 - __clz(f1);
        const int kb = __shfl_sync(0xffffffffu, k1, j), ka = __shfl_sync(0xffffffffu, k1, min(31, j + 1));
        k = kb;
        if (ka < kb - 1) {  // round 2: rises with the lane; lane 31 (kb) fits
            const int k2 = ka + lane * (kb - ka) / 31;
            const unsigned f2 = __ballot_sync(0xffffffffu, fits(k2));
            k = __shfl_sync(0xffffffffu, k2, __ffs(f2) - 1);
        }
    }
    const int c = k * STEP;
    // each sequence's first task (in units of KV_HEADS tasks): an inclusive scan of its task count
    int n = lane < BATCH ? (L > 0 ? (att_rows(L) + c - 1) / c : 1) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, n, o);
        if (lane >= o) n += u;
    }
    if (lane < BATCH) sched[3 + lane] = n;
    if (lane == 0) { sched[0] = c; sched[2] = 0; }
    if (lane == 31) sched[1] = n * KV_HEADS;
}

// ATT_DYN 2: warp 0 writes sched[0] = R (units a block), sched[1] = W (units in all), sched[2 + b] = the units of
// the KV heads' spans before sequence b / KV_HEADS (b <= BATCH), sched[3 + BATCH + b] = its rows (0: refused). A
// sequence of L rows has U = max(1, ceil(L / 16)) tiles a KV head (an empty or refused one: one tile, its NaN
// output); each (sequence, KV head) spans ATT_PIECE_TILES units (a piece's fixed cost in tiles: queries, the partial,
// the counter) then its U tiles, so a run over many short sequences holds fewer of them. R = max(ceil(W / blocks),
// ceil((Umax - 1) / (ATT_NSPLIT - 1))) keeps a pair within ATT_NSPLIT pieces (generator/modes/decode.py
// attention_stream does the same arithmetic).
__device__ void att_stream_schedule(const int* pos, int* sched) {
    static_assert(ATT_DYN != 2 || ATT_NSPLIT >= 2, "ATT_DYN 2: room for two pieces a pair");
    const int lane = threadIdx.x & 31;
    int L = 0;
    if (lane < BATCH) {
        int p;
        asm volatile("ld.global.s32 %0, [%1];" : "=r"(p) : "l"(pos + lane));
        L = p >= 0 && p < SEQ_LEN ? p + 1 : 0;
        sched[3 + BATCH + lane] = L;
    }
    const int u = lane < BATCH ? max(1, (att_rows(L) + 15) >> 4) : 0;
    const int umax = (int)__reduce_max_sync(0xffffffffu, (unsigned)u);
    int n = lane < BATCH ? u + ATT_PIECE_TILES : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, n, o);
        if (lane >= o) n += t;
    }
    if (lane < BATCH) sched[3 + lane] = n;
    const int w = __shfl_sync(0xffffffffu, n, 31) * KV_HEADS;
    if (lane == 0) {
        // (max(1, ..): a plan of one split compiles this unused code too; no division by zero)
        sched[0] = max((w + (int)gridDim.x - 1) / (int)gridDim.x,
                       (umax - 1 + ATT_NSPLIT - 2) / max(1, ATT_NSPLIT - 1));
        sched[1] = w;
        sched[2] = 0;
    }
}

// Head h of a task's GQA group in its sequence's qkv row (b x QKV_DIM + column): query heads 0 .. GROUP - 1, then
// the KV head's k (GROUP) and v (GROUP + 1).
__device__ __forceinline__ size_t qkv_at(int b, int kvh, int h) {
    return (size_t)b * QKV_DIM + (h < GROUP ? (kvh * GROUP + h) * HEAD_DIM
                                            : Q_DIM + (h - GROUP) * KV_DIM + kvh * HEAD_DIM);
}
// One head's HEAD_DIM values of qkv at `at` (qkv_at), lane's value j at dim lane + 32 j: fp32 loads, or with
// QKV_FLOW 2 its words, loaded by qkv_words (issued early: with the task's position) and polled by qkv_values until
// each carries the epoch (ll_poll: after 2^24 polls a trap, not a hang); with QKV_KSPLIT > 1 each split's word
// (qkv_proj.cuh: split s's at s x BATCH x QKV_DIM), summed here in split order.
constexpr int QV = (HEAD_DIM + 31) / 32, QW = QKV_FLOW == 2 ? QV * QKV_KSPLIT : 1;  // QW: a lane's words
static_assert(QW < 32, "qkv_values' poll: a bit a word of the lane");
struct QkvWords {
    unsigned long long w[QW];
};
__device__ __forceinline__ size_t qkv_word_at(size_t at, int i, int lane) {  // word i = split i / QV, value i % QV
    return (size_t)(i / QV) * BATCH * QKV_DIM + at + lane + 32 * (i % QV);
}
__device__ __forceinline__ QkvWords qkv_words(const float* ws_qkv, size_t at, unsigned ll_e, int lane) {
    QkvWords q;
    if constexpr (QKV_FLOW == 2)
#pragma unroll
        for (int i = 0; i < QW; ++i)
            q.w[i] = lane + 32 * (i % QV) < HEAD_DIM ? ll_load8(ws_qkv, qkv_word_at(at, i, lane))
                                                     : (unsigned long long)ll_e << 32;
    return q;
}
__device__ __forceinline__ void qkv_values(QkvWords q, const float* ws_qkv, size_t at, unsigned ll_e, int lane,
                                           float (&v)[QV]) {
    if constexpr (QKV_FLOW == 2) {
        auto late = [&](unsigned m) {  // bit i: q.w[i] named in m and without the epoch
            unsigned l = 0u;
#pragma unroll
            for (int i = 0; i < QW; ++i) l |= (unsigned)(m >> i & 1u && (unsigned)(q.w[i] >> 32) != ll_e) << i;
            return l;
        };
        ll_poll(late((1u << QW) - 1u), [&](unsigned m) {
#pragma unroll
            for (int i = 0; i < QW; ++i)
                if (m >> i & 1u) q.w[i] = ll_load8(ws_qkv, qkv_word_at(at, i, lane));
            return late(m);
        });
#pragma unroll
        for (int j = 0; j < QV; ++j) v[j] = __uint_as_float((unsigned)q.w[j]);
#pragma unroll
        for (int i = QV; i < QW; ++i) v[i % QV] += __uint_as_float((unsigned)q.w[i]);
    } else {
#pragma unroll
        for (int j = 0; j < QV; ++j) v[j] = lane + 32 * j < HEAD_DIM ? ws_qkv[at + lane + 32 * j] : 0.f;
    }
}

// attention's output element (b, k), normalised: T in X_FRAG's or row-major order (O_GEMM: the GEMM engine's,
// gemm_x), or with ATT_LL o_proj's word (templates/gemv.cuh ll_store; ll_e: this launch's epoch)
__device__ __forceinline__ void att_out(T* ws_attn, int b, int k, float v, unsigned ll_e) {
    if constexpr (ATT_LL) ll_store(ws_attn, x_at<true>(b, k, Q_DIM), from_f(v), ll_e);
    else if constexpr (O_GEMM) ws_attn[gemm_x(b, k, Q_DIM)] = from_f(v);
    else ws_attn[x_at<X_FRAG>(b, k, Q_DIM)] = from_f(v);
}

__device__ void attention(const int* __restrict__ pos, const float* ws_qkv, const T* __restrict__ q_norm_w,
                          const T* __restrict__ k_norm_w, const float* __restrict__ inv_freq, T* k_cache,
                          T* v_cache, const unsigned char* kv_tmaps, float* ws_part, unsigned* ws_count,
                          const unsigned* ws_ready, T* ws_attn, const unsigned* ws_epoch, long long* ws_timeline,
                          unsigned char* smem) {
    const unsigned ll_e = ATT_LL || QKV_FLOW == 2 ? ll_epoch(ws_epoch) : 0u;
    // ATT_COMBINE 4: the split partials as 64-bit words tagged with this launch's whole count (a partial is not
    // rewritten every launch, a split past the position skips it: 32 bits, not the 16-bit epoch, so no stale word
    // carries a live tag in 2^32 launches)
    const unsigned part_tag = ATT_COMBINE == 4 ? ll_launch(ws_epoch) : 0u;
    // TIMELINE: thread 0 stamps the phases of the block's last task that walks rows (interface.TIMELINE_ATT_PHASES)
    long long tl_start = 0;
    auto tl = [&](int phase, long long t = 0) {
        if constexpr (TIMELINE)
            if (threadIdx.x == 0)
                ws_timeline[(size_t)blockIdx.x * TL_SLOTS + TL_ATT + phase] = t ? t : globaltimer_ns();
    };
    // QKV_FLOW 2: nothing between qkv_proj and this step (no barrier, no counter's block barrier): the block's own
    // qkv epilogue may still read the shared memory this step writes
    if constexpr (QKV_FLOW == 2) __syncthreads();
    constexpr int NW = THREADS / 32;
    constexpr int NTASK = ATT_NSPLIT * BATCH * KV_HEADS;
    static_assert(ATT_COMBINE < 3 || !ATT_DYN, "ATT_COMBINE 3, 4: every split's block waits for its peers, which "
                  "needs the static split's one round (the planner refuses ATT_DYN with them)");
    constexpr int WS = HEAD_DIM + 2;          // per-warp state: acc[HEAD_DIM], m, l
    constexpr int NT = (GROUP + 7) / 8;       // n-tiles of 8 query heads
    constexpr int KS = HEAD_DIM / 16;         // 16-wide steps over the head dimension
    constexpr int NH = (HEAD_DIM + 63) / 64;  // ATT_TMA: 64-dim boxes a row
    constexpr int TILE = ATT_TMA ? NH * 16 * 64 : 16 * (HEAD_DIM + 8);  // one 16-key tile of K (or V) in the ring
    constexpr int CH = HEAD_DIM / 8;          // 16-byte chunks per row
    constexpr int PL = 24;                    // P^T row length (elements): 16 keys + pad, conflict-free reads
    float* qs = reinterpret_cast<float*>(smem + SMEM_QS);     // [GROUP][HEAD_DIM] prepared queries
    float* ks = qs + GROUP * HEAD_DIM;                         // [HEAD_DIM] new key
    float* vs = ks + HEAD_DIM;    // ATT_KVLAST: [HEAD_DIM] the new value and [GROUP] its row's scores, as walked
    float* wst = reinterpret_cast<float*>(smem + SMEM_WST);   // [ATT_WARPS (+1)][GROUP][WS] warp states (alias ring)
    int* flag = reinterpret_cast<int*>(smem + SMEM_FLAG);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    T* ring = reinterpret_cast<T*>(smem + SMEM_WST) + (size_t)warp * ATT_STAGES * 2 * TILE;  // [stage][K,V] tiles
    const AttAddr ring_a = att_addr(ring);
    T* pt = reinterpret_cast<T*>(smem + SMEM_PT) + warp * NT * 8 * PL;                       // [NT*8 heads][PL]
    const bool walker = warp < ATT_WARPS;
    // ATT_TMA: a walker warp's ring stages each counted on an mbarrier (lane 0 arms it and issues the copies); its
    // k-th tile of the launch in stage k % ATT_STAGES, phase parity (k / ATT_STAGES) & 1
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + SMEM_MBAR) + warp * ATT_STAGES;
    unsigned ktile = 0;
    if constexpr (ATT_TMA) {
        // the ring's shared memory was last written by generic stores (the step before): ordered before the
        // tensor copies by every thread, then the block barrier below
        fence_proxy_async_smem();
        if (walker && lane == 0) {
            if ((unsigned)__cvta_generic_to_shared(smem + SMEM_WST) & 1023u) __trap();  // att_at's swizzle atom
#pragma unroll
            for (int s = 0; s < ATT_STAGES; ++s) mbar_init(bars + s, 1);
            mbar_init_fence();
            // the maps were written to global memory by a host copy: acquired by the tensormap proxy before this
            // thread's first copy (as templates/gemm.cuh)
            asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;" :: "l"(kv_tmaps) : "memory");
            asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;" :: "l"(kv_tmaps + TMAP_BYTES)
                         : "memory");
        }
        __syncthreads();
    }

    int att_c = ATT_C, ntask = NTASK, su = 0, su_end = 0;  // ATT_DYN 2: this block's run of units [su, su_end)
    const int* first = reinterpret_cast<const int*>(smem + SMEM_SCHED) + 2;  // ATT_DYN: first tasks, rows
    if constexpr (ATT_DYN) {
        if (warp == 0) {
            if constexpr (ATT_DYN == 2) att_stream_schedule(pos, reinterpret_cast<int*>(smem + SMEM_SCHED));
            else att_schedule(pos, reinterpret_cast<int*>(smem + SMEM_SCHED));
        }
        __syncthreads();
        att_c = first[-2];
        ntask = first[-1];
        su = blockIdx.x * att_c;
        su_end = min(ntask, su + att_c);
    }
    // ATT_ROT: task t on block (t + r) mod grid, r = qkv's tasks mod grid (gemv.cuh: the blocks from r on carry one
    // qkv task fewer than those before), so the first tasks start on the blocks that leave qkv first, on any grid
    // the launch has
    static_assert(!ATT_ROT || !ATT_DYN, "ATT_ROT: the static split (the planner refuses ATT_DYN with it)");
    constexpr int QKV_TASKS = gemv_tasks<QKV_DIM, QKV_KSPLIT, QKV_TM>;
    const int first_task = ATT_ROT ? ((int)blockIdx.x + (int)gridDim.x - QKV_TASKS % (int)gridDim.x) % (int)gridDim.x
                                   : (int)blockIdx.x;
    for (int task = first_task; ATT_DYN == 2 ? su < su_end : task < ntask; task += gridDim.x) {
        if constexpr (TIMELINE) tl_start = globaltimer_ns();
        int split, b, kvh, row0, row1 = 0, nsplit = 0;  // ATT_DYN 2: the piece's rows [row0, row1), its pair's pieces
        if constexpr (ATT_DYN == 2) {  // pairs sequence-major, KV head fastest: ATT_PIECE_TILES + U_b units each
            b = __popc(__ballot_sync(0xffffffffu, lane < BATCH - 1 && KV_HEADS * first[lane + 1] <= su));
            const int s0 = KV_HEADS * first[b], span = first[b + 1] - first[b], ub = span - ATT_PIECE_TILES;
            kvh = (su - s0) / span;
            const int f = s0 + kvh * span + ATT_PIECE_TILES, end = min(f + ub, su_end);  // f: the pair's first tile
            if (end <= f) {  // the run ends inside the pair's fixed cost: nothing of it to walk here
                su = su_end;
                continue;
            }
            row0 = (max(su, f) - f) * 16;
            row1 = (end - f) * 16;
            split = (int)blockIdx.x - f / att_c;
            nsplit = (f + ub - 1) / att_c - f / att_c + 1;
            su = end;
        } else if constexpr (ATT_DYN) {  // sequence-major, KV head fastest: b, the last sequence starting by u
            const int u = task / KV_HEADS;
            kvh = task % KV_HEADS;
            b = __popc(__ballot_sync(0xffffffffu, lane < BATCH - 1 && first[lane + 1] <= u));
            split = u - first[b];
        } else {
            split = task / (BATCH * KV_HEADS);
            const int rem = task % (BATCH * KV_HEADS);
            b = rem / KV_HEADS;
            kvh = rem % KV_HEADS;
        }
        // QKV_FLOW 2: warp h < GROUP + 2's head words loaded now, in flight with the position's load (the ring's
        // first tiles wait for the position; the words are polled after them); ATT_KVLAST: the k and v words by
        // warps NW - 2 and NW - 1
        QkvWords pre{};
        const int hw = !ATT_KVLAST || warp < GROUP ? warp : warp >= NW - 2 ? GROUP + warp - (NW - 2) : GROUP + 2;
        if constexpr (QKV_FLOW == 2)
            if (hw < GROUP + 2) pre = qkv_words(ws_qkv, qkv_at(b, kvh, hw), ll_e, lane);
        // (a volatile load: with QKV_FLOW no grid barrier stops the compiler hoisting it into qkv_proj, whose
        // register peak it then raises past the cap: a spill)
        int p;  // ATT_DYN: from the schedule's copy (rows - 1; -1: refused)
        if constexpr (ATT_DYN) p = first[BATCH + 1 + b] - 1;
        else asm volatile("ld.global.s32 %0, [%1];" : "=r"(p) : "l"(pos + b));
        if constexpr (ATT_DYN != 2) row0 = split * att_c;
        if (p < 0 || p >= SEQ_LEN) {                  // the loader checks positions; this guards graph replays
            if (split == 0)
                for (int t = tid; t < GROUP * HEAD_DIM; t += THREADS)
                    att_out(ws_attn, b, kvh * GROUP * HEAD_DIM + t, __int_as_float(0x7fc00000), ll_e);
            continue;                                 // no cache write: the sequence's output becomes NaN
        }
        // the walk covers rows lo .. p (WINDOW: the last WINDOW of them), row0, n and the splits counted from lo;
        // pr: the position's row past lo
        const int lo = WINDOW ? max(0, p + 1 - WINDOW) : 0, pr = p - lo;
        if (row0 > pr) continue;                      // the same for the whole block
        tl(0, tl_start);
        tl(1);  // (p was used above: its load is in)
        int n = ATT_DYN == 2 ? min(row1, pr + 1) - row0 : min(att_c, pr + 1 - row0);  // the rows walked
        if constexpr (ATT_DYN != 2) nsplit = pr / att_c + 1;
        const bool appends = split == nsplit - 1;
        if constexpr (ATT_KVLAST) n -= appends;  // (the appending split's last, row p: folded in after the walk)
        const size_t head_base = ((size_t)b * KV_HEADS + kvh) * SEQ_LEN * HEAD_DIM;
        const T* kc = k_cache + head_base + (size_t)(lo + row0) * HEAD_DIM;
        const T* vc = v_cache + head_base + (size_t)(lo + row0) * HEAD_DIM;

        // rows before p were written by earlier launches: streamed before the queries are ready. Row p is
        // appended by this launch: it is zero-filled here (ATT_TMA: whatever the copy brings) and patched in (plain
        // loads) after the block barrier (ATT_KVLAST: past n, never walked); so are rows past n (ATT_TMA: V's zeroed
        // after the copy, K's scores masked)
        auto issue = [&](int t0, int stage) {
            if (walker && t0 < n) {
                T* dst = ring + stage * 2 * TILE;
                if constexpr (ATT_TMA) {  // one box a 64-dim part of K and of V: rows (b, kvh, row0 + t0 ..) of the maps
                    if (lane == 0) {
                        unsigned long long* bar = bars + stage;
                        mbar_expect_tx(bar, 2 * TILE * (unsigned)sizeof(T));
                        const int y = ((b * KV_HEADS + kvh) * SEQ_LEN) + lo + row0 + t0;
#pragma unroll
                        for (int h = 0; h < NH; ++h) {
                            tensor_copy2(dst + h * 1024, kv_tmaps, h * 64, y, bar);
                            tensor_copy2(dst + TILE + h * 1024, kv_tmaps + TMAP_BYTES, h * 64, y, bar);
                        }
                    }
                } else {
                    for (int c = lane; c < 16 * CH; c += 32) {
                        const int r = c / CH, off = (c % CH) * 8, row = t0 + r;
                        const bool ok = row < n && row0 + row < pr;
                        cp_async16(dst + r * (HEAD_DIM + 8) + off, ok ? kc + (size_t)row * HEAD_DIM + off : kc, ok);
                        cp_async16(dst + TILE + r * (HEAD_DIM + 8) + off, ok ? vc + (size_t)row * HEAD_DIM + off : vc,
                                   ok);
                    }
                }
            }
            if constexpr (!ATT_TMA) cp_async_commit();  // an empty group past the end keeps the wait count uniform
        };
#pragma unroll
        for (int st = 0; st < ATT_STAGES - 1; ++st) issue((st * ATT_WARPS + warp) * 16, (ktile + st) % ATT_STAGES);

        // 1. queries (and the new key/value): one warp per head; RoPE's inv_freq loaded alongside the queries (not
        // after them, inside rope). With QKV_FLOW no grid barrier separates this from qkv_proj: first this KV head's
        // q, k and v tiles must be in (one thread acquires the count, the block barrier passes it on to the block's
        // plain loads, as the PTX memory model's causality order does through bar.sync; QKV_FLOW 2: each warp polls
        // its head's words, qkv_values)
        if constexpr (QKV_FLOW == 1) {
            if (tid == 0) {
                unsigned got;
                while (true) {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(got) : "l"(ws_ready + kvh) : "memory");
                    if (got >= (unsigned)QKV_TILES_PER_HEAD) break;
                    __nanosleep(64);  // up to 132 pollers on one L2 sector: space them out
                }
            }
            __syncthreads();
        }
        if constexpr (QKV_FLOW != 2) tl(2);  // (QKV_FLOW 2: once warp 0's head words are in, below)
        float freqs[ROPE_K];  // (after the wait: fewer registers live across it)
        rope_freqs(inv_freq, lane, freqs);
        for (int h = warp; h < GROUP + (ATT_KVLAST ? 0 : 2); h += NW) {
            // (the head's values: QKV_FLOW 2 polls the words loaded with the position, or for a second head of
            // this warp its own)
            auto values = [&](float (&v)[QV]) {
                const size_t at = qkv_at(b, kvh, h);
                qkv_values(h == warp ? pre : qkv_words(ws_qkv, at, ll_e, lane), ws_qkv, at, ll_e, lane, v);
            };
            if (h < GROUP) {
                float* q = qs + h * HEAD_DIM;
                float v[QV];
                values(v);
                if constexpr (QKV_FLOW == 2)
                    if (h == 0) tl(2);
#pragma unroll
                for (int j = 0; j < QV; ++j)
                    if (lane + 32 * j < HEAD_DIM) q[lane + 32 * j] = v[j];
                __syncwarp();
                qk_norm(q, q_norm_w, lane);
                rope(q, p, freqs, SCORE_SCALE * ROPE_ATTN, lane);
            } else if (appends && h == GROUP) {
                float v[QV];
                values(v);
#pragma unroll
                for (int j = 0; j < QV; ++j)
                    if (lane + 32 * j < HEAD_DIM) ks[lane + 32 * j] = v[j];
                __syncwarp();
                qk_norm(ks, k_norm_w, lane);
                rope(ks, p, freqs, ROPE_ATTN, lane);
                kv_append(k_cache + head_base, p, ks, lane);
            } else if (appends) {
                float v[QV];
                values(v);
                kv_append(v_cache + head_base, p, v, lane);
            }
        }
        __syncthreads();  // queries ready; the appended row visible to the whole block (ATT_KVLAST: not yet)
        tl(3);
        // 2. each walker warp: tiles warp, warp + ATT_WARPS, ... of 16 keys
        // Q^T as B fragments (n = head gid of each n-tile, k = dims), bf16, zero for heads past GROUP
        // ATT_QSMEM (the planner's: NT x KS >= 16, e.g. a group of more than 8 heads at head_dim >= 128, or head_dim
        // 256): the fragments once in shared memory for the block, read a step at a time, instead of 2 x NT x KS
        // registers held through the walk (beside the accumulators they spilled 168-676 B)
        constexpr int QN = ATT_QSMEM ? 1 : NT, QK = ATT_QSMEM ? 1 : KS;  // (1 x 1 unused registers under ATT_QSMEM)
        unsigned qb[QN][QK][2];
        uint2* qp = reinterpret_cast<uint2*>(smem + SMEM_QP);  // ATT_QSMEM: [NT][KS][32 lanes]
        auto q_frag = [&](int t, int kk, int ln) {
            const int h = t * 8 + (ln >> 2);
            const float* q = qs + h * HEAD_DIM + kk * 16 + 2 * (ln & 3);
            return h < GROUP ? make_uint2(pack2(q[0], q[1]), pack2(q[8], q[9])) : make_uint2(0u, 0u);
        };
        if constexpr (ATT_QSMEM) {
            for (int i = tid; i < NT * KS * 32; i += THREADS) qp[i] = q_frag(i / (KS * 32), i / 32 % KS, i % 32);
            __syncthreads();
        } else {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    const uint2 f = q_frag(t, kk, lane);
                    qb[t][kk][0] = f.x;
                    qb[t][kk][1] = f.y;
                }
        }
        // ATT_KVLAST: the new key (normed, rotated, appended; its score against each query head as the walk would
        // take it: both rounded to T, fp32 sums) and value (appended, rounded to T) while the walkers walk (after
        // the last block barrier before the walk: ATT_QSMEM's)
        if (ATT_KVLAST && appends && warp >= NW - 2) {
            float v[QV];
            qkv_values(pre, ws_qkv, qkv_at(b, kvh, hw), ll_e, lane, v);
            if (warp == NW - 2) {
#pragma unroll
                for (int j = 0; j < QV; ++j)
                    if (lane + 32 * j < HEAD_DIM) ks[lane + 32 * j] = v[j];
                __syncwarp();
                qk_norm(ks, k_norm_w, lane);
                rope(ks, p, freqs, ROPE_ATTN, lane);  // (ends in __syncwarp: ks whole for every lane)
                kv_append(k_cache + head_base, p, ks, lane);
                for (int h = 0; h < GROUP; ++h) {
                    float s = 0.f;
                    for (int d = lane; d < HEAD_DIM; d += 32)
                        s = fmaf(to_f(from_f(qs[h * HEAD_DIM + d])), to_f(from_f(ks[d])), s);
#pragma unroll
                    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if (lane == 0) vs[HEAD_DIM + h] = s;
                }
            } else {
                kv_append(v_cache + head_base, p, v, lane);
#pragma unroll
                for (int j = 0; j < QV; ++j)
                    if (lane + 32 * j < HEAD_DIM) vs[lane + 32 * j] = to_f(from_f(v[j]));
            }
        }
        // out^T accumulators: m-tile mt holds dims mt*16 + gid (+8), heads t*8 + 2*tig (+1)
        float o[NT][KS][4], m[NT][2], l[NT][2];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            m[t][0] = m[t][1] = -INFINITY;
            l[t][0] = l[t][1] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) o[t][kk][0] = o[t][kk][1] = o[t][kk][2] = o[t][kk][3] = 0.f;
        }
        if (walker) {
            int k = 0;
            for (int t0 = warp * 16; t0 < n; ++k, t0 += ATT_WARPS * 16) {
                const unsigned g = ATT_TMA ? ktile + k : k;  // the warp's tile count (ATT_TMA: over the launch's tasks)
                issue(t0 + (ATT_STAGES - 1) * ATT_WARPS * 16, (g + ATT_STAGES - 1) % ATT_STAGES);
                if constexpr (ATT_TMA) mbar_wait(bars + g % ATT_STAGES, (g / ATT_STAGES) & 1);
                else cp_async_wait<ATT_STAGES - 1>();
                const AttAddr kt = att_plus(ring_a, (g % ATT_STAGES) * 2 * TILE), vt = att_plus(kt, TILE);
                if (ATT_TMA && n - t0 < 16) {  // rows past n: V zeroed (P is 0 there, but 0 x NaN is not)
                    for (int c = lane; c < 16 * CH; c += 32)
                        if (c / CH >= n - t0)
                            st16(att_at(vt, c / CH, (c % CH) * 8), make_uint4(0u, 0u, 0u, 0u));
                }
                if (!ATT_KVLAST && t0 <= pr - row0 && pr - row0 < t0 + 16) { // the tile of the appended row: patch
                    const int r = pr - row0 - t0;                 // (each chunk by the lane that zero-filled it)
                    for (int c = lane; c < 16 * CH; c += 32) {
                        if (c / CH != r) continue;
                        const int off = (c % CH) * 8;
                        st16(att_at(kt, r, off),
                             *reinterpret_cast<const uint4*>(kc + (size_t)(pr - row0) * HEAD_DIM + off));
                        st16(att_at(vt, r, off),
                             *reinterpret_cast<const uint4*>(vc + (size_t)(pr - row0) * HEAD_DIM + off));
                    }
                }
                // (ATT_TMA: the stores above, and this tile's reads below, ordered before the next tensor copy into
                // this stage)
                if constexpr (ATT_TMA) fence_proxy_async_smem();
                __syncwarp();  // the ring rows (this lane's copies and the patch) are visible to the whole warp

                // scores^T [16 keys x 8 heads] per n-tile: A = K tile (ldmatrix), B = Q^T
                float sc[NT][4];
#pragma unroll
                for (int t = 0; t < NT; ++t) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    unsigned a[4];
                    ldsm_x4(a, att_at(kt, lane & 15, kk * 16 + (lane >> 4) * 8));
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        const uint2 f = ATT_QSMEM ? qp[(t * KS + kk) * 32 + lane]
                                                  : make_uint2(qb[t % QN][kk % QK][0], qb[t % QN][kk % QK][1]);
                        mma_bf16(sc[t], make_uint4(a[0], a[1], a[2], a[3]), f.x, f.y);
                    }
                }
                // keys past n: -inf; then per head: tile max over the 16 keys (lanes with equal tig)
                const bool v0 = t0 + gid < n, v1 = t0 + gid + 8 < n;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (!v0) sc[t][0] = sc[t][1] = -INFINITY;
                    if (!v1) sc[t][2] = sc[t][3] = -INFINITY;
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        float mb = fmaxf(sc[t][j], sc[t][j + 2]);
                        mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 4));
                        mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 8));
                        mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 16));
                        if (mb > m[t][j]) {  // finite: the tile's first key is valid
                            const float f = exp2f(m[t][j] - mb);
                            m[t][j] = mb;
                            l[t][j] *= f;
#pragma unroll
                            for (int kk = 0; kk < KS; ++kk) { o[t][kk][j] *= f; o[t][kk][j + 2] *= f; }
                        }
                        const float p0 = exp2f(sc[t][j] - m[t][j]), p1 = exp2f(sc[t][j + 2] - m[t][j]);
                        l[t][j] += p0 + p1;
                        // P^T to shared memory as [head][key] (T), read back below as B fragments
                        pt[(t * 8 + 2 * tig + j) * PL + gid] = from_f(p0);
                        pt[(t * 8 + 2 * tig + j) * PL + gid + 8] = from_f(p1);
                    }
                }
                __syncwarp();
                // out^T [16 dims x 8 heads] += V^T tile (ldmatrix.trans) . P^T
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const T* pr = pt + (t * 8 + gid) * PL + 2 * tig;
                    const unsigned b0 = *reinterpret_cast<const unsigned*>(pr);
                    const unsigned b1 = *reinterpret_cast<const unsigned*>(pr + 8);
#pragma unroll
                    for (int kk = 0; kk < KS; ++kk) {
                        unsigned a[4];
                        ldsm_x4_t(a, att_at(vt, (lane & 7) + ((lane >> 4) << 3), kk * 16 + ((lane >> 3) & 1) * 8));
                        mma_bf16(o[t][kk], make_uint4(a[0], a[1], a[2], a[3]), b0, b1);
                    }
                }
                __syncwarp();  // P^T and this ring stage are rewritten by the next tile
            }
            if constexpr (ATT_TMA) ktile += k;  // (the tiles this warp walked; cp.async's stages restart each task)
        }
        if constexpr (!ATT_TMA) cp_async_wait<0>();  // no copy may land in the ring once it is reused for the warp states
        // (ATT_TMA: every copy issued was waited on: none past n is issued)
        __syncthreads();
        tl(4);

        // 3. publish the warp's state: l summed over the lanes of one head (they share m)
        if (walker) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float lj = l[t][j];
                    lj += __shfl_xor_sync(0xffffffffu, lj, 4);
                    lj += __shfl_xor_sync(0xffffffffu, lj, 8);
                    lj += __shfl_xor_sync(0xffffffffu, lj, 16);
                    const int h = t * 8 + 2 * tig + j;
                    if (h < GROUP) {
                        float* w = wst + (warp * GROUP + h) * WS;
#pragma unroll
                        for (int kk = 0; kk < KS; ++kk) {
                            w[kk * 16 + gid] = o[t][kk][j];
                            w[kk * 16 + gid + 8] = o[t][kk][j + 2];
                        }
                        if (gid == 0) { w[HEAD_DIM] = m[t][j]; w[HEAD_DIM + 1] = lj; }
                    }
                }
        }
        // ATT_KVLAST: the new row as warp ATT_WARPS's state (m its score, l 1, acc its value), by the warps that
        // do not walk
        constexpr int SLOTS = ATT_WARPS + (ATT_KVLAST ? 1 : 0);
        const int slots = ATT_KVLAST && appends ? SLOTS : ATT_WARPS;
        if (ATT_KVLAST && appends && !walker)
            for (int i = tid - ATT_WARPS * 32; i < GROUP * WS; i += THREADS - ATT_WARPS * 32) {
                const int g = i / WS, d = i % WS;
                wst[(ATT_WARPS * GROUP + g) * WS + d] = d < HEAD_DIM ? vs[d] : d == HEAD_DIM ? vs[HEAD_DIM + g] : 1.f;
            }
        __syncthreads();
        tl(5);

        // 4. combine the warps (max-rescaled): the final output if this is the only split, else a partial
        const size_t part0 = ((size_t)b * HEADS + kvh * GROUP) * ATT_NSPLIT;  // + g * ATT_NSPLIT + split
        // every split's block combines a slice (ATT_COMBINE 3, 4) where every task is in this round (the planner's
        // condition; a GPU with fewer SMs than planned takes ATT_COMBINE 1's path: float partials and the counter)
        const bool sliced = ATT_COMBINE >= 3 && ntask <= (int)gridDim.x;
        for (int t = tid; t < GROUP * WS; t += THREADS) {
            const int g = t / WS, d = t % WS;
            float M = -INFINITY;
#pragma unroll
            for (int w = 0; w < SLOTS; ++w)
                if (w < slots) M = fmaxf(M, wst[(w * GROUP + g) * WS + HEAD_DIM]);
            float o = 0.f, den = 0.f;
            if (d < HEAD_DIM || d == HEAD_DIM + 1) {
#pragma unroll
                for (int w = 0; w < SLOTS; ++w) {
                    if (w >= slots) continue;
                    const float* ww = wst + (w * GROUP + g) * WS;
                    const float e = ww[HEAD_DIM] == -INFINITY ? 0.f : exp2f(ww[HEAD_DIM] - M);
                    o = fmaf(e, ww[d], o);
                    den = fmaf(e, ww[HEAD_DIM + 1], den);
                }
            } else {
                o = M;
            }
            if (nsplit == 1) {
                if (d < HEAD_DIM)
                    att_out(ws_attn, b, (kvh * GROUP + g) * HEAD_DIM + d, o / den, ll_e);
            } else if (ATT_COMBINE == 4 && sliced) {
                ll_store8(ws_part, (part0 + (size_t)g * ATT_NSPLIT + split) * WS + d, o, part_tag);
            } else {
                ws_part[(part0 + (size_t)g * ATT_NSPLIT + split) * WS + d] = o;   // acc..., m, l
            }
        }
        tl(6);  // (thread 0's share)
        if (nsplit > 1 && sliced) {
            // every split's block combines a slice of the outputs (every task in one round, which the planner
            // requires: no block may wait on a task of its own later round). ATT_COMBINE 3: each releases its
            // partial and counts (one thread: fence.acq_rel + red, as below), waits until all nsplit have counted,
            // acquires, and writes outputs [o0, o1) of the GROUP x HEAD_DIM: a lane a split, the splits' power of two
            // lanes an output (a fixed order: the same result whichever split is last). The chain after the last
            // partial is one poll and one batch of loads, not the last split's whole combine. The counter goes to
            // 2 x nsplit as each block leaves its wait: the one that brings it there resets it for the next launch
            // (every block has passed its wait by then). ATT_COMBINE 4: no fence, counter or block barrier: each lane
            // polls its split's three words (m, l, acc[d]) until each carries this launch's tag (NCCL's LL protocol:
            // the data is the flag; one L2 round trip after the last partial's stores instead of a fence, a counter
            // and a load; bench/NOTES.md session 41's hand-off measurement)
            unsigned* cnt = ws_count + b * KV_HEADS + kvh;
            unsigned left = 0u;
            if constexpr (ATT_COMBINE == 3) {
                __syncthreads();
                if (tid == 0) {
                    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(cnt) : "memory");
                    unsigned got;
                    while (true) {
                        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(got) : "l"(cnt) : "memory");
                        if (got >= (unsigned)nsplit) break;
                        __nanosleep(32);
                    }
                    asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], 1;" : "=r"(left) : "l"(cnt) : "memory");
                }
                __syncthreads();
            }
            constexpr int OUTS = GROUP * HEAD_DIM;
            const int o0 = split * OUTS / nsplit, o1 = (split + 1) * OUTS / nsplit;
            // SEG lanes an output (the splits' power of two, at most 32), 32 / SEG outputs a warp at once
            const int seg = nsplit >= 32 ? 32 : 1 << (32 - __clz(nsplit - 1)), sub = lane / seg, sl = lane % seg;
            for (int base = o0 + warp * (32 / seg); base < o1; base += NW * (32 / seg)) {
                const int t = base + sub;
                const bool out = t < o1;
                const int g = (out ? t : o0) / HEAD_DIM, d = (out ? t : o0) % HEAD_DIM;
                const size_t pi = (part0 + (size_t)g * ATT_NSPLIT) * WS;  // split 0's partial (ATT_COMBINE 4: words)
                const float* pg = ws_part + pi;
                float M = -INFINITY, den = 0.f, o = 0.f;
                for (int r0 = 0; r0 < nsplit; r0 += seg) {  // (nsplit <= 32: one pass, three loads in flight)
                    const int s = r0 + sl;
                    const bool in = out && s < nsplit;
                    float ms = -INFINITY, ls = 0.f, as = 0.f;
                    if (ATT_COMBINE == 4 && in) {  // the split's words, polled together until each is this launch's
                        const size_t at = pi + (size_t)s * WS;
                        const size_t idx[3] = {at + HEAD_DIM, at + HEAD_DIM + 1, at + d};
                        unsigned long long w[3];
#pragma unroll
                        for (int j = 0; j < 3; ++j) w[j] = ll_load8(ws_part, idx[j]);
                        auto late = [&](unsigned m) {
                            unsigned l = 0u;
#pragma unroll
                            for (int j = 0; j < 3; ++j)
                                l |= (unsigned)(m >> j & 1u && (unsigned)(w[j] >> 32) != part_tag) << j;
                            return l;
                        };
                        ll_poll<64>(late(7u), [&](unsigned m) {
#pragma unroll
                            for (int j = 0; j < 3; ++j)
                                if (m >> j & 1u) w[j] = ll_load8(ws_part, idx[j]);
                            return late(m);
                        });
                        ms = __uint_as_float((unsigned)w[0]);
                        ls = __uint_as_float((unsigned)w[1]);
                        as = __uint_as_float((unsigned)w[2]);
                    } else if (in) {
                        ms = __ldcg(pg + (size_t)s * WS + HEAD_DIM);
                        ls = __ldcg(pg + (size_t)s * WS + HEAD_DIM + 1);
                        as = __ldcg(pg + (size_t)s * WS + d);
                    }
                    float mx = ms;
                    for (int k = seg / 2; k > 0; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
                    const float Mn = fmaxf(M, mx), f = M == -INFINITY ? 0.f : exp2f(M - Mn);
                    const float e = in ? exp2f(ms - Mn) : 0.f;
                    float el = e * ls, ea = e * as;
                    for (int k = seg / 2; k > 0; k >>= 1) {
                        el += __shfl_xor_sync(0xffffffffu, el, k);
                        ea += __shfl_xor_sync(0xffffffffu, ea, k);
                    }
                    den = fmaf(den, f, el);
                    o = fmaf(o, f, ea);
                    M = Mn;
                }
                if (out && sl == 0) att_out(ws_attn, b, (kvh * GROUP + g) * HEAD_DIM + d, o / den, ll_e);
            }
            if (ATT_COMBINE == 3 && tid == 0 && left == 2u * nsplit - 1u) *cnt = 0u;  // every block has left its wait
        } else if (nsplit > 1 && ATT_COMBINE >= 1) {
            // the block's partial, then one thread's release (fence.acq_rel + the counter: the block barrier makes
            // every thread's stores its own, cumulativity publishes them) in place of a fence by every thread
            __syncthreads();
            if (tid == 0) {
                unsigned done;
                asm volatile("fence.acq_rel.gpu;\n\tatom.add.relaxed.gpu.global.u32 %0, [%1], 1;"
                             : "=r"(done) : "l"(ws_count + b * KV_HEADS + kvh) : "memory");
                *flag = done == (unsigned)(nsplit - 1);
                if (*flag) {
                    ws_count[b * KV_HEADS + kvh] = 0u;  // every split has counted: ready for the next launch
                    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire: the other splits' partials
                }
            }
            __syncthreads();
            if (*flag && ATT_COMBINE == 2) {
                // last split, split-parallel: WPH warps a query head, each a run of its splits; a lane holds one
                // split's (m, l) and, for each split of the run, the dims lane + 32 i, a batch of splits' loads in
                // flight together (issued before the max and sum need theirs); then each head's WPH states merge
                // in shared memory. Fixed runs and merge order: the same result whichever split is last.
                constexpr int WPH = NW / GROUP > 0 ? NW / GROUP : 1, DPL = (HEAD_DIM + 31) / 32;
                constexpr int B = 32 / DPL > 0 ? 32 / DPL : 1;  // splits a batch of loads (32 registers)
                static_assert(GROUP * WPH * WS * 4 <= SMEM_FLAG - SMEM_WST, "ATT_COMBINE 2: the merge states");
                float* mst = wst;  // [GROUP * WPH][WS]: acc[HEAD_DIM], M, den (the warp states are consumed)
                const int spw = (nsplit + WPH - 1) / WPH;
                for (int job = warp; job < GROUP * WPH; job += NW) {
                    const int g = job / WPH, s0 = job % WPH * spw, s1 = min(nsplit, s0 + spw);
                    const float* pg = ws_part + (part0 + (size_t)g * ATT_NSPLIT) * WS;
                    float M = -INFINITY, den = 0.f, acc[DPL];
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
                    for (int r0 = s0; r0 < s1; r0 += 32) {  // runs of at most 32 splits, a lane's (m, l) each
                        const int cnt = min(32, s1 - r0);
                        float a[B][DPL];
                        auto load = [&](int j0) {
#pragma unroll
                            for (int j = 0; j < B; ++j)
#pragma unroll
                                for (int i = 0; i < DPL; ++i)
                                    a[j][i] = j0 + j < cnt && lane + 32 * i < HEAD_DIM
                                                  ? __ldcg(pg + (size_t)(r0 + j0 + j) * WS + lane + 32 * i) : 0.f;
                        };
                        load(0);
                        const float ms = lane < cnt ? __ldcg(pg + (size_t)(r0 + lane) * WS + HEAD_DIM) : -INFINITY;
                        const float ls = lane < cnt ? __ldcg(pg + (size_t)(r0 + lane) * WS + HEAD_DIM + 1) : 0.f;
                        const float Mn = fmaxf(M, warp_max(ms)), f = exp2f(M - Mn), e = exp2f(ms - Mn);
                        den = fmaf(den, f, warp_sum(e * ls));
                        M = Mn;
#pragma unroll
                        for (int i = 0; i < DPL; ++i) acc[i] *= f;
                        for (int j0 = 0; j0 < cnt; j0 += B) {
                            if (j0 > 0) load(j0);
#pragma unroll
                            for (int j = 0; j < B; ++j) {
                                if (j0 + j >= cnt) break;
                                const float ej = __shfl_sync(0xffffffffu, e, j0 + j);
#pragma unroll
                                for (int i = 0; i < DPL; ++i) acc[i] = fmaf(ej, a[j][i], acc[i]);
                            }
                        }
                    }
                    float* st = mst + job * WS;
#pragma unroll
                    for (int i = 0; i < DPL; ++i)
                        if (lane + 32 * i < HEAD_DIM) st[lane + 32 * i] = acc[i];
                    if (lane == 0) { st[HEAD_DIM] = M; st[HEAD_DIM + 1] = den; }
                }
                __syncthreads();
                for (int t = tid; t < GROUP * HEAD_DIM; t += THREADS) {
                    const int g = t / HEAD_DIM, d = t % HEAD_DIM;
                    const float* sg = mst + g * WPH * WS;
                    float M = -INFINITY;
#pragma unroll
                    for (int w = 0; w < WPH; ++w) M = fmaxf(M, sg[w * WS + HEAD_DIM]);
                    float o = 0.f, den = 0.f;
#pragma unroll
                    for (int w = 0; w < WPH; ++w) {
                        const float e = sg[w * WS + HEAD_DIM] == -INFINITY ? 0.f : exp2f(sg[w * WS + HEAD_DIM] - M);
                        o = fmaf(e, sg[w * WS + d], o);
                        den = fmaf(e, sg[w * WS + HEAD_DIM + 1], den);
                    }
                    att_out(ws_attn, b, (kvh * GROUP + g) * HEAD_DIM + d, o / den, ll_e);
                }
            } else if (*flag) {  // last split: one online pass over the splits per output (max, sum and acc loaded
                                 // together, in split order: the same result whichever split is last)
                for (int t = tid; t < GROUP * HEAD_DIM; t += THREADS) {
                    const int g = t / HEAD_DIM, d = t % HEAD_DIM;
                    const float* pg = ws_part + (part0 + (size_t)g * ATT_NSPLIT) * WS;
                    float M = -INFINITY, o = 0.f, den = 0.f;
#pragma unroll 8
                    for (int s = 0; s < nsplit; ++s) {
                        const float ms = __ldcg(pg + s * WS + HEAD_DIM), ls = __ldcg(pg + s * WS + HEAD_DIM + 1);
                        const float as = __ldcg(pg + s * WS + d);
                        const float Mn = fmaxf(M, ms), f = exp2f(M - Mn), e = exp2f(ms - Mn);
                        o = fmaf(o, f, e * as);
                        den = fmaf(den, f, e * ls);
                        M = Mn;
                    }
                    att_out(ws_attn, b, (kvh * GROUP + g) * HEAD_DIM + d, o / den, ll_e);
                }
            }
        } else if (nsplit > 1) {
            __threadfence();
            __syncthreads();
            if (tid == 0) {
                const unsigned done = atomicAdd(ws_count + b * KV_HEADS + kvh, 1u);
                *flag = done == (unsigned)(nsplit - 1);
                if (*flag) ws_count[b * KV_HEADS + kvh] = 0u;  // every split has counted: ready for the next launch
            }
            __syncthreads();
            if (*flag) {  // last split: combine all, normalised weights first (one warp per head), then outputs
                __threadfence();
                float* ew = wst;  // [GROUP][ATT_NSPLIT]: the warp states are consumed
                for (int g = warp; g < GROUP; g += NW) {
                    const float* pg = ws_part + (part0 + (size_t)g * ATT_NSPLIT) * WS;
                    float M = -INFINITY;
                    for (int s = lane; s < nsplit; s += 32) M = fmaxf(M, __ldcg(pg + s * WS + HEAD_DIM));
                    M = warp_max(M);
                    float den = 0.f;
                    for (int s = lane; s < nsplit; s += 32) {
                        const float e = exp2f(__ldcg(pg + s * WS + HEAD_DIM) - M);
                        ew[g * ATT_NSPLIT + s] = e;
                        den = fmaf(e, __ldcg(pg + s * WS + HEAD_DIM + 1), den);
                    }
                    den = warp_sum(den);
                    __syncwarp();
                    for (int s = lane; s < nsplit; s += 32) ew[g * ATT_NSPLIT + s] /= den;
                }
                __syncthreads();
                for (int t = tid; t < GROUP * HEAD_DIM; t += THREADS) {
                    const int g = t / HEAD_DIM, d = t % HEAD_DIM;
                    const float* pg = ws_part + (part0 + (size_t)g * ATT_NSPLIT) * WS + d;
                    float o = 0.f;
#pragma unroll 8
                    for (int s = 0; s < nsplit; ++s) o = fmaf(ew[g * ATT_NSPLIT + s], __ldcg(pg + s * WS), o);
                    att_out(ws_attn, b, (kvh * GROUP + g) * HEAD_DIM + d, o, ll_e);
                }
            }
        }
        // shared memory is reused by the next task (ATT_TMA: the warp states' and combine's generic stores ordered
        // before its tensor copies into the ring)
        if constexpr (ATT_TMA) fence_proxy_async_smem();
        __syncthreads();
        tl(7);
    }
    if constexpr (ATT_TMA)
        if (walker && lane == 0)
#pragma unroll
            for (int s = 0; s < ATT_STAGES; ++s) mbar_inval(bars + s);  // the next step reuses the memory
}
