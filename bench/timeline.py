"""A per-block timeline of one decode layer on a GPU (the plan knob TIMELINE; bench/NOTES.md sessions 34 and 42): the
variant built with TIMELINE 1 on top of the plan `megakernel build` gives it (its tuned plan where tuning/ has one)
and any --overrides, checked against the fp32 reference, then a stack of distinct layers run in a CUDA graph with
every sequence at --row (or at full context) and the last layer's launch read back. For each stamp (a block's entry,
after the launch's wait, each step's end and its grid barrier, and attention's phases in each block's last task that
walks rows: its start, the position loaded, qkv in, queries ready, walk end, warp states published, warps combined,
task end): µs from the launch's first block entry, min / median / max over the blocks that stamped it, the last
block and how many; then the launch boundary (this launch's first entry and first passed wait against the previous
layer's blocks' last stamps). Stamps are thread 0's: a step's end is when thread 0 left it.

    python bench/timeline.py --variant NAME [--overrides JSON] [--row 191|full] [--variants FILE]
                             [--build-dir DIR] [--out FILE]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ and generator/ from this tree
    sys.path.insert(0, str(ROOT))


def stamp_names(steps: list[str]) -> list[str]:
    """The TIMELINE slots' names for a plan's steps (templates/kernel.cu.j2: entry, after the wait, then each step's
    end and barrier; a step that runs twice is "norm", then "norm (2)"; then from interface.TIMELINE_ATT attention's
    phases in the block's last task that walks rows, templates/stages/attention.cuh)."""
    from generator.interface import TIMELINE_ATT, TIMELINE_ATT_PHASES
    out, seen = ["entry", "after wait"], {}
    for s in steps:
        seen[s] = seen.get(s, 0) + 1
        name = s if seen[s] == 1 else f"{s} ({seen[s]})"
        out += [f"{name} end", f"{name} barrier"]
    out += [f"(slot {i})" for i in range(len(out), TIMELINE_ATT)]  # (never stamped)
    return out + [f"attention: {p}" for p in TIMELINE_ATT_PHASES]


def summarize(stamps, names: list[str]) -> list[dict]:
    """Rows {stamp, min_us, median_us, max_us, last_block, blocks} from a [blocks, slots] array of ns (0: not
    stamped, or a block not launched), µs from the earliest entry; slots no block stamped are left out."""
    import statistics
    rows = [(b, r) for b, r in enumerate(stamps) if r[0] > 0]
    if not rows:
        raise ValueError("timeline: no block stamped its entry (was the TIMELINE build launched?)")
    t0 = min(r[0] for _, r in rows)
    out = []
    for j, name in enumerate(names):
        got = [((r[j] - t0) / 1e3, b) for b, r in rows if r[j] > 0]
        if got:
            us = [u for u, _ in got]
            out.append({"stamp": name, "min_us": round(min(us), 2), "median_us": round(statistics.median(us), 2),
                        "max_us": round(max(us), 2), "last_block": max(got)[1], "blocks": len(got)})
    return out


def launch_gap(prev, stamps) -> dict:
    """Where a launch starts against the previous layer's (two [blocks, slots] arrays of ns from the same global
    timer, bench/timeline.py's last two layers): µs from the previous launch's last block's last step stamp (its
    blocks leave right after) to this launch's first entry and first passed wait, and from the previous launch's
    first block done to this first entry. Under PDL a block of this launch may start where one of the previous has
    left; the wait holds it until that whole launch is done (loader.pdl_config)."""
    from generator.interface import TIMELINE_ATT
    ends = [max(r[:TIMELINE_ATT]) for r in prev if r[0] > 0]
    rows = [r for r in stamps if r[0] > 0]
    if not ends or not rows:
        raise ValueError("timeline: a launch stamped nothing (was the TIMELINE build launched?)")
    entry, wait = min(r[0] for r in rows), min(r[1] for r in rows if r[1] > 0)
    return {"first_entry_after_last_us": round((entry - max(ends)) / 1e3, 2),
            "first_entry_after_first_us": round((entry - min(ends)) / 1e3, 2),
            "first_wait_after_last_us": round((wait - max(ends)) / 1e3, 2)}


def main(argv=None):
    from bench import ScriptParser
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", required=True, help="a decode variant (variants.yaml, bench/heldout.yaml, --variants)")
    ap.add_argument("--overrides", default="{}", help="JSON object of plan overrides on top of its plan")
    ap.add_argument("--row", default="191", help="every sequence's position (a row number), or full [191]")
    ap.add_argument("--variants", action="append", default=[], help="more variants files (repeatable)")
    ap.add_argument("--build-dir", default="build-timeline", help="where the stamped plan is built [build-timeline]")
    ap.add_argument("--out", default=None, help="JSON file [$OUT/timeline.json, else ./timeline.json]")
    ap.add_argument("--compile-only", action="store_true",
                    help="build the stamped plan into --build-dir and stop; no GPU (a later run there reuses it)")
    args = ap.parse_args(argv)
    try:
        ov = json.loads(args.overrides)
    except json.JSONDecodeError as exc:
        ap.error(f"--overrides {args.overrides!r}: not JSON ({exc.msg})")
    if not isinstance(ov, dict) or not all(isinstance(k, str) and type(x) is int for k, x in ov.items()):
        ap.error(f"--overrides {args.overrides!r}: must be a JSON object of knob: integer")
    if args.row != "full" and not (args.row.isascii() and args.row.isdigit()):
        ap.error(f"--row {args.row}: a row number (0 or more) or full")
    from bench import build_plans, fail, find_decode
    from bench.tune import renamed
    from generator.plan import PlanError
    from generator.render import plan as render_plan
    v, base, source = find_decode(args.variant, args.variants, "--variant")
    row = v.seq_len - 1 if args.row == "full" else int(args.row)
    if row >= v.seq_len:
        fail(f"--row {row}: past {v.name}'s cache (rows 0 .. {v.seq_len - 1})")
    plan_ov = {**base, **ov, "TIMELINE": 1}
    try:
        render_plan(v, overrides=plan_ov)
    except PlanError as exc:
        fail(str(exc))
    import torch
    if not args.compile_only and not torch.cuda.is_available():
        fail("bench/timeline.py runs the layer: no CUDA GPU visible to torch")
    c = renamed(v, "tl")
    e, = build_plans([(c, plan_ov)], args.build_dir)
    if e["status"] != "ok":
        sys.exit(f"error: {c.name}: {e['status']}: {(e.get('error') or '').splitlines()[:1]}")
    if args.compile_only:
        r = e.get("resources") or {}
        print(f"{c.name} {plan_ov}: built in {args.build_dir}, {r.get('registers')} registers, spills "
              f"{r.get('spill_stores')} / {r.get('spill_loads')} B")
        return
    from bench.measure import n_layers_for
    from bench.timing import graph_of, layer_bytes
    from generator import reference, verify
    from generator.loader import load
    W = reference.random_weights(v.model, seed=1, device="cuda")
    first = load(c.name, W, build_dir=args.build_dir)
    x, p = verify.random_inputs(first, 2)
    r = verify.check_step(first, x, p, weights=W)
    if not verify.passed(r, v.model.dtype):
        sys.exit(f"error: {c.name}: fails the fp32 check (rel_err {r['rel_err']:.2e}, first bad stage "
                 f"{r['first_bad_stage']}): no timeline of a wrong plan")
    pos = torch.full((v.batch,), row, dtype=torch.int32)
    n = n_layers_for(layer_bytes(v.model, v.batch, pos))
    layers = [first]
    for i in range(1, n):
        Wi = reference.random_weights(v.model, seed=1 + i, device="cuda")
        layers.append(load(c.name, Wi, build_dir=args.build_dir))
        del Wi
    for L in layers:
        L.k_cache.normal_()
        L.v_cache.normal_()
    pos_dev = pos.cuda()
    xs = torch.randn(v.batch, v.model.hidden, device="cuda").to(reference.TORCH_DTYPES[v.model.dtype])

    def step():
        y = xs
        for L in layers:
            y = L(y, pos_dev, validate=False)
        return y
    g = graph_of(step)
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    stamps = layers[-1].buffer("timeline").cpu().tolist()
    rows = summarize(stamps, stamp_names(layers[-1].plan["steps"]))
    gap = launch_gap(layers[-2].buffer("timeline").cpu().tolist(), stamps)  # (each layer its own workspace)
    print(f"{v.name} ({source} plan{f' {base}' if base else ''}{f' + {ov}' if ov else ''}), every sequence at row "
          f"{row}, the last of {n} layers, µs from the first block's entry:")
    print(f"{'stamp':<30}{'min':>8}{'median':>8}{'max':>8}  last block  blocks")
    for x in rows:
        print(f"{x['stamp']:<30}{x['min_us']:>8.2f}{x['median_us']:>8.2f}{x['max_us']:>8.2f}  {x['last_block']:>10}"
              f"  {x['blocks']:>6}")
    print(f"the launch boundary: this launch's first entry {gap['first_entry_after_last_us']:.2f} µs after the "
          f"previous layer's last block's last stamp ({gap['first_entry_after_first_us']:.2f} after its first), its "
          f"first wait passed {gap['first_wait_after_last_us']:.2f} µs after it")
    path = Path(args.out or Path(os.environ.get("OUT", ".")) / "timeline.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "variant": v.name, "plan": source, "base": base,
                                "overrides": ov, "row": row, "layers": n, "stamps": rows, "launch_gap": gap,
                                "per_block_ns": stamps},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
