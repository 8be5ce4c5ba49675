"""One rank of the tensor-parallel tests (tests/test_tp.py starts it under torchrun, one process per GPU, or per CPU
with gloo). Each rank writes its findings to OUT/rank<r>.json; the test asserts on them.

    torchrun --standalone --nproc_per_node 2 tests/tp_worker.py TASK --out DIR [...]

TASK: unfused  (the unfused TP layer against the whole layer: decode and prefill, any device)
      model    (a TP model's greedy tokens and logits against the same checkpoint on one device/GPU)
      fused    (every fused TP variant given: the whole layer's reference, CUDA-graph replay = direct call)
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import click
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from generator import reference, serve, verify  # noqa: E402
from generator.unfused import UnfusedLayer  # noqa: E402
from generator.variants import Model, shard_model  # noqa: E402
from hf_util import greedy_agreement  # noqa: E402  (tests/, this script's directory)

SHAPE = Model(name="tp-tiny", hidden=128, heads=8, kv_heads=4, head_dim=32, intermediate=320, layers=1,
              norm="rmsnorm", norm_eps=1e-5, rope_theta=10000.0, activation="silu", qkv_bias=True, qk_norm=False,
              dtype="bf16")


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def task_unfused(dev) -> dict:
    """The TP layer (this rank's part + all-reduces) equals the whole unfused layer, fp32, decode and prefill."""
    m, B, L = SHAPE, 3, 24
    W = reference.random_weights(m, seed=5, device=dev, dtype=torch.float32)
    part = shard_model(m, dist.get_world_size())
    kc = torch.zeros(B, part.kv_heads, L, m.head_dim, device=dev)
    vc = torch.zeros_like(kc)
    fk = torch.zeros(B, m.kv_heads, L, m.head_dim, device=dev)
    fv = torch.zeros_like(fk)
    tp, whole = UnfusedLayer(W, m, kc, vc, group=dist.group.WORLD), UnfusedLayer(W, m, fk, fv)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, 5, m.hidden, generator=g).to(dev)
    start = torch.zeros(B, dtype=torch.int32, device=dev)
    errs = {"prefill": rel(tp.prefill(x, start, kv_len=5), whole.prefill(x, start, kv_len=5))}
    pos = torch.tensor([5, 9, 17], dtype=torch.int32, device=dev)
    y = torch.randn(B, m.hidden, generator=g).to(dev)
    errs["decode"] = rel(tp.decode(y, pos), whole.decode(y, pos))
    r, n = dist.get_rank(), dist.get_world_size()
    errs["k_cache"] = rel(kc, fk.chunk(n, 1)[r])
    return errs


def task_model(dev, ckpt: Path, build: Path, new: int) -> dict:
    """Greedy generation of a TP model (its fused TP variants where built, else the unfused TP layers) against the
    same checkpoint on this rank's device alone (its tp = 1 variants)."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    kw = dict(build_dir=build, device=dev, cache_len=64, max_batch=2)
    if dev.type == "cpu":
        kw.update(dtype=torch.float32, variants=[])
    tp = serve.Model.from_hf(ckpt, group=dist.group.WORLD, **kw)
    one = serve.Model.from_hf(ckpt, **kw)
    a = tp.generate(prompts, new, output_logits=True)
    b = one.generate(prompts, new, output_logits=True)
    agree = [greedy_agreement(a.tokens[i], b.tokens[i], torch.stack([lg[i] for lg in a.logits]),
                              torch.stack([lg[i] for lg in b.logits])) for i in range(len(prompts))]
    return {"tp_tokens": a.tokens, "one_tokens": b.tokens, "agreement": agree,
            "tp_paths": [s["variant"] for s in tp.stats()], "one_paths": [s["variant"] for s in one.stats()],
            "tp_kv_heads": tp.k_caches[0].shape[1], "one_kv_heads": one.k_caches[0].shape[1]}


def task_fused(dev, build: Path, names: list[str], seed: int) -> dict:
    """Each fused TP variant: one step against the whole layer's fp32 reference at random positions; then a CUDA
    graph of the step (all-reduces inside) replayed equals the direct call."""
    from generator.loader import load
    out = {}
    for name in names:
        W = reference.random_weights(_model_of(name, build), seed=seed, device=dev)  # the whole layer's, every rank
        layer = load(name, W, build_dir=build, group=dist.group.WORLD)
        x, pos = verify.random_inputs(layer, seed)
        res = verify.check_step(layer, x, pos, weights=W)
        row = {k: res[k] for k in ("rel_err", "k_err", "v_err", "cache_untouched", "unwritten", "first_bad_stage")}
        row["pass"] = verify.passed(res, layer.model.dtype)
        pos_dev = pos.to(dev)
        kc, vc = layer.k_cache.clone(), layer.v_cache.clone()
        direct = layer(x, pos_dev, validate=False).clone()
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(x, pos_dev, validate=False)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x, pos_dev, validate=False)
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
        graph.replay()
        torch.cuda.synchronize()
        row["graph_equal"] = bool(torch.equal(y, direct))
        out[name] = row
    return out


def _model_of(name: str, build: Path):
    from generator.manifest import find_entry, variant_from_entry
    return variant_from_entry(find_entry(name, build)[0]).model


@click.command()
@click.argument("task", type=click.Choice(["unfused", "model", "fused"]))
@click.option("--out", required=True, type=click.Path(path_type=Path))
@click.option("--ckpt", type=click.Path(path_type=Path))
@click.option("--build", type=click.Path(path_type=Path))
@click.option("--variant", "names", multiple=True)
@click.option("--new", type=int, default=12)
@click.option("--seed", type=int, default=11)
def main(task, out, ckpt, build, names, new, seed):
    cuda = task == "fused" or (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and task != "unfused")
    rank = int(os.environ["RANK"])
    if cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=5))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    try:
        if task == "unfused":
            res = task_unfused(dev)
        elif task == "model":
            res = task_model(dev, ckpt, build, new)
        else:
            res = task_fused(dev, build, list(names), seed)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        res = {"error": f"{type(exc).__name__}: {exc}"}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
