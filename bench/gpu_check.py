"""The one-call GPU check: build, run the GPU tests, verify every variant (declared, and the held-out shapes of
bench/heldout.yaml that no plan was tuned for) against the reference on fresh random inputs, time it against the
unfused torch layer in a CUDA graph, the serving-style layer (bench/serving_layer.py: merged q/k/v and gate/up
GEMMs, torch.compile max-autotune, CUDA graph; on the --serving rows while --serving-budget lasts: its compile takes
tens of seconds a shape) and the FlashInfer layer (where FlashInfer is installed and has kernels for the shape), and
print a table last. "x best" is against the fastest baseline timed for the row.

    python bench/gpu_check.py [--variants FILE] [--heldout FILE] [--only GLOB ...] [--no-tests] [--out DIR]

Details go to $OUT (or --out): gpu_check.json and the pytest log.
"""
from __future__ import annotations

import fnmatch
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import HELP, run_click  # noqa: E402
from bench.baselines import TorchLayer  # noqa: E402
from bench.providers import FlashInfer, ServingCompileGraph, compile_layer_step, compiled_graphs  # noqa: E402
# n_layers_for: distinct layers, one pass over the stack >= 4x the L2
from bench.measure import check_prefill, mixed_positions, n_layers_for  # noqa: E402
from bench.timing import copy_bandwidth, graph_of, layer_bytes, time_replays  # noqa: E402
from generator import compile as gcompile, reference, variants as gvariants, verify  # noqa: E402
from generator.loader import load  # noqa: E402
from generator.report import path_cell  # noqa: E402
from generator.tune import knob_dict  # noqa: E402


def check_variant(v, build_dir: str, seed: int, bw: float, serving: bool = False) -> dict:
    """Verify decode variant `v` (built in build_dir) and time it, a stack of distinct layers at full context (and
    at a serving mix of positions where batch > 1), against the unfused torch layer, FlashInfer's where it runs and,
    with `serving`, the serving-style compiled layer (row["serving"]: "ok", or why it was not timed). Returns the
    row (µs a layer, % of the copy bandwidth `bw` GB/s, speedups, each baseline's rel_err)."""
    m = v.model
    row = {"variant": v.name}
    W = reference.random_weights(m, seed=seed, device="cuda")
    layer = load(v.name, W, build_dir=build_dir)
    row["load_ms"] = round(layer.load_ms, 2)
    row["knobs"] = knob_dict(layer.plan)
    row["path"] = path_cell(layer.plan["consts"]) or ""  # (the plan column's; WINDOW too, which knobs lack)
    x, pos = verify.random_inputs(layer, seed)
    res = verify.check_step(layer, x, pos, weights=W)
    row.update({k: res[k] for k in ("rel_err", "unwritten", "k_err", "v_err", "cache_untouched", "first_bad_stage",
                                    "overflows")})
    row["pass"] = verify.passed(res, m.dtype)
    del layer

    # timing: a stack of distinct layers, every sequence at full context (the worst case for decode)
    pos_full = torch.full((v.batch,), v.seq_len - 1, dtype=torch.int32)
    nbytes = layer_bytes(m, v.batch, pos_full)
    n = n_layers_for(nbytes)
    pos_dev = pos_full.cuda()
    xs = torch.randn(v.batch, m.hidden, device="cuda").to(reference.TORCH_DTYPES[m.dtype])
    fused, base, fi, sv = [], [], [], []
    fi_provider, sv_provider = FlashInfer(), ServingCompileGraph()
    row["flashinfer"] = fi_provider.unavailable(v) or "ok"
    row["serving"] = "ok" if serving else "not timed (--serving, --serving-budget)"
    for i in range(n):
        Wi = reference.random_weights(m, seed=seed + 1 + i, device="cuda")
        fused.append(load(v.name, Wi, build_dir=build_dir))
        base.append(TorchLayer(Wi, m, v.batch, v.seq_len))
        for c in (fused[-1].k_cache, fused[-1].v_cache):
            c.normal_()
        base[-1].k_cache.copy_(fused[-1].k_cache)
        base[-1].v_cache.copy_(fused[-1].v_cache)
        for name, prov, layers in (("serving", sv_provider, sv), ("flashinfer", fi_provider, fi)):
            if row[name] == "ok":
                try:
                    layers.append(prov.make_layer(v, Wi, build_dir=build_dir, device="cuda"))
                    prov.load_cache(layers[-1], fused[-1].k_cache, fused[-1].v_cache)
                    if name == "serving":  # which attention it runs (bench/serving_layer.py's two paths)
                        row["serving_attention"] = layers[-1].attention
                except Exception as exc:  # noqa: BLE001 - the baseline failing must not hide the fused result
                    row[name] = f"error: {type(exc).__name__}: {exc}"[:200]
                    layers.clear()

    def stack(layers, p=pos_dev):
        def step():
            y = xs
            for L in layers:
                y = L(y, p, validate=False) if hasattr(L, "launch") else L(y, p)
            return y
        return step

    if sv:  # compiled once for the stack's shape (the layer is an argument: bench.providers.torch_layer_step)
        fn = compile_layer_step(sv_provider.compile_mode, n)
        t0 = time.perf_counter()
        try:
            fn(sv[0], xs, pos_dev)
            torch.cuda.synchronize()
            sv = [functools.partial(fn, L) for L in sv]
        except Exception as exc:  # noqa: BLE001 - the baseline failing must not hide the fused result
            row["serving"], sv = f"error: {type(exc).__name__}: {exc}"[:200], []
        row["serving_compile_s"] = round(time.perf_counter() - t0, 1)
    # each baseline is checked before it is timed: layer 0 against the fp32 reference; a baseline that fails to run,
    # check, capture or time says so in its field, and the row keeps the others
    def baseline(name, layers, what):
        try:
            return what()
        except Exception as exc:  # noqa: BLE001
            row[name] = f"error: {type(exc).__name__}: {exc}"[:200]
            layers.clear()

    if fi or sv:
        kc, vc = base[0].k_cache.clone(), base[0].v_cache.clone()
        ref = reference.decoder_layer(xs, pos_dev, base[0].W, kc, vc, m)
        del kc, vc
        for name, layers in (("flashinfer", fi), ("serving", sv)):
            err = baseline(name, layers, lambda: verify.rel_err(layers[0](xs, pos_dev), ref)) if layers else None
            if err is not None:
                row[f"{name}_rel_err"] = err
                if err > verify.REL_TOL[m.dtype]:
                    row[name] = f"failed check: rel_err {err:.2e}"
                    layers.clear()
    timings = {}  # GPU time of the stacks (queued: the host's graph launch not charged to the layers, TIMING)
    for label, layers in (("fused", fused), ("torch_graph", base), ("serving", sv), ("flashinfer", fi)):
        if not layers:
            continue
        if label in ("fused", "torch_graph"):
            g = graph_of(stack(layers))
            timings[label] = time_replays(g.replay, n, queued=True)
            if label == "fused":  # as runs before session 44 timed it: the graph's launch included
                row["us_unqueued"] = round(time_replays(g.replay, n)["median"], 2)
        elif (t := baseline(label, layers, lambda: time_replays(graph_of(stack(layers)).replay, n, queued=True))) \
                is not None:
            timings[label] = t
    if sv:  # more than one graph: a break or a recompile (bench/measure.py notes the same)
        row["serving_graphs"] = compiled_graphs()
    if v.batch > 1:  # a serving mix: the sequences' positions spread evenly over the cache
        pos_mix = torch.tensor(mixed_positions(v.batch, v.seq_len), dtype=torch.int32)
        pos_mix_dev = pos_mix.cuda()  # alive while the graphs that read it are replayed
        timings["fused_mixed"] = time_replays(graph_of(stack(fused, pos_mix_dev)).replay, n, queued=True)

        def fi_mixed():
            for L in fi:
                L.set_positions(pos_mix)
            return time_replays(graph_of(stack(fi, pos_mix_dev)).replay, n, queued=True)
        if fi and (t := baseline("flashinfer", fi, fi_mixed)) is not None:
            timings["flashinfer_mixed"] = t
        row["us_mixed"] = round(timings["fused_mixed"]["median"], 2)
        row["flashinfer_us_mixed"] = round(timings["flashinfer_mixed"]["median"], 2) if fi else None
    fused[0](xs, pos_dev, validate=False)
    row["stage_us"] = {k: round(t, 1) for k, t in fused[0].stage_us().items()}  # one launch, weights from HBM
    row["clock_mhz"] = round(fused[0].clock_mhz())  # the SM clock's rate the stage times are converted at
    row["layers_timed"] = n
    row["bytes"] = nbytes
    row["us"] = round(timings["fused"]["median"], 2)
    row["us_p10"], row["us_p90"] = round(timings["fused"]["p10"], 2), round(timings["fused"]["p90"], 2)
    row["torch_graph_us"] = round(timings["torch_graph"]["median"], 2)
    row["speedup"] = round(timings["torch_graph"]["median"] / timings["fused"]["median"], 2)
    row["flashinfer_us"] = round(timings["flashinfer"]["median"], 2) if "flashinfer" in timings else None
    row["serving_us"] = round(timings["serving"]["median"], 2) if "serving" in timings else None
    full = {k: t for k, t in timings.items() if not k.endswith("_mixed")}
    best = min(t["median"] for k, t in full.items() if k != "fused")
    row["best_baseline"] = min((k for k in full if k != "fused"), key=lambda k: full[k]["median"])
    row["speedup_vs_best"] = round(best / timings["fused"]["median"], 2)
    row["gbps"] = round(nbytes / (timings["fused"]["median"] * 1e-6) / 1e9, 1)
    row["pct_bw"] = round(100 * row["gbps"] / bw, 1)
    row["floor_us"] = round(nbytes / (bw * 1e9) * 1e6, 2)
    del fused, base, fi, sv
    torch.cuda.empty_cache()
    return row


# the rows timed against the serving-style layer by default: each model's batch 1 and 8 at KV 4096, declared and held
# out (its compile, max-autotune, takes tens of seconds a shape: --serving-budget bounds the whole)
SERVING_ROWS = ("*_b1_s4096_*", "*_b8_s4096_*")


def serving_order(vs: list, held: list) -> list:
    """The --serving rows in the order they get the serving-style layer's compile while --serving-budget lasts: the
    largest weights first at each batch, batch 1 before larger ones, declared before held out (the comparisons the
    issue's figures rest on first)."""
    from generator.reference import weight_shapes
    size = {v.name: sum(torch.Size(s).numel() for s in weight_shapes(v.model).values()) for v in vs}
    return sorted(vs, key=lambda v: (v.batch, v in held, -size[v.name], v.name))


# how the rows are timed, recorded in gpu_check.json ("us_unqueued": the fused stack as runs before session 44 timed it)
TIMING = ("queued: µs a layer = GPU time of a stack of distinct layers in a CUDA graph / its layers, each replay "
          "enqueued behind a spin kernel so the host's graph launch (estimated 5-20 µs a sample) is not charged to the "
          "layers")


def check_options(f):
    """The options gpu_check and tp_check share: which variants (declared, held out, --only), where they are
    built, where the details go, the seed."""
    for opt in reversed((
            click.option("--variants", "variants_file", default=str(ROOT / "variants.yaml"), show_default=True,
                         help="the declared variants, built into BUILD_DIR with tuning/'s plans"),
            click.option("--heldout", "heldout_file", default=str(ROOT / "bench" / "heldout.yaml"),
                         show_default=True, help="shapes not in the variants file, built into BUILD_DIR-heldout "
                                                 "('' to skip)"),
            click.option("--only", multiple=True, help="check only the variants (declared or held out) whose name "
                                                       "matches this glob (repeatable)"),
            click.option("--build-dir", default=str(ROOT / "build"), show_default=True,
                         help="where the declared variants are built (objects compiled there before are reused)"),
            click.option("--out", default=os.environ.get("OUT", str(ROOT / "out")), show_default=True,
                         help="where gpu_check.json and the details go (the device's $OUT when set)"),
            click.option("--seed", type=int, default=None, help="default: fresh from the clock"))):
        f = opt(f)
    return f


def build_checked(vs, held, variants_file, heldout_file, build_dir) -> tuple[dict, list]:
    """Build the declared variants `vs` into build_dir with the plans `megakernel build` takes (tuning/'s winners
    where it holds one file; the GPU tests' fixtures build the same) and the held-out `held` into
    build_dir-heldout (default plans: the planner's own choice is what they test), printing the count, the plans
    and every failure or tuning warning: ({variant name: its build dir}, the manifest entries)."""
    from generator import tune as gtune
    where = {v.name: build_dir for v in vs} | {v.name: f"{build_dir}-heldout" for v in held}
    t0 = time.time()
    tfile = gtune.default_tuning_file()
    result = gcompile.build(vs, build_dir, variants_file=variants_file, tuning_file=tfile)
    tuned = sum(e.get("plan_source", "").startswith("tuned") for e in result["entries"])
    print(f"plans: {tuned} declared variants tuned" + (f" ({gtune.display(tfile)})" if tfile else "")
          + ", the rest default", flush=True)
    for w in result.get("warnings", []) + result.get("replans", []):
        print(f"  {w}", flush=True)
    hres = gcompile.build(held, f"{build_dir}-heldout", variants_file=heldout_file) if held else \
        {"entries": [], "distinct": 0}
    for w in hres.get("replans", []):  # a held-out default plan that spilled: which plan ran instead
        print(f"  {w}", flush=True)
    entries = result["entries"] + hres["entries"]
    print(f"build: {len(vs)} declared + {len(held)} held-out variants, {result['distinct'] + hres['distinct']} "
          f"binaries, {time.time() - t0:.1f} s", flush=True)
    for e in entries:
        if e["status"] != "ok":
            print(f"  {e['name']}: {e['status']}: {e['error'].splitlines()[0]}", flush=True)
    return where, entries


# the unqueued figure (the host's graph launch included) bounds the layers' GPU time from above, so a queued figure over
# it by more than this carries a cost of the queueing, not of the layers: named under the table (H100s: the held-out
# hidden-576 b3 at +4 % in seven of twelve checks, session 60's hidden-1536 b2 at +9.8 % once; not explained)
QUEUED_OVER_UNQUEUED = 1.03


def print_tables(doc: dict, routes_path=None) -> None:
    """The decode and prefill tables of a gpu_check result (`doc`: gpu_check.json's content), as the run prints them;
    `routes_path`: where the run recorded the prefill routes (named under the prefill table)."""
    from generator import routes
    rows = doc["rows"]
    print(f"\n{doc['gpu']}  {doc['date']}  seed {doc['seed']}  copy BW {doc['copy_gbps']:.0f} GB/s  tests: {doc['tests']}")
    if doc.get("timing"):
        print(f"timing: {doc['timing']}")
    hdr = (f"{'variant (* held out)':41s} {'rel_err':>8s} {'pass':>4s} {'us':>7s} {'%BW':>5s} {'torch_g':>7s} "
           f"{'serving':>7s} {'flashinf':>8s} {'x best':>6s} {'mix us':>7s} {'x FI':>5s}")
    print(hdr + "   stages (us): norm qkv att o norm gu down (norm: NORM_GLOBAL's step, else 0; the second 0 with H_STATS)")
    print("(mix: the batch's positions spread evenly over the cache, fused and FlashInfer re-timed)")
    for r in rows:
        name = r["variant"] + ("*" if r.get("heldout") else "")
        if r.get("mode") == "prefill":
            continue
        if "error" in r:
            print(f"{name:41s} {'-':>8s} {'FAIL':>4s}  {r['error'][:80]}")
        else:
            bad = "" if r["pass"] else f"  first bad stage: {r['first_bad_stage']}"
            fi = f"{r['flashinfer_us']:8.1f}" if r["flashinfer_us"] else f"{'-':>8s}"
            sv = f"{r['serving_us']:7.1f}" if r.get("serving_us") else f"{'-':>7s}"
            mix = f"{r['us_mixed']:7.1f}" if r.get("us_mixed") else f"{'-':>7s}"
            mix += (f" {r['flashinfer_us_mixed'] / r['us_mixed']:5.2f}" if r.get("flashinfer_us_mixed")
                    else f" {'-':>5s}")
            print(f"{name:41s} {r['rel_err']:8.1e} {'ok' if r['pass'] else 'FAIL':>4s} {r['us']:7.1f} "
                  f"{r['pct_bw']:5.1f} {r['torch_graph_us']:7.1f} {sv} {fi} {r['speedup_vs_best']:6.2f} {mix}   "
                  + " ".join(f"{t:.1f}" for t in r["stage_us"].values()) + bad)
    pre = [r for r in rows if r.get("mode") == "prefill"]
    if pre:
        print(f"\n{'prefill variant (* held out)':41s} {'rel_err':>8s} {'pass':>4s} {'us':>9s} {'TFLOP/s':>7s} "
              f"{'unfused':>9s} {'TFLOP/s':>7s} {'x unf':>6s} route    stages (us): norm qkv kv att o norm gu down")
        for r in pre:
            name = r["variant"] + ("*" if r.get("heldout") else "")
            if "error" in r:
                print(f"{name:41s} {'-':>8s} {'FAIL':>4s}  {r['error'][:80]}")
                continue
            bad = "" if r["pass"] else f"  first bad stage: {r['first_bad_stage']}"
            print(f"{name:41s} {r['rel_err']:8.1e} {'ok' if r['pass'] else 'FAIL':>4s} {r['us']:9.1f} "
                  f"{r['tflops']:7.1f} {r['unfused_us']:9.1f} {r['unfused_tflops']:7.1f} {r['speedup']:6.2f} "
                  f"{r['route']}  " + " ".join(f"{s:.0f}" for s in r["stage_us"].values()) + bad)
        if routes_path:
            print(f"routes: {routes_path} (commit it as routes/{routes.gpu_slug(doc['gpu'])}.json; a route flips "
                  f"only beyond {routes.ROUTE_MARGIN:.0%}: the table shows the recorded one)")
    for name in ("serving", "flashinfer"):  # why a baseline has no figure in a row ("-")
        for why in sorted({r[name] for r in rows if r.get(name, "ok") != "ok"}):
            print(f"{name}: {why} ({sum(r.get(name) == why for r in rows)} rows)")
    odd = [r for r in rows if r.get("us_unqueued") and r.get("us") and r["us"] > QUEUED_OVER_UNQUEUED * r["us_unqueued"]]
    if odd:
        print(f"timing: queued µs over {QUEUED_OVER_UNQUEUED:.2f} x the unqueued (the host's launch included, an upper "
              f"bound of the layers' GPU time) on {len(odd)} rows: a cost of the queueing there (" + ", ".join(
                  f"{r['variant']} {r['us']:.1f} / {r['us_unqueued']:.1f}" for r in odd) + ")")
    timed = [r for r in rows if r.get("serving_us") is not None]  # the rows whose serving layer was timed
    for how in sorted({r.get("serving_attention") for r in timed} - {None}):
        print(f"serving: attention by {how} ({sum(r.get('serving_attention') == how for r in timed)} rows)")


def markdown_tables(doc: dict) -> str:
    """The decode and prefill tables of a gpu_check result (`doc`: gpu_check.json's content) as the README's markdown
    tables: µs a layer, % of the copy bandwidth, each baseline's µs ("–" where not timed), × the best baseline and
    which it was, the serving mix's figures, the plan (its kernel-shaping knobs as `report.path_cell` names them,
    "–" for none, "?" where the row recorded no plan; "tuned" where the tuning file's entry ran, as recorded since
    session 66); held-out rows marked. Failed rows are listed with their error."""
    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "–"

    def plan(r):  # (rows of before session 66 recorded the knobs only: their path from those, WINDOW unnamed)
        shape = r["path"] if "path" in r else path_cell(r["knobs"]) if r.get("knobs") else "?"
        tuned = ["tuned"] if str(r.get("plan_source", "")).startswith("tuned") else []
        return " ".join([shape] * bool(shape) + tuned) or "–"
    out = ["| variant | rel. err | fused µs | % of copy BW | torch + graph µs | serving µs | FlashInfer layer µs | "
           "× best baseline | best | mixed positions: fused µs | × FlashInfer (mixed) | plan |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [r for r in doc["rows"] if r.get("mode") != "prefill"]
    for r in rows:
        name = r["variant"] + (" (held out)" if r.get("heldout") else "")
        if "error" in r or not r.get("pass"):
            out.append(f"| {name} | {r.get('error') or 'FAILED its check: ' + f(r.get('rel_err'), '.1e')} |"
                       + " |" * 10)
            continue
        mix_fi = r["flashinfer_us_mixed"] / r["us_mixed"] if r.get("flashinfer_us_mixed") and r.get("us_mixed") \
            else None
        out.append(f"| {name} | {r['rel_err']:.1e} | {r['us']:.1f} | {r['pct_bw']:.1f} | {r['torch_graph_us']:.1f} | "
                   f"{f(r.get('serving_us'), '.1f')} | {f(r.get('flashinfer_us'), '.1f')} | "
                   f"{r['speedup_vs_best']:.2f} | {r.get('best_baseline') or '–'} | {f(r.get('us_mixed'), '.1f')} | "
                   f"{f(mix_fi, '.2f')} | {plan(r)} |")
    pre = [r for r in doc["rows"] if r.get("mode") == "prefill"]
    if pre:
        out += ["", "| variant | rel. err | fused µs | TFLOP/s | unfused µs | unfused TFLOP/s | × unfused | route |",
                "|---|---|---|---|---|---|---|---|"]
        for r in pre:
            name = r["variant"] + (" (held out)" if r.get("heldout") else "")
            if "error" in r or not r.get("pass"):
                out.append(f"| {name} | {r.get('error') or 'FAILED its check'} |" + " |" * 6)
                continue
            out.append(f"| {name} | {r['rel_err']:.1e} | {r['us']:.1f} | {r['tflops']:.1f} | {r['unfused_us']:.1f} | "
                       f"{r['unfused_tflops']:.1f} | {r['speedup']:.2f} | {r['route']} |")
    return "\n".join(out) + "\n"


@click.command(context_settings=HELP)
@check_options
@click.option("--no-tests", is_flag=True, help="skip the pytest GPU suite")
@click.option("--tests", "test_paths", default="tests", show_default=True, help="pytest paths (comma-separated)")
@click.option("--serving", "serving_globs", multiple=True, default=SERVING_ROWS, show_default=True,
              help="glob over decode variant names timed against the serving-style compiled layer too (repeatable; "
                   "'*' for all)")
@click.option("--serving-budget", type=click.FloatRange(min=0), default=180.0, show_default=True,
              help="seconds of its torch.compile (max-autotune) in all: a row compiles it while the time spent plus "
                   "1.25 x the longest compile so far fits (batch 1 first, the largest models first)")
@click.option("--markdown", "markdown_of", type=click.Path(exists=True, dir_okay=False), default=None,
              help="print a gpu_check.json's tables as the README's markdown tables and exit (no GPU)")
def main(variants_file, heldout_file, only, build_dir, out, seed, no_tests, test_paths, serving_globs,
         serving_budget, markdown_of):
    """The one-call GPU check: build the declared and held-out variants, run the GPU tests, verify every variant
    against the fp32 reference and time it against the unfused baselines (the serving-style layer, FlashInfer's,
    torch + CUDA graph), writing gpu_check.json to --out and printing the tables last."""
    if markdown_of:
        try:
            doc = json.loads(Path(markdown_of).read_text())
        except (ValueError, OSError) as exc:
            click.echo(f"error: {markdown_of}: not JSON ({exc})", err=True)
            sys.exit(2)
        if not (isinstance(doc, dict) and isinstance(doc.get("rows"), list)
                and all(isinstance(r, dict) and isinstance(r.get("variant"), str) for r in doc["rows"])):
            click.echo(f"error: {markdown_of}: not a gpu_check result (an object whose \"rows\" each name their "
                       "\"variant\")", err=True)
            sys.exit(2)
        if not doc["rows"]:
            click.echo(f"error: {markdown_of}: a gpu_check result with no rows (its selection held no variant of one "
                       "GPU, e.g. --only '*_tp2'): no table to print", err=True)
            sys.exit(2)
        try:
            click.echo(markdown_tables(doc), nl=False)
        except (KeyError, TypeError, ValueError) as exc:  # a passed row lacks a figure, or holds a wrong type
            click.echo(f"error: {markdown_of}: a row is not a gpu_check row "
                       f"({'lacks ' + str(exc) if isinstance(exc, KeyError) else exc})", err=True)
            sys.exit(2)
        return
    if not torch.cuda.is_available():  # said before minutes of building
        click.echo("error: bench/gpu_check.py verifies and times the variants on a CUDA GPU, and none is visible "
                   "(on this machine: `megakernel build` and `megakernel report`)", err=True)
        sys.exit(2)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed = seed if seed is not None else int(time.time()) % 100000
    vs = gvariants.select(gvariants.load(variants_file), only)
    held = gvariants.select(gvariants.load(heldout_file), only) if heldout_file else []
    where, entries = build_checked(vs, held, variants_file, heldout_file, build_dir)

    tests = "skipped"
    if not no_tests:
        env = dict(os.environ, MEGAKERNEL_VARIANTS=variants_file, MEGAKERNEL_BUILD=build_dir,
                   MEGAKERNEL_ONLY=",".join(only))
        t1 = time.time()
        r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE",
                            *[str(ROOT / t) for t in test_paths.split(",")]],
                           env=env, capture_output=True, text=True, cwd=ROOT)
        (out / "pytest_gpu.log").write_text(r.stdout + r.stderr)
        tests = (r.stdout.strip().splitlines() or ["no output"])[-1]
        print(f"gpu tests ({time.time() - t1:.0f} s): {tests}", flush=True)

    # said before the minutes of timing: without FlashInfer the decode rows' "x best" is torch's only (a shape
    # FlashInfer has no kernel for says so first, so every decode variant is asked)
    fi_why = {FlashInfer().unavailable(v) for v in vs + held if v.mode == "decode" and v.tp == 1}
    missing = sorted(w for w in fi_why if w and w.startswith("flashinfer not"))
    if missing:
        print(f"warning: {missing[0]}: decode rows are compared with torch + CUDA graph only (carry the wheels: "
              "../shared/wheels/README.md)", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw:.0f} GB/s (read + write)", flush=True)
    ok_names = {e["name"] for e in entries if e["status"] == "ok"}
    sources = {e["name"]: e.get("plan_source", "default") for e in entries}
    doc = {"gpu": torch.cuda.get_device_name(), "arch": "%d%d" % torch.cuda.get_device_capability(),
           "date": time.strftime("%Y-%m-%d"), "time": time.strftime("%H:%M:%S"),
           "seed": seed, "copy_gbps": round(bw, 1), "tests": tests, "timing": TIMING, "rows": []}
    order = [v for v in vs + held if v.tp == 1]  # (tp > 1: one process per GPU, bench/tp_check.py under torchrun)
    sv_rows = serving_order([v for v in order if v.mode == "decode" and v.name in ok_names
                             and any(fnmatch.fnmatchcase(v.name, g) for g in serving_globs)], held)
    serving_s, most = 0.0, 0.0  # the serving layer's compiles so far, and the longest
    rows = {}
    for v in sv_rows + [v for v in order if v not in sv_rows]:  # the serving rows first, while its budget lasts
        if v.name not in ok_names:
            row = {"variant": v.name, "pass": False, "error": "not built"}
        else:
            try:
                serving = v in sv_rows and serving_s + 1.25 * most <= serving_budget
                row = check_prefill(v, where[v.name], seed) if v.mode == "prefill" else \
                    check_variant(v, where[v.name], seed, bw, serving=serving)
                serving_s += row.get("serving_compile_s", 0.0)
                most = max(most, row.get("serving_compile_s", 0.0))
                row["heldout"] = v in held
                row["plan_source"] = sources.get(v.name, "default")  # (tuned, override, default or re-planned)
            except Exception as exc:  # keep going: one broken variant must not hide the others
                row = {"variant": v.name, "pass": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows[v.name] = row
        print(json.dumps(row), flush=True)
        # after every row, in the variants' order: a run cut short (the device's time limit) keeps what it measured
        doc["rows"] = [rows[u.name] for u in order if u.name in rows]
        (out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
    rows = doc["rows"]

    # the declared prefill variants' routes, from routes/'s (a tie keeps the recorded path), into $OUT
    from generator import routes
    routes_path = routes.record_checked(torch.cuda.get_device_name(),
                                        [r for r in rows if r.get("mode") == "prefill" and not r.get("heldout")],
                                        Path(out), time.strftime("%Y-%m-%d"), seed_dir=routes.ROUTES_DIR)
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1))  # (the routes set each prefill row's path)
    print_tables(doc, routes_path)
    tp_ok = tensor_parallel(vs + held, variants_file, heldout_file, only, build_dir, out, seed)
    sys.exit(0 if all(r["pass"] for r in rows) and tp_ok else 1)


def tensor_parallel(vs, variants_file, heldout_file, only, build_dir, out, seed) -> bool:
    """bench/tp_check.py under torchrun, one process per GPU, for each tp > 1 of the variants where that many GPUs
    are visible; its table printed here, its log and JSON in `out`. True when all passed or none could run."""
    ok = True
    for tp in sorted({v.tp for v in vs if v.tp > 1}):
        if torch.cuda.device_count() < tp:
            print(f"\ntensor parallel: {sum(v.tp == tp for v in vs)} tp = {tp} variants not run: "
                  f"{torch.cuda.device_count()} GPU(s) visible (bench/tp_check.py under torchrun on {tp})")
            continue
        ok = _tp_check(tp, variants_file, heldout_file, only, build_dir, out, seed) and ok
    return ok


def _tp_check(tp, variants_file, heldout_file, only, build_dir, out, seed) -> bool:
    torch.cuda.empty_cache()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp),
           str(ROOT / "bench" / "tp_check.py"), "--variants", variants_file, "--heldout", heldout_file or "",
           "--build-dir", build_dir, "--out", str(out), "--seed", str(seed), *sum((["--only", g] for g in only), [])]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    (Path(out) / f"tp_check_tp{tp}.log").write_text(r.stdout + r.stderr)
    lines = r.stdout.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(torch.cuda.get_device_name())), None)
    print("\ntensor parallel (bench/tp_check.py):")
    print("\n".join(lines[start:] if start is not None else (r.stdout + r.stderr).splitlines()[-15:]))
    return r.returncode == 0


if __name__ == "__main__":
    run_click(main)
