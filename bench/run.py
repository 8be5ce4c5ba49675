"""`megakernel bench`: the fused kernel against the unfused PyTorch layer, timed in one run on one GPU.

For every selected variant, the same work (a stack of N distinct layers, one decode step each, every sequence at
pos = seq_len-1, i.e. the full KV context) is timed for each provider:

  fused        N FusedDecoderLayer (one cooperative launch each), captured in a CUDA graph
  eager        N bench.baselines.TorchLayer, run eagerly (cuBLAS + SDPA, launch overhead included)
  torch_graph  the same TorchLayer stack captured in a CUDA graph
  compile      torch.compile(mode="default", dynamic=False) of the TorchLayer step, compiled once per variant and
               shared by its N layers, then captured in a CUDA graph (only for --compile-subset: compiling is slow)

Each provider's layer-0 output is first checked against the fp32 reference (generator.reference); one that fails is
reported, not timed. The providers are then timed interleaved (round-robin, several rounds, samples pooled) so
that clock and thermal drift hit them alike. Results: bench/results/<gpu>-<date>.json and .csv, PNG plots
(bench/plots.py) and a table printed last.

Everything that does not touch the GPU (rows, speedups, layer counts, writing, the CLI's refusal without a GPU)
is plain Python, tested on the CPU by tests/test_bench.py.
"""
from __future__ import annotations

import csv
import dataclasses
import fnmatch
import gc
import io
import json
import math
import re
import sys
import time
import types
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from bench.timing import summarize, time_samples
from generator import variants as gvariants

L2_BYTES = 60 * 2**20           # H100/H200 L2: a stack of distinct layers must not fit in it
L2_PASSES = 4                   # one pass over the stack moves at least 4x the L2
MIN_LAYERS = 8
REL_TOL = 2e-2                  # vs the fp32 reference: bf16 baselines round every intermediate
PROVIDERS = ("fused", "eager", "torch_graph", "compile")
BASELINES = ("eager", "torch_graph", "compile")
DEFAULT_COMPILE_SUBSET = ("*_b1_s4096_*",)  # five compiles keep the default run inside 10 minutes
DEFAULT_REPS = 40
DEFAULT_ROUNDS = 4
DEFAULT_TIME_BUDGET_S = 540.0   # stop starting new work after this: the whole run fits in 10 minutes
FIELDS = ["variant", "provider", "batch", "seq_len", "layers_timed", "us_median", "us_p10", "us_p90", "bytes",
          "gbps", "pct_bw", "floor_us", "tokens_per_s", "speedup_vs_eager", "speedup_vs_torch_graph",
          "speedup_vs_compile", "status", "error"]
EXTRA_FIELDS = ["model", "rel_err", "compile_s", "compile_graphs"]
POSITIONS_NOTE = "every sequence at pos = seq_len-1 (full KV context, the worst case for decode)"

console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200, highlight=False)


def fail(msg: str, code: int = 2):
    err_console.print(f"error: {msg}", markup=False, soft_wrap=True)
    sys.exit(code)


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return first[:limit]


# ---------------------------------------------------------------------------------------------------------------
# GPU-free parts: layer count, memory estimate, rows, speedups, writing

def n_layers_for(layer_bytes: int, l2: int = L2_BYTES, minimum: int = MIN_LAYERS) -> int:
    """Distinct layers so that one pass over the stack is at least L2_PASSES x the L2 (and at least `minimum`)."""
    return max(minimum, math.ceil(L2_PASSES * l2 / layer_bytes))


class BudgetError(RuntimeError):
    """The variant's stack would not fit in GPU memory (one line)."""


def choose_layers(layer_bytes: int, *, requested: int | None = None, mem_per_layer: int = 0,
                  mem_avail: float | None = None) -> tuple[int, str | None]:
    """(N, note): --layers or the default count, lowered where N layers of this variant would not fit in memory.
    Never below what keeps a pass over the stack >= L2_PASSES x L2 (BudgetError instead)."""
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


def memory_estimate(m, batch: int, seq_len: int) -> tuple[int, int]:
    """(bytes per layer, bytes per variant) of GPU memory the benchmark of one variant holds at its peak.

    Per layer: the baseline's weights and the fused layer's packed copy, both KV caches, the fused workspace.
    Per variant: the graph pools / eager temporaries of SDPA's math path (K and V expanded to every query head,
    fp32), the reference's cache clones and its fp32 per-sequence copies, and a margin."""
    from generator.reference import weight_shapes
    esize = 2
    weights = sum(math.prod(s) for s in weight_shapes(m).values()) * esize
    kv = 2 * batch * m.kv_heads * seq_len * m.head_dim * esize
    act = batch * (m.heads * m.head_dim + 2 * m.kv_heads * m.head_dim + m.hidden + 2 * m.intermediate) * 4
    per_layer = 2 * weights + 2 * kv + 2 * act
    sdpa_tmp = 2 * batch * m.heads * seq_len * m.head_dim * 4 + batch * m.heads * seq_len * 8
    ref_tmp = kv + 2 * m.heads * seq_len * m.head_dim * 4 + 4 * weights
    per_variant = 3 * sdpa_tmp + ref_tmp + (1 << 30)
    return per_layer, per_variant


def make_row(variant: str, provider: str, *, model: str, batch: int, seq_len: int, model_layers: int,
             layers_timed: int | None, nbytes: int, copy_gbps: float, stats: dict | None = None,
             status: str = "ok", error: str | None = None, **extra) -> dict:
    """One (variant, provider) row; figures from `stats` (µs per layer) where the provider was timed."""
    row = dict.fromkeys(FIELDS + EXTRA_FIELDS)
    row.update(variant=variant, provider=provider, model=model, batch=batch, seq_len=seq_len,
               layers_timed=layers_timed, bytes=int(nbytes), status=status, error=error)
    if copy_gbps:
        row["floor_us"] = round(nbytes / (copy_gbps * 1e9) * 1e6, 3)
    if stats is not None:
        us = stats["median"]
        row.update(us_median=round(us, 3), us_p10=round(stats["p10"], 3), us_p90=round(stats["p90"], 3))
        gbps = nbytes / (us * 1e-6) / 1e9
        row["gbps"] = round(gbps, 1)
        row["pct_bw"] = round(100 * gbps / copy_gbps, 1) if copy_gbps else None
        row["tokens_per_s"] = round(batch * 1e6 / (us * model_layers), 1)
    for key, value in extra.items():
        row[key] = value
    return row


def add_speedups(rows: list[dict]) -> list[dict]:
    """On each variant's fused row: speedup_vs_<baseline> = baseline median / fused median (None where the
    baseline or the fused provider was not timed). Other rows keep None."""
    by_variant: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], {})[r["provider"]] = r
    for provs in by_variant.values():
        fused = provs.get("fused")
        if fused is None:
            continue
        for b in BASELINES:
            base = provs.get(b)
            ok = (fused.get("status") == "ok" and fused.get("us_median") and base is not None
                  and base.get("status") == "ok" and base.get("us_median"))
            fused[f"speedup_vs_{b}"] = round(base["us_median"] / fused["us_median"], 3) if ok else None
    return rows


def check_output(out: torch.Tensor, ref: torch.Tensor, tol: float = REL_TOL) -> tuple[bool, float]:
    """(passed, relative error) of a provider's layer output against the fp32 reference; NaN/inf never pass."""
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return False, math.inf
    err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    return err <= tol, err


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def result_stem(out_dir: Path, gpu: str, date: str) -> str:
    """<gpu>-<date>; a second run on the same day gets -HHMMSS so it does not overwrite the first."""
    stem = f"{gpu_slug(gpu)}-{date}"
    if (out_dir / f"{stem}.json").exists():
        stem += time.strftime("-%H%M%S")
    return stem


def write_results(doc: dict, out_dir: Path, stem: str) -> tuple[Path, Path]:
    """<stem>.json (the whole document) and <stem>.csv (its rows), each written atomically."""
    from generator.compile import atomic_write
    out_dir = Path(out_dir)
    jpath, cpath = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    atomic_write(jpath, json.dumps(doc, indent=1, default=str) + "\n")
    buf = io.StringIO()
    cols = FIELDS + [c for c in EXTRA_FIELDS if any(r.get(c) is not None for r in doc["rows"])]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in doc["rows"]:
        w.writerow({k: ("" if r.get(k) is None else r[k]) for k in cols})
    atomic_write(cpath, buf.getvalue())
    return jpath, cpath


def wants_compile(name: str, subset: tuple[str, ...], no_compile: bool) -> bool:
    return not no_compile and any(fnmatch.fnmatchcase(name, g) for g in subset)


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


# ---------------------------------------------------------------------------------------------------------------
# GPU parts

@dataclasses.dataclass
class Backend:
    """Where a variant runs. The benchmark uses cuda_backend(); tests drive the same code on the CPU with
    cpu_backend() (no graphs: step() stands in for a replay; wall-clock samples)."""
    device: torch.device
    graph_of: object            # step -> object with .replay()
    sample: object              # (run, n_layers, reps) -> µs per layer, one per rep
    sync: object
    mem_free: object            # () -> free bytes
    empty_cache: object
    compile_backend: str = "inductor"


def cuda_backend() -> Backend:
    from bench.timing import graph_of

    def sync():
        torch.cuda.synchronize()
    return Backend(device=torch.device("cuda", torch.cuda.current_device()), graph_of=graph_of, sample=time_samples,
                   sync=sync, mem_free=lambda: torch.cuda.mem_get_info()[0], empty_cache=torch.cuda.empty_cache)


def cpu_backend(mem_free: float = 64e9) -> Backend:
    def fake_graph(step):
        for _ in range(2):
            step()
        return types.SimpleNamespace(replay=step)

    def sample(run, n_layers, reps):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) * 1e6 / n_layers)
        return out
    return Backend(device=torch.device("cpu"), graph_of=fake_graph, sample=sample, sync=lambda: None,
                   mem_free=lambda: mem_free, empty_cache=lambda: None, compile_backend="eager")


def _torch_layer_step(layer, x, pos):
    """What torch.compile compiles: one TorchLayer step. The layer object is an argument, so its tensors (weights,
    caches) are graph inputs guarded by shape/dtype only: one compile serves every layer of the stack."""
    return layer(x, pos)


def _stack(layers, call, x, holder: dict):
    """step(): x through every layer; holder['first'] keeps layer 0's output (the graph's static tensor once
    captured) for the check against the reference."""
    def step():
        y = x
        for i, layer in enumerate(layers):
            y = call(layer, y)
            if i == 0:
                holder["first"] = y
        return y
    return step


def _raise_recompile_limit(n: int) -> None:
    """Head room for N layers should guards ever tell them apart (a recompile each, then still compiled code)."""
    cfg = torch._dynamo.config
    attr = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    if hasattr(cfg, attr) and getattr(cfg, attr) < n:
        setattr(cfg, attr, n)


def bench_variant(v, *, build_dir: str, fused_error: str | None, layers: int | None, seed: int, rounds: int,
                  reps: int, compile_mode: str, copy_gbps: float, log, backend: Backend | None = None
                  ) -> tuple[list[dict], dict]:
    """All providers of one variant -> (rows, info). compile_mode: "yes", or why the compile provider is skipped.
    Every tensor of the variant is freed before this returns."""
    from bench.timing import layer_bytes

    m, B, S = v.model, v.batch, v.seq_len
    nbytes = layer_bytes(m, B, [S - 1] * B)
    common = dict(model=m.name, batch=B, seq_len=S, model_layers=m.layers, nbytes=nbytes, copy_gbps=copy_gbps)
    info = {"compile_s": None, "note": None}

    backend = backend or cuda_backend()
    gc.collect()
    backend.empty_cache()
    per_layer, per_variant = memory_estimate(m, B, S)
    free = backend.mem_free()
    try:
        n, info["note"] = choose_layers(nbytes, requested=layers, mem_per_layer=per_layer,
                                        mem_avail=0.9 * free - per_variant)
    except BudgetError as exc:
        return [make_row(v.name, p, layers_timed=None, status="skipped", error=f"memory: {exc}", **common)
                for p in PROVIDERS], info
    common["layers_timed"] = n

    status: dict[str, tuple[str, str | None]] = {}
    extra: dict[str, dict] = {p: {} for p in PROVIDERS}
    samples: dict[str, list[float]] = {}
    try:
        _measure(v, n, build_dir=build_dir, fused_error=fused_error, seed=seed, rounds=rounds, reps=reps,
                 compile_mode=compile_mode, status=status, extra=extra, samples=samples, info=info, log=log,
                 backend=backend)
    except Exception as exc:  # noqa: BLE001 - setup (weights, caches, reference) failed: no provider is timed
        msg = one_line(exc)
        for provider in PROVIDERS:
            if status.get(provider, ("ok",))[0] == "ok":
                status[provider] = ("error", msg)
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
    for provider in PROVIDERS:
        st, err = status.get(provider, ("ok", None))
        stats = summarize(samples[provider]) if st == "ok" and samples.get(provider) else None
        if st == "ok" and stats is None:
            st, err = "error", "not timed"
        rows.append(make_row(v.name, provider, stats=stats, status=st, error=err, **common, **extra[provider]))
    return add_speedups(rows), info


def _measure(v, n: int, *, build_dir, fused_error, seed, rounds, reps, compile_mode, status, extra, samples, info,
             log, backend: Backend) -> None:
    """Build the N-layer stacks, check every provider's layer-0 output, time the survivors interleaved. Results go
    into status / extra / samples / info; every tensor lives in this frame only."""
    from bench.baselines import TorchLayer
    from generator import reference
    from generator.loader import load

    m, B, S = v.model, v.batch, v.seq_len
    dev = backend.device
    dtype = reference.TORCH_DTYPES[m.dtype]
    pos = torch.full((B,), S - 1, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(B, m.hidden, generator=gen, device=dev).to(dtype)

    base, fused = [], []
    for i in range(n):
        W = reference.random_weights(m, seed=seed + 1 + i, device=dev)
        layer = TorchLayer(W, m, B, S, device=dev)
        layer.k_cache.normal_(generator=gen)   # random, never zeros: every row is read at pos = seq_len-1
        layer.v_cache.normal_(generator=gen)
        base.append(layer)
        if fused_error is None:
            try:
                f = load(v.name, W, build_dir=build_dir, device=dev)
                f.k_cache.copy_(layer.k_cache)  # the same cache contents for every provider
                f.v_cache.copy_(layer.v_cache)
                fused.append(f)
            except Exception as exc:  # noqa: BLE001 - reported in the fused row
                fused_error = one_line(exc)
                fused.clear()
    if fused_error is not None:
        status["fused"] = ("error", fused_error)

    # the fp32 reference for layer 0, on clones (it appends to the caches it is given). Row seq_len-1 is rewritten
    # by every step before attention reads it, so repeated steps leave the state the reference saw.
    kc, vc = base[0].k_cache.clone(), base[0].v_cache.clone()
    ref = reference.decoder_layer(x, pos, base[0].W, kc, vc, m)
    del kc, vc

    holders = {p: {} for p in PROVIDERS}
    runs, graphs = {}, {}

    def add(provider, layers_, call, graph: bool):
        step = _stack(layers_, call, x, holders[provider])
        if graph:
            graphs[provider] = backend.graph_of(step)
            runs[provider] = graphs[provider].replay
        else:
            runs[provider] = step

    compiled = None
    for provider in PROVIDERS:
        if provider in status:
            continue
        if provider == "compile" and compile_mode != "yes":
            status[provider] = ("skipped", compile_mode)
            continue
        try:
            if provider == "fused":
                add("fused", fused, lambda L, y: L(y, pos, validate=False), True)
            elif provider == "eager":
                add("eager", base, lambda L, y: L(y, pos), False)
            elif provider == "torch_graph":
                add("torch_graph", base, lambda L, y: L(y, pos), True)
            else:
                from torch._dynamo.utils import counters
                _raise_recompile_limit(n + 4)
                torch._dynamo.reset()
                counters.clear()
                if backend.compile_backend == "inductor":
                    compiled = torch.compile(_torch_layer_step, mode="default", dynamic=False)
                else:
                    compiled = torch.compile(_torch_layer_step, backend=backend.compile_backend, dynamic=False)
                t0 = time.perf_counter()
                _stack(base, lambda L, y: compiled(L, y, pos), x, {})()  # compiles once, for layer 0
                backend.sync()
                info["compile_s"] = round(time.perf_counter() - t0, 1)
                n_graphs = int(counters["stats"]["unique_graphs"])
                extra["compile"].update(compile_s=info["compile_s"], compile_graphs=n_graphs)
                if n_graphs > 1:
                    log(f"  note: torch.compile made {n_graphs} graphs for {v.name} (graph breaks or recompiles)")
                add("compile", base, lambda L, y: compiled(L, y, pos), True)
        except Exception as exc:  # noqa: BLE001 - one provider failing must not hide the others
            status[provider] = ("error", one_line(exc))
            runs.pop(provider, None)
            graphs.pop(provider, None)

    # correctness first: a provider whose layer-0 output is off is reported, not timed
    for provider in list(runs):
        try:
            runs[provider]()
            backend.sync()
            ok, err = check_output(holders[provider]["first"].float(), ref)
        except Exception as exc:  # noqa: BLE001
            status[provider] = ("error", one_line(exc))
            del runs[provider]
            continue
        extra[provider]["rel_err"] = float(f"{err:.3g}") if math.isfinite(err) else None
        if not ok:
            status[provider] = ("failed-check", f"rel_err {err:.2e} > {REL_TOL:.0e} vs the fp32 reference")
            del runs[provider]

    per_round = max(1, math.ceil(reps / rounds))
    try:
        samples.update(interleave(runs, rounds=rounds, reps_per_round=per_round,
                                  sample=lambda run, k: backend.sample(run, n, k), sync=backend.sync))
    except Exception as exc:  # noqa: BLE001
        for provider in runs:
            status[provider] = ("error", f"timing: {one_line(exc)}")
    for provider in runs:
        status.setdefault(provider, ("ok", None))


def _versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import cupy
        out["cupy"] = cupy.__version__
        out["driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception:  # noqa: BLE001
        out["cupy"] = None
    return out


def require_cuda() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        fail(f"megakernel bench needs a CUDA GPU, and torch (version {torch.__version__}, {build}) sees none")


# ---------------------------------------------------------------------------------------------------------------
# output

def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def print_table(doc: dict, con: Console | None = None) -> None:
    """One line per variant: the fused figures, each baseline's median, the speedups."""
    con = con or console
    by_variant: dict[str, dict[str, dict]] = {}
    for r in doc["rows"]:
        by_variant.setdefault(r["variant"], {})[r["provider"]] = r
    t = Table(title=f"megakernel bench: µs per layer (median of {doc['settings']['reps']} replays, "
                    f"p10-p90), {doc['gpu']}", header_style="bold", show_lines=False)
    for h in ("variant", "N", "fused µs", "p10-p90", "% BW", "floor µs", "eager µs", "graph µs", "compile µs",
              "× eager", "× graph", "× compile", "tok/s (fused)", "notes"):
        if h == "notes":  # the full messages are logged above the table
            t.add_column(h, justify="left", no_wrap=True, overflow="ellipsis", max_width=70)
        else:
            t.add_column(h, justify="left" if h == "variant" else "right", no_wrap=True)

    def med(r):
        if r is None:
            return "-"
        if r["status"] == "ok":
            return _fmt(r["us_median"])
        return {"skipped": "[dim]skip[/dim]", "failed-check": "[red]WRONG[/red]"}.get(r["status"], "[red]ERR[/red]")

    for name, provs in by_variant.items():
        f = provs.get("fused") or {}
        notes = [f"{p}: {r['error']}" for p, r in provs.items()
                 if r["status"] not in ("ok", "skipped") and r.get("error")]
        notes += [f"{p}: {r['error']}" for p, r in provs.items() if r["status"] == "skipped"
                  and r.get("error") and not (p == "compile" and r["error"].startswith("not in"))]
        spd = []
        for b in BASELINES:
            s = f.get(f"speedup_vs_{b}")
            spd.append("-" if s is None else (f"[green]{s:.2f}[/green]" if s >= 1 else f"[red]{s:.2f}[/red]"))
        t.add_row(name, _fmt(f.get("layers_timed"), "d"), med(f),
                  f"{_fmt(f.get('us_p10'))}-{_fmt(f.get('us_p90'))}" if f.get("us_p10") is not None else "-",
                  _fmt(f.get("pct_bw")), _fmt(f.get("floor_us")), med(provs.get("eager")),
                  med(provs.get("torch_graph")), med(provs.get("compile")), *spd, _fmt(f.get("tokens_per_s"), ",.0f"),
                  "; ".join(notes))
    s = doc["settings"]
    t.caption = (f"copy bandwidth {doc['copy_gbps']:.0f} GB/s (read + write) · positions: {POSITIONS_NOTE} · "
                 f"torch.compile only for {' '.join(s['compile_subset']) if not s['no_compile'] else 'none'} · "
                 f"tok/s for a model of that depth · elapsed {doc['elapsed_s']:.0f} s")
    con.print(t)


# ---------------------------------------------------------------------------------------------------------------
# command

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--variants", "variants_file", default="variants.yaml", show_default=True, help="variants file")
@click.option("--only", multiple=True, help="glob over variant names (repeatable)")
@click.option("--build-dir", default="build", show_default=True, help="build directory (built first; cached)")
@click.option("--out-dir", default="bench/results", show_default=True, help="where results and plots go")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="distinct layers per stack [enough that one pass is >= 4x the 60 MB L2, at least 8; fewer "
                   "where GPU memory would not hold them]")
@click.option("--reps", type=click.IntRange(min=1), default=DEFAULT_REPS, show_default=True,
              help="timed replays of the stack per provider (spread over the rounds)")
@click.option("--rounds", type=click.IntRange(min=1), default=DEFAULT_ROUNDS, show_default=True,
              help="round-robin rounds over the providers")
@click.option("--compile-subset", multiple=True, default=DEFAULT_COMPILE_SUBSET, show_default=True,
              help="glob over variant names that get the torch.compile provider (repeatable; '*' for all) "
                   "[batch 1 and 8 at seq_len 4096: compiling is slow]")
@click.option("--no-compile", is_flag=True, help="no torch.compile provider at all")
@click.option("--seed", type=int, default=None, help="random weights, inputs and caches [fresh from the clock]")
@click.option("--arch", default="90", show_default=True, help="SM architecture for the build (90 = sm_90)")
@click.option("--time-budget", type=click.FloatRange(min=0), default=DEFAULT_TIME_BUDGET_S, show_default=True,
              help="seconds after which no new variant or compile is started (0: no limit)")
@click.option("--no-plots", is_flag=True, help="do not write PNG plots")
def cli(variants_file, only, build_dir, out_dir, layers, reps, rounds, compile_subset, no_compile, seed, arch,
        time_budget, no_plots):
    """Time the fused kernel against eager PyTorch, a CUDA graph of it and torch.compile, on this GPU.

    Every provider runs the same stack of distinct layers (random weights, random KV caches) with
    every sequence at pos = seq_len-1 (full context); outputs are checked against the fp32 reference first."""
    t_start = time.perf_counter()
    require_cuda()
    try:
        vs = gvariants.load(variants_file)
    except gvariants.VariantError as exc:
        fail(str(exc))
    vs = gvariants.select(vs, tuple(only))
    if not vs:
        fail(f"{variants_file}: no variant matches --only {' '.join(only)}")
    if not re.fullmatch(r"\d{2,3}a?", arch):
        fail(f"--arch: expected digits such as 90 or 90a, got '{arch}'")
    seed = seed if seed is not None else int(time.time()) % 100000
    out_dir = Path(out_dir)
    log = lambda msg: console.print(msg, markup=False, soft_wrap=True)  # noqa: E731

    from generator import compile as gcompile
    log(f"building {len(vs)} variants into {build_dir}/ (cached: only what changed is compiled)")
    t0 = time.perf_counter()
    try:
        result = gcompile.build(vs, build_dir, arch=arch)
    except Exception as exc:  # noqa: BLE001 - no compiler, unwritable build dir...
        fail(f"build failed: {one_line(exc)}")
    built = {e["name"]: e for e in result["entries"]}
    n_ok = sum(1 for e in built.values() if e["status"] == "ok")
    log(f"build: {n_ok}/{len(vs)} variants ok, {result['distinct']} binaries, {time.perf_counter() - t0:.1f} s")
    for e in built.values():
        if e["status"] != "ok":
            log(f"  {e['name']}: {e['status']}: {e.get('error', '').splitlines()[0] if e.get('error') else ''}")

    from bench.timing import copy_bandwidth
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth()
    torch.cuda.empty_cache()
    backend = cuda_backend()
    n_compile = sum(wants_compile(v.name, compile_subset, no_compile) for v in vs)
    log(f"{gpu}: copy bandwidth {copy_gbps:.0f} GB/s (read + write); seed {seed}")
    log(f"positions: {POSITIONS_NOTE}; caches filled with random values")
    if no_compile:
        log("torch.compile: off (--no-compile)")
    else:
        dflt = " (the default: batch 1 and 8 at seq_len 4096; --compile-subset '*' for all)" \
            if tuple(compile_subset) == DEFAULT_COMPILE_SUBSET else ""
        log(f"torch.compile (mode=default, dynamic=False, then a CUDA graph): {n_compile} of {len(vs)} variants, "
            f"those matching {' '.join(compile_subset)}{dflt}")

    date = time.strftime("%Y-%m-%d")
    stem = result_stem(out_dir, gpu, date)
    doc = {"gpu": gpu, "date": date, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "copy_gbps": round(copy_gbps, 1),
           **_versions(),
           "settings": {"variants_file": str(variants_file), "only": list(only), "layers": layers, "reps": reps,
                        "rounds": rounds, "compile_subset": list(compile_subset), "no_compile": no_compile,
                        "seed": seed, "positions": "seq_len-1", "l2_bytes": L2_BYTES, "l2_passes": L2_PASSES,
                        "rel_tol": REL_TOL, "time_budget_s": time_budget, "arch": arch},
           "elapsed_s": None, "complete": False, "rows": []}

    est_variant, est_compile = 15.0, 90.0  # first guesses, replaced by what this run measures
    seen_variant, seen_compile = [], []
    for i, v in enumerate(vs, 1):
        elapsed = time.perf_counter() - t_start
        e = built.get(v.name, {})
        fused_error = None if e.get("status") == "ok" else \
            f"build {e.get('status', 'missing')}: {(e.get('error') or '').splitlines()[0] if e.get('error') else ''}"
        common = dict(model=v.model.name, batch=v.batch, seq_len=v.seq_len, model_layers=v.model.layers,
                      layers_timed=None, copy_gbps=copy_gbps)
        if time_budget and elapsed + est_variant > time_budget:
            from bench.timing import layer_bytes
            nb = layer_bytes(v.model, v.batch, [v.seq_len - 1] * v.batch)
            doc["rows"] += [make_row(v.name, p, nbytes=nb, status="skipped",
                                     error=f"time budget ({time_budget:.0f} s) spent", **common) for p in PROVIDERS]
            log(f"[{i}/{len(vs)}] {v.name}: skipped (time budget {time_budget:.0f} s spent)")
            continue
        if not wants_compile(v.name, compile_subset, no_compile):
            compile_mode = "--no-compile" if no_compile else "not in --compile-subset"
        elif time_budget and elapsed + est_variant + est_compile > time_budget:
            compile_mode = f"time budget ({time_budget:.0f} s): no time left to compile"
        else:
            compile_mode = "yes"
        tv = time.perf_counter()
        rows, info = bench_variant(v, build_dir=build_dir, fused_error=fused_error, layers=layers, seed=seed,
                                   rounds=rounds, reps=reps, compile_mode=compile_mode, copy_gbps=copy_gbps, log=log,
                                   backend=backend)
        dt = time.perf_counter() - tv
        if info["compile_s"] is not None:
            seen_compile.append(info["compile_s"])
            est_compile = 1.25 * max(seen_compile)
        seen_variant.append(dt - (info["compile_s"] or 0))
        est_variant = 1.5 * max(seen_variant)
        doc["rows"] += rows
        doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_results(doc, out_dir, stem)  # after every variant: a killed run still leaves what it measured
        by = {r["provider"]: r for r in rows}
        parts = []
        for p in PROVIDERS:
            r = by[p]
            parts.append(f"{p} {r['us_median']:.1f}" if r["status"] == "ok" else f"{p} {r['status']}")
        sp = by["fused"].get("speedup_vs_torch_graph")
        log(f"[{i}/{len(vs)}] {v.name}: N={by['fused']['layers_timed']}, µs/layer: " + ", ".join(parts)
            + (f"; ×{sp:.2f} vs torch_graph" if sp else "")
            + (f"; compile {info['compile_s']:.0f} s" if info["compile_s"] is not None else "")
            + (f"; {info['note']}" if info["note"] else "") + f" ({dt:.1f} s, total {time.perf_counter() - t_start:.0f} s)")
        for r in rows:
            if r["status"] in ("error", "failed-check"):
                log(f"  {r['provider']}: {r['status']}: {r['error']}")

    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    doc["complete"] = True
    jpath, cpath = write_results(doc, out_dir, stem)
    written = [jpath, cpath]
    if not no_plots:
        try:
            from bench import plots
            written += plots.plot_results(jpath, out_dir)
        except Exception as exc:  # noqa: BLE001 - the numbers are written; a plot problem must not lose them
            log(f"warning: plots not written: {one_line(exc)}")
    log("wrote " + ", ".join(str(p) for p in written))
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    print_table(doc)
    if any(r["provider"] == "fused" and r["status"] == "failed-check" for r in doc["rows"]):
        sys.exit(1)  # a fused kernel computed a wrong layer: the table says which


if __name__ == "__main__":
    cli()
