// The served model's sampled draw in one launch after the head (generator.sampler): what generator.serve's
// sample_tokens computes with ~30 torch launches, the same tokens, then the decode step's advance.
// Per row b (temperature t[b] > 0; a row with t <= 0 keeps next[b], the head's greedy token):
//   s = logit / max(t, 1e-6) (fp32, as torch divides; every ranking below is of s, as sample_tokens ranks it); top-k
//   (top_k[b] > 0) keeps every s >= the k-th largest (ties included, as transformers' TopKLogitsWarper); p = softmax
//   over those (top-k off: over the whole row); top-p keeps the smallest prefix of the descending order whose
//   exclusive cumulative sum stays below top_p (the first always); then the Gumbel-max draw: argmax over kept i of
//   s_i - log(-log(u(seed, step, id_i))), u = serve.uniform_noise's hash, first index on ties.
// Two kernels: sample_topk (top-k and/or top-p: G blocks a row each keep their slice's s >= the slice's k-th
// largest, the row's last block selects the row's k-th among them by radix select, sorts the kept ones and draws;
// top-k off, the C largest are ranked and where they hold less than top_p of the row's probability, the row's last
// block finds the cut over the whole row instead (nucleus_draw: binned sums by probability, then the cut's bin
// sorted; a radix select where that bin is too full): the same cut either way, to the probabilities' fp32 rounding) and sample_gumbel (temperature only: the whole vocabulary, no ranking; G blocks
// a row, the row's maximum by a 64-bit atomicMax). The last block of either does the advance (lm_head.cu's, the same
// fields).
// Config (generator.sampler prepends it): HIDDEN, T.
#include "common.cuh"
#include "argmax.cuh"

constexpr int THREADS = 256, WARPS = THREADS / 32;
constexpr int CH = HIDDEN / 8;  // 16-byte chunks of an embedding row
static_assert(HIDDEN % 8 == 0, "HIDDEN must be a multiple of 8");

// serve._mix32 on values below 2^32 (its int64 arithmetic, where no product overflows 64 bits: the same bits)
__device__ __forceinline__ unsigned long long mix32(unsigned long long x) {
    x ^= x >> 16;
    x = (x * 0x7FEB352Dull) & 0xFFFFFFFFull;
    x ^= x >> 15;
    x = (x * 0x2C1B3C6Dull) & 0xFFFFFFFFull;
    return x ^ (x >> 16);
}
// serve.uniform_noise's per-(seed, step) hash h; seeds are non-negative (serve.SEED_MAX)
__device__ __forceinline__ unsigned long long noise_hash(long long seed, long long step) {
    const unsigned long long s = (unsigned long long)seed;
    return mix32(mix32((s & 0xFFFFFFFFull) ^ mix32(s >> 32)) ^ ((unsigned long long)step & 0xFFFFFFFFull));
}
// -log(-log(u)) for token id, u = min(fp32((x >> 8) + 0.5) / 2^24, 1 - 2^-24) as serve.uniform_noise computes it
// (the same roundings; the top value would round to 1); logf, as torch's log
__device__ __forceinline__ float gumbel(unsigned long long h, long long id) {
    const unsigned long long x = mix32((h + (unsigned long long)id * 0x9E3779B1ull) & 0xFFFFFFFFull);
    const float u = fminf(((float)(x >> 8) + 0.5f) * (1.0f / 16777216.0f), 0.99999994f);
    return -logf(-logf(u));
}
// the whole-row draw's key of token id (s = key_float(key)): s plus its noise, as argmax_key orders them
__device__ __forceinline__ unsigned long long noisy_key(unsigned key, unsigned long long h, unsigned id) {
    return argmax_key(key_float(key) + gumbel(h, id), id);
}
// top-p's cut (tau, idk: nucleus_cut's) keeps token (key, ~id nid): above tau, or tied with it at a low enough id
__device__ __forceinline__ bool cut_keeps(unsigned key, unsigned nid, unsigned tau, unsigned idk) {
    return key > tau || (key == tau && nid >= idk);
}
__device__ unsigned long long block_max_key(unsigned long long k, unsigned long long* red) {
    k = warp_max_key(k);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = k;
    __syncthreads();
    k = red[0];
    for (int w = 1; w < WARPS; ++w) k = red[w] > k ? red[w] : k;
    __syncthreads();
    return k;
}
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    v = 0.f;
    for (int w = 0; w < WARPS; ++w) v += red[w];
    __syncthreads();
    return v;
}

// row b's token t: next[b] = t and, where hist is not null, hist[st][b] = t, pos[b] += 1, x_next[b] = embed[t]
// (every thread of the block copies). arrive: the last of `blocks` blocks to arrive sets *step = st + 1 and resets
// counter (st: *step as this block read it before its arrival).
__device__ void finish_row(int b, long long t, int nb, long long* next, long long* hist, long long st, int* pos,
                           const T* embed, T* x_next) {
    if (threadIdx.x == 0) {
        next[b] = t;
        if (hist != nullptr) {
            hist[st * nb + b] = t;
            pos[b] += 1;
        }
    }
    if (hist != nullptr)
        for (int c = threadIdx.x; c < CH; c += THREADS)
            *reinterpret_cast<uint4*>(x_next + (size_t)b * HIDDEN + c * 8) =
                *reinterpret_cast<const uint4*>(embed + (size_t)t * HIDDEN + c * 8);
}
__device__ void arrive(unsigned* counter, int blocks, long long* step, long long st) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(counter, 1u) == (unsigned)blocks - 1) {
            if (step != nullptr) *step = st + 1;
            *counter = 0u;
        }
    }
}

// f(i, load(i)) for this thread's i of [0, n) (i = threadIdx.x + j x THREADS), U loads issued before any f: one
// block walking a row from L2 is bound by the loads it has in flight (load: the load alone, unconditional at a
// clamped index, so that nothing waits on one before the next is issued; f does the arithmetic)
template <int U, typename Load, typename F>
__device__ __forceinline__ void for_each(Load load, int n, F f) {
    using R = decltype(load(0));
#pragma unroll 1
    for (int i0 = threadIdx.x; i0 < n; i0 += U * THREADS) {
        R v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = load(min(i0 + u * THREADS, n - 1));
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i0 + u * THREADS < n) f(i0 + u * THREADS, v[u]);
    }
}
struct KeyIs {  // kth_largest's key of a loaded value: the value itself
    template <typename R>
    __device__ __forceinline__ unsigned operator()(int, R r) const { return r; }
};

// The k-th largest of the keys key(i, get(i)), i in 0 .. n-1 (uint32; 0: absent, and 1 <= k <= the present ones), by
// the block's threads together: a radix select, 8 bits a pass from the top; hist: 256 counters in shared memory.
// Every thread returns it.
template <typename Get, typename Key = KeyIs>
__device__ unsigned kth_largest(Get get, int n, int k, unsigned* hist, unsigned* pick, Key keyf = {}) {
    unsigned prefix = 0u, mask = 0u;
    int remaining = k;  // the rank, among keys matching prefix under mask, of the one sought
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += THREADS) hist[i] = 0u;
        __syncthreads();
        for_each<8>(get, n, [&](int i, auto r) {
            const unsigned key = keyf(i, r);
            if (key != 0u && (key & mask) == prefix) atomicAdd(hist + ((key >> shift) & 255u), 1u);
        });
        __syncthreads();
        if (threadIdx.x < 32) {  // the digit where the count from the top reaches `remaining`: a lane 8 bins
            const int lane = threadIdx.x;
            unsigned c[8], tot = 0u;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = hist[255 - 8 * lane - j];
                tot += c[j];
            }
            unsigned incl = tot;  // the bins above this lane's, and its own
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += t;
            }
            unsigned above = incl - tot;
            if ((int)above < remaining && remaining <= (int)incl) {
                for (int j = 0; j < 8; ++j) {
                    if (remaining <= (int)(above + c[j])) {
                        pick[0] = 255u - 8u * lane - j;
                        pick[1] = above;
                        break;
                    }
                    above += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= pick[0] << shift;
        mask |= 255u << shift;
        remaining -= (int)pick[1];
        __syncthreads();
    }
    return prefix;
}

// Bitonic sort of a[0 .. n) descending (n a power of two), the block's threads together.
__device__ void sort_desc(unsigned long long* a, int n) {
    for (int size = 2; size <= n; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < n / 2; i += THREADS) {
                const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const unsigned long long x = a[lo], y = a[hi];
                if ((x < y) == desc) {
                    a[lo] = y;
                    a[hi] = x;
                }
            }
            __syncthreads();
        }
}

// Of the entries get(0 .. n-1) (key << 32 | ~id; 0: absent), those whose key is >= kth, into out[0 .. count) in any
// order: all of them where they fit in C, else every key > kth (fewer than C: kth is a k-th largest, k <= C) and the
// lowest ids of key == kth up to C (a radix select over their ~ids: the same set every run). Returns the count
// (every thread). cnt3: 3 ints of shared memory.
template <typename Get>
__device__ int keep_top(Get get, int n, unsigned kth, int C, unsigned long long* out, unsigned* hist,
                        unsigned* pick, int* cnt3) {
    if (threadIdx.x < 3) cnt3[threadIdx.x] = 0;
    __syncthreads();
    int gt = 0, eq = 0;
    for_each<8>(get, n, [&](int, unsigned long long e) {
        const unsigned key = (unsigned)(e >> 32);
        gt += e != 0ull && key > kth;
        eq += e != 0ull && key == kth;
    });
    atomicAdd(cnt3, gt);
    atomicAdd(cnt3 + 1, eq);
    __syncthreads();
    const int GT = cnt3[0], EQ = cnt3[1];
    const unsigned idk = GT + EQ <= C ? 0u : kth_largest([&](int i) {
        const unsigned long long e = get(i);
        return e != 0ull && (unsigned)(e >> 32) == kth ? (unsigned)e : 0u;
    }, n, C - GT, hist, pick);
    for_each<8>(get, n, [&](int, unsigned long long e) {
        const unsigned key = (unsigned)(e >> 32);
        if (e != 0ull && (key > kth || (key == kth && (unsigned)e >= idk))) out[atomicAdd(cnt3 + 2, 1)] = e;
    });
    __syncthreads();
    return cnt3[2];
}

constexpr int SLICE = THREADS * 16;  // logits a block of sample_topk takes (generator.sampler: IDS_PER_BLOCK)
constexpr int MAX_SLICES = 128;      // of a row (generator.sampler: MAX_VOCAB = MAX_SLICES x SLICE)
constexpr float Q_ONE = 1099511627776.f;  // 2^40: the cut's probabilities in fixed point (sums exact to 2^-40 a token)

// A probability exp(s - M) / Z as an integer of 2^-40 units: sums of them are the same in any order, so the cut
// found from them is the same every run (the tokens a probability below 2^-40 are 0)
__device__ __forceinline__ unsigned long long qmass(unsigned key, float M, float Z) {
    return (unsigned long long)(expf(key_float(key) - M) / Z * Q_ONE);
}

// Top-p's cut over a whole row when the ranked candidates hold less than top_p of its probability (rare: a flat
// distribution): the key tau of the last token kept (the descending order by s, then lowest id), by a radix select
// by probability, 4 bits a pass: tau such that the probability above it is below top_p and with it reaches top_p;
// ties at tau are kept lowest id first while the probability before them stays below top_p (idk: the last kept's
// ~id; 0: all of them). row: the V logits, divided by tt as the draw divides them. Each thread sums its tokens'
// probabilities into its own 16 bins (ph: 16 x THREADS of shared memory; no atomics: a flat row's keys share their
// top bits, and atomics on one bin serialise), integer sums in any order: the same cut every run. hq: 17 sums of
// shared memory.
__device__ __forceinline__ uint2 nucleus_cut(const float* row, float tt, int V, float M, float Z, float p_top,
                                             unsigned long long* ph, unsigned long long* hq, unsigned* hist,
                                             unsigned* pick) {  // (tau, idk)
    auto load = [&](int i) { return __ldcg(row + i); };
    const unsigned long long P = (unsigned long long)((double)p_top * (double)Q_ONE);
    unsigned prefix = 0u, mask = 0u;
    unsigned long long above = 0ull, q_at = 0ull;  // the probability of the keys above prefix's range
#pragma unroll 1
    for (int shift = 28; shift >= 0; shift -= 4) {
        unsigned long long* mine = ph + threadIdx.x;
#pragma unroll
        for (int j = 0; j < 16; ++j) mine[j * THREADS] = 0ull;
        for_each<16>(load, V, [&](int, float v) {
            const unsigned key = float_key(v / tt);
            if (key != 0u && (key & mask) == prefix) mine[((key >> shift) & 15u) * THREADS] += qmass(key, M, Z);
        });
        __syncthreads();
        for (int j = threadIdx.x / 32; j < 16; j += WARPS) {  // each bin's sum over the threads
            unsigned long long v = 0ull;
            for (int t = threadIdx.x % 32; t < THREADS; t += 32) v += ph[j * THREADS + t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (threadIdx.x % 32 == 0) hq[j] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // the digit from the top where the probability reaches P
            unsigned long long run = above;
            int d = -1;
            for (int j = 15; j >= 0 && d < 0; --j) {
                if (run + hq[j] >= P) d = j;
                else run += hq[j];
            }
            pick[0] = (unsigned)d;  // (-1 only in the first pass: fixed point's truncation below P; keep all)
            hq[16] = run;           // the probability above digit d
        }
        __syncthreads();
        const int d = (int)pick[0];
        if (d < 0) return make_uint2(0u, 0u);  // every token
        prefix |= (unsigned)d << shift;
        mask |= 15u << shift;
        above = hq[16];
        q_at = hq[d];
        __syncthreads();
    }
    const unsigned tau = prefix;
    unsigned idk = 0u;
    // ties at tau, each q (> 0: the bin reached P from below); kept while the probability before one stays below P
    const unsigned long long q = qmass(tau, M, Z);
    if (q > 0ull && q_at > q && above < P) {
        // the tied tokens it takes to reach P, ceil((P - above) / q), and their count q_at / q: in double, exact
        // here (operands below 2^41, and a quotient's fraction at least 1/q; no 64-bit division's call)
        const double need = ceil((double)(P - above) / (double)q);
        if (need < (double)q_at / (double)q)
            idk = kth_largest(load, V, (int)need, hist, pick, [&](int i, float v) {
                return float_key(v / tt) == tau ? 0xFFFFFFFFu - (unsigned)i : 0u;
            });
    }
    return make_uint2(tau, idk);
}

constexpr int NUC_BINS = 2048;  // nucleus_draw's bins of s below the row's maximum
constexpr float NUC_RANGE = 28.f;  // their span in s: below it a token's probability is under 2^-40 (0 in qmass)
// a bin holds its tokens' probability in the low NUC_COUNT_SHIFT bits (a row's sums to ~2^40) and their count above
// (up to MAX_VOCAB = 2^19 tokens: 62 bits), both added by one atomic
constexpr int NUC_COUNT_SHIFT = 43;
constexpr unsigned long long NUC_MASS = (1ull << NUC_COUNT_SHIFT) - 1ull;
static_assert(NUC_BINS * 8 <= SLICE * 4, "nucleus_draw's bins live in sample_topk's keys");

// A block's exclusive prefix sum of v over threadIdx.x; *total: the sum of all (every thread). red: WARPS sums.
__device__ unsigned long long block_excl_sum(unsigned long long v, unsigned long long* red, unsigned long long* total) {
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    unsigned long long incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    if (lane == 31) red[w] = incl;
    __syncthreads();
    unsigned long long base = 0ull, all = 0ull;
    for (int j = 0; j < WARPS; ++j) {
        base += j < w ? red[j] : 0ull;
        all += red[j];
    }
    __syncthreads();
    *total = all;
    return base + incl - v;
}

// Top-p's cut and the draw over a whole row in two passes (nucleus_cut's cut, the same tokens: bench/NOTES.md
// session 49): pass 1 sums each token's probability (qmass) into NUC_BINS bins of s over [M - NUC_RANGE, M] (a bin is
// a range of the descending order; integer sums, the same in any order) and finds the bin d where the probability
// from the top reaches top_p; pass 2 draws over the tokens of the bins above d (all kept) and gathers d's tokens,
// which are sorted (s, then lowest id) to find the cut among them, and drawn where kept. Returns 0 with *best the
// block's draw (this thread's share), 1 where the row holds less than top_p in fixed point (keep every token), 2 where
// bin d holds more than `cap` tokens (a near-flat row: nucleus_cut's radix select instead; known after pass 1 from
// the bins' counts of tokens with a non-zero probability, which bin d's are, or after pass 2). bins: NUC_BINS sums
// of shared memory; list: cap (a power of two) keys of shared memory.
__device__ int nucleus_draw(const float* row, float tt, int V, float M, float Z, float p_top, unsigned long long h,
                            unsigned long long* bins, unsigned long long* list, int cap, unsigned long long* red,
                            unsigned long long* best) {
    __shared__ int s_n, s_d, s_dn;
    __shared__ unsigned long long s_above;
    __shared__ unsigned s_tau, s_idk;
    auto load = [&](int i) { return __ldcg(row + i); };
    const unsigned long long P = (unsigned long long)((double)p_top * (double)Q_ONE);
    const float lo = M - NUC_RANGE, scale = NUC_BINS / NUC_RANGE;
    auto bin = [&](float s) { return !(s >= lo) ? -1 : min(NUC_BINS - 1, (int)((s - lo) * scale)); };  // monotone in s
    for (int j = threadIdx.x; j < NUC_BINS; j += THREADS) bins[j] = 0ull;
    if (threadIdx.x == 0) {
        s_n = 0;
        s_d = -1;
        s_dn = 0;
        s_tau = 0u;
        s_idk = 0u;
    }
    __syncthreads();
    for_each<16>(load, V, [&](int, float v) {
        const unsigned key = float_key(v / tt);
        if (key == 0u) return;
        const float s = key_float(key);
        const int b = bin(s);
        const unsigned long long q = b < 0 ? 0ull : qmass(key, M, Z);
        if (q) atomicAdd(bins + b, q + (1ull << NUC_COUNT_SHIFT));
    });
    __syncthreads();
    constexpr int PER = NUC_BINS / THREADS;  // a thread's bins, from the top: thread 0 the highest
    static_assert(NUC_BINS % THREADS == 0, "NUC_BINS must be a multiple of THREADS");
    unsigned long long c[PER], mine = 0ull, total;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        c[j] = bins[NUC_BINS - 1 - PER * threadIdx.x - j] & NUC_MASS;
        mine += c[j];
    }
    unsigned long long run = block_excl_sum(mine, red, &total);
    if (total < P) return 1;  // (every thread: total is the block's)
    if (run < P && P <= run + mine) {
        for (int j = 0; j < PER; ++j) {
            if (run + c[j] >= P) {
                s_d = NUC_BINS - 1 - PER * threadIdx.x - j;
                s_dn = (int)(bins[s_d] >> NUC_COUNT_SHIFT);
                s_above = run;
                break;
            }
            run += c[j];
        }
    }
    __syncthreads();
    const int d = s_d;
    if (s_dn > cap) return 2;  // (every thread: bin d's tokens would not fit the list)
    unsigned long long b0 = 0ull;
    for_each<16>(load, V, [&](int i, float v) {
        const unsigned key = float_key(v / tt);
        if (key == 0u) return;
        const float s = key_float(key);
        const int b = bin(s);
        if (b > d) {
            const unsigned long long sk = noisy_key(key, h, (unsigned)i);
            b0 = sk > b0 ? sk : b0;
        } else if (b == d) {
            const int slot = atomicAdd(&s_n, 1);
            if (slot < cap) list[slot] = ((unsigned long long)key << 32) | (0xFFFFFFFFu - (unsigned)i);
        }
    });
    __syncthreads();
    const int n = s_n;
    if (n > cap) return 2;
    int np = 1;
    while (np < n) np <<= 1;
    for (int i = n + threadIdx.x; i < np; i += THREADS) list[i] = 0ull;
    __syncthreads();
    sort_desc(list, np);
    // the cut: the first of d's tokens in the order whose probability with those before it reaches P
    const int E = (n + THREADS - 1) / THREADS, i0 = min(n, (int)threadIdx.x * E), i1 = min(n, i0 + E);
    unsigned long long part = 0ull;
    for (int i = i0; i < i1; ++i) part += qmass((unsigned)(list[i] >> 32), M, Z);
    unsigned long long cum = s_above + block_excl_sum(part, red, &total);
    for (int i = i0; i < i1; ++i) {
        const unsigned long long q = qmass((unsigned)(list[i] >> 32), M, Z);
        if (cum < P && P <= cum + q) {
            s_tau = (unsigned)(list[i] >> 32);
            s_idk = (unsigned)list[i];
        }
        cum += q;
    }
    __syncthreads();
    const unsigned tau = s_tau, idk = s_idk;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        const unsigned key = (unsigned)(list[i] >> 32), nid = (unsigned)list[i];
        if (cut_keeps(key, nid, tau, idk)) {
            const unsigned long long sk = noisy_key(key, h, 0xFFFFFFFFu - nid);
            b0 = sk > b0 ? sk : b0;
        }
    }
    *best = b0;
    return 0;
}

// logits [nb][V] fp32 -> next [nb] int64 (in: the greedy tokens, kept where temp <= 0): top-k (top_k[b] > 0: every
// s >= the row's k-th largest; where more than C, those above it and the lowest ids tied with it: keep_top) and
// top-p, then the Gumbel-max draw. Grid: G x nb blocks (blockIdx.x = b * G + g), block g a slice of SLICE logits:
// its own s >= its k-th largest (a superset of the row's: a slice's k-th largest is at most the row's) go to
// cand[b][g][0 .. C) as (key << 32 | ~id), their count to cnt[b][g]; the row's last block (rowdone[b]) selects the
// row's k-th from them, sorts the kept ones in shared memory (dynamic: C rounded up to a power of two, 8 bytes
// each) and draws. C: a power of two (generator.sampler: at most MAX_CANDIDATES). top_k[b] <= 0 (off): k = C, and
// the slices also write their maximum s and sum of exp(s - max) to zs[b][g] (the row's softmax denominator); where
// the C ranked hold top_p or more of the row's probability the cut lies among them, else (or top_p 1) the cut comes
// from the whole row (nucleus_draw, or nucleus_cut) and the draw is over the whole row. Counters rowdone [nb], counter: 0 before the
// first launch, left at 0.
extern "C" __global__ void __launch_bounds__(THREADS) sample_topk(
    const float* __restrict__ logits, int V, int G, int C, const float* __restrict__ temp,
    const long long* __restrict__ topk, const float* __restrict__ topp, const long long* __restrict__ seed,
    long long* __restrict__ next, int nb, unsigned long long* __restrict__ cand, int* __restrict__ cnt,
    float2* __restrict__ zs, unsigned* __restrict__ rowdone, unsigned* __restrict__ counter,
    long long* __restrict__ hist, long long* __restrict__ step, int* __restrict__ pos, const T* __restrict__ embed,
    T* __restrict__ x_next) {
    extern __shared__ __align__(16) unsigned long long kept[];  // the row's last block: the kept logits, sorted
    __shared__ __align__(8) unsigned keys[SLICE];  // (the last block: the slices' pairs, then the cut's bins or 17 sums)
    __shared__ unsigned hist256[256], pick[2];
    __shared__ int cnt3[3], scnt[MAX_SLICES];
    __shared__ float fred[WARPS];
    __shared__ unsigned long long kred[WARPS];
    __shared__ float scan[THREADS];
    __shared__ bool last;
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // programmatic dependent launch: the head's logits first
#endif
    const int b = blockIdx.x / G, g = blockIdx.x % G;
    const float t = temp[b], tt = fmaxf(t, 1e-6f);
    const long long k0 = topk[b];
    const bool full = k0 < 1;  // top-k off: top-p's probabilities over the whole row
    const int k = (int)(full || k0 > C ? C : k0);
    unsigned long long* mine = cand + ((size_t)b * G + g) * C;
    if (t > 0.f) {  // this slice's s >= its k-th largest (every one where it has no more than k)
        const int lo = g * SLICE, n = min(SLICE, V - lo);
        const float* row = logits + (size_t)b * V + lo;
        for_each<16>([&](int i) { return __ldg(row + i); }, n, [&](int i, float v) { keys[i] = float_key(v / tt); });
        __syncthreads();
        if (full) {  // the slice's maximum and sum of exp(s - maximum)
            unsigned long long mk = 0ull;
            for (int i = threadIdx.x; i < n; i += THREADS) mk = keys[i] > mk ? keys[i] : mk;
            const float m = key_float((unsigned)block_max_key(mk, kred));
            float z = 0.f;
            if (m != -INFINITY)
                for (int i = threadIdx.x; i < n; i += THREADS) z += expf(key_float(keys[i]) - m);
            z = block_sum(z, fred);
            if (threadIdx.x == 0) zs[b * G + g] = make_float2(m, z);
        }
        const unsigned kth = n > k ? kth_largest([&](int i) { return keys[i]; }, n, k, hist256, pick) : 0u;
        const int kept_n = keep_top([&](int i) {
            return ((unsigned long long)keys[i] << 32) | (0xFFFFFFFFu - (unsigned)(lo + i));
        }, n, kth, C, mine, hist256, pick, cnt3);
        if (threadIdx.x == 0) cnt[b * G + g] = kept_n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(rowdone + b, 1u) == (unsigned)G - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // the row's last block: the row's k-th largest among the slices' candidates, the kept ones sorted, the draw
    const long long st = hist != nullptr ? *step : 0;
    const int p0 = pos[b];
    long long tok;
    if (t > 0.f) {
        const unsigned long long* rc = cand + (size_t)b * G * C;
        for (int q = threadIdx.x; q < G; q += THREADS) scnt[q] = __ldcg(cnt + b * G + q);
        __syncthreads();
        int total = 0;
        for (int q = 0; q < G; ++q) total += scnt[q];
        // candidate i of the row: slice i >> lc at slot i & (C - 1), present where that slot < the slice's count
        const int lc = __ffs(C) - 1;
        auto entry = [&](int i) -> unsigned long long {  // (the load unconditional: for_each's loads in flight)
            const unsigned long long e = __ldcg(rc + i);
            return (i & (C - 1)) < scnt[i >> lc] ? e : 0ull;
        };
        const unsigned kth = kth_largest([&](int i) { return (unsigned)(entry(i) >> 32); }, G * C, min(k, total),
                                         hist256, pick);
        for (int i = threadIdx.x; i < C; i += THREADS) kept[i] = 0ull;
        const int nk = keep_top(entry, G * C, kth, C, kept, hist256, pick, cnt3);
        int np = 1;
        while (np < nk) np <<= 1;
        sort_desc(kept, np);  // (s, then lowest id) descending: the zeros past nk last
        // the draw over kept[0 .. nk): every one is in the top k (ties included); top-k off: the softmax's maximum
        // and denominator are the row's (its slices', in slice order: the same every run)
        const float m = key_float((unsigned)(kept[0] >> 32));
        const int E = (nk + THREADS - 1) / THREADS, i0 = threadIdx.x * E, i1 = min(nk, i0 + E);
        float Z;
        if (full) {  // (the slices' pairs loaded together into the idle keys, then combined in slice order)
            float2* sz = reinterpret_cast<float2*>(keys);
            for (int q = threadIdx.x; q < G; q += THREADS) sz[q] = __ldcg(zs + b * G + q);
            __syncthreads();
            float M = -INFINITY, zf = 0.f;
            for (int q = 0; q < G; ++q) {
                const float2 v = sz[q];
                if (v.y <= 0.f) continue;
                if (v.x > M) {
                    zf = zf * expf(M - v.x) + v.y;
                    M = v.x;
                } else {
                    zf += v.y * expf(v.x - M);
                }
            }
            Z = zf * expf(M - m);  // (M is m: the row's maximum is ranked)
        } else {
            float z = 0.f;
            for (int i = i0; i < i1; ++i) z += expf(key_float((unsigned)(kept[i] >> 32)) - m);
            Z = block_sum(z, fred);
        }
        float run = 0.f;
        for (int i = i0; i < i1; ++i) run += expf(key_float((unsigned)(kept[i] >> 32)) - m) / Z;
        scan[threadIdx.x] = run;  // exclusive scan of the runs' sums (Hillis-Steele: nk is small)
        __syncthreads();
        for (int o = 1; o < THREADS; o <<= 1) {
            const float a = threadIdx.x >= o ? scan[threadIdx.x - o] : 0.f;
            __syncthreads();
            scan[threadIdx.x] += a;
            __syncthreads();
        }
        float cum = scan[threadIdx.x] - run;  // the probability before this run
        const float p_top = topp[b];
        const unsigned long long h = noise_hash(seed[b], (long long)p0 + 1);
        unsigned long long best = 0ull;
        // top-k off, and the ranked hold less than top_p (or top_p 1: every token): the cut is past them
        const bool whole = full && nk < V && (p_top >= 1.f || scan[THREADS - 1] < p_top);
        if (!whole) {
            for (int i = i0; i < i1; ++i) {
                const float s = key_float((unsigned)(kept[i] >> 32));
                const float p = expf(s - m) / Z;
                cum += p;  // inclusive, as probs.cumsum(-1); kept where cumsum - p < top_p
                if (i == 0 || p_top >= 1.f || cum - p < p_top) {  // (top_p 1: off, as transformers applies none)
                    const unsigned id = 0xFFFFFFFFu - (unsigned)kept[i];
                    const unsigned long long key = argmax_key(s + gumbel(h, id), (unsigned)i);
                    best = key > best ? key : best;
                }
            }
            best = block_max_key(best, kred);
            tok = 0xFFFFFFFFu - (unsigned)kept[key_index(best)];
        } else {
            const float* row = logits + (size_t)b * V;
            // (the sort's room, idle now: the gathered bin, or THREADS x 16 sums; the slices' keys: the bins, or 17
            // sums); top_p 1: every token
            unsigned long long* room = reinterpret_cast<unsigned long long*>(keys);
            const int how = p_top < 1.f ? nucleus_draw(row, tt, V, m, Z, p_top, h, room, kept,
                                                       max(C, THREADS * 16), kred, &best) : 1;
            if (how != 0) {
                const uint2 cut = how == 2 ? nucleus_cut(row, tt, V, m, Z, p_top, kept, room, hist256, pick)
                                           : make_uint2(0u, 0u);
                const unsigned tau = cut.x, idk = cut.y;
                for_each<16>([&](int i) { return __ldcg(row + i); }, V, [&](int i, float v) {
                    const unsigned key = float_key(v / tt);
                    if (key != 0u && cut_keeps(key, 0xFFFFFFFFu - (unsigned)i, tau, idk)) {
                        const unsigned long long sk = noisy_key(key, h, (unsigned)i);
                        best = sk > best ? sk : best;
                    }
                });
            }
            best = block_max_key(best, kred);
            tok = key_index(best);
        }
    } else {
        tok = next[b];
    }
    __syncthreads();  // (every thread has read pos[b] and next[b])
    finish_row(b, tok, nb, next, hist, st, pos, embed, x_next);
    if (threadIdx.x == 0) rowdone[b] = 0u;
    arrive(counter, nb, hist != nullptr ? step : nullptr, st);
}

// logits [nb][V] fp32 -> next [nb] int64 (in: the greedy tokens, kept where temp <= 0), by the Gumbel-max draw over
// the whole vocabulary (no top-k, no top-p). Grid: G x nb blocks (block g of row b: blockIdx.x = b * G + g), each
// a slice of V / G ids; rowmax [nb] uint64: 0 before the first launch, the last block resets it.
extern "C" __global__ void __launch_bounds__(THREADS) sample_gumbel(
    const float* __restrict__ logits, int V, int G, const float* __restrict__ temp,
    const long long* __restrict__ seed, long long* __restrict__ next, int nb,
    unsigned long long* __restrict__ rowmax, unsigned* __restrict__ counter, long long* __restrict__ hist,
    long long* __restrict__ step, int* __restrict__ pos, const T* __restrict__ embed, T* __restrict__ x_next) {
    __shared__ unsigned long long kred[WARPS];
    __shared__ bool last;
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const int b = blockIdx.x / G, g = blockIdx.x % G;
    const float t = temp[b];
    if (t > 0.f) {
        const float tt = fmaxf(t, 1e-6f);
        const unsigned long long h = noise_hash(seed[b], (long long)pos[b] + 1);
        const int per = (V + G - 1) / G, lo = g * per, hi = min(V, lo + per);
        const float* row = logits + (size_t)b * V;
        unsigned long long best = 0ull;
        for (int i = lo + threadIdx.x; i < hi; i += THREADS) {
            const unsigned long long key = argmax_key(__ldg(row + i) / tt + gumbel(h, i), (unsigned)i);
            best = key > best ? key : best;
        }
        best = block_max_key(best, kred);
        if (threadIdx.x == 0 && best) atomicMax(rowmax + b, best);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long long st = hist != nullptr ? *step : 0;
    for (int r = 0; r < nb; ++r) {
        const unsigned long long k = atomicAdd(rowmax + r, 0ull);  // (L2: every block's atomicMax)
        const long long tok = temp[r] > 0.f ? (long long)key_index(k) : next[r];
        __syncthreads();  // (every thread has read next[r] and rowmax[r])
        finish_row(r, tok, nb, next, hist, st, pos, embed, x_next);
        if (threadIdx.x == 0) rowmax[r] = 0ull;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (hist != nullptr) *step = st + 1;
        *counter = 0u;
    }
}
