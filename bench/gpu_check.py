"""The one-call GPU check: build, run the GPU tests, verify every variant against the reference on fresh random
inputs, time it against the unfused torch layer in a CUDA graph, and print a table last.

    python bench/gpu_check.py [--variants FILE] [--only GLOB ...] [--no-tests] [--out DIR]

Details go to $OUT (or --out): gpu_check.json and the pytest log.
"""
from __future__ import annotations

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

from bench.baselines import TorchLayer  # noqa: E402
from bench.measure import n_layers_for  # noqa: E402  (distinct layers: one pass over the stack >= 4x the L2)
from bench.timing import copy_bandwidth, graph_of, layer_bytes, time_replays  # noqa: E402
from generator import compile as gcompile, reference, variants as gvariants, verify  # noqa: E402
from generator.loader import load  # noqa: E402

def check_variant(v, build_dir: str, seed: int, bw: float) -> dict:
    m = v.model
    row = {"variant": v.name}
    W = reference.random_weights(m, seed=seed, device="cuda")
    layer = load(v.name, W, build_dir=build_dir)
    row["load_ms"] = round(layer.load_ms, 2)
    x, pos = verify.random_inputs(layer, seed)
    res = verify.check_step(layer, x, pos)
    row.update({k: res[k] for k in ("rel_err", "unwritten", "k_err", "v_err", "cache_untouched")})
    row["pass"] = verify.passed(res, m.dtype)
    del layer

    # timing: a stack of distinct layers, every sequence at full context (the worst case for decode)
    pos_full = torch.full((v.batch,), v.seq_len - 1, dtype=torch.int32)
    nbytes = layer_bytes(m, v.batch, pos_full)
    n = n_layers_for(nbytes)
    pos_dev = pos_full.cuda()
    xs = torch.randn(v.batch, m.hidden, device="cuda").to(reference.TORCH_DTYPES[m.dtype])
    fused, base = [], []
    for i in range(n):
        Wi = reference.random_weights(m, seed=seed + 1 + i, device="cuda")
        fused.append(load(v.name, Wi, build_dir=build_dir))
        base.append(TorchLayer(Wi, m, v.batch, v.seq_len))
        for c in (fused[-1].k_cache, fused[-1].v_cache):
            c.normal_()
        base[-1].k_cache.copy_(fused[-1].k_cache)
        base[-1].v_cache.copy_(fused[-1].v_cache)

    def stack(layers):
        def step():
            y = xs
            for L in layers:
                y = L(y, pos_dev, validate=False) if hasattr(L, "launch") else L(y, pos_dev)
            return y
        return step

    timings = {}
    for label, layers in (("fused", fused), ("torch_graph", base)):
        g = graph_of(stack(layers))
        timings[label] = time_replays(g.replay, n)
    fused[0](xs, pos_dev, validate=False)
    row["stage_us"] = {k: round(t, 1) for k, t in fused[0].stage_us().items()}  # one launch, weights from HBM
    row["layers_timed"] = n
    row["bytes"] = nbytes
    row["us"] = round(timings["fused"]["median"], 2)
    row["us_p10"], row["us_p90"] = round(timings["fused"]["p10"], 2), round(timings["fused"]["p90"], 2)
    row["torch_graph_us"] = round(timings["torch_graph"]["median"], 2)
    row["speedup"] = round(timings["torch_graph"]["median"] / timings["fused"]["median"], 2)
    row["gbps"] = round(nbytes / (timings["fused"]["median"] * 1e-6) / 1e9, 1)
    row["pct_bw"] = round(100 * row["gbps"] / bw, 1)
    row["floor_us"] = round(nbytes / (bw * 1e9) * 1e6, 2)
    del fused, base
    torch.cuda.empty_cache()
    return row


@click.command()
@click.option("--variants", "variants_file", default=str(ROOT / "variants.yaml"), show_default=True)
@click.option("--only", multiple=True, help="glob over variant names (repeatable)")
@click.option("--build-dir", default=str(ROOT / "build"), show_default=True)
@click.option("--no-tests", is_flag=True, help="skip the pytest GPU suite")
@click.option("--tests", "test_paths", default="tests", show_default=True, help="pytest paths (comma-separated)")
@click.option("--out", default=os.environ.get("OUT", str(ROOT / "out")), show_default=True)
@click.option("--seed", type=int, default=None, help="default: fresh from the clock")
def main(variants_file, only, build_dir, no_tests, test_paths, out, seed):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed = seed if seed is not None else int(time.time()) % 100000
    vs = gvariants.select(gvariants.load(variants_file), only)
    t0 = time.time()
    result = gcompile.build(vs, build_dir)
    print(f"build: {len(vs)} variants, {result['distinct']} binaries, {time.time() - t0:.1f} s", flush=True)
    for e in result["entries"]:
        if e["status"] != "ok":
            print(f"  {e['name']}: {e['status']}: {e['error'].splitlines()[0]}", flush=True)

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

    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw:.0f} GB/s (read + write)", flush=True)
    rows = []
    ok_names = {e["name"] for e in result["entries"] if e["status"] == "ok"}
    for v in vs:
        if v.name not in ok_names:
            rows.append({"variant": v.name, "pass": False, "error": "not built"})
            continue
        try:
            row = check_variant(v, build_dir, seed, bw)
        except Exception as exc:  # keep going: one broken variant must not hide the others
            row = {"variant": v.name, "pass": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)

    doc = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "seed": seed,
           "copy_gbps": round(bw, 1), "tests": tests, "rows": rows}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
    print(f"\n{doc['gpu']}  {doc['date']}  seed {seed}  copy BW {bw:.0f} GB/s  tests: {tests}")
    hdr = f"{'variant':40s} {'rel_err':>8s} {'pass':>4s} {'us':>8s} {'torch_g':>8s} {'speedup':>7s} {'%BW':>6s}"
    print(hdr + "   stages (us): qkv att o gu down")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:40s} {'-':>8s} {'FAIL':>4s}  {r['error'][:80]}")
        else:
            print(f"{r['variant']:40s} {r['rel_err']:8.1e} {'ok' if r['pass'] else 'FAIL':>4s} {r['us']:8.1f} "
                  f"{r['torch_graph_us']:8.1f} {r['speedup']:7.2f} {r['pct_bw']:6.1f}   "
                  + " ".join(f"{t:.1f}" for t in r["stage_us"].values()))
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
