"""A grid barrier and a hand-off between blocks, measured alone on a GPU (bench/NOTES.md session 41): µs a barrier
for cooperative groups' grid.sync() and hand-written ones (one counter, eight counters, per-block flags, a barrier
carried by data words), one block an SM x 512 threads as the fused layer runs, with 8 or 512 words written by each
block before it; and µs a hop of a ping-pong between two blocks: data + fence + flag, or the flag in the data's own
8-byte word (NCCL's LL protocol). Per barrier = (time of 1,010 - time of 10) / 1,000, median of 7 launches.

    python bench/barrier_bench.py [--out FILE]   # a line each; the JSON to FILE [$OUT/barrier_bench.json, else .]"""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ from this tree
    sys.path.insert(0, str(ROOT))

SRC = r'''
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
__device__ __forceinline__ void red_release(unsigned* p, unsigned v){ asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p){ unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p){ unsigned v; asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_relaxed(unsigned* p, unsigned v){ asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void st_release(unsigned* p, unsigned v){ asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ unsigned long long ld_relaxed64(const unsigned long long* p){ unsigned long long v; asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_relaxed64(unsigned long long* p, unsigned long long v){ asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }

// mode: 0 cg grid.sync; 1 one counter (red.release + ld.acquire poll); 2 eight counters; 3 per-block flags, relaxed
// (no fence: the LL floor); 4 per-block flags st.release / ld.acquire; 5 LL data: each block writes WORDS 8-byte
// (value, epoch) words, every block's warp 0 polls all blocks' first word (a barrier carried by data)
extern "C" __global__ void __launch_bounds__(512, 1) bar(int mode, int iters, int words, unsigned* ctr, unsigned long long* data, float* sink)
{
    cg::grid_group grid = cg::this_grid();
    const int nb = gridDim.x, b = blockIdx.x, t = threadIdx.x;
    float acc = 0.f;
    for (int it = 0; it < iters; ++it) {
        // the data a stage hands on (each block writes words x 8 bytes), before the barrier
        if (mode != 5) for (int w = t; w < words; w += blockDim.x) data[(size_t)b * words + w] = ((unsigned long long)(it + 1) << 32) | w;
        if (mode == 0) { grid.sync(); }
        else if (mode == 1) {
            __syncthreads();
            if (t == 0) { red_release(ctr, 1u); const unsigned tgt = (unsigned)(it + 1) * nb; while (ld_acquire(ctr) < tgt) {} }
            __syncthreads();
        } else if (mode == 2) {
            __syncthreads();
            if (t == 0) red_release(ctr + 32 * (b & 7), 1u);
            if (t < 8) { const unsigned per = (nb + 7 - t) / 8; const unsigned tgt = (unsigned)(it + 1) * per; while (ld_acquire(ctr + 32 * t) < tgt) {} }
            __syncthreads();
        } else if (mode == 3 || mode == 4) {
            __syncthreads();
            if (t == 0) { if (mode == 3) st_relaxed(ctr + 32 * b, it + 1); else st_release(ctr + 32 * b, it + 1); }
            if (t < 32) {
                for (int j = t; j < nb; j += 32) { if (mode == 3) { while (ld_relaxed(ctr + 32 * j) < (unsigned)(it + 1)) {} } else { while (ld_acquire(ctr + 32 * j) < (unsigned)(it + 1)) {} } }
                __syncwarp();
            }
            __syncthreads();
        } else {
            // LL: the data words carry the epoch; block b's words at data[b*words ...]
            for (int w = t; w < words; w += blockDim.x) st_relaxed64(data + (size_t)b * words + w, ((unsigned long long)(it + 1) << 32) | (unsigned)w);
            if (t < 32) {
                for (int j = t; j < nb; j += 32) { const unsigned long long* p = data + (size_t)j * words + (words - 1); while ((unsigned)(ld_relaxed64(p) >> 32) < (unsigned)(it + 1)) {} acc += (float)(unsigned)ld_relaxed64(p); }
                __syncwarp();
            }
            __syncthreads();
        }
    }
    if (acc == 12345.f) sink[0] = acc;
}

// ping-pong between block 0 and block P: hop latency. mode 0: LL word; mode 1: data + __threadfence + flag, reader
// polls the flag (ld.acquire) then reads the data
extern "C" __global__ void pingpong(int mode, int iters, unsigned long long* word, unsigned* flag, unsigned long long* data, float* sink)
{
    const int b = blockIdx.x; if (b != 0 && b != gridDim.x - 1) return; if (threadIdx.x) return;
    const int me = b == 0 ? 0 : 1; float acc = 0.f;
    for (int i = 0; i < iters; ++i) {
        const unsigned mine = 2 * i + me + 1;   // hop numbers: block 0 writes odd, block 1 even
        if (me == 1) { // wait for hop mine-1
            if (mode == 0) { while ((unsigned)(ld_relaxed64(word) >> 32) < mine - 1) {} }
            else { while (ld_acquire(flag) < mine - 1) {} acc += (float)data[0]; }
        } else if (i > 0) {
            if (mode == 0) { while ((unsigned)(ld_relaxed64(word) >> 32) < mine - 1) {} }
            else { while (ld_acquire(flag) < mine - 1) {} acc += (float)data[0]; }
        }
        if (mode == 0) st_relaxed64(word, ((unsigned long long)mine << 32) | 7u);
        else { data[0] = mine; __threadfence(); st_relaxed(flag, mine); }
    }
    if (acc == 12345.f) sink[0] = acc;
}
'''

def main(argv=None):
    from bench import ScriptParser
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file [$OUT/barrier_bench.json, else ./barrier_bench.json]")
    args = ap.parse_args(argv)
    import cupy as cp
    try:
        gpus = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        gpus = 0
    if not gpus:
        print("error: bench/barrier_bench.py launches kernels: no CUDA GPU", file=sys.stderr)
        sys.exit(2)
    bar = cp.RawKernel(SRC, "bar", options=("-std=c++17",), backend="nvcc", enable_cooperative_groups=True)
    pp = cp.RawKernel(SRC, "pingpong", options=("-std=c++17",), backend="nvcc")
    nsm = cp.cuda.Device().attributes["MultiProcessorCount"]
    ctr = cp.zeros(32 * 256, dtype=cp.uint32)
    data = cp.zeros(nsm * 4096, dtype=cp.uint64)
    sink = cp.zeros(4, dtype=cp.float32)
    flag = cp.zeros(32, dtype=cp.uint32)
    word = cp.zeros(16, dtype=cp.uint64)

    def median_us(launch, reset, reps):  # one launch's µs, median of reps (the counters reset before each)
        ts = []
        for _ in range(reps):
            reset()
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            launch()
            e.record()
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) * 1e3)
        return sorted(ts)[reps // 2]

    def time_bar(mode, iters, words):
        return median_us(lambda: bar((nsm,), (512,), (cp.int32(mode), cp.int32(iters), cp.int32(words), ctr, data,
                                                      sink)),
                         lambda: (ctr.fill(0), data.fill(0)), 7)
    res = {}
    names = {0: "cg grid.sync", 1: "1 counter", 2: "8 counters", 3: "flags relaxed (LL floor)",
             4: "flags release/acquire", 5: "LL data words"}
    for words in (8, 512):
        for mode in range(6):
            us = (time_bar(mode, 1010, words) - time_bar(mode, 10, words)) / 1000
            res[f"{names[mode]} words={words}"] = us
            print(f"{names[mode]:28s} words/block {words:4d}: {us:.3f} us/barrier", flush=True)
    for mode, nm in ((0, "pingpong LL"), (1, "pingpong data+fence+flag")):
        ts = [median_us(lambda: pp((nsm,), (32,), (cp.int32(mode), cp.int32(n), word, flag, data, sink)),
                        lambda: (word.fill(0), flag.fill(0)), 5) for n in (10, 2010)]
        hop = (ts[1] - ts[0]) / (2 * 2000)
        res[nm] = hop
        print(f"{nm:28s}: {hop:.3f} us/hop", flush=True)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "barrier_bench.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
