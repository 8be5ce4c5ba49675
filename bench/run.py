"""`megakernel bench`, the command: the fused kernel against the unfused PyTorch layer, timed in one run on one GPU.

The parts live in one module each:

  bench/providers.py  the providers (fused, torch eager, torch + CUDA graph, torch.compile + graph) and their
                      registry: how each layer stack is built and called
  bench/measure.py    layer-count choice, memory and time budget, the reference check, interleaved sampling
  bench/results.py    rows, speedups (against each baseline and the fastest one), JSON/CSV files and their names
  bench/run.py        this file: the click command, its log lines and the table printed last

Each provider's layer-0 output is first checked against the fp32 reference (generator.reference); one that fails is
reported, not timed. Results: bench/results/<gpu>-<date>.json and .csv, PNG plots (bench/plots.py) and a table.
Everything that does not touch the GPU is plain Python, tested on the CPU by tests/test_bench.py.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from bench.measure import (DEFAULT_COMPILE_SUBSET, DEFAULT_REPS, DEFAULT_ROUNDS, DEFAULT_TIME_BUDGET_S, L2_BYTES,
                           L2_PASSES, REL_TOL, TimeBudget, bench_variant, cuda_backend, one_line, wants_compile)
from bench.providers import PROVIDERS
from bench.results import POSITIONS_NOTE, make_row, result_stem, write_results
from generator import variants as gvariants
from generator.cli import console_width, pick_tuning_file, tuned_opts

COMPILE_SUBSET_NOTE = "batch 1 at seq_len 4096, one variant per model: compiling is slow"

console = Console(width=console_width(sys.stdout, 200), highlight=False)
err_console = Console(stderr=True, width=console_width(sys.stderr, 200), highlight=False)


def fail(msg: str, code: int = 2):
    """One `error:` line on stderr, then exit `code`."""
    err_console.print(f"error: {msg}", markup=False, soft_wrap=True)
    sys.exit(code)


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
    """Exit 2 with one line where torch sees no CUDA GPU (checked before anything is built or loaded)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        fail(f"megakernel bench needs a CUDA GPU, and torch (version {torch.__version__}, {build}) sees none")


# ---------------------------------------------------------------------------------------------------------------
# output

def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def print_table(doc: dict, con: Console | None = None) -> None:
    """One line per variant: the fused figures, each provider's median µs per layer, the speedup against the
    fastest baseline timed and which one it was (per-baseline speedups are in the JSON/CSV)."""
    con = con or console
    by_variant: dict[str, dict[str, dict]] = {}
    for r in doc["rows"]:
        by_variant.setdefault(r["variant"], {})[r["provider"]] = r
    present = [p for p in PROVIDERS if p.baseline and any(p.name in provs for provs in by_variant.values())]
    t = Table(title=f"megakernel bench: µs per layer (median of {doc['settings']['reps']} replays, "
                    f"p10-p90), {doc['gpu']}", header_style="bold", show_lines=False)
    heads = ["variant", "N", "fused µs", "p10-p90", "% BW", "floor µs", *[f"{p.label} µs" for p in present],
             "× best", "best", "tok/s (fused)", "notes"]
    for h in heads:
        if h == "notes":  # the full messages are logged above the table
            t.add_column(h, justify="left", no_wrap=True, overflow="ellipsis", max_width=70)
        else:
            t.add_column(h, justify="left" if h in ("variant", "best") else "right", no_wrap=True)

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
                  and r.get("error") and not r["error"].startswith("not in")]
        s = f.get("speedup_vs_best")
        best = "-" if s is None else (f"[green]{s:.2f}[/green]" if s >= 1 else f"[red]{s:.2f}[/red]")
        t.add_row(name, _fmt(f.get("layers_timed"), "d"), med(f),
                  f"{_fmt(f.get('us_p10'))}-{_fmt(f.get('us_p90'))}" if f.get("us_p10") is not None else "-",
                  _fmt(f.get("pct_bw")), _fmt(f.get("floor_us")), *[med(provs.get(p.name)) for p in present],
                  best, f.get("best_baseline") or "-", _fmt(f.get("tokens_per_s"), ",.0f"), "; ".join(notes))
    s = doc["settings"]
    t.caption = (f"copy bandwidth {doc['copy_gbps']:.0f} GB/s (read + write) · positions: {POSITIONS_NOTE} · "
                 f"torch.compile only for {' '.join(s['compile_subset']) if not s['no_compile'] else 'none'} · "
                 f"× best: the fastest baseline's µs / fused µs · "
                 f"tok/s for a model of that depth · elapsed {doc['elapsed_s']:.0f} s")
    con.print(t)


def bench_prefill(vs, built: dict, build_dir: str, seed: int, doc: dict, out_dir, stem, budget, log) -> list[dict]:
    """Prefill variants `vs` (built: the build's manifest entries by name): bench.measure.check_prefill each
    (verified, then fused vs the unfused layer as a prompt's first chunk), appended to doc["prefill"] and the
    results file rewritten after every variant. A variant not timed gets a row with "status" and "error" and no "us":
    "skipped" (not built, or the time budget spent) or "error" (it raised). Returns doc["prefill"]."""
    from bench.measure import check_prefill
    rows = doc.setdefault("prefill", [])
    for i, v in enumerate(vs, 1):
        e = built.get(v.name, {})
        if e.get("status") != "ok":
            row = {"variant": v.name, "mode": "prefill", "status": "skipped",
                   "error": f"build {e.get('status', 'missing')}"}
        elif not budget.allows_variant():
            row = {"variant": v.name, "mode": "prefill", "status": "skipped",
                   "error": f"time budget ({budget.seconds:.0f} s) spent"}
        else:
            tv = time.perf_counter()
            try:
                row = check_prefill(v, build_dir, seed)
            except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
                row = {"variant": v.name, "mode": "prefill", "status": "error", "error": one_line(exc)}
            budget.record(time.perf_counter() - tv, None)
        rows.append(row)
        write_results(doc, out_dir, stem)
        log(f"[prefill {i}/{len(vs)}] {v.name}: " + (
            f"fused {row['us']:.1f} µs, unfused {row['unfused_us']:.1f} µs, ×{row['speedup']:.2f}, route "
            f"{row['route']}" + ("" if row["pass"] else f"; FAILED the reference check (rel. err {row['rel_err']:.1e})")
            if "us" in row else row["error"]))
    return rows


def print_prefill(rows: list[dict], con: Console | None = None) -> None:
    """The prefill rows: µs and TFLOP/s of the fused and the unfused layer, × unfused, the route."""
    con = con or console
    t = Table(title="prefill: a prompt's first chunk (start 0), per layer, stack of distinct layers, CUDA graph")
    t.add_column("variant", no_wrap=True, min_width=max([len(r["variant"]) for r in rows] + [7]))
    for c in ("rel. err", "fused µs", "TFLOP/s", "unfused µs", "TFLOP/s", "× unfused", "route"):
        t.add_column(c, justify="left" if c == "route" else "right")
    for r in rows:
        if "us" not in r:
            t.add_row(r["variant"], "-", "-", "-", "-", "-", "-", f"{r.get('status', 'error')}: {r['error']}")
            continue
        t.add_row(r["variant"], f"{r['rel_err']:.1e}" + ("" if r["pass"] else " [red]FAIL[/red]"),
                  f"{r['us']:.1f}", f"{r['tflops']:.1f}", f"{r['unfused_us']:.1f}", f"{r['unfused_tflops']:.1f}",
                  f"{r['speedup']:.2f}", r["route"] if r["pass"] else "-")
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
                   f"[the default: {COMPILE_SUBSET_NOTE}]")
@click.option("--no-compile", is_flag=True, help="no torch.compile provider at all")
@click.option("--seed", type=int, default=None, help="random weights, inputs and caches [fresh from the clock]")
@click.option("--arch", default="90", show_default=True, help="SM architecture for the build (90 = sm_90)")
@click.option("--time-budget", type=click.FloatRange(min=0), default=DEFAULT_TIME_BUDGET_S, show_default=True,
              help="seconds after which no new variant or compile is started (0: no limit)")
@click.option("--no-plots", is_flag=True, help="do not write PNG plots")
@click.option("--routes-dir", default=None, help="where the prefill variants' measured routes are recorded "
                                                  "[routes/ of this project, which the runtime reads]")
@tuned_opts
def cli(variants_file, only, build_dir, out_dir, layers, reps, rounds, compile_subset, no_compile, seed, arch,
        time_budget, no_plots, routes_dir, tuned_for, no_tuned):
    """Time the fused kernel against its baselines on this GPU: eager PyTorch, a CUDA graph of it, torch.compile,
    the serving-style layer (merged projections, FlashAttention's varlen decode, max-autotune, CUDA graph) and
    FlashInfer's layer where FlashInfer is installed (bench/providers.py PROVIDERS; the compiled ones on a subset).

    Decode: every provider runs the same stack of distinct layers (random weights, random KV caches) with
    every sequence at pos = seq_len-1 (full context); outputs are checked against the fp32 reference first.
    Prefill: each variant verified, then timed as a prompt's first chunk against the unfused layer (cuBLAS + SDPA,
    CUDA graph); the faster path is recorded as its route in routes/<gpu>.json, which the runtime follows."""
    t_start = time.perf_counter()
    require_cuda()
    try:
        vs = gvariants.load(variants_file)
    except gvariants.VariantError as exc:
        fail(str(exc))
    vs = gvariants.select(vs, tuple(only))
    # tensor-parallel variants need one process per GPU: bench/tp_check.py (torchrun) times them
    vs = [v for v in vs if v.tp == 1]
    if not vs:
        sel = f" matches --only {' '.join(only)}" if only else ""
        fail(f"{variants_file}: no single-GPU variant{sel} (tp > 1: bench/tp_check.py)")
    if not re.fullmatch(r"\d{2,3}a?", arch):
        fail(f"--arch: expected digits such as 90 or 90a, got '{arch}'")
    seed = seed if seed is not None else int(time.time()) % 100000
    out_dir = Path(out_dir)
    log = lambda msg: console.print(msg, markup=False, soft_wrap=True)  # noqa: E731

    from generator import compile as gcompile, toolchain, tune as gtune
    try:
        toolchain.find_nvcc()
    except toolchain.ToolchainError as exc:
        fail(str(exc))
    tfile = pick_tuning_file(tuned_for, no_tuned)  # the plans `megakernel build` takes: timed as they are served
    log(f"building {len(vs)} variants into {build_dir}/ (cached: only what changed is compiled)")
    t0 = time.perf_counter()
    try:
        result = gcompile.build(vs, build_dir, arch=arch, variants_file=variants_file, tuning_file=tfile)
    except Exception as exc:  # noqa: BLE001 - no compiler, unwritable build dir...
        fail(f"build failed: {one_line(exc)}")
    built = {e["name"]: e for e in result["entries"]}
    n_ok = sum(1 for e in built.values() if e["status"] == "ok")
    n_tuned = sum(e.get("plan_source", "").startswith("tuned") for e in built.values())
    log(f"build: {n_ok}/{len(vs)} variants ok, {result['distinct']} binaries, {time.perf_counter() - t0:.1f} s; "
        f"plans: {n_tuned} tuned" + (f" ({gtune.display(tfile)})" if tfile else "") + ", the rest default")
    for w in result.get("warnings", []) + result.get("replans", []):
        log(f"  {w}")
    for e in built.values():
        if e["status"] != "ok":
            log(f"  {e['name']}: {e['status']}: {e.get('error', '').splitlines()[0] if e.get('error') else ''}")

    # prefill variants after the decode ones, timed as bench/gpu_check.py times them (bench_prefill)
    prefill = [v for v in vs if v.mode == "prefill"]
    vs = [v for v in vs if v.mode != "prefill"]
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
        dflt = f" (the default: {COMPILE_SUBSET_NOTE}; --compile-subset '*' for all)" \
            if tuple(compile_subset) == DEFAULT_COMPILE_SUBSET else ""
        modes = ", ".join(f"{p.name}: mode={p.compile_mode}" for p in PROVIDERS if p.compile_mode)
        log(f"torch.compile ({modes}; dynamic=False, then a CUDA graph): {n_compile} of {len(vs)} variants, "
            f"those matching {' '.join(compile_subset)}{dflt}")

    date = time.strftime("%Y-%m-%d")
    stem = result_stem(out_dir, gpu, date)
    doc = {"gpu": gpu, "date": date, "time": time.strftime("%H:%M:%S"), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "copy_gbps": round(copy_gbps, 1),
           **_versions(),
           "settings": {"variants_file": str(variants_file), "only": list(only), "layers": layers, "reps": reps,
                        "rounds": rounds, "compile_subset": list(compile_subset), "no_compile": no_compile,
                        "seed": seed, "positions": "seq_len-1", "l2_bytes": L2_BYTES, "l2_passes": L2_PASSES,
                        "rel_tol": REL_TOL, "time_budget_s": time_budget, "arch": arch,
                        "tuning_file": gtune.display(tfile) if tfile else None},
           "elapsed_s": None, "complete": False, "rows": []}

    budget = TimeBudget(time_budget, t_start)
    for i, v in enumerate(vs, 1):
        e = built.get(v.name, {})
        fused_error = None if e.get("status") == "ok" else \
            f"build {e.get('status', 'missing')}: {(e.get('error') or '').splitlines()[0] if e.get('error') else ''}"
        common = dict(model=v.model.name, batch=v.batch, seq_len=v.seq_len, model_layers=v.model.layers,
                      layers_timed=None, copy_gbps=copy_gbps)
        if not budget.allows_variant():
            from bench.timing import layer_bytes
            nb = layer_bytes(v.model, v.batch, [v.seq_len - 1] * v.batch)
            doc["rows"] += [make_row(v.name, p.name, nbytes=nb, status="skipped",
                                     error=f"time budget ({time_budget:.0f} s) spent", **common)
                           for p in PROVIDERS]
            log(f"[{i}/{len(vs)}] {v.name}: skipped (time budget {time_budget:.0f} s spent)")
            continue
        if not wants_compile(v.name, compile_subset, no_compile):
            compile_mode = "--no-compile" if no_compile else "not in --compile-subset"
        elif not budget.allows_compile():
            compile_mode = f"time budget ({time_budget:.0f} s): no time left to compile"
        else:
            compile_mode = "yes"
        tv = time.perf_counter()
        rows, info = bench_variant(v, build_dir=build_dir, fused_error=fused_error, layers=layers, seed=seed,
                                   rounds=rounds, reps=reps, compile_mode=compile_mode, copy_gbps=copy_gbps, log=log,
                                   backend=backend)
        dt = time.perf_counter() - tv
        budget.record(dt, info["compile_s"])
        doc["rows"] += rows
        doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_results(doc, out_dir, stem)  # after every variant: a killed run still leaves what it measured
        by = {r["provider"]: r for r in rows}
        parts = []
        for p in PROVIDERS:
            r = by[p.name]
            parts.append(f"{p.name} {r['us_median']:.1f}" if r["status"] == "ok" else f"{p.name} {r['status']}")
        sp, best = by["fused"].get("speedup_vs_best"), by["fused"].get("best_baseline")
        log(f"[{i}/{len(vs)}] {v.name}: N={by['fused']['layers_timed']}, µs/layer: " + ", ".join(parts)
            + (f"; ×{sp:.2f} vs {best} (the fastest baseline)" if sp else "")
            + (f"; compile {info['compile_s']:.0f} s" if info["compile_s"] is not None else "")
            + (f"; {info['note']}" if info["note"] else "") + f" ({dt:.1f} s, total {time.perf_counter() - t_start:.0f} s)")
        for r in rows:
            if r["status"] in ("error", "failed-check"):
                log(f"  {r['provider']}: {r['status']}: {r['error']}")

    routes_path = None
    if prefill:
        bench_prefill(prefill, built, build_dir, seed, doc, out_dir, stem, budget, log)
        from generator import routes
        routes_path = routes.record_checked(gpu, doc["prefill"], routes_dir, date)  # rows' route: the path recorded
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
    if doc["rows"]:
        print_table(doc)
    if prefill:
        print_prefill(doc["prefill"])
        if routes_path:
            from generator.routes import ROUTE_MARGIN
            log(f"routes: {sum('us' in r for r in doc['prefill'])} prefill variants recorded in {routes_path} (the "
                "runtime follows them; a variant that failed its check routes unfused; a route flips only beyond "
                f"{ROUTE_MARGIN:.0%})")
    if any(r["provider"] == "fused" and r["status"] == "failed-check" for r in doc["rows"]) or \
            any("us" in r and not r["pass"] for r in doc.get("prefill", [])):
        sys.exit(1)  # a fused kernel computed a wrong layer: the tables say which


if __name__ == "__main__":
    cli()
