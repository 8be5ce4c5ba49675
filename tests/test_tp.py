"""Tensor parallel: the variant field, sharding and planning on the CPU; the unfused TP layer and a TP model over
gloo (2 CPU processes, in CI); on 2 GPUs (NCCL), every fused TP variant against the whole layer's reference and a
TP model's greedy tokens against the single-GPU model's (tests/tp_worker.py is one rank)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generator import interface, render, variants as gvariants
from generator.loader import tp_rank
from generator.variants import VariantError, shard_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from hf_util import NEAR_TIE_RMS  # noqa: E402
from tp_worker import SHAPE  # noqa: E402

ENTRY = """models:
  m:
    {{hidden: 256, heads: 8, kv_heads: {kv}, head_dim: 32, intermediate: 640, layers: 2, norm: rmsnorm,
     norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16,
     matrix: {{mode: [{mode}], batch: [1], seq_len: [64], tp: {tp}}}}}
"""


def parse(kv=4, mode="decode", tp="[1, 2]"):
    return gvariants.parse(ENTRY.format(kv=kv, mode=mode, tp=tp), "v.yaml")


def test_tp_is_a_matrix_field_named_in_the_variant():
    one, two = parse()
    assert (one.tp, two.tp) == (1, 2)
    assert one.name == "m_decode_b1_s64_bf16" and two.name == "m_decode_b1_s64_bf16_tp2"
    assert two.params()["tp"] == 2
    s = two.shard
    assert (s.heads, s.kv_heads, s.intermediate, s.hidden, s.head_dim) == (4, 2, 320, 256, 32)


@pytest.mark.parametrize("kw,match", [
    (dict(kv=3, tp="[2]"), r"field 'heads' \(8\) must be divisible by kv_heads|'kv_heads' \(3\) must be divisible "
                          r"by tp = 2"),
    (dict(kv=1, tp="[2]"), r"'kv_heads' \(1\) must be divisible by tp = 2 \(KV heads are split, not replicated\)"),
    (dict(tp="[3]"), r"'heads' \(8\) must be divisible by tp = 3"),
    (dict(mode="prefill", tp="[2]"), "tensor parallel is built for decode only"),
    (dict(tp="[0]"), "'matrix.tp' must be positive"),
])
def test_tp_that_cannot_split_is_one_line(kw, match):
    with pytest.raises(VariantError, match=match) as e:
        parse(**kw)
    assert "\n" not in str(e.value)


def test_tp_plan_ends_a_kernel_at_each_partial_sum():
    one, two = parse()
    p1, p2 = render.plan(one), render.plan(two)
    assert [k["name"] for k in p1["kernels"]] == ["decoder_layer"] and p1["kernels"][0]["reduce"] is None
    assert [(k["name"], k["steps"], k["reduce"]) for k in p2["kernels"]] == [
        ("decoder_layer_0", ["norm", "qkv_proj", "attention", "o_proj"], "h"),
        ("decoder_layer_1", ["norm", "gate_up", "down_proj"], "out")]
    # the barrier after o_proj is the launch boundary; one GPU also replaces qkv's by counters or, at batch 1 under
    # the LL rule, by words (QKV_FLOW 1 / 2; the LL rule drops two more barriers there)
    assert p1["consts"]["QKV_FLOW"] == 2 and p2["consts"]["QKV_FLOW"] == 0
    barriers = render.plan(one, overrides={"QKV_FLOW": 0, "ATT_LL": 0, "H_LL": 0})["grid_syncs"]
    assert p2["grid_syncs"] == barriers - 1
    c1, c2 = p1["consts"], p2["consts"]
    assert (c2["HEADS"], c2["KV_HEADS"], c2["INTER"], c2["HIDDEN"], c2["TP"]) == (4, 2, 320, 256, 2)
    assert c1["TP"] == 1 and c1["HEADS"] == 8
    # the workspace is one GPU's: a quarter of the q|k|v rows' floats of the whole layer's... per the shard
    assert p2["workspace"]["buffers"]["act"]["shape"] == [1, 320]
    src = render.render(two, p2)
    assert src.count('extern "C" __global__') == 2 and "decoder_layer_1(" in src and "tp_rank" in src


def test_tp_batch_past_the_rows_names_norm_global_and_that_plan_builds(tmp_path):
    """Tensor parallel keeps the norms' rows in shared memory by default (NORM_GLOBAL has not run on 2 GPUs): a batch
    whose rows do not fit is refused naming the override that keeps them in global memory; that plan splits at the
    two partial sums as any TP plan does, its norms steps of their own, and compiles without spills."""
    import dataclasses

    from generator import compile as gcompile
    from generator.plan import PlanError
    v70 = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.tp == 2)
    v = dataclasses.replace(v70, batch=16)
    with pytest.raises(PlanError, match=r"a batch of at most 12 fits; NORM_GLOBAL=1 keeps them in global memory "
                                        r"\(with tensor parallel an override only, not yet timed on 2 GPUs: an entry "
                                        r'\{"llama3-70b_decode_b16_s4096_bf16_tp2": \{"overrides": \{"NORM_GLOBAL": 1\}\}\} '
                                        r"in the one file in tuning/") as e:
        render.plan(v)
    assert "\n" not in str(e.value)
    p = render.plan(v, overrides={"NORM_GLOBAL": 1})
    assert p["consts"]["NORM_GLOBAL"] == 1 and p["consts"]["H_STATS"] == 0 and p["consts"]["TP"] == 2
    assert [(k["steps"], k["reduce"]) for k in p["kernels"]] == [
        (["norm", "qkv_proj", "attention", "o_proj"], "h"), (["norm", "gate_up", "down_proj"], "out")]
    assert render.plan(dataclasses.replace(v70, batch=8))["consts"]["NORM_GLOBAL"] == 0  # the default unchanged
    res = gcompile.build([v], tmp_path / "b", overrides={v.name: {"NORM_GLOBAL": 1}})
    (e,) = res["entries"]
    assert e["status"] == "ok" and e["plan_source"] == "override", e.get("error")
    r = e["resources"]
    assert r["spill_stores"] == r["spill_loads"] == 0 and r["smem_total"] <= r["smem_limit"], r


def test_the_tp_override_through_a_tuning_file_as_a_user_takes_it(tmp_path):
    """The refusal's advice followed with the CLI (a new user's trial, session 45): a tuning entry with
    {"NORM_GLOBAL": 1} builds the TP batch the default refuses; report.csv says which plan (overrides and path);
    `render` without the file names the file the build used; `--tuned-for ""` is an error, not the default file."""
    import csv
    import json as _json

    from conftest import run_cli
    (tmp_path / "v.yaml").write_text(
        "models:\n  l70:\n    {hidden: 8192, heads: 64, kv_heads: 8, head_dim: 128, intermediate: 28672, layers: 80,"
        " norm: rmsnorm, norm_eps: 1.0e-5, rope_theta: 500000.0, activation: silu, qkv_bias: false, qk_norm: false,"
        " dtype: bf16, matrix: {mode: [decode], batch: [16], seq_len: [4096], tp: [2]}}\n")
    name = "l70_decode_b16_s4096_bf16_tp2"
    args = ["build", "--variants", tmp_path / "v.yaml", "--build-dir", tmp_path / "b", "--no-report"]
    r = run_cli(args + ["--no-tuned"], cwd=tmp_path, timeout=600)
    assert r.returncode == 1 and '{"overrides": {"NORM_GLOBAL": 1}}' in r.stderr, r.stderr
    (tmp_path / "t.json").write_text(_json.dumps({name: {"overrides": {"NORM_GLOBAL": 1}}}))
    r = run_cli(args + ["--tuned-for", tmp_path / "t.json"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "b" / "report.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["plan"].startswith("tuned") and row["overrides"] == "NORM_GLOBAL=1" and "NORM_GLOBAL" in row["path"]
    r = run_cli(["render", name, "--variants", tmp_path / "v.yaml", "--build-dir", tmp_path / "b"], cwd=tmp_path)
    assert r.returncode == 2 and f"used the overrides of {tmp_path / 't.json'}: --tuned-for" in r.stderr, r.stderr
    r = run_cli(args + ["--tuned-for", ""], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --tuned-for: empty"), r.stderr
    # a build without that file refuses the variant again: said, with the flag that keeps the tuned build
    r = run_cli(args + ["--no-tuned"], cwd=tmp_path, timeout=600)
    assert r.returncode == 1 and f"its build of the tuned ({tmp_path / 't.json'}) plan is replaced (build with " \
        f"--tuned-for {tmp_path / 't.json'} to keep it)" in r.stderr, r.stderr


def test_shard_weights_split_heads_and_columns_and_join_back():
    m, tp = SHAPE, 2
    from generator import reference
    W = reference.random_weights(m, seed=1, dtype=torch.float32)
    parts = [interface.shard_weights(W, tp, r) for r in range(tp)]
    want = interface.weight_shapes(shard_model(m, tp))
    for p in parts:
        assert {k: tuple(v.shape) for k, v in p.items()} == want
    for name, t in W.items():
        dim = interface.TP_SPLIT.get(name)
        joined = t if dim is None else torch.cat([p[name] for p in parts], dim=dim)
        assert torch.equal(joined, t), name
    # q rows of rank 1 are heads 4..7: rows 4 * head_dim on
    assert torch.equal(parts[1]["self_attn.q_proj.weight"], W["self_attn.q_proj.weight"][4 * 32:])


def test_a_tp_variant_needs_its_process_group():
    with pytest.raises(ValueError, match="pass the torch.distributed process group"):
        tp_rank(None, 2, "x_tp2")
    assert tp_rank(None, 1, "x") == 0


def _torchrun(task, out, *args, timeout=600, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "tp_worker.py"), task, "--out", str(out), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    res = []
    for rank in range(2):
        f = Path(out) / f"rank{rank}.json"
        assert f.exists(), f"rank {rank} wrote nothing:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        res.append(json.loads(f.read_text()))
        assert "error" not in res[-1], res[-1]["error"]
    return res


def test_unfused_tp_layer_equals_the_whole_layer_over_gloo(tmp_path):
    for res in _torchrun("unfused", tmp_path):
        assert res["prefill"] <= 1e-5 and res["decode"] <= 1e-5 and res["k_cache"] <= 1e-6, res


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from test_serve import make_llama
    d = tmp_path_factory.mktemp("tp") / "tiny-llama"
    make_llama(d, seed=4, hidden_size=256, intermediate_size=640, num_attention_heads=8, num_key_value_heads=4,
               head_dim=32)
    return d


def test_tp_model_generates_what_one_device_does_over_gloo(tiny_ckpt, tmp_path):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("on 2 GPUs test_gpu_tp_model_greedy_equals_one_gpu runs the model")
    for res in _torchrun("model", tmp_path, "--ckpt", tiny_ckpt, "--build", tmp_path / "no-build"):
        assert res["tp_tokens"] == res["one_tokens"], res  # (fp32: no near-tie is that near)
        assert all(a["logits_rel"] <= 1e-5 for a in res["agreement"]), res
        assert (res["tp_kv_heads"], res["one_kv_heads"]) == (2, 4)


# ------------------------------------------------------------------------------------------------------------
# 2 GPUs (NCCL)
# ------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs (tensor parallel)")


def _declared_tp():
    vs = gvariants.load(os.environ.get("MEGAKERNEL_VARIANTS", ROOT / "variants.yaml"))
    only = tuple(g for g in os.environ.get("MEGAKERNEL_ONLY", "").split(",") if g)
    return [v for v in gvariants.select(vs, only) if v.tp == 2]


@pytest.fixture(scope="module")
def tp_build(tmp_path_factory, tiny_ckpt):
    """The declared tp = 2 variants (project build dir) and the tiny checkpoint's tp 1 and tp 2 decode variants."""
    from generator import compile as gcompile
    from generator.hf.config import model_from_hf
    build = os.environ.get("MEGAKERNEL_BUILD", str(ROOT / "build"))
    from generator.tune import default_tuning_file
    gcompile.build(_declared_tp(), build, variants_file=os.environ.get("MEGAKERNEL_VARIANTS", ROOT / "variants.yaml"),
                   tuning_file=default_tuning_file())  # the plans `build` compiles
    tiny = model_from_hf(tiny_ckpt)
    vs = [gvariants.Variant(tiny, "decode", b, 64, tp) for b in (1, 2) for tp in (1, 2)]
    tb = tmp_path_factory.mktemp("tp_build") / "build"
    res = gcompile.build(vs, tb)
    assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
    # the TP variants again with the plans tensor parallel takes by override only (not yet run on 2 GPUs): the norms'
    # rows in global memory, one buffer of partial sums
    for d, ov in TP_OVERRIDE_BUILDS.items():
        two = [v for v in vs if v.tp == 2]
        res = gcompile.build(two, tb.parent / d, overrides={v.name: ov for v in two})
        assert all(e["status"] == "ok" and all(e["plan"]["consts"][k] == x for k, x in ov.items())
                   for e in res["entries"]), res
    return Path(build), tb, vs


TP_OVERRIDE_BUILDS = {"build-norm-global": {"NORM_GLOBAL": 1}, "build-red-db0": {"RED_DB": 0}}


@gpu
@two_gpus
def test_gpu_tp_layers_equal_the_whole_layer_reference(tp_build, tmp_path):
    build, tb, vs = tp_build
    declared = [v.name for v in _declared_tp()]
    small = [v.name for v in vs if v.tp == 2]
    for b, names in ((build, declared), (tb, small), *((tb.parent / d, small) for d in TP_OVERRIDE_BUILDS)):
        if not names:
            continue
        for res in _torchrun("fused", tmp_path / b.name, "--build", b, *sum((["--variant", n] for n in names), [])):
            for name, row in res.items():
                assert row["pass"] and row["graph_equal"], (name, row)


@gpu
@two_gpus
def test_gpu_tp_model_greedy_equals_one_gpu(tp_build, tiny_ckpt, tmp_path):
    _, tb, _ = tp_build
    for res in _torchrun("model", tmp_path, "--ckpt", tiny_ckpt, "--build", tb, "--new", 16):
        # bf16 over two plans: equal tokens up to a near-tie (prompt [8, 9, 10] meets a top-two gap of ~0.02 of a
        # logit, about one bf16 step), equal logits up to it
        assert all(a["logits_rel"] <= 2e-2 and a.get("tie_gap", 0.0) <= NEAR_TIE_RMS for a in res["agreement"]), res
        assert any(p.endswith("_tp2") for p in res["tp_paths"]), res  # decode ran the fused TP variant
        assert (res["tp_kv_heads"], res["one_kv_heads"]) == (2, 4)


def test_cli_generate_under_torchrun_runs_tensor_parallel_over_gloo(tiny_ckpt, tmp_path):
    """`torchrun ... -m generator.cli generate --device cpu`: the unfused layers split over 2 processes print the
    tokens one process prints alone."""
    args = ["generate", str(tiny_ckpt), "--device", "cpu", "--ids", "1,2,3,4", "--max-new-tokens", "6",
            "--build-dir", str(tmp_path / "no-build")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    one = subprocess.run([sys.executable, "-m", "generator.cli", *args], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "generator.cli", *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    tokens = one.stdout.split()
    assert len(tokens) == 6 and two.stdout.split() == tokens  # rank 0 alone prints
    assert "tensor parallel over 2" in two.stderr and "tensor parallel" not in one.stderr
    # a bad request: every rank says its own error in one line
    bad = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "generator.cli", *args, "--cache-len", "5"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert bad.returncode != 0
    for r in (0, 1):
        assert f"error: [rank {r}] --max-new-tokens: the longest prompt (4 tokens) + 6 new tokens" in bad.stderr


# ------------------------------------------------------------------------------------------------------------
# 1 GPU: the TP ranks as threads of one process (the 2-GPU machine is lent rarely)
# ------------------------------------------------------------------------------------------------------------

class _Ranks:
    """tp ranks of a tensor-parallel layer as threads of one process on one GPU, in place of a process group: their
    all-reduces and all-gathers meet at a barrier. Every rank's work goes to one stream, so the ranks' launches run
    one after another (each launch a whole cooperative grid) in the order the threads reach them."""

    def __init__(self, tp: int):
        import threading
        self.tp, self.barrier, self.slots = tp, threading.Barrier(tp, timeout=300), [None] * tp

    def exchange(self, rank: int, t: torch.Tensor) -> list:
        """Every rank's t, once every rank's queued work is done (the stream synchronised before the barrier)."""
        torch.cuda.current_stream().synchronize()
        self.slots[rank] = t
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # (no rank posts its next tensor before every rank has read these)
        return got


class _Group:
    """What FusedDecoderLayer gets as its `group`: the rank and its _Ranks."""

    def __init__(self, ranks: _Ranks, rank: int):
        self.ranks, self.rank = ranks, rank


class _LocalReduce:
    """collectives.AllReduce's interface over _Ranks: no buffer of its own (the kernel writes its partial where the
    NCCL path has it), the sum of every rank's `out` in fp32, rounded once to out's dtype (as a 2-rank NCCL sum)."""

    def __init__(self, group, numel, dtype, device, method="auto"):
        self.group, self.buffer, self.method = group, None, "local"

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        r = self.group.ranks
        parts = r.exchange(self.group.rank, out)
        s = sum(p.float() for p in parts)
        torch.cuda.current_stream().synchronize()
        r.barrier.wait()  # every rank has its sum before any overwrites its `out`
        out.copy_(s.to(out.dtype))
        torch.cuda.current_stream().synchronize()
        return out


@pytest.fixture
def local_ranks(monkeypatch):
    """generator.loader and verify with _Ranks in place of torch.distributed: a layer given a _Group is that rank."""
    from generator import loader, verify
    real_rank = loader.tp_rank
    monkeypatch.setattr(loader, "tp_rank", lambda g, t, n: g.rank if isinstance(g, _Group) else real_rank(g, t, n))
    monkeypatch.setattr(loader, "AllReduce", _LocalReduce)
    # (each rank posts a copy: the other rank's next launch, on the shared stream, appends rows to its live cache)
    monkeypatch.setattr(verify, "_gather_heads",
                        lambda c, layer: torch.cat(layer.group.ranks.exchange(layer.group.rank, c.clone()), 1))


def run_tp_on_one_gpu(name: str, build, weights: dict, seed: int) -> list[dict]:
    """Variant `name` (tp ranks) checked by verify.check_step on one GPU, each rank a thread (_Ranks; the
    local_ranks fixture in force): every rank's row (rel_err, k_err, v_err, first_bad_stage, unwritten, pass)."""
    import threading

    from generator import loader, verify
    from generator.manifest import find_entry, variant_from_entry
    tp = variant_from_entry(find_entry(name, build)[0]).tp
    ranks, stream = _Ranks(tp), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the caller's weights are made (the new stream does not wait)
    rows, errors = [None] * tp, []

    def rank(r):
        try:
            with torch.cuda.stream(stream):
                layer = loader.load(name, weights, build_dir=build, group=_Group(ranks, r))
                x, pos = verify.random_inputs(layer, seed)
                res = verify.check_step(layer, x, pos, weights=weights)
                rows[r] = {k: res[k] for k in ("rel_err", "k_err", "v_err", "first_bad_stage", "unwritten")}
                rows[r]["pass"] = verify.passed(res, layer.model.dtype)
                torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001 - said by the test; the other ranks leave their barrier
            errors.append(f"rank {r}: {type(exc).__name__}: {exc}")
            ranks.barrier.abort()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return rows


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tp_ranks_on_one_gpu_equal_the_whole_layer_reference(tp_build, tmp_path, local_ranks):
    """Every fused TP variant (the declared ones, bench/heldout.yaml's, the tiny checkpoint's at batch 1 and 2, with
    TP_OVERRIDE_BUILDS' plans too, and Llama-3-70B tp2 at batch 16 with NORM_GLOBAL=1, past the rows' batch) with its
    ranks as threads on one GPU: the output against the whole layer's fp32 reference, each rank's cache rows and
    step results against its part."""
    import dataclasses

    from generator import compile as gcompile, reference
    from generator.manifest import find_entry, variant_from_entry
    build, tb, vs = tp_build
    v70 = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.tp == 2)
    big = dataclasses.replace(v70, batch=16)
    bb, hb = tmp_path / "b16", tmp_path / "heldout"
    res = gcompile.build([big], bb, overrides={big.name: {"NORM_GLOBAL": 1}})
    assert res["entries"][0]["status"] == "ok", res["entries"][0].get("error")
    held = [v for v in gvariants.load(ROOT / "bench" / "heldout.yaml") if v.tp > 1]  # (default plans)
    res = gcompile.build(held, hb)
    assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
    small = [v.name for v in vs if v.tp == 2]
    cases = [(build, v.name) for v in _declared_tp()] + [(hb, v.name) for v in held] + [(tb, n) for n in small] \
        + [(tb.parent / d, n) for d in TP_OVERRIDE_BUILDS for n in small] + [(bb, big.name)]
    for b, name in cases:
        m = variant_from_entry(find_entry(name, b)[0]).model
        W = reference.random_weights(m, seed=13, device="cuda")
        for r, row in enumerate(run_tp_on_one_gpu(name, b, W, 13)):
            assert row["pass"], (str(b), name, r, row)
        del W
        torch.cuda.empty_cache()
