// The served model's sampled draw in one launch after the head (generator.sampler): what generator.serve's
// sample_tokens computes with ~30 torch launches, the same tokens, then the decode step's advance.
// Per row b (temperature t[b] > 0; a row with t <= 0 keeps next[b], the head's greedy token):
//   s = logit / max(t, 1e-6) (fp32, as torch divides); top-k keeps every s >= the k-th largest (ties included, as
//   transformers' TopKLogitsWarper); p = softmax over those; top-p keeps the smallest prefix of the descending
//   order whose exclusive cumulative sum stays below top_p (the first always); then the Gumbel-max draw:
//   argmax over kept i of s_i - log(-log(u(seed, step, id_i))), u = serve.uniform_noise's hash, first index on ties.
// Two kernels: sample_candidates (top-k / top-p over the row's C largest logits, sorted: torch.topk's output; a
// block a row) and sample_gumbel (temperature only: the whole vocabulary, no ranking; G blocks a row, the row's
// maximum by a 64-bit atomicMax). The last block of either does the advance (lm_head.cu's, the same fields).
// Config (generator.sampler prepends it): HIDDEN, T.
#include "common.cuh"

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
// -log(-log(u)) for token id, u = ((x >> 8) + 0.5) / 2^24 as serve.uniform_noise (exact in fp32); logf, as torch's log
__device__ __forceinline__ float gumbel(unsigned long long h, long long id) {
    const unsigned long long x = mix32((h + (unsigned long long)id * 0x9E3779B1ull) & 0xFFFFFFFFull);
    const float u = ((float)(x >> 8) + 0.5f) * (1.0f / 16777216.0f);
    return -logf(-logf(u));
}
// a float and its index as one 64-bit key whose unsigned order is (value, then lowest index): argmax by max
__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned i) {
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xFFFFFFFFu - i);
}
__device__ __forceinline__ unsigned key_index(unsigned long long k) { return 0xFFFFFFFFu - (unsigned)k; }

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long t = __shfl_xor_sync(0xffffffffu, k, o);
        k = t > k ? t : k;
    }
    return k;
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
// (every thread of the block copies). Then the grid's last block to arrive sets *step = st + 1 and resets counter.
// st: *step as this block read it before its arrival.
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
__device__ void arrive(unsigned* counter, long long* step, long long st) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(counter, 1u) == gridDim.x - 1) {
            if (step != nullptr) *step = st + 1;
            *counter = 0u;
        }
    }
}

// vals [nb][C] fp32: each row's C largest logits, descending (torch.topk of the raw logits: dividing by t > 0
// keeps their order), ids [nb][C] int64 their token ids; temp, topp [nb] fp32, topk, seed [nb] int64, pos [nb]
// int32 (the noise's step is pos + 1, the position the token takes); next [nb] int64: in, the greedy tokens; out,
// the draw. Grid: nb blocks. Needs top_k <= C where top-k is on (generator.sampler's caller sizes C).
extern "C" __global__ void __launch_bounds__(THREADS) sample_candidates(
    const float* __restrict__ vals, const long long* __restrict__ ids, int C, const float* __restrict__ temp,
    const long long* __restrict__ topk, const float* __restrict__ topp, const long long* __restrict__ seed,
    long long* __restrict__ next, int nb, unsigned* __restrict__ counter, long long* __restrict__ hist,
    long long* __restrict__ step, int* __restrict__ pos, const T* __restrict__ embed, T* __restrict__ x_next) {
    __shared__ float fred[WARPS];
    __shared__ unsigned long long kred[WARPS];
    __shared__ float scan[THREADS];
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // programmatic dependent launch: the head's logits first
#endif
    const int b = blockIdx.x;
    const float* v = vals + (size_t)b * C;
    const long long st = hist != nullptr ? *step : 0;
    const int p0 = pos[b];  // (read by every thread before finish_row's increment, after a block barrier below)
    const float t = temp[b];
    long long tok = 0;
    if (t > 0.f) {
        const float tt = fmaxf(t, 1e-6f);
        const long long k = topk[b];
        const float m = v[0] / tt;
        const float kth = v[(k < 1 ? 1 : (k > C ? C : k)) - 1] / tt;
        // each thread a contiguous run of E candidates: the scan is then a run's sum, a block scan, a re-walk
        const int E = (C + THREADS - 1) / THREADS, i0 = threadIdx.x * E, i1 = min(C, i0 + E);
        float z = 0.f;
        for (int i = i0; i < i1; ++i) {
            const float s = v[i] / tt;
            if (k <= 0 || s >= kth) z += expf(s - m);
        }
        const float Z = block_sum(z, fred);
        float run = 0.f;
        for (int i = i0; i < i1; ++i) {
            const float s = v[i] / tt;
            if (k <= 0 || s >= kth) run += expf(s - m) / Z;
        }
        // exclusive scan of the runs' sums (Hillis-Steele over the block: C is small)
        scan[threadIdx.x] = run;
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
        for (int i = i0; i < i1; ++i) {
            const float s = v[i] / tt;
            const bool in_k = k <= 0 || s >= kth;
            const float p = in_k ? expf(s - m) / Z : 0.f;
            cum += p;  // inclusive, as probs.cumsum(-1); kept where cumsum - p < top_p
            if (i == 0 || (in_k && cum - p < p_top)) {
                const unsigned long long key = argmax_key(s + gumbel(h, ids[(size_t)b * C + i]), (unsigned)i);
                best = key > best ? key : best;
            }
        }
        best = block_max_key(best, kred);
        tok = ids[(size_t)b * C + key_index(best)];
    } else {
        tok = next[b];
    }
    __syncthreads();  // (every thread has read pos[b] and next[b])
    finish_row(b, tok, nb, next, hist, st, pos, embed, x_next);
    arrive(counter, hist != nullptr ? step : nullptr, st);
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
