"""Timing on the GPU: CUDA events around CUDA-graph replays of a stack of distinct layers (so no provider is served
weights from the 60 MB L2), after warm-up; median, p10, p90 per layer."""
from __future__ import annotations

import statistics

import torch


def copy_bandwidth(device="cuda", nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s): the ceiling we report against."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    times = []
    for _ in range(3):
        b.copy_(a)
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times) / 1e9


def graph_of(step, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Capture step() (after warm-up on a side stream, as torch's docs require)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


# a spin kernel's length (SM cycles, ~0.1 ms at the H200's ~1.8 GHz): longer than the host takes to enqueue one graph
# replay behind it (estimated 5-20 µs, not yet measured alone: bench/NOTES.md session 44)
QUEUE_CYCLES = 200_000


def time_samples(run, n_layers: int, reps: int, *, queued: bool = False) -> list[float]:
    """µs per layer of `reps` runs of run(), CUDA events around each, synchronised between runs (so an eager
    provider's launch overhead is not hidden behind a queue of earlier work). queued: each run is enqueued behind a
    spin kernel (torch.cuda._sleep, QUEUE_CYCLES), so the start event fires when the GPU reaches work already queued:
    GPU time only, without the host's launch latency of a graph replay (estimated 5-20 µs a sample, which unqueued is
    charged to the stack's layers; bench/NOTES.md session 44). For graph replays only: an eager provider's host overhead is
    what its user pays."""
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(QUEUE_CYCLES)
        s.record()
        run()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / n_layers)
    return out


def summarize(samples: list[float]) -> dict:
    """median, p10, p90 of per-layer µs samples."""
    per = sorted(samples)
    q = lambda f: per[min(len(per) - 1, int(f * len(per)))]  # noqa: E731
    return {"median": statistics.median(per), "p10": q(0.1), "p90": q(0.9), "n": len(per)}


def time_replays(run, n_layers: int, reps: int = 30, warmup: int = 3, *, queued: bool = False) -> dict:
    """run() executes the whole stack once; returns µs per layer: median, p10, p90 over reps (queued: GPU time only,
    time_samples)."""
    for _ in range(warmup):
        run()
    return summarize(time_samples(run, n_layers, reps, queued=queued))


def layer_bytes(m, batch: int, pos) -> int:
    """Bytes one decode step must move: every weight once, the KV rows 0..pos read (a sliding window's last rows
    only), activations in and out, the new KV row written."""
    from generator.reference import weight_shapes
    esize = 2
    weights = sum(torch.Size(s).numel() for s in weight_shapes(m).values()) * esize
    kv_row = 2 * m.kv_heads * m.head_dim * esize
    w = getattr(m, "sliding_window", None) or 1 << 62
    kv = sum(min(int(p) + 1, w) for p in pos) * kv_row + batch * kv_row
    return weights + kv + 2 * batch * m.hidden * esize
