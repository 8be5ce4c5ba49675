"""A/B of plan overrides on a GPU: each case's variant built with the plan `megakernel build` gives it (its tuned plan
where tuning/ has one for the variant, as build picks the file; else the default plan) and with each override set
on top of that plan, every plan checked against the fp32 reference (a wrong one is never timed), then timed as the tuner times candidates
(bench/tune.py measure: a stack of distinct layers in a CUDA graph, the plans interleaved over rounds) at full
context, at each row given (every sequence at that position: a served model's short context) and at `mix` (gpu_check's
serving mix: sequence b at (b + 1) / batch of the cache, bench.measure.mixed_positions). Prints a line a (case,
position) and writes every row (variant, where, overrides, µs a layer, % against the first plan, rel_err).

    python bench/ab.py --case NAME '{"KNOB": 1}' [--case NAME '{...}' ...] [--variants FILE ...]
                       [--rows full,191] [--build-dir DIR] [--out FILE] [--compile-only] [--no-tuned]

NAME: a decode variant declared in variants.yaml, bench/heldout.yaml or a --variants file; a case may repeat NAME
to time several override sets against one default. --compile-only: build and print registers and spills (no GPU).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ and generator/ from this tree
    sys.path.insert(0, str(ROOT))


def parse(argv=None):
    """The arguments, checked: (args, cases {variant: [overrides, ...]}, rows ["full" | "mix" | int]). Exits 2 with one
    `error:` line on a bad one."""
    from bench import ScriptParser
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", nargs=2, action="append", metavar=("NAME", "JSON"), required=True,
                    help="a decode variant and a JSON object of plan overrides (repeatable)")
    ap.add_argument("--variants", action="append", default=[], help="more variants files (repeatable)")
    ap.add_argument("--rows", default="full,191",
                    help="where to time: full, mix and/or row numbers, comma-separated [full,191]")
    ap.add_argument("--build-dir", default="build-ab", help="where the plans are built [build-ab]")
    ap.add_argument("--out", default=None, help="JSON file [$OUT/ab.json, else ./ab.json]")
    ap.add_argument("--compile-only", action="store_true", help="build and print resources; no GPU")
    ap.add_argument("--no-tuned", action="store_true", help="start from the default plans, whatever tuning/ holds")
    ap.add_argument("--queued", action="store_true",
                    help="count GPU time only: each sample's replay queued behind a spin kernel, so the host's graph "
                         "launch latency is not charged to the layers (bench.timing.time_samples)")
    args = ap.parse_args(argv)
    cases: dict[str, list[dict]] = {}
    for name, text in args.case:
        try:
            ov = json.loads(text)
        except json.JSONDecodeError as exc:
            ap.error(f"--case {name} {text!r}: not JSON ({exc.msg})")
        if not isinstance(ov, dict) or not ov or not all(isinstance(k, str) and type(v) is int for k, v in ov.items()):
            ap.error(f"--case {name} {text!r}: must be a non-empty JSON object of knob: integer")
        cases.setdefault(name, []).append(ov)
    rows = []
    for r in args.rows.split(","):
        if r not in ("full", "mix") and not (r.isascii() and r.isdigit()):
            ap.error(f"--rows {args.rows}: each must be 'full', 'mix' or a row number (0 or more)")
        rows.append(r if r in ("full", "mix") else int(r))
    return args, cases, rows


def main(argv=None):
    args, cases, rows = parse(argv)
    from bench import build_plans, fail, find_decode
    from bench.tune import renamed
    from generator.plan import PlanError
    from generator.render import plan as render_plan
    from generator.tune import knob_dict
    plans, notes = [], []  # (variant, [(built variant, overrides)]): the plan build gives it first
    for name, ovs in cases.items():
        v, base, source = find_decode(name, args.variants, "--case")
        if args.no_tuned:
            base, source = {}, "default"
        for r in rows:
            if isinstance(r, int) and r >= v.seq_len:
                fail(f"--rows {r}: past {name}'s cache (rows 0 .. {v.seq_len - 1})")
        sets = [base, *({**base, **ov} for ov in ovs)]
        try:
            planned = [knob_dict(render_plan(v, overrides=ov)) for ov in sets]
        except PlanError as exc:
            fail(str(exc))
        for ov, k in zip(ovs, planned[1:]):  # (a case the base already plans would time a kernel against itself)
            if k == planned[0]:
                fail(f"--case {name} {json.dumps(ov)}: plans the same kernel as its base (the {source} plan"
                     f"{f' {base}' if base else ''}): nothing to compare")
        knobs = f" {base}" if base else ""  # (a tuning entry that plans the default resolves as "default")
        notes.append(f"{name}: from its {source} plan{knobs}")
        plans.append((v, [(renamed(v, f"ab{i}"), ov) for i, ov in enumerate(sets)]))
    if not args.compile_only:
        import torch
        if not torch.cuda.is_available():  # (before compiling anything)
            fail("bench/ab.py times on a GPU: no CUDA GPU visible to torch (--compile-only builds only)")
    print("\n".join(notes), flush=True)  # (after the refusals: a refused run is its one error line)
    entries = build_plans([p for _, ps in plans for p in ps], args.build_dir)
    overrides = {c.name: ov for _, ps in plans for c, ov in ps}
    for e in entries:
        r = e.get("resources") or {}
        print(f"{e['name']} {overrides.get(e['name'], {})}: {e['status']}, {r.get('registers')} registers, spills "
              f"{r.get('spill_stores')} / {r.get('spill_loads')} B"
              + (f": {e['error'].splitlines()[0]}" if e.get("error") else ""), flush=True)
    if args.compile_only or any(e["status"] != "ok" for e in entries):
        sys.exit(0 if args.compile_only else 1)
    import torch
    from bench.measure import mixed_positions
    from bench.tune import measure
    out = []
    for v, ps in plans:
        for r in rows:
            got = measure(v, [(c.name, ov) for c, ov in ps], Path(args.build_dir), 1234, 50, 5,
                          sets=[None if r == "full" else mixed_positions(v.batch, v.seq_len) if r == "mix"
                                else [r] * v.batch], queued=args.queued)
            t0 = got[0]["us"]
            for g in got:
                g.update(variant=v.name, where=r,
                         vs_base_pct=round((g["us"] / t0 - 1) * 100, 2) if g["us"] and t0 else None)
            out += got
            print(f"{v.name} @ {r}: " + "; ".join(
                (f"{'base' if g is got[0] else g['overrides']} {g['us']} us"
                 + (f" ({g['vs_base_pct']:+.2f} %)" if g["vs_base_pct"] is not None else ""))
                if g["us"] else f"{g['overrides'] or 'base'} FAILED {g.get('error')}" for g in got), flush=True)
    path = Path(args.out or Path(os.environ.get("OUT", ".")) / "ab.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "queued": args.queued, "rows": out}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
