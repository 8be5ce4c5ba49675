"""Tensor-parallel check, one process per GPU: build, verify and time every tensor-parallel decode variant (declared,
and the held-out shapes of bench/heldout.yaml) whose tp is the number of processes.

    torchrun --nproc_per_node 2 bench/tp_check.py [--only GLOB ...] [--out DIR] [--seed N]

Each variant: the fused TP layer (one launch per part, an all-reduce between: generator.collectives) against the
fp32 reference of the whole layer on fresh random inputs (every rank: output, its KV heads' cache rows, no other row
touched), then a stack of distinct layers (every sequence at full context) in a CUDA graph, against the same layer
with NCCL all-reduces, the unfused TP layer (merged cuBLAS GEMMs, SDPA, the same all-reduces; generator.unfused)
and the FlashInfer TP layer (bench/flashinfer_layer.py) in the same run. The bound is each GPU's
weight-and-KV bytes at the copy bandwidth measured in the same run plus the measured time of the step's two
all-reduces alone. bench/gpu_check.py runs this where it sees enough GPUs. Rank 0 prints a table last and writes
tp_check_tp<N>.json to --out ($OUT).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import HELP, run_click  # noqa: E402
from bench.measure import n_layers_for  # noqa: E402
from bench.timing import copy_bandwidth, graph_of, layer_bytes, time_replays  # noqa: E402
from generator import reference, variants as gvariants, verify  # noqa: E402
from bench.flashinfer_layer import FlashInferLayer, flashinfer_available  # noqa: E402
from bench.gpu_check import build_checked, check_options  # noqa: E402
from generator.collectives import AllReduce  # noqa: E402
from generator.loader import load  # noqa: E402
from generator.unfused import UnfusedLayer  # noqa: E402


def allreduce_us(batch: int, hidden: int, dtype: torch.dtype, n: int = 64) -> dict:
    """µs of the decode step's two all-reduces alone, as the fused layer runs them (the fp32 residual h, then the
    output in the layer dtype; generator.collectives), in a CUDA graph of n pairs: {"symm_mem": µs or None where it
    cannot run, "nccl": µs}."""
    out = {}
    for method in ("symm_mem", "nccl"):
        ars = [AllReduce(dist.group.WORLD, batch * hidden, d, torch.device("cuda", torch.cuda.current_device()),
                         method) for d in (torch.float32, dtype)]
        if any(a.method != method for a in ars):
            out[method] = None
            continue
        outs = [torch.randn(batch, hidden, device="cuda").to(d) for d in (torch.float32, dtype)]
        for a, o in zip(ars, outs):
            if a.buffer is not None:
                a.buffer.copy_(o.view(-1))

        def step(ars=ars, outs=outs):
            for _ in range(n):
                for a, o in zip(ars, outs):
                    a(o)
        g = graph_of(step)
        out[method] = round(time_replays(g.replay, n, queued=True)["median"], 2)
    return out


def check_tp(v, build_dir: str, seed: int, bw: float, ar: dict) -> dict:
    m, tp = v.model, v.tp
    row = {"variant": v.name, "tp": tp}
    W = reference.random_weights(m, seed=seed, device="cuda")
    layer = load(v.name, W, build_dir=build_dir, group=dist.group.WORLD)
    x, pos = verify.random_inputs(layer, seed)
    res = verify.check_step(layer, x, pos, weights=W)
    ok = torch.tensor([int(verify.passed(res, m.dtype))], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank's cache rows and output
    row.update({k: res[k] for k in ("rel_err", "k_err", "v_err", "cache_untouched", "unwritten", "first_bad_stage")})
    row["pass"] = bool(ok.item())
    del layer, W, res

    pos_full = torch.full((v.batch,), v.seq_len - 1, dtype=torch.int32)
    nbytes = layer_bytes(v.shard, v.batch, pos_full)  # what one GPU streams per step
    n = n_layers_for(nbytes)
    pos_dev = pos_full.cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = torch.randn(v.batch, m.hidden, device="cuda", generator=g).to(reference.TORCH_DTYPES[m.dtype])
    stacks = {"fused": [], "fused_nccl": [], "unfused": [], "flashinfer": []}
    fi_why = flashinfer_available(v.shard)
    row["flashinfer"] = fi_why or "ok"
    world = dist.group.WORLD
    for i in range(n):
        Wi = reference.random_weights(m, seed=seed + 1 + i, device="cuda")
        f = load(v.name, Wi, build_dir=build_dir, group=world)
        for c in (f.k_cache, f.v_cache):
            c.normal_(generator=g)
        stacks["fused"].append(f)
        # the same weights and caches with the all-reduce through NCCL: the measured choice of all-reduce
        stacks["fused_nccl"].append(load(v.name, None, build_dir=build_dir, packed=f.packed,
                                         caches=(f.k_cache, f.v_cache), group=world, allreduce="nccl"))
        stacks["unfused"].append(UnfusedLayer(Wi, m, f.k_cache.clone(), f.v_cache.clone(), group=world))
        if not fi_why:
            first = stacks["flashinfer"][0] if stacks["flashinfer"] else None
            L = FlashInferLayer(Wi, m, v.batch, v.seq_len, share_plan_with=first, group=world)
            L.load_kv(f.k_cache, f.v_cache)
            stacks["flashinfer"].append(L)
        del Wi
    torch.cuda.empty_cache()
    row["allreduce"] = stacks["fused"][0].allreduce

    def stack(layers, call):
        def step():
            y = xs
            for L in layers:
                y = call(L, y)
            return y
        return step
    fused = lambda L, y: L(y, pos_dev, validate=False)  # noqa: E731
    calls = {"fused": fused, "fused_nccl": fused, "unfused": lambda L, y: L.decode(y, pos_dev),
             "flashinfer": lambda L, y: L(y, pos_dev)}
    if stacks["flashinfer"]:  # the baseline is checked before it is timed, against the unfused TP layer
        ref = stacks["unfused"][0].decode(xs, pos_dev)
        row["flashinfer_rel_err"] = verify.rel_err(stacks["flashinfer"][0](xs, pos_dev), ref.float())
        if row["flashinfer_rel_err"] > verify.REL_TOL[m.dtype]:
            row["flashinfer"], stacks["flashinfer"] = f"failed check: rel_err {row['flashinfer_rel_err']:.2e}", []
    timings = {k: time_replays(graph_of(stack(layers, calls[k])).replay, n, queued=True)["median"]
               for k, layers in stacks.items() if layers}
    stacks["fused"][0](xs, pos_dev, validate=False)
    row["stage_us"] = {k: round(t, 1) for k, t in stacks["fused"][0].stage_us().items()}
    us = timings["fused"]
    base = {k: t for k, t in timings.items() if not k.startswith("fused")}
    best = min(base, key=base.get)
    ar_us = ar[row["allreduce"]]
    stream_us = nbytes / (bw * 1e9) * 1e6
    row.update(layers_timed=n, bytes_per_gpu=nbytes, us=round(us, 1), fused_nccl_us=round(timings["fused_nccl"], 1),
               unfused_us=round(base["unfused"], 1), flashinfer_us=round(base["flashinfer"], 1) if "flashinfer" in base
               else None, best_baseline=best, speedup=round(base[best] / us, 2),
               allreduce_us=ar_us, allreduce_all=ar, stream_us=round(stream_us, 1),
               bound_us=round(stream_us + ar_us, 1), of_bound=round(us / (stream_us + ar_us), 2),
               pct_bw=round(100 * stream_us / max(us - ar_us, 1e-9), 1))
    del stacks
    torch.cuda.empty_cache()
    return row


@click.command(context_settings=HELP)
@check_options
def main(variants_file, heldout_file, only, build_dir, out, seed):
    """Verify and time the tensor-parallel variants, one process per GPU:
    torchrun --nproc_per_node 2 bench/tp_check.py [OPTIONS]"""
    if "LOCAL_RANK" not in os.environ:
        print("error: run one process per GPU: torchrun --nproc_per_node 2 bench/tp_check.py", file=sys.stderr)
        sys.exit(2)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])),
                            timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_t = torch.tensor([seed if seed is not None else int(time.time()) % 100000], device="cuda")
    dist.broadcast(seed_t, 0)  # one seed: every rank draws the same whole-layer weights and inputs
    seed = int(seed_t.item())
    pick = lambda vs: [v for v in gvariants.select(vs, only) if v.tp == world]  # noqa: E731
    vs = pick(gvariants.load(variants_file))
    held = pick(gvariants.load(heldout_file)) if heldout_file else []
    where = {v.name: build_dir for v in vs} | {v.name: f"{build_dir}-heldout" for v in held}
    ok_names = None
    if rank == 0:  # one rank builds; the others wait for its list of what built
        _, entries = build_checked(vs, held, variants_file, heldout_file, build_dir)
        ok_names = [e["name"] for e in entries if e["status"] == "ok"]
    box = [ok_names]
    dist.broadcast_object_list(box, 0)
    ok_names = set(box[0])
    bw = copy_bandwidth()
    ar = {(b, h, dt): allreduce_us(b, h, reference.TORCH_DTYPES[dt])
          for b, h, dt in sorted({(v.batch, v.model.hidden, v.model.dtype) for v in vs + held})}
    rows = []
    for v in vs + held:
        if v.name not in ok_names:
            rows.append({"variant": v.name, "pass": False, "error": "not built"})
            continue
        try:
            row = check_tp(v, where[v.name], seed, bw, ar[(v.batch, v.model.hidden, v.model.dtype)])
            row["heldout"] = v in held
        except Exception as exc:  # keep going: one broken variant must not hide the others
            row = {"variant": v.name, "pass": False,
                   "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        doc = {"gpu": torch.cuda.get_device_name(), "arch": "%d%d" % torch.cuda.get_device_capability(),
               "gpus": world, "date": time.strftime("%Y-%m-%d"),
               "time": time.strftime("%H:%M:%S"), "seed": seed, "copy_gbps": round(bw, 1),
               "allreduce_us": {f"b{b}_h{h}_{dt}": t for (b, h, dt), t in ar.items()}, "rows": rows}
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"tp_check_tp{world}.json").write_text(json.dumps(doc, indent=1))
        print(f"\n{doc['gpu']} x{world}  {doc['date']}  seed {seed}  copy BW {bw:.0f} GB/s per GPU")
        for (b, h, dt), t in ar.items():
            print(f"two all-reduces alone (fp32 + {dt} [{b}, {h}]), µs: symm_mem one-shot {t['symm_mem']}, "
                  f"NCCL {t['nccl']}")
        print(f"{'TP variant (* held out)':40s} {'rel_err':>8s} {'pass':>4s} {'fused':>7s} {'AR':>8s} {'bound':>7s} "
              f"{'x bnd':>5s} {'%BW':>5s} {'f+NCCL':>7s} {'unf TP':>7s} {'FI TP':>7s} {'x best':>6s}   stages (us)")
        for r in rows:
            name = r["variant"] + ("*" if r.get("heldout") else "")
            if "error" in r:
                print(f"{name:40s} {'-':>8s} {'FAIL':>4s}  {r['error'][:90]}")
                continue
            fi = f"{r['flashinfer_us']:7.1f}" if r["flashinfer_us"] else f"{'-':>7s}"
            print(f"{name:40s} {r['rel_err']:8.1e} {'ok' if r['pass'] else 'FAIL':>4s} {r['us']:7.1f} "
                  f"{r['allreduce']:>8s} {r['bound_us']:7.1f} {r['of_bound']:5.2f} {r['pct_bw']:5.1f} "
                  f"{r['fused_nccl_us']:7.1f} {r['unfused_us']:7.1f} {fi} {r['speedup']:6.2f}   "
                  + " ".join(f"{t:.1f}" for t in r["stage_us"].values()))
        for why in sorted({r["flashinfer"] for r in rows if r.get("flashinfer", "ok") != "ok"}):
            print(f"flashinfer: {why}")
    dist.barrier()
    dist.destroy_process_group()
    if not rows and rank == 0:
        print(f"no tp = {world} variant declared or held out")
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    run_click(main)
