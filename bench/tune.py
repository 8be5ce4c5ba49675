"""`megakernel tune`: sweep each variant's plan candidates (decode and prefill) on this GPU and record the winner per
variant in tuning/<gpu-slug>.json (generator.tune), which `megakernel build` then uses.

Per variant: the candidates of generator.tune.candidates (the default plan and single-knob neighbours), each
compiled as its own renamed variant into one temporary build directory (all in parallel), checked against the fp32
reference (generator.verify.check_step on random inputs; a failing candidate is discarded and reported), then timed
as gpu_check times the fused layer: a stack of distinct layers (bench.measure.n_layers_for) in a CUDA graph, every
sequence at full context (decode) or a prompt's first chunk (prefill: start 0), candidates interleaved over rounds
so drift hits them alike. A second round times the union of the stages' single-knob winners (stages are separated
by grid barriers) against the default and the best single. A non-default plan wins only when it beats the default
by more than 1% in the same run.

    megakernel tune [--only GLOB] [--variants FILE] [--build-dir DIR] [--out FILE] [--shard I/N] [-j N]
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIN_GAIN = 0.01  # a non-default plan must beat the default by this fraction (noise guard)


def renamed(v, tag: str):
    """`v` under another model name (its own entry, source and cache key in the tuner's build directory)."""
    return dataclasses.replace(v, model=dataclasses.replace(v.model, name=f"{v.model.name}.{tag}"))


def group_of(ov: dict) -> str:
    """The stage a single-knob candidate tunes (QKV, O, GU, DOWN, ATT); QKV_FLOW (the barrier after qkv, not its
    tiling) is a group of its own, so its win can merge with a qkv tiling win."""
    if not ov:
        return ""
    knob = next(iter(ov))
    return "FLOW" if knob == "QKV_FLOW" else knob.split("_")[0]


def measure(v, cands: list[tuple[str, dict]], build_dir: Path, seed: int, reps: int, rounds: int,
            sets: list[list[int] | None] | None = None, queued: bool = False) -> list[dict]:
    """Verify and time candidates [(built name, overrides)] of variant `v`; one dict per candidate: name,
    overrides, pass, rel_err, error, us (median per layer; None where it failed). Decode is timed at each of `sets`
    (default [None]): None is full context (every sequence at row seq_len - 1), a list one position a sequence (e.g.
    bench.measure.mixed_positions, a serving mix), each set timed on the same graphs (the kernels read the positions
    from the device); with several, "us_at" holds the median at each, in order, and "us" their geometric mean.
    queued: GPU time only (bench.timing.time_samples)."""
    import torch

    from bench.measure import PREFILL_CACHE, n_layers_for
    from bench.timing import graph_of, layer_bytes, summarize, time_samples
    from generator import reference, verify
    from generator.loader import load

    m = v.model
    prefill = v.mode == "prefill"
    cache_len = max(PREFILL_CACHE, v.seq_len) if prefill else None  # decode: the variant's own
    rows = [{"name": n, "overrides": ov, "pass": False, "us": None} for n, ov in cands]
    W0 = reference.random_weights(m, seed=seed, device="cuda")
    base = load(cands[0][0], W0, build_dir=build_dir, cache_len=cache_len)
    for r in rows:  # correctness first: a wrong candidate is never timed
        try:
            L = load(r["name"], None, build_dir=build_dir, packed=base.packed, caches=(base.k_cache, base.v_cache))
            x, pos = verify.random_inputs(L, seed)
            res = verify.check_step(L, x, pos, weights=W0)
            r["rel_err"] = res["rel_err"]
            r["pass"] = verify.passed(res, m.dtype)
            if not r["pass"]:
                r["error"] = f"failed check: rel_err {res['rel_err']:.2e}, first bad stage {res['first_bad_stage']}"
            del L
        except Exception as exc:  # noqa: BLE001 - one broken candidate must not hide the others
            r["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    del base, W0
    ok = [r for r in rows if r["pass"]]
    if not ok:
        return rows

    # decode: every sequence at full context; prefill: a prompt's first chunk (start 0), as gpu_check times them
    at = []
    for ps in (sets if sets is not None and not prefill else [None]):
        if ps is not None and (len(ps) != v.batch or not all(0 <= q < v.seq_len for q in ps)):
            raise ValueError(f"positions: {v.batch} rows in [0, {v.seq_len}), got {ps}")
        at.append(torch.full((v.batch,), 0 if prefill else v.seq_len - 1, dtype=torch.int32) if ps is None
                  else torch.tensor(ps, dtype=torch.int32))
    n = max(n_layers_for(layer_bytes(m, v.batch, p)) for p in at)  # (the fewest bytes a layer: the most layers)
    pos_dev = at[0].cuda()
    xs = torch.randn(v.batch, *((v.seq_len,) if prefill else ()), m.hidden, device="cuda").to(
        reference.TORCH_DTYPES[m.dtype])
    firsts = []
    for i in range(n):  # n distinct layers: weights and caches shared by every candidate's stack
        Wi = reference.random_weights(m, seed=seed + 1 + i, device="cuda")
        firsts.append(load(ok[0]["name"], Wi, build_dir=build_dir, cache_len=cache_len))
        del Wi
        for c in (firsts[-1].k_cache, firsts[-1].v_cache):
            c.normal_()
    graphs = {}
    for r in ok:
        layers = firsts if r is ok[0] else [
            load(r["name"], None, build_dir=build_dir, packed=f.packed, caches=(f.k_cache, f.v_cache)) for f in firsts]

        def step(layers=layers):
            y = xs
            for L in layers:
                y = L.prefill(y, pos_dev, validate=False) if prefill else L(y, pos_dev, validate=False)
            return y
        graphs[r["name"]] = (graph_of(step), layers)
    meds = {r["name"]: [] for r in ok}
    for p in at:
        pos_dev.copy_(p)  # (the graphs read the positions from this tensor at each replay)
        samples = {r["name"]: [] for r in ok}
        for name, (g, _) in graphs.items():  # warm-up
            for _ in range(3):
                g.replay()
        for _ in range(rounds):
            for name, (g, _) in graphs.items():
                samples[name] += time_samples(g.replay, n, reps, queued=queued)
        for r in ok:
            meds[r["name"]].append(summarize(samples[r["name"]])["median"])
    for r in ok:
        got = meds[r["name"]]
        r["us"] = round(got[0] if len(got) == 1 else math.exp(sum(map(math.log, got)) / len(got)), 3)
        if len(at) > 1:
            r["us_at"] = [round(u, 3) for u in got]
        r["layers_timed"] = n
    del graphs, firsts
    torch.cuda.empty_cache()
    return rows


def loses(r: dict, d: dict) -> bool:
    """Candidate row r slower than the default d by more than MIN_GAIN at one of the position sets both were timed
    at ("us_at"; False where they were timed at one set)."""
    return any(a > b * (1 + MIN_GAIN) for a, b in zip(r.get("us_at", ()), d.get("us_at", ())))


def pick(rows: list[dict], spills: frozenset | set = frozenset()) -> dict | None:
    """The winner: the fastest passing candidate if it beats the default (rows[0]) by MIN_GAIN, else the default.
    Timed at several position sets ("us_at"; "us" their geometric mean), a candidate slower than the default by more
    than MIN_GAIN at any one of them is not a winner (a plan tuned for short contexts must not lose at full context).
    A default whose plan spills (its name in `spills`: timed as the baseline only) is never the winner: the fastest
    passing other candidate is, whatever its gain; None where there is none."""
    d = rows[0]
    ok = [r for r in rows if r["us"] is not None and r["name"] not in spills]
    if d["name"] not in spills:
        ok = [r for r in ok if not loses(r, d)]
    if not ok:
        return None
    best = min(ok, key=lambda r: r["us"])
    if d["name"] not in spills and d["us"] is not None and best is not d and best["us"] > d["us"] * (1 - MIN_GAIN):
        return d
    return best


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--variants", "variants_file", default="variants.yaml", show_default=True,
              help="variants file (every variant of tp 1 in it, or those --only selects)")
@click.option("--only", multiple=True, help="glob over variant names (repeatable)")
@click.option("--build-dir", default=None, help="where the candidates are compiled [a temporary directory, removed]")
@click.option("--out", default=None, help="tuning file to merge the winners into [tuning/<gpu-slug>.json]")
@click.option("--shard", default="0/1", show_default=True, help="I/N: tune every N-th variant from the I-th "
              "(one process per GPU; they merge into one file under a lock)")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="parallel compiles [all cores]")
@click.option("--limit", type=click.IntRange(min=1), default=28, show_default=True,
              help="candidates per variant, the default plan included")
@click.option("--no-combine", is_flag=True, help="skip the second round (the union of the stages' winners)")
@click.option("--reps", type=click.IntRange(min=1), default=10, show_default=True, help="timed replays per round")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="interleaved rounds")
@click.option("--seed", type=int, default=None, help="default: fresh from the clock")
@click.option("--positions", default="full", show_default=True,
              help="where decode candidates are timed: full (every sequence at the cache's last row), mixed (a "
                   "serving mix: the batch spread evenly over the cache) or a row N (every sequence at N: a short "
                   "context), or several of them comma-separated (e.g. full,191: a candidate wins on the geometric "
                   "mean and must not be slower than the default by more than 1 % at any of them); the plan that "
                   "wins at full context need not win where a model is served (bench/NOTES.md session 32); each "
                   "entry records it")
def cli(variants_file, only, build_dir, out, shard, jobs, limit, no_combine, reps, rounds, seed, positions):
    """Sweep plan candidates per variant (decode and prefill) on this GPU; write the winners to tuning/<gpu>.json."""
    from generator import compile as gcompile, report as greport, tune as gtune, variants as gvariants
    from generator.manifest import identity
    from generator.render import plan as render_plan
    from generator.targets import DEFAULT_ARCH

    def fail(msg):
        click.echo(f"error: {msg}", err=True)
        sys.exit(2)

    try:  # the arguments first: a wrong one says so on any machine
        si, sn = (int(x) for x in shard.split("/"))
        assert 0 <= si < sn
    except (ValueError, AssertionError):
        fail(f"--shard {shard}: must be I/N with 0 <= I < N")
    if out is not None:  # where the winners go, checked now: not after an hour of timing
        if not out.strip():
            fail("--out: an empty path (leave it out for tuning/<gpu>.json)")
        op = Path(out)
        if op.exists() and not op.is_file():
            fail(f"--out {out}: not a regular file (a directory or a device): name a tuning file (.json)")
        if op.is_file() and (why := gtune.tuning_problem(op, entries=True)) and why != "an empty file":
            fail(f"--out {out}: not a tuning file ({why}): name a new file or a tuning file")
        # (folders that do not exist yet are made when the winners are written: the nearest one that does counts)
        near = next(q for q in (op.resolve().parent, *op.resolve().parent.parents) if q.exists())
        if not near.is_dir() or not os.access(near, os.W_OK):
            fail(f"--out {out}: {near} is not a writable folder")
    if build_dir is not None and not build_dir.strip():
        fail("--build-dir: empty (give a directory, or leave it out for a temporary one)")
    if build_dir is not None and Path(build_dir).exists() and not Path(build_dir).is_dir():
        fail(f"--build-dir {build_dir}: exists and is not a directory")
    specs = [p.strip() for p in positions.split(",")]
    row_spec = re.compile(r"[0-9]+")  # (ASCII: str.isdigit takes "²", which int() refuses)
    if bad := [p for p in specs if p not in ("full", "mixed") and not row_spec.fullmatch(p)]:
        fail(f"--positions {positions}: full, mixed or a row number (0 or more), or several comma-separated; "
             f"not {bad[0]!r}")
    specs = [str(int(p)) if row_spec.fullmatch(p) else p for p in specs]  # (row 0191 is row 191)
    if twice := next((p for i, p in enumerate(specs) if p in specs[:i]), None):
        fail(f"--positions {positions}: {twice if twice in ('full', 'mixed') else 'row ' + twice} named twice")
    rows_at = [int(p) for p in specs if p not in ("full", "mixed")]
    names = [p if p in ("full", "mixed") else f"row {p}" for p in specs]  # what each entry records
    label = ", ".join(names)
    try:
        vs = gvariants.load(variants_file)
    except gvariants.VariantError as exc:
        fail(str(exc))
    vs = [v for v in vs if v.tp == 1
          and (not only or any(fnmatch.fnmatchcase(v.name, g) for g in only))]
    if not vs:
        sel = f" matches --only {' '.join(only)}" if only else ""
        fail(f"{variants_file}: no single-GPU variant{sel} (the tuner times one GPU; a tensor-parallel variant's plan "
             "is its default or a hand-written tuning entry)")
    if rows_at and (short := [v for v in vs if v.mode == "decode" and v.seq_len <= max(rows_at)]):
        which = "" if len(specs) == 1 else f"row {max(rows_at)} is "
        fail(f"--positions {positions}: {which}past the cache of {short[0].name} (seq_len {short[0].seq_len}; rows "
             f"0 .. {short[0].seq_len - 1})")
    if specs != ["full"]:  # prefill candidates time a whole chunk from position 0: --positions does not apply
        pre = [v.name for v in vs if v.mode != "decode"]
        chosen = "--only selects" if only else f"{variants_file} holds"
        if len(pre) == len(vs):
            fail(f"--positions {positions}: decode variants only (a prefill candidate is timed on its whole chunk); "
                 f"{chosen} {greport.counted(len(pre), 'prefill variant')} and no decode one")
        if pre:
            click.echo(f"warning: --positions {positions}: decode variants only; prefill variants "
                       f"({len(pre)} selected) are timed on their whole chunk as with full",
                       err=True)
    if not vs[si::sn]:  # (a launcher's shard past the selection: nothing to do, not a failure)
        click.echo(f"note: --shard {shard}: selects none of the {greport.counted(len(vs), 'variant')} (shard I of N "
                   "takes every N-th from the I-th): nothing to tune", err=True)
        sys.exit(0)
    vs = vs[si::sn]

    from bench.measure import mixed_positions

    def at(v) -> list[list[int] | None] | None:  # the decode position sets a variant's candidates are timed at
        if v.mode != "decode" or specs == ["full"]:  # (None: full context alone, as measure times by default)
            return None
        return [None if p == "full" else mixed_positions(v.batch, v.seq_len) if p == "mixed"
                else [int(p)] * v.batch for p in specs]
    for v in vs:  # sets that are the same positions for a variant (mixed at batch 1 is full): timed twice, said
        got = [[v.seq_len - 1] * v.batch if s is None else s for s in at(v) or []]
        if same := next(((a, b) for a in range(len(got)) for b in range(a + 1, len(got)) if got[a] == got[b]), None):
            click.echo(f"warning: --positions {positions}: {names[same[0]]} and {names[same[1]]} are the same "
                       f"positions for {v.name}: timed twice, they weigh twice in its mean", err=True)
    import torch
    if not torch.cuda.is_available():
        fail(f"no CUDA GPU visible to torch {torch.__version__}: `megakernel tune` times candidates on the GPU")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" if f"{major}{minor}" in ("90",) else DEFAULT_ARCH
    gpu = torch.cuda.get_device_name()
    out = Path(out) if out else gtune.tuning_file(gpu)
    seed = seed if seed is not None else int(time.time()) % 100000
    tmp = build_dir is None
    bdir = Path(build_dir or tempfile.mkdtemp(prefix="megakernel-tune-"))
    t0 = time.time()
    try:
        cands = {}
        for v in vs:
            cands[v.name] = [(renamed(v, f"c{i:02d}"), ov)
                             for i, ov in enumerate(gtune.candidates(v, arch, limit,
                                                                     "full" if specs == ["full"] else positions))]

        def compile_all(pairs):
            t = time.time()
            res = gcompile.build([c for c, _ in pairs], bdir, jobs=jobs, arch=arch,
                                 overrides={c.name: ov for c, ov in pairs}, replan_spills=False)
            bad = {e["name"]: e.get("error", e["status"]).splitlines()[0] for e in res["entries"]
                   if e["status"] != "ok"}
            for e in res["entries"]:  # a plan that spills is not one to record (the report would flag it)
                r = e.get("resources") or {}
                if e["status"] == "ok" and r.get("spill_stores", 0) + r.get("spill_loads", 0):
                    if e["name"] in defaults:  # still the baseline the others are timed against
                        spills.add(e["name"])
                    else:
                        bad[e["name"]] = f"spills {r['spill_stores'] + r['spill_loads']} B"
            click.echo(f"compiled {len(pairs)} candidates ({res['distinct']} binaries) in {time.time() - t:.0f} s"
                       f"{f', {len(bad)} failed' if bad else ''}", err=True)
            return bad

        defaults = {ps[0][0].name for ps in cands.values()}  # each variant's default plan (candidate c00)
        spills: set[str] = set()  # defaults that spill: timed, never recorded as the winner
        bad = compile_all([p for ps in cands.values() for p in ps])
        results = {}
        for v in vs:
            t = time.time()
            ok = [(c.name, ov) for c, ov in cands[v.name] if c.name not in bad]
            failed = [f"{ov or 'default'}: {bad[c.name]}" for c, ov in cands[v.name] if c.name in bad]
            rows = (measure(v, ok, bdir, seed, reps, rounds, sets=at(v))
                    if ok and cands[v.name][0][0].name not in bad else [])
            failed += [f"{r['overrides'] or 'default'}: {r['error']}" for r in rows if not r["pass"]]
            results[v.name] = {"rows": rows, "failed": failed, "tried": len(cands[v.name])}
            click.echo(f"{v.name}: {len(rows)} candidates timed in {time.time() - t:.0f} s; "
                       + (f"default {rows[0]['us']} us, best {min(r['us'] for r in rows if r['us']):.2f} us"
                          if rows and rows[0]["us"] else "default failed"), err=True)
            for f in failed:
                click.echo(f"  discarded {f}", err=True)

        if not no_combine:  # round 2: the union of the stages' single-knob winners
            pairs, second = [], {}
            for v in vs:
                rows = results[v.name]["rows"]
                if not rows or rows[0]["us"] is None:
                    continue
                best_by_group = {}
                for r in rows[1:]:  # (a stage's winner: as pick() would take it, losing at no position set)
                    if r["us"] is not None and r["us"] < rows[0]["us"] * (1 - MIN_GAIN) and (
                            rows[0]["name"] in spills or not loses(r, rows[0])):
                        g = group_of(r["overrides"])
                        if g not in best_by_group or r["us"] < best_by_group[g]["us"]:
                            best_by_group[g] = r
                merged = gtune.combine(v, arch, [r["overrides"] for r in best_by_group.values()])
                if merged is not None:
                    c = renamed(v, "x00")
                    pairs.append((c, merged))
                    second[v.name] = (c, merged)
            bad2 = compile_all(pairs) if pairs else {}
            for v in vs:
                if v.name not in second or second[v.name][0].name in bad2:
                    continue
                rows = results[v.name]["rows"]
                single = pick(rows, spills)
                again = [(rows[0]["name"], rows[0]["overrides"])]
                if single is not None and single is not rows[0]:
                    again.append((single["name"], single["overrides"]))
                again.append((second[v.name][0].name, second[v.name][1]))
                rows2 = measure(v, again, bdir, seed + 7, reps, rounds, sets=at(v))
                results[v.name]["tried"] += 1
                if not rows2[-1]["pass"]:
                    results[v.name]["failed"].append(f"{rows2[-1]['overrides']}: {rows2[-1].get('error')}")
                results[v.name]["rows"] = rows2  # the final comparison: all in one run
                click.echo(f"{v.name}: combined {second[v.name][1]}: {rows2[-1]['us']} us vs default "
                           f"{rows2[0]['us']} us", err=True)

        entries = {}
        date = time.strftime("%Y-%m-%d")
        for v in vs:
            rows = results[v.name]["rows"]
            if not rows or rows[0]["us"] is None:
                click.echo(f"{v.name}: default plan failed or not built: nothing recorded", err=True)
                continue
            w = pick(rows, spills)
            if w is None:
                click.echo(f"{v.name}: its default plan spills and no other candidate passed: nothing recorded",
                           err=True)
                continue
            entries[v.name] = {"overrides": w["overrides"], "default_us": rows[0]["us"], "tuned_us": w["us"],
                               "candidates": results[v.name]["tried"], "failed": len(results[v.name]["failed"]),
                               "identity": identity(v.params(), arch), "gpu": gpu, "date": date,
                               "knobs": gtune.knob_dict(render_plan(v, arch, overrides=w["overrides"] or None))}
            if at(v) is not None:  # timed where it is served, not at full context alone: said in the entry
                entries[v.name]["positions"] = label
                if len(specs) > 1:  # (default_us and tuned_us: the geometric means over them)
                    entries[v.name]["us_at"] = {p: {"default": a, "tuned": b} for p, a, b in
                                                zip(names, rows[0]["us_at"], w["us_at"])}
            click.echo(f"{v.name}: {w['overrides'] or 'default plan'}  {rows[0]['us']:.2f} -> {w['us']:.2f} us "
                       f"(x{rows[0]['us'] / w['us']:.3f})")
        if entries:
            gtune.record(out, entries)
            click.echo(f"wrote {len(entries)} entries to {gtune.display(out)} ({time.time() - t0:.0f} s)", err=True)
    finally:
        if tmp:
            shutil.rmtree(bdir, ignore_errors=True)
    sys.exit(0 if len(entries) == len(vs) else 1)


if __name__ == "__main__":
    cli()
