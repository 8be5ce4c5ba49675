"""The served model's fused draw alone on constructed logits (bench/NOTES.md sessions 40-41): for each draw shape, its
time in a CUDA graph against serve.sample_tokens' (torch), how many rows take the fused draw's slow path (top-k off,
top-p < 1: rows whose ranked candidates hold less than top_p of the probability, whose cut is found over the whole
row), and whether the two drew the same tokens. Logits: randn x scale, rounded to bf16 (x 12: peaked, x 3: medium,
x 1: flat), a 128,256-token vocabulary, batch 1 and 8.

    python bench/draw_bench.py [--build-dir DIR] [--out FILE]   # a line each; JSON to FILE [$OUT/draw_bench.json]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ and generator/ from this tree
    sys.path.insert(0, str(ROOT))

V = 128256


def main(argv=None):
    from bench import ScriptParser
    ap = ScriptParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="build", help="where the draw's kernels are compiled (its object cache)")
    ap.add_argument("--out", default=None, help="JSON file [$OUT/draw_bench.json, else ./draw_bench.json]")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("error: bench/draw_bench.py launches kernels: no CUDA GPU visible to torch", file=sys.stderr)
        sys.exit(2)
    from bench.timing import graph_of, time_replays
    from generator import sampler, serve
    draw = sampler.Sampler(2048, torch.bfloat16, "cuda", build_dir=args.build_dir)
    res = {}

    def run(name, B, scale, temp, k, p, room, cands, nucleus):
        g = torch.Generator(device="cuda").manual_seed(B * 100 + int(scale * 10))
        logits = (torch.randn(B, V, device="cuda", generator=g) * scale).bfloat16().float()
        t, tk, tp = (torch.full((B,), x, device="cuda") for x in (temp, k, p))
        seed = torch.arange(B, device="cuda") * 7919 + 1
        pos = torch.arange(B, dtype=torch.int32, device="cuda") + 9
        past = 0
        if room and k == 0:
            mass = (logits / temp).softmax(-1).topk(room, dim=-1).values.sum(-1)
            past = int(((mass < p) | (p >= 1)).sum())
        want = serve.sample_tokens(logits, t, tk, tp, seed, pos.long() + 1, candidates=cands, nucleus=nucleus)
        nxt = logits.argmax(-1)
        got = draw(logits, t, tk, tp, seed, pos, nxt.clone(), candidates=room, nucleus=nucleus)
        same = int((got == want).sum())
        gr = graph_of(lambda: draw(logits, t, tk, tp, seed, pos, nxt, candidates=room, nucleus=nucleus))
        us = time_replays(gr.replay, 1, reps=50, queued=True)["median"]
        gt = graph_of(lambda: serve.sample_tokens(logits, t, tk, tp, seed, pos.long() + 1, candidates=cands,
                                                  nucleus=nucleus))
        ut = time_replays(gt.replay, 1, reps=20, queued=True)["median"]
        res[name] = dict(B=B, us=round(us, 1), torch_us=round(ut, 1), rows_whole=past, same=f"{same}/{B}")
        print(f"{name:40s} fused {us:7.1f} us  torch {ut:7.1f}  rows past the ranked {past}/{B}  same {same}/{B}",
              flush=True)

    nc = sampler.NUCLEUS_CANDIDATES
    for B in (1, 8):
        run(f"b{B} top-k 50 p 0.9", B, 3, 0.8, 50, 0.9, 128, 128, True)
        run(f"b{B} top-p 0.9 peaked (x12)", B, 12, 0.8, 0, 0.9, nc, 0, True)
        run(f"b{B} top-p 0.5 (x3)", B, 3, 0.8, 0, 0.5, nc, 0, True)
        run(f"b{B} top-p 0.9 (x3)", B, 3, 0.8, 0, 0.9, nc, 0, True)
        run(f"b{B} top-p 0.9 flat (x1)", B, 1, 1.0, 0, 0.9, nc, 0, True)
        run(f"b{B} top-p 0.9 peaked room 128", B, 12, 0.8, 0, 0.9, 128, 0, True)
        run(f"b{B} top-p 0.9 peaked room 1024", B, 12, 0.8, 0, 0.9, 1024, 0, True)
        run(f"b{B} temperature only", B, 3, 0.8, 0, 1.0, 0, 0, False)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "draw_bench.json"
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
