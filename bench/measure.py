"""Measurement for `megakernel bench`: how many distinct layers a stack needs (L2, GPU memory), the time budget of a
run, the correctness check against the fp32 reference, and the interleaved timing of every provider of one variant.

The work timed is the same for every provider: a stack of N distinct layers, one decode step each, every sequence
at pos = seq_len-1 (the full KV context). Providers are timed interleaved (round-robin, several rounds, samples
pooled) so that clock and thermal drift hit them alike. Everything runs on a Backend: cuda_backend() for the
benchmark, cpu_backend() for the tests (no graphs, wall-clock samples).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import gc
import math
import time
import types

import torch

from bench.providers import PROVIDERS, Provider, compile_layer_step, compiled_graphs
from bench.results import make_row, add_speedups
from bench.timing import summarize, time_samples

L2_BYTES = 60 * 2**20           # H100/H200 L2: a stack of distinct layers must not fit in it
L2_PASSES = 4                   # one pass over the stack moves at least 4x the L2
MIN_LAYERS = 8
PREFILL_CACHE = 4096  # cache rows per sequence behind every prefill variant (a chunk longer than that: its length)
REL_TOL = 2e-2                  # vs the fp32 reference: bf16 baselines round every intermediate
DEFAULT_COMPILE_SUBSET = ("*_b1_s4096_*",)  # batch 1 at seq_len 4096: five compiles keep a default run in 10 min
DEFAULT_REPS = 40
DEFAULT_ROUNDS = 4
DEFAULT_TIME_BUDGET_S = 540.0   # stop starting new work after this: the whole run fits in 10 minutes


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return first[:limit]


# ---------------------------------------------------------------------------------------------------------------
# layer count, memory, time budget

def mixed_positions(batch: int, seq_len: int) -> list[int]:
    """A serving mix of decode positions: the batch's sequences spread evenly over the cache (sequence b at
    (b + 1) * seq_len / batch rows), as bench/gpu_check.py times fused and FlashInfer layers beside full context."""
    return [max(0, (b + 1) * seq_len // batch - 1) for b in range(batch)]


def n_layers_for(layer_bytes: int, l2: int = L2_BYTES, minimum: int = MIN_LAYERS) -> int:
    """Distinct layers so that one pass over the stack (layer_bytes each) is at least L2_PASSES x the L2 (bytes),
    and at least `minimum`."""
    return max(minimum, math.ceil(L2_PASSES * l2 / layer_bytes))


class BudgetError(RuntimeError):
    """The variant's stack would not fit in GPU memory (one line)."""


def choose_layers(layer_bytes: int, *, requested: int | None = None, mem_per_layer: int = 0,
                  mem_avail: float | None = None) -> tuple[int, str | None]:
    """(N, note): --layers or the default count, lowered where N layers of mem_per_layer bytes would not fit in
    mem_avail bytes (note says so). Never below what keeps a pass over the stack >= L2_PASSES x L2: BudgetError."""
    want = requested if requested is not None else n_layers_for(layer_bytes)
    if mem_avail is None or mem_per_layer <= 0:
        return want, None
    fit = int(max(0.0, mem_avail) // mem_per_layer)
    if fit >= want:
        return want, None
    floor = 1 if requested is not None else max(2, math.ceil(L2_PASSES * L2_BYTES / layer_bytes))
    if fit < floor:
        raise BudgetError(f"{floor} layer(s) need {floor * mem_per_layer / 1e9:.1f} GB of GPU memory, "
                          f"{max(0.0, mem_avail) / 1e9:.1f} GB available")
    return fit, f"{fit} layers, not {want}: GPU memory"


def memory_estimate(m, batch: int, seq_len: int, stacks: int = 2) -> tuple[int, int]:
    """(bytes per layer, bytes per variant) of GPU memory the benchmark of one variant holds at its peak.

    Per layer: the weights and KV caches of each of `stacks` distinct layer stacks (the TorchLayer baselines share
    one; the fused layer's packed copy is another), and activations. Per variant: the graph pools / eager
    temporaries of SDPA's math path (K and V expanded to every query head, fp32), the reference's cache clones and
    its fp32 per-sequence copies, and a margin."""
    from generator.reference import weight_shapes
    esize = 2
    weights = sum(math.prod(s) for s in weight_shapes(m).values()) * esize
    kv = 2 * batch * m.kv_heads * seq_len * m.head_dim * esize
    act = batch * (m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim + m.hidden + 2 * m.intermediate) * 4
    per_layer = stacks * weights + stacks * kv + stacks * act
    sdpa_tmp = 2 * batch * m.heads * seq_len * m.head_dim * 4 + batch * m.heads * seq_len * 8
    ref_tmp = kv + 2 * m.heads * seq_len * m.head_dim * 4 + 4 * weights
    per_variant = 3 * sdpa_tmp + ref_tmp + (1 << 30)
    return per_layer, per_variant


def wants_compile(name: str, subset: tuple[str, ...], no_compile: bool) -> bool:
    """Whether variant `name` gets the torch.compile providers: it matches a --compile-subset glob."""
    return not no_compile and any(fnmatch.fnmatchcase(name, g) for g in subset)


class TimeBudget:
    """Whether a run may start another variant (or another compile) and still end within `seconds` of `start`
    (time.perf_counter() seconds; 0: no limit). The estimates start as guesses and follow what the run measures:
    1.5x the slowest variant seen so far, 1.25x the slowest compile."""

    def __init__(self, seconds: float, start: float, variant_s: float = 15.0, compile_s: float = 90.0):
        self.seconds, self.start = seconds, start
        self.variant_s, self.compile_s = variant_s, compile_s
        self._variants: list[float] = []
        self._compiles: list[float] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows_variant(self) -> bool:
        return not self.seconds or self.elapsed() + self.variant_s <= self.seconds

    def allows_compile(self) -> bool:
        return not self.seconds or self.elapsed() + self.variant_s + self.compile_s <= self.seconds

    def record(self, variant_s: float, compile_s: float | None) -> None:
        """One variant took variant_s seconds in all, compile_s of them compiling (None: no compile)."""
        if compile_s is not None:
            self._compiles.append(compile_s)
            self.compile_s = 1.25 * max(self._compiles)
        self._variants.append(variant_s - (compile_s or 0))
        self.variant_s = 1.5 * max(self._variants)


# ---------------------------------------------------------------------------------------------------------------
# backends, check, interleaving

@dataclasses.dataclass
class Backend:
    """Where a variant runs. The benchmark uses cuda_backend(); tests drive the same code on the CPU with
    cpu_backend() (no graphs: step() stands in for a replay; wall-clock samples)."""
    device: torch.device
    graph_of: object            # step -> object with .replay()
    sample: object              # (run, n_layers, reps, queued=) -> µs per layer, one per rep (bench.timing)
    sync: object
    mem_free: object            # () -> free bytes
    empty_cache: object
    compile_backend: str = "inductor"


def cuda_backend() -> Backend:
    """The current CUDA device: CUDA graphs, CUDA-event samples, torch.compile with inductor."""
    from bench.timing import graph_of

    def sync():
        torch.cuda.synchronize()
    return Backend(device=torch.device("cuda", torch.cuda.current_device()), graph_of=graph_of, sample=time_samples,
                   sync=sync, mem_free=lambda: torch.cuda.mem_get_info()[0], empty_cache=torch.cuda.empty_cache)


def cpu_backend(mem_free: float = 64e9) -> Backend:
    """The CPU, for tests: a "graph" is the step itself, samples are wall-clock µs, torch.compile's eager backend."""
    def fake_graph(step):
        for _ in range(2):
            step()
        return types.SimpleNamespace(replay=step)

    def sample(run, n_layers, reps, queued=False):  # (queued: nothing is launched on the CPU)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e6 / n_layers)
        return out
    return Backend(device=torch.device("cpu"), graph_of=fake_graph, sample=sample, sync=lambda: None,
                   mem_free=lambda: mem_free, empty_cache=lambda: None, compile_backend="eager")


def check_output(out: torch.Tensor, ref: torch.Tensor, tol: float = REL_TOL) -> tuple[bool, float]:
    """(passed, relative error ‖out − ref‖/‖ref‖) of a provider's layer output against the fp32 reference (any
    shapes that match, compared in float64); NaN/inf never pass."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return False, math.inf
    err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    return err <= tol, err


def interleave(runs: dict, *, rounds: int, reps_per_round: int, sample, warmup: int = 1,
               sync=lambda: None) -> dict[str, list[float]]:
    """Round-robin over providers (the starting one rotates each round): per round and provider, `warmup`
    untimed runs, then sample(run, reps_per_round) -> list of µs per layer; samples are pooled per provider."""
    names = list(runs)
    pooled: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            for _ in range(warmup):
                runs[name]()
            sync()
            pooled[name].extend(sample(runs[name], reps_per_round))
    return pooled


def stack_step(layers, call, x, holder: dict):
    """step(): x through every layer (call(layer, y) -> y); holder['first'] keeps layer 0's output (the graph's
    static tensor once captured) for the check against the reference."""
    def step():
        y = x
        for i, layer in enumerate(layers):
            y = call(layer, y)
            if i == 0:
                holder["first"] = y
        return y
    return step


# ---------------------------------------------------------------------------------------------------------------
# one variant

def bench_variant(v, *, build_dir: str, fused_error: str | None, layers: int | None, seed: int, rounds: int,
                  reps: int, compile_mode: str, copy_gbps: float, log, backend: Backend | None = None,
                  providers: list[Provider] | None = None) -> tuple[list[dict], dict]:
    """Every provider of variant v -> (rows in registry order, with speedups; info {"compile_s", "note"}).

    fused_error: why the fused provider cannot run (its build failed), or None. compile_mode: "yes", or why the
    compiled providers are skipped. layers: --layers or None (chosen from L2 and memory). Every tensor of the
    variant is freed before this returns."""
    from bench.timing import layer_bytes

    providers = PROVIDERS if providers is None else providers
    m, B, S = v.model, v.batch, v.seq_len
    nbytes = layer_bytes(m, B, [S - 1] * B)
    common = dict(model=m.name, batch=B, seq_len=S, model_layers=m.layers, nbytes=nbytes, copy_gbps=copy_gbps)
    info = {"compile_s": None, "note": None}

    backend = backend or cuda_backend()
    gc.collect()
    backend.empty_cache()
    stacks = len({p.stack_key for p in providers if p.compile_mode is None or compile_mode == "yes"})
    per_layer, per_variant = memory_estimate(m, B, S, stacks=max(2, stacks))
    free = backend.mem_free()
    try:
        n, info["note"] = choose_layers(nbytes, requested=layers, mem_per_layer=per_layer,
                                        mem_avail=0.9 * free - per_variant)
    except BudgetError as exc:
        return [make_row(v.name, p.name, layers_timed=None, status="skipped", error=f"memory: {exc}", **common)
                for p in providers], info
    common["layers_timed"] = n

    status: dict[str, tuple[str, str | None]] = {}
    extra: dict[str, dict] = {p.name: {} for p in providers}
    samples: dict[str, list[float]] = {}
    try:
        _measure(v, n, providers, build_dir=build_dir, fused_error=fused_error, seed=seed, rounds=rounds, reps=reps,
                 compile_mode=compile_mode, status=status, extra=extra, samples=samples, info=info, log=log,
                 backend=backend)
    except Exception as exc:  # noqa: BLE001 - setup (weights, caches, reference) failed: no provider is timed
        msg = one_line(exc)
        for p in providers:
            if status.get(p.name, ("ok",))[0] == "ok":
                status[p.name] = ("error", msg)
    finally:
        # _measure's frame (layers, caches, graphs and their pools) is gone: give the memory back
        if compile_mode == "yes":
            torch._dynamo.reset()
        gc.collect()
        try:
            backend.sync()
            backend.empty_cache()
        except Exception:  # noqa: BLE001 - a dead context: the next variant reports it
            pass

    rows = []
    for p in providers:
        st, err = status.get(p.name, ("ok", None))
        stats = summarize(samples[p.name]) if st == "ok" and samples.get(p.name) else None
        if st == "ok" and stats is None:
            st, err = "error", "not timed"
        rows.append(make_row(v.name, p.name, stats=stats, status=st, error=err, **common, **extra[p.name]))
    return add_speedups(rows), info


def _measure(v, n: int, providers: list[Provider], *, build_dir, fused_error, seed, rounds, reps, compile_mode,
             status, extra, samples, info, log, backend: Backend) -> None:
    """Build the N-layer stacks, check every provider's layer-0 output, time the survivors interleaved. Results go
    into status / extra / samples / info; every tensor lives in this frame only."""
    from bench.baselines import TorchLayer
    from generator import reference
    from generator.tune import knob_dict

    m, B, S = v.model, v.batch, v.seq_len
    dev = backend.device
    dtype = reference.TORCH_DTYPES[m.dtype]
    pos = torch.full((B,), S - 1, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(B, m.hidden, generator=gen, device=dev).to(dtype)

    # which providers run at all
    for p in providers:
        if p.name == "fused" and fused_error is not None:
            status[p.name] = ("error", fused_error)
        elif p.compile_mode is not None and compile_mode != "yes":
            status[p.name] = ("skipped", compile_mode)
        elif (why := p.unavailable(v)) is not None:
            status[p.name] = ("skipped", why)

    # the reference stack: TorchLayers with random caches (never zeros: every row is read at pos = seq_len-1);
    # every other stack gets the same weights and the same cache contents
    weights = [reference.random_weights(m, seed=seed + 1 + i, device=dev) for i in range(n)]
    base = []
    for W in weights:
        layer = TorchLayer(W, m, B, S, device=dev)
        layer.k_cache.normal_(generator=gen)
        layer.v_cache.normal_(generator=gen)
        base.append(layer)
    stacks = {TorchLayer: base}
    for p in providers:
        if p.name in status or p.stack_key in stacks:
            continue
        try:
            own = []
            for W, b in zip(weights, base):
                layer = p.make_layer(v, W, build_dir=build_dir, device=dev)
                p.load_cache(layer, b.k_cache, b.v_cache)
                own.append(layer)
            stacks[p.stack_key] = own
            if isinstance(getattr(own[0], "plan", None), dict):  # the fused layer: the plan timed, for the report
                for q in providers:
                    if q.stack_key == p.stack_key:
                        extra[q.name]["knobs"] = knob_dict(own[0].plan)
        except Exception as exc:  # noqa: BLE001 - reported in this provider's rows
            msg = one_line(exc)
            for q in providers:
                if q.stack_key == p.stack_key and q.name not in status:
                    status[q.name] = ("error", msg)

    # the fp32 reference for layer 0, on clones (it appends to the caches it is given). Row seq_len-1 is rewritten
    # by every step before attention reads it, so repeated steps leave the state the reference saw.
    kc, vc = base[0].k_cache.clone(), base[0].v_cache.clone()
    ref = reference.decoder_layer(x, pos, base[0].W, kc, vc, m)
    del kc, vc

    holders = {p.name: {} for p in providers}
    runs, graphs = {}, {}
    compiled_any = False
    for p in providers:
        if p.name in status:
            continue
        try:
            if p.compile_mode is not None:
                fn = compile_layer_step(p.compile_mode, n, backend=backend.compile_backend, reset=not compiled_any)
                compiled_any = True
                graphs_before = compiled_graphs()
                t0 = time.perf_counter()
                stack_step(stacks[p.stack_key], lambda L, y, fn=fn: fn(L, y, pos), x, {})()  # compiles once
                backend.sync()
                compile_s = round(time.perf_counter() - t0, 1)
                n_graphs = compiled_graphs() - graphs_before
                info["compile_s"] = round((info["compile_s"] or 0) + compile_s, 1)
                extra[p.name].update(compile_s=compile_s, compile_graphs=n_graphs)
                if n_graphs > 1:
                    log(f"  note: torch.compile made {n_graphs} graphs for {v.name}, {p.name} "
                        "(graph breaks or recompiles)")
                call = lambda L, y, fn=fn: fn(L, y, pos)  # noqa: E731
            else:
                call = lambda L, y, p=p: p.call(L, y, pos)  # noqa: E731
            step = stack_step(stacks[p.stack_key], call, x, holders[p.name])
            if p.graph:
                graphs[p.name] = backend.graph_of(step)
                runs[p.name] = graphs[p.name].replay
            else:
                runs[p.name] = step
        except Exception as exc:  # noqa: BLE001 - one provider failing must not hide the others
            status[p.name] = ("error", one_line(exc))
            runs.pop(p.name, None)
            graphs.pop(p.name, None)

    # correctness first: a provider whose layer-0 output is off is reported, not timed
    for name in list(runs):
        try:
            runs[name]()
            backend.sync()
            ok, err = check_output(holders[name]["first"].float(), ref)
        except Exception as exc:  # noqa: BLE001
            status[name] = ("error", one_line(exc))
            del runs[name]
            continue
        extra[name]["rel_err"] = float(f"{err:.3g}") if math.isfinite(err) else None
        if not ok:
            status[name] = ("failed-check", f"rel_err {err:.2e} > {REL_TOL:.0e} vs the fp32 reference")
            del runs[name]

    per_round = max(1, math.ceil(reps / rounds))
    # a graph's replay queued (GPU time: the host's graph launch not charged to the layers, bench.timing); an eager
    # provider's host launches are what its user pays, so timed as they come
    queued = {graphs[name].replay for name in graphs}
    try:
        samples.update(interleave(runs, rounds=rounds, reps_per_round=per_round,
                                  sample=lambda run, k: backend.sample(run, n, k, queued=run in queued),
                                  sync=backend.sync))
    except Exception as exc:  # noqa: BLE001
        for name in runs:
            status[name] = ("error", f"timing: {one_line(exc)}")
    for name in runs:
        status.setdefault(name, ("ok", None))


def check_prefill(v, build_dir: str, seed: int) -> dict:
    """A prefill variant: verified against the fp32 reference at random start positions (0 and a chunk ending at the
    last cache row included), then timed as the first chunk of a prompt (start 0) against the unfused layer
    (generator.unfused: cuBLAS GEMMs + SDPA's flash kernel), both as a stack of distinct layers in a CUDA graph.
    The faster path is the variant's route (generator.routes). bench/gpu_check.py and `megakernel bench` both run it.

    v: a prefill Variant built in build_dir; seed: weights, inputs and caches. Needs a CUDA device; what loading or
    launching raises (generator.loader.LoadError, a CUDA error) propagates. Returns the row: pass, rel_err, unwritten,
    k_err, v_err, cache_untouched, first_bad_stage, overflows (verify.check_step), start_pos, knobs (the plan timed),
    layers_timed, us and unfused_us (µs per layer, medians), speedup (unfused / fused), tflops and unfused_tflops
    (projections + causal attention, TFLOP/s), gbps (the weights' bytes per fused µs, GB/s), route ("fused" or
    "unfused"), stage_us (µs per stage, one launch), clock_mhz."""
    from bench.timing import graph_of, time_replays
    from generator import reference, verify
    from generator.loader import load
    from generator.tune import knob_dict
    from generator.unfused import UnfusedLayer
    m = v.model
    row = {"variant": v.name, "mode": "prefill"}
    # (a sliding window: a cache past it, so that the check's last chunk attends through it)
    cache_len = max(PREFILL_CACHE, v.seq_len, 2 * (m.sliding_window or 0))
    W = reference.random_weights(m, seed=seed, device="cuda")
    layer = load(v.name, W, build_dir=build_dir, cache_len=cache_len)
    row["knobs"] = knob_dict(layer.plan)  # the plan timed (the report flags a build that plans otherwise)
    x, start = verify.random_inputs(layer, seed)
    res = verify.check_step(layer, x, start, weights=W)
    row.update({k: res[k] for k in ("rel_err", "unwritten", "k_err", "v_err", "cache_untouched", "first_bad_stage",
                                    "overflows")})
    row["pass"] = verify.passed(res, m.dtype)
    row["start_pos"] = start.tolist()
    del layer, res

    esize = torch.tensor([], dtype=reference.TORCH_DTYPES[m.dtype]).element_size()
    weight_bytes = sum(math.prod(s) for s in reference.weight_shapes(m).values()) * esize
    n = n_layers_for(weight_bytes)
    B, C = v.batch, v.seq_len
    zero = torch.zeros(B, dtype=torch.int32, device="cuda")
    xs = torch.randn(B, C, m.hidden, device="cuda").to(reference.TORCH_DTYPES[m.dtype])
    fused, base = [], []
    for i in range(n):
        Wi = reference.random_weights(m, seed=seed + 1 + i, device="cuda")
        fused.append(load(v.name, Wi, build_dir=build_dir, cache_len=cache_len))
        base.append(UnfusedLayer(Wi, m, torch.zeros_like(fused[-1].k_cache), torch.zeros_like(fused[-1].v_cache)))
    timings = {}
    for label, call in (("fused", lambda L, y: L.prefill(y, zero, validate=False)),
                        ("unfused", lambda L, y: L.prefill(y, zero, kv_len=C))):
        layers = fused if label == "fused" else base

        def step(layers=layers, call=call):
            y = xs
            for L in layers:
                y = call(L, y)
            return y
        timings[label] = time_replays(graph_of(step).replay, n)
    fused[0].prefill(xs, zero, validate=False)
    row["stage_us"] = {k: round(s, 1) for k, s in fused[0].stage_us().items()}  # one launch, weights from HBM
    row["clock_mhz"] = round(fused[0].clock_mhz())
    p = fused[0].plan
    att_flops = 2 * 2 * B * m.heads * m.head_dim * C * (C + 1) / 2  # causal: QK^T and PV over half the square
    flops = p["gemm_flops"] + att_flops
    row.update(layers_timed=n, us=round(timings["fused"]["median"], 1),
               unfused_us=round(timings["unfused"]["median"], 1),
               speedup=round(timings["unfused"]["median"] / timings["fused"]["median"], 2),
               tflops=round(flops / (timings["fused"]["median"] * 1e-6) / 1e12, 1),
               unfused_tflops=round(flops / (timings["unfused"]["median"] * 1e-6) / 1e12, 1),
               gbps=round(weight_bytes / (timings["fused"]["median"] * 1e-6) / 1e9, 1))
    row["route"] = "fused" if row["us"] <= row["unfused_us"] else "unfused"
    del fused, base
    torch.cuda.empty_cache()
    return row
