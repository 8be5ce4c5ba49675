// ---- GEMV engine shared by the four projection stages (not a stage itself) ----
#pragma once
#include "common.cuh"
// out[n][b] = sum_k W[n][k] * X[b][k] on the tensor cores: mma.sync m16n8k16 with 16 weight rows as M, 16 of K,
// and the batch as N (8 sequences per n-tile, zero-padded). A task is TM consecutive 16-row tiles of W (the decode
// plan's <P>_TM, usually 1) over the whole of K, done by a group of GEMV_NWG warps that split K; each B fragment of
// X is loaded once for the TM tiles (X from L2 at large batch: TM 2 halves its reads). The weights are packed on
// the host in fragment order, so one coalesced 16-byte load gives a lane its whole A fragment of a 16x16 tile. The
// warps' accumulators meet in shared memory and the stage's epilogue reads tile(r, b), once per tile.

constexpr int NTILE = (BATCH + 7) / 8;  // n-tiles of 8 sequences
// Element (b, k) of an activation that a later GEMV reads from global memory as X (attention's output, the MLP's
// act, and NORM_GLOBAL's normalised rows): row-major [BATCH][ld], or with XF (the decode plan's X_FRAG; always
// for NORM_GLOBAL's rows) in mma m16n8k16 B-fragment order,
// [K/16][NTILE][32 lanes][4]: the two registers a lane needs for a k-tile and 8 rows are one 8-byte load, a warp's 256 contiguous bytes (row-major,
// they were two 4-byte loads touching 8 rows each: at batch >= 16 the L1's request rate, not bytes, bounded
// o_proj and down_proj). Rows past BATCH (up to NTILE x 8) are never written; their products are discarded.
// generator.interface.from_frag is the host's inverse.
template <bool XF>
__device__ __forceinline__ size_t x_at(int b, int k, int ld) {
    if constexpr (XF)
        return ((((size_t)(k >> 4) * NTILE + (b >> 3)) * 32 + (b & 7) * 4 + ((k & 7) >> 1)) << 2) +
               ((k >> 3) & 1) * 2 + (k & 1);
    else
        return (size_t)b * ld + k;
}

// The GEMMs' token inputs (X of gemm.cuh's engine: prefill's normed rows, attention output, act; decode's GEMM_PROJ
// inputs) in global memory. sm_90a (GEMM_WGMMA): tiled as the ring holds them, [ceil(K/64)][GEMM_XROWS][64] with a row's 16-byte chunk c at c ^ (t %
// 8) (the 128-byte swizzle), so a token tile's 64-wide chunk is one contiguous run: one bulk copy (the TMA unit)
// instead of every thread's 16-byte cp.async (8B, 512 tokens: 662 -> 597 µs, bench/NOTES.md session 20). Rows past
// the chunk (up to GEMM_XROWS, a whole token tile) and columns past K are never written: zeros from the workspace's
// allocation (decode GEMM_PROJ with QKV_GEMM 0: xn's padding rows hold the first norm's fragment-ordered ones, whose
// columns give only their own, unused, results; the planner keeps qkv_proj on the engine where HIDDEN % 64 would put
// them in padding columns). Elsewhere row-major [rows][K]. The writers keep 8-element runs (a 16-byte chunk)
// contiguous either way.
__device__ __forceinline__ size_t gemm_x(int t, int k, int K) {
    if constexpr (GEMM_WGMMA)
        return ((size_t)(k >> 6) * GEMM_XROWS + t) * 64 + ((((k >> 3) & 7) ^ (t & 7)) << 3) + (k & 7);
    else
        return (size_t)t * K + k;
}

// Element (b, k) of a decode activation that the next projection reads from global memory: gemm_x's layout where
// that projection runs on the GEMM engine (ENGINE: the decode plan's GEMM_PROJ for gate_up, QKV_GEMM for qkv_proj),
// else fragment order
template <bool ENGINE>
__device__ __forceinline__ size_t xg_at(int b, int k, int K) {
    if constexpr (ENGINE)
        return gemm_x(b, k, K);
    else
        return x_at<true>(b, k, K);
}

// ATT_LL (decode): attention's output handed to o_proj with no grid barrier between them, as NCCL's LL protocol
// hands data over: each element is a 32-bit word, its T bits in the low half and the launch's epoch in the high
// half, written by one relaxed store; o_proj's lanes poll the words themselves (a 32-bit access is single-copy
// atomic, a vector load's elements each: a word with this launch's epoch holds this launch's value), so the writer
// makes no fence and sets no flag. The words sit at x_at<true>'s indices (twice its bytes). The epoch is the launch
// count mod 2^16 (ws_epoch, advanced by block 0 once every block has read it: gate_up.cuh next_launch); every word
// is rewritten each launch, so a stale one carries the last launch's epoch (or 0 before the first).
__device__ __forceinline__ unsigned ll_launch(const unsigned* ws_epoch) {  // this launch's count (from 1)
    unsigned e;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(e) : "l"(ws_epoch) : "memory");
    return e + 1u;
}
__device__ __forceinline__ unsigned ll_epoch(const unsigned* ws_epoch) {  // this launch's epoch, in the high half
    return (ll_launch(ws_epoch) & 0xffffu) << 16;
}
// H_LL: the second norm's input (o_proj's h rounded to T) as such words, row-major; the norm's source type
struct LLWord {
    unsigned w;
};
__device__ __forceinline__ void ll_store(T* buf, size_t i, T v, unsigned epoch) {
    const unsigned w = (unsigned)*reinterpret_cast<const unsigned short*>(&v) | epoch;
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(reinterpret_cast<unsigned*>(buf) + i), "r"(w));
}
// the lane's four words of a k-tile and n-tile (the B fragment's two pairs), from L2 (relaxed, gpu scope)
__device__ __forceinline__ uint4 ll_load4(const T* buf, size_t lane_at) {
    uint4 u;
    asm volatile("ld.relaxed.gpu.global.v4.u32 { %0, %1, %2, %3 }, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(reinterpret_cast<const uint4*>(buf) + lane_at));
    return u;
}
__device__ __forceinline__ bool ll_ready(const uint4& u, unsigned epoch) {
    return ((u.x ^ epoch) | (u.y ^ epoch) | (u.z ^ epoch) | (u.w ^ epoch)) < 0x10000u;
}
// Polls word sets until every one carries the epoch: `late` names those that lacked it when first loaded, and
// reload(m) loads again each set named in m, all together (SLEEP ns after the last poll), then returns the bits of
// those still without it. One L2 round trip a poll however many are late (a set polled at a time costs one each:
// ~2 us of o_proj's wait at Llama-3.2-1B b1, where a lane's 8 k-tiles come from 8 heads; bench/NOTES.md session
// 43). After 2^24 polls a trap, not a hang.
template <int SLEEP = 0, class Reload>
__device__ __forceinline__ void ll_poll(unsigned late, Reload reload) {
    for (unsigned polls = 0u; late; late = reload(late)) {
        if constexpr (SLEEP > 0) __nanosleep(SLEEP);
        if (++polls == 1u << 24) __trap();
    }
}
// the T pairs of two words' low halves
__device__ __forceinline__ unsigned ll_pair(unsigned lo, unsigned hi) { return __byte_perm(lo, hi, 0x5410); }
// QKV_FLOW 2: qkv's fp32 results handed to attention the same way, as 64-bit words (the value's bits in the low
// half, ll_epoch's epoch in the high), one relaxed 8-byte store or load each (single-copy atomic)
__device__ __forceinline__ void ll_store8(float* buf, size_t i, float v, unsigned epoch) {
    const unsigned long long w = (unsigned long long)epoch << 32 | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;"
                 :: "l"(reinterpret_cast<unsigned long long*>(buf) + i), "l"(w));
}
__device__ __forceinline__ unsigned long long ll_load8(const float* buf, size_t i) {
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];"
                 : "=l"(w) : "l"(reinterpret_cast<const unsigned long long*>(buf) + i));
    return w;
}

template <int NWG, int TM = 1, int BS = 1>
struct Tile {  // one of the task's TM 16 x BATCH results (buf at its first), summed over the group's warps (BS:
    // over the NWG / BS warps of b's batch slice, warps slice x NWG / BS ...: the others did not write b's column)
    const float* buf;
    __device__ __forceinline__ float operator()(int r, int b) const {
        constexpr int NWGK = NWG / BS, NT = (NTILE + BS - 1) / BS;
        const int w0 = BS == 1 ? 0 : b / 8 / NT * NWGK;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < NWGK; ++w) s += buf[((w0 + w) * TM * 16 + r) * BATCH + b];
        return s;
    }
};

__device__ __forceinline__ unsigned mul2(unsigned a, unsigned b) {  // two T products, T-rounded
    const T2 r = __hmul2(*reinterpret_cast<const T2*>(&a), *reinterpret_cast<const T2*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
}

// The sum of a tile's KSPLIT partials in global memory, in split order (the same sum whichever split is last).
struct SplitTile {
    const float* part;  // [KSPLIT][N][BATCH]
    int n_rows, row0, ksplit;
    __device__ __forceinline__ float operator()(int r, int b) const {
        float s = 0.f;
        for (int k = 0; k < ksplit; ++k) s += __ldcg(part + ((size_t)k * n_rows + row0 + r) * BATCH + b);
        return s;
    }
};

struct NoDone {  // gemv's `done` where no later step waits on single tiles (a grid barrier follows the projection)
    static constexpr bool active = false, defer = false;
    __device__ void operator()(int) const {}
};
struct RawSplits {  // gemv's `done` for split-K without the reduction: each split's 16 x BATCH partial sums go to the
    // epilogue as rows ks x N + row (no part buffer, no counter), and the consumer sums the splits (decode's QKV_FLOW 2
    // with QKV_KSPLIT: attention, as it polls qkv's words)
    static constexpr bool active = false, defer = false;
    __device__ void operator()(int) const {}
};
struct NoWait {  // gemv's `wait` where X is complete when the stage starts (a grid barrier precedes it)
    static constexpr bool active = false;
    __device__ void operator()(int) const {}
};
struct NoSkip {  // gemv's `skip` where every block takes tasks
    static constexpr bool active = false;
    int n = 0;
};
struct BlockSkip {  // gemv's `skip`: blocks [0, n) take no task (GU_SKIP)
    static constexpr bool active = true;
    int n;
};
struct NoStaged {  // gemv's `staged` where every weight comes from global memory (else: down_proj.cuh DownStaged)
    static constexpr bool active = false;
    __device__ bool covers(int) const { return false; }
    __device__ void wait() const {}
    __device__ uint4 load(int, int) const { return make_uint4(0u, 0u, 0u, 0u); }
    static constexpr int kt = 0;
};

// a GEMV's tasks: its 16-row tiles, TM a task, each in KSPLIT splits (task t runs on block t mod grid: gemv)
template <int N, int KSPLIT, int TM>
constexpr int gemv_tasks = N / 16 / TM * KSPLIT;
// a task's first tile and its split: a tile's KSPLIT splits are consecutive tasks (run in the same round, so with
// QKV_FLOW 2's unreduced splits a whole head is in as early as unsplit), the tiles from TILE0 on (then wrapping)
template <int N, int KSPLIT, int TILE0, int TM>
__device__ __forceinline__ int2 gemv_task(int task) {
    constexpr int TILES = N / 16, TT = TILES / TM;
    if constexpr (KSPLIT == 1)  // (the split as task / TT, 0 for every task: with a constant 0 instead, ptxas
        return make_int2(((task % TT) * TM + TILE0) % TILES, task / TT);  // spilled 4 B at Qwen3-1.7B b4)
    else
        return make_int2(((task / KSPLIT % TT) * TM + TILE0) % TILES, task % KSPLIT);
}
// one step of a task: a warp's U weight loads from k-tile k0 of each of the task's TM tiles, a[m * U + u] (all in
// flight before any use; L1: kept in L1, for the group's other batch slices)
template <int N, int K, int NWG, int U, int KSPLIT, int TILE0, int TM = 1, bool L1 = false>
__device__ __forceinline__ void gemv_load_step(const T* __restrict__ W, int task, int k0, int lane,
                                               uint4 (&a)[U * TM]) {
    constexpr int KT = K / 16 / KSPLIT;
    const int2 tk = gemv_task<N, KSPLIT, TILE0, TM>(task);
    const int tile = tk.x, ks = tk.y;
#pragma unroll
    for (int m = 0; m < TM; ++m) {
        const uint4* wt = reinterpret_cast<const uint4*>(W) + ((size_t)(tile + m) * KSPLIT + ks) * KT * 32 + lane;
#pragma unroll
        for (int u = 0; u < U; ++u)
            a[m * U + u] = (k0 + u * NWG < KT)
                               ? ld_weight<L1>(reinterpret_cast<const T*>(wt + (size_t)(k0 + u * NWG) * 32))
                               : make_uint4(0u, 0u, 0u, 0u);
    }
}

// A projection's first weight step, loaded before the barrier (or the launch's wait) that precedes its stage (the
// decode plan's <P>_PRE): weights do not depend on the stage's input, so the group's first U loads fly while the
// block waits; gemv<..., PRE = 1> takes them as its first step. ON = 0: nothing is loaded (and nothing held); 2: as 1,
// and the rest of the group's first task prefetched into L2 (for QKV_PRE under COOP 0, where a block may start
// several µs before the previous launch is done).
template <int U>
struct GemvPre {
    uint4 a[U];
};
template <int ON, int N, int K, int NWG, int U, int KSPLIT, int TILE0 = 0, int TM = 1, bool SKIPS = false>
__device__ __forceinline__ GemvPre<U * TM> gemv_pre(const T* __restrict__ W, int skip = 0) {
    if constexpr (!ON) {
        return GemvPre<U * TM>{};  // nothing loaded (PRE 0 never reads it)
    } else {
        GemvPre<U * TM> p;
        const int group = threadIdx.x / (32 * NWG), warp = threadIdx.x % (32 * NWG) / 32;
        // the group's task in gemv's first round (its round loop; skip: as gemv's)
        int task = group * gridDim.x + blockIdx.x;
        if constexpr (SKIPS)
            task = blockIdx.x < (unsigned)skip ? 0x7fffffff
                                               : group * (gridDim.x - (unsigned)skip) + (blockIdx.x - (unsigned)skip);
        if (task < gemv_tasks<N, KSPLIT, TM>) {
            gemv_load_step<N, K, NWG, U, KSPLIT, TILE0, TM>(W, task, warp, threadIdx.x & 31, p.a);
            if constexpr (ON == 2) {
                // the rest of the task's k-tiles this warp streams, into L2: a 128-byte line a prefetch, one lane
                // in eight (a k-tile's 32 lanes x 16 B are 512 contiguous bytes; packed layout above)
                constexpr int KT = K / 16 / KSPLIT;
                const int2 tk = gemv_task<N, KSPLIT, TILE0, TM>(task);
                const int tile = tk.x, ks = tk.y, lane = threadIdx.x & 31;
                if ((lane & 7) == 0)
#pragma unroll
                    for (int m = 0; m < TM; ++m) {
                        const uint4* wt =
                            reinterpret_cast<const uint4*>(W) + ((size_t)(tile + m) * KSPLIT + ks) * KT * 32 + lane;
                        for (int kt = warp + NWG * U; kt < KT; kt += NWG)
                            asm volatile("prefetch.global.L2 [%0];" :: "l"(wt + (size_t)kt * 32));
                    }
            }
        }
        return p;
    }
}

// W: packed [N/16][K/16][32 lanes][8 elements]; X: BATCH rows of LDX elements (shared or global memory), or with
// XF in fragment order (x_at); XF 2: ATT_LL's words, polled until they carry the epoch ll_e (ll_load4); 3: the same,
// ~256 ns between polls (a poll is an L2 round trip, ~0.6 us: a short sleep would hardly thin them).
// epi(row0, tile, gt) runs on every thread of the group once the task's sums are ready.
// Split-K (KSPLIT > 1: a projection with fewer 16-row tiles than SMs): a tile's K range is split over KSPLIT tasks
// on different blocks; each writes its partial sums to part [KSPLIT][N][BATCH] and counts itself in count[tile]; the
// last to count (and reset the counter for the next launch: no barrier) runs the epilogue over all the partials.
// done(tile) (Done::active): called by the first thread of the group that wrote the tile, once its epilogue stores
// are all made (a block barrier, then its release fence; one thread for all of them spilled at the register cap);
// KSPLIT 1 only. TILE0: the first tile in task order
// (tiles are taken in the order TILE0, TILE0 + 1, ..., wrapping), so the tiles a waiting step needs first come first.
// gs (NORM_FOLD: X is the norm's raw rows): X's column k is multiplied by gs[k] as its B fragments are loaded (gs in
// shared memory, or NORM_FOLD 2 the norm's weight in global memory).
// pre (PRE, the decode plan's <P>_PRE): this group's first step of its first-round task, loaded by gemv_pre before
// the barrier that precedes the stage; used in place of that step's loads (PF 1/2 then prefetch as without it).
// wait(chunk) (Wait::active, KSPLIT 1): called by every lane of a warp before its step's mma read X's k-tiles
// [chunk x NWG x U, (chunk + 1) x NWG x U), after that step's weight loads are issued; it returns once they are written.
// DB (the decode plan's RED_DB): the partial sums red double-buffered by round; 0: one buffer, the group meeting
// before a round writes it (its last epilogue's reads are done), so the block needs less shared memory.
// staged (Staged::active; KSPLIT 1, TM 1): a task it covers has its k-tiles below staged.kt in shared memory
// (staged.wait(): until their copy is in; staged.load(kt, lane): the lane's 16 bytes), the rest from W as any task's.
// skip (BlockSkip): blocks [0, skip.n) take no task (they return at once: no block barrier of gemv's); the tasks go
// round the others (the decode plan's GU_SKIP: gate_up leaves down_proj's blocks free).
template <int N, int K, int LDX, int NWG, int U, int KSPLIT, int XF = 0, int PF = 0, int TILE0 = 0, int PRE = 0,
          int DB = 1, int TM = 1, int BS = 1, class Epi, class Done = NoDone, class Wait = NoWait,
          class Staged = NoStaged, class Skip = NoSkip>
__device__ __forceinline__ void gemv(const T* __restrict__ W, const T* X, float* red, float* part, unsigned* count,
                                     Epi epi, Done done = {}, const T* gs = nullptr,
                                     const GemvPre<U * TM>* pre = nullptr, Wait wait = {},
                                     unsigned ll_e = 0u, Staged staged = {}, Skip skip = {}) {
    static_assert(N % (16 * TM) == 0 && K % (16 * KSPLIT) == 0 && THREADS % (32 * NWG) == 0 && TILE0 % TM == 0,
                  "bad GEMV plan");
    static_assert(TM == 1 || KSPLIT == 1, "tiles a task: unsplit projections");
    static_assert(XF < 2 || U * NTILE <= 32, "XF >= 2: a bit a word set of a step");
    // BS (the decode plan's <P>_BS): the group's warps in BS batch slices of NT n-tiles, NWG / BS warps splitting K
    // in each, so a warp holds the accumulators and B fragments of NT n-tiles, not NTILE (at batch 64 those of all 8
    // left no registers for a step's loads in flight); each slice loads the task's weights (the same lines, from L1)
    static_assert(NWG % BS == 0 && (BS == 1 || (XF < 2 && !PRE && !Wait::active && !Staged::active)),
                  "batch slices: whole warps each, the weights loaded in the stage, X complete at its start");
    constexpr int NWGK = NWG / BS, NT = (NTILE + BS - 1) / BS;
    constexpr int KT = K / 16 / KSPLIT, NG = THREADS / (32 * NWG), TILES = N / 16, TASKS = gemv_tasks<N, KSPLIT, TM>;
    const int group = threadIdx.x / (32 * NWG), gt = threadIdx.x % (32 * NWG);
    const int warp = gt / 32, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int kw = warp % NWGK, t0 = warp / NWGK * NT;  // the warp's first k-tile and first n-tile
    constexpr int RED = NWG * TM * 16 * BATCH;  // a buffer of the group's partial sums: [warp][TM][16][BATCH]
    float* my_red = red + group * (1 + DB) * RED;
    static_assert(KSPLIT == 1 || (!Done::active && !Wait::active), "per-tile completion is for unsplit projections");
    static_assert(!Staged::active || (KSPLIT == 1 && TM == 1 && !PRE), "staged weights: one unsplit tile a task");
    auto load_step = [&](int task, int k0, uint4 (&a)[U * TM]) {
        if constexpr (Staged::active) {
            if (staged.covers(task)) {
                staged.wait();
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int kt = k0 + u * NWGK;
                    a[u] = kt >= KT ? make_uint4(0u, 0u, 0u, 0u)
                           : kt < staged.kt ? staged.load(kt, lane)
                           : ld_weight(W + ((size_t)gemv_task<N, 1, TILE0, 1>(task).x * KT + kt) * 256 + lane * 8);
                }
                return;
            }
        }
        gemv_load_step<N, K, NWGK, U, KSPLIT, TILE0, TM, (BS > 1)>(W, task, k0, lane, a);
    };
    // PF (the decode plan's GEMV_PF) 1: the next round's first step is loaded as soon as this task's last is used,
    // before the block barrier and the epilogue, so a projection of several rounds keeps weight loads in flight
    // through each round's reduction (pf: those loads; U x TM x 4 registers more). PF 2: a software pipeline of two
    // register sets (pf and nx, U x TM loads each): every step's loads are issued one step ahead, so the next step's
    // weights fly while this step's mma run, and across rounds as with PF 1.
    uint4 pf[U * TM];
    // Done::defer without PF: a round's release (its fence and done) is made by its first thread after the next
    // round's first weight loads are issued, so the fence's wait does not hold those loads back (the group's
    // epilogue stores were ordered before it by the block barrier after the epilogue)
    constexpr bool DEFER = Done::defer && PF == 0;
    int pending = -1;  // DEFER: the first tile whose release is due (first thread of the group only)
    auto release = [&](int t) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
#pragma unroll
        for (int m = 0; m < TM; ++m) done(t + m);
    };
    // one task (split ks of a tile, or TM tiles): this warp's share of its K range for 16 x TM rows on the tensor
    // cores, its partial sums to buf; next: the task this group takes in the next round (< 0: none); use_pf: its
    // first step is in pf
    auto compute = [&](int task, float* buf, int next, bool use_pf) {
        const int ks = gemv_task<N, KSPLIT, TILE0, TM>(task).y;
        const T* xk = X + ks * KT * 16;  // this split's columns of X
        float c[TM][NT][4];  // (n-tiles t0 .. t0 + NT - 1)
#pragma unroll
        for (int m = 0; m < TM; ++m)
#pragma unroll
            for (int t = 0; t < NT; ++t) c[m][t][0] = c[m][t][1] = c[m][t][2] = c[m][t][3] = 0.f;
        // the mma of one step's k-tiles k0, k0 + NWGK, ... with its weights a (each B fragment for the TM tiles)
        auto mma_step = [&](const uint4 (&a)[U * TM], int k0) {
            if constexpr (Wait::active)
                if (k0 < KT) wait(k0 / (NWG * U));
            // XF >= 2: the step's words all loaded, each packed into its B fragment and its epoch tested; those not yet
            // written are polled again, together (ll_poll). The step's weights are already in flight.
            uint2 xb[XF >= 2 ? U : 1][NTILE];
            if constexpr (XF >= 2) {
                auto at = [&](int u, int t) { return ((size_t)(ks * KT + k0 + u * NWG) * NTILE + t) * 32 + lane; };
                // bit u * NTILE + t: a word set of the step, its raw words held until every set is in (packing as
                // they arrive would hold the packed and the in-flight registers together: spills at head_dim 128);
                // rows past BATCH and k-tiles past KT are never written (their words: zeros with the epoch)
                uint4 w[U][NTILE];
                unsigned sets = 0u;
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int t = 0; t < NTILE; ++t) {
                        w[u][t] = make_uint4(ll_e, ll_e, ll_e, ll_e);
                        if (k0 + u * NWG < KT && t * 8 + gid < BATCH) sets |= 1u << (u * NTILE + t);
                    }
                auto reload = [&](unsigned m) {  // the named sets loaded, then tested
#pragma unroll
                    for (int u = 0; u < U; ++u)
#pragma unroll
                        for (int t = 0; t < NTILE; ++t)
                            if (m >> (u * NTILE + t) & 1u) w[u][t] = ll_load4(X, at(u, t));
                    unsigned late = 0u;
#pragma unroll
                    for (int u = 0; u < U; ++u)
#pragma unroll
                        for (int t = 0; t < NTILE; ++t) {
                            const int i = u * NTILE + t;
                            late |= (unsigned)(m >> i & 1u && !ll_ready(w[u][t], ll_e)) << i;
                        }
                    return late;
                };
                ll_poll<XF == 3 ? 256 : 0>(reload(sets), reload);
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int t = 0; t < NTILE; ++t)
                        xb[u][t] = make_uint2(ll_pair(w[u][t].x, w[u][t].y), ll_pair(w[u][t].z, w[u][t].w));
                __syncwarp();  // (the lanes leave their polls apart; mma.sync wants them together)
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int kt = k0 + u * NWGK;
                if (kt < KT) {
                    unsigned g0 = 0u, g1 = 0u;  // the gain's two pairs this lane's B fragments take (gs only)
                    if (!XF && gs) {
                        const T* gp = gs + (ks * KT + kt) * 16 + 2 * tig;
                        g0 = *reinterpret_cast<const unsigned*>(gp);
                        g1 = *reinterpret_cast<const unsigned*>(gp + 8);
                    }
#pragma unroll
                    for (int tt = 0; tt < NT; ++tt) {
                        const int t = t0 + tt, b = t * 8 + gid;
                        if (NT * BS != NTILE && t >= NTILE) continue;  // (the last slice's missing n-tiles)
                        unsigned b0 = 0u, b1 = 0u;
                        if constexpr (XF >= 2) {
                            b0 = xb[u][t].x;
                            b1 = xb[u][t].y;
                        } else if constexpr (XF) {
                            const uint2 v = *reinterpret_cast<const uint2*>(
                                X + (((size_t)(ks * KT + kt) * NTILE + t) * 32 + lane) * 4);
                            b0 = v.x;
                            b1 = v.y;
                        } else if (b < BATCH) {
                            const T* xp = xk + (size_t)b * LDX + kt * 16 + 2 * tig;
                            b0 = *reinterpret_cast<const unsigned*>(xp);
                            b1 = *reinterpret_cast<const unsigned*>(xp + 8);
                            if (gs) {
                                b0 = mul2(b0, g0);
                                b1 = mul2(b1, g1);
                            }
                        }
#pragma unroll
                        for (int m = 0; m < TM; ++m) mma_bf16(c[m][tt], a[m * U + u], b0, b1);
                    }
                }
            }
        };
        constexpr int S = NWGK * U;  // k-tiles a step of the group's slice
        if constexpr (PF == 2) {
            uint4 nx[U * TM];  // pf holds this task's first step; the sets alternate, with no register copies
            for (int k0 = kw; k0 < KT; k0 += 2 * S) {
                if (k0 + S < KT) load_step(task, k0 + S, nx);
                mma_step(pf, k0);
                if (k0 + 2 * S < KT) load_step(task, k0 + 2 * S, pf);
                else if (next >= 0) load_step(next, kw, pf);  // the next round's first step
                if (k0 + S < KT) mma_step(nx, k0 + S);
            }
        } else {
            for (int k0 = kw; k0 < KT; k0 += S) {
                uint4 a[U * TM];
                if ((PF || PRE) && use_pf && k0 == kw) {
#pragma unroll
                    for (int u = 0; u < U * TM; ++u) a[u] = pf[u];
                } else {
                    load_step(task, k0, a);
                }
                if constexpr (DEFER)
                    if (k0 == kw && pending >= 0) {
                        release(pending);
                        pending = -1;
                    }
                mma_step(a, k0);
            }
            if (PF && next >= 0) load_step(next, kw, pf);
        }
        if constexpr (!DB) {  // one buffer: the group's last epilogue has read it (a one-warp group: its lanes)
            if constexpr (NWG == 1) __syncwarp();
            else group_sync(group, NWG * 32);  // NWG >= 2: at most 8 groups, named barriers 1..8
        }
#pragma unroll
        for (int m = 0; m < TM; ++m)
#pragma unroll
            for (int tt = 0; tt < NT; ++tt)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int r = gid + (j >> 1) * 8, b = (t0 + tt) * 8 + 2 * tig + (j & 1);
                    if (b < BATCH) buf[((warp * TM + m) * 16 + r) * BATCH + b] = c[m][tt][j];
                }
    };
    // tasks go round the blocks first, so a projection with few tiles still spreads over all SMs (the splits of a
    // tile run on different blocks); all groups of a block take the same rounds, one block barrier each. The
    // partial sums are double-buffered (DB): the next round's writes cannot race this round's epilogue.
    if constexpr (Skip::active)
        if (blockIdx.x < (unsigned)skip.n) return;
    // the group's first-round task: over the blocks that take tasks (where none is skipped, written as before the
    // skip existed: a variable for gridDim.x held it in a register, one more through the loop, and moved spills)
    auto first_task = [&]() -> unsigned {
        if constexpr (Skip::active) return group * (gridDim.x - (unsigned)skip.n) + (blockIdx.x - (unsigned)skip.n);
        else return group * gridDim.x + blockIdx.x;
    };
    const int stride = (Skip::active ? gridDim.x - (unsigned)skip.n : gridDim.x) * NG;
    const int rounds = (TASKS + stride - 1) / stride;
    if constexpr (PRE) {
#pragma unroll
        for (int u = 0; u < U * TM; ++u) pf[u] = pre->a[u];
    } else if (PF && first_task() < TASKS) {
        load_step(first_task(), kw, pf);
    }
    for (int rd = 0; rd < rounds; ++rd) {
        const int task = rd * stride + first_task();
        const int2 tk = gemv_task<N, KSPLIT, TILE0, TM>(task);
        const int tile = tk.x, ks = tk.y;  // its first tile, its split
        const bool active = task < TASKS;
        float* buf = my_red + (DB ? rd & 1 : 0) * RED;
        if (active) compute(task, buf, task + stride < TASKS ? task + stride : -1, PF || rd == 0);
        __syncthreads();
        if constexpr (KSPLIT == 1) {
            if (active)
#pragma unroll
                for (int m = 0; m < TM; ++m) epi((tile + m) * 16, Tile<NWG, TM, BS>{buf + m * 16 * BATCH}, gt);
            if constexpr (Done::active) {
                __syncthreads();  // the group's epilogue stores are all made: its first thread releases them
                if (active && gt == 0) {
                    if constexpr (DEFER) pending = tile;
                    else release(tile);
                }
            }
        } else if constexpr (std::is_same_v<Done, RawSplits>) {
            if (active) epi(ks * N + tile * 16, Tile<NWG, 1, BS>{buf}, gt);  // (the consumer sums the splits)
        } else {
            __shared__ int last[NG];  // per group: its task was the tile's last split
            if (active)
                for (int i = gt; i < 16 * BATCH; i += NWG * 32)
                    part[((size_t)ks * N + tile * 16 + i / BATCH) * BATCH + i % BATCH] =
                        Tile<NWG, 1, BS>{buf}(i / BATCH, i % BATCH);
            __threadfence();
            __syncthreads();
            if (active && gt == 0) {
                last[group] = atomicAdd(count + tile, 1u) == KSPLIT - 1;
                if (last[group]) count[tile] = 0u;  // every split has counted: ready for the next launch
            }
            __syncthreads();
            if (active && last[group]) {
                __threadfence();
                epi(tile * 16, SplitTile{part, N, tile * 16, KSPLIT}, gt);
            }
        }
    }
    if constexpr (DEFER)
        if (pending >= 0) release(pending);  // the last round's: no loads follow
}
