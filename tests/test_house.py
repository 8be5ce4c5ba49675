"""The house: the kernel interface written once, modes and stages as parts, a runtime that stands alone, one table
per kind of fact, builds that go stale when anything that defines them changes, and real target architectures."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from generator import interface, manifest as gmanifest, reference, render as grender, targets, variants as gvariants
from generator.modes import MODES
from generator.plan import PlanError

from conftest import ROOT, TINY_NAMES, cli_env, run_cli

DEFAULTS = gvariants.load(ROOT / "variants.yaml")
ONE = next(v for v in DEFAULTS if v.name == "llama3.2-1b_decode_b1_s4096_bf16")


def nvcc() -> str:
    path = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(path).exists():
        pytest.skip("nvcc not found")
    return path


# ---------------------------------------------------------------- the interface, written once

def test_rendered_parameter_list_is_the_interface():
    src = grender.render(ONE)
    sig = re.search(r"decoder_layer\((.*?)\)\s*\{", src, re.S).group(1)
    names = [re.split(r"[\s*]+", p.strip())[-1] for p in sig.split(",")]
    assert names == [a.name for a in interface.ARGS]
    # every workspace buffer is an argument, and the layout covers each once, aligned
    layout = grender.plan(ONE)["workspace"]
    assert [f"ws_{b}" for b in layout["buffers"]] == [a.name for a in interface.ARGS if a.role == "workspace"]
    ends = 0
    for b in layout["buffers"].values():
        assert b["offset"] % interface.ALIGN == 0 and b["offset"] >= ends
        ends = b["offset"] + b["bytes"]
    assert layout["bytes"] >= ends


def test_adding_a_buffer_is_one_line(monkeypatch):
    extra = interface.Buffer("probe", "float", lambda c: (c["ROWS"], 3), "test")
    monkeypatch.setattr(interface, "WORKSPACE", interface.WORKSPACE + (extra,))
    monkeypatch.setattr(interface, "ARGS", interface.ARGS + (interface.Arg("ws_probe", "float*", "workspace"),))
    p = grender.plan(ONE)
    assert p["workspace"]["buffers"]["probe"]["shape"] == [ONE.batch, 3]
    assert "float* ws_probe" in grender.render(ONE, p)


def test_weights_pack_and_unpack_through_the_interface():
    torch = pytest.importorskip("torch")
    for v in DEFAULTS[:1] + [gvariants.parse(_TINY_C, "t.yaml")[0]]:
        W = reference.random_weights(v.model, seed=3)
        packed = interface.pack_weights(W, v.model)
        assert set(packed) == {p.arg for p in interface.PACKED if p.when(v.model)}
        assert set(packed) <= {a.name for a in interface.ARGS if a.role == "weight"}
        back = interface.unpack_weights(packed, v.model)
        assert set(back) == set(W)
        for k in W:
            assert torch.equal(back[k], W[k]), k


_TINY_C = """
matrix: {mode: [decode], batch: [2], seq_len: [128]}
models:
  tiny-c: {hidden: 128, heads: 4, kv_heads: 2, head_dim: 32, intermediate: 256, layers: 2, norm: layernorm,
           norm_eps: 1.0e-6, rope_theta: 500000.0, activation: gelu, qkv_bias: true, qk_norm: true, dtype: fp16}
"""


# ---------------------------------------------------------------- modes and stages as parts

def test_every_step_is_a_header_and_a_reference_function():
    for mode in MODES.values():
        assert mode.grid_syncs == sum(s.then == "grid" for s in mode.steps)
        for s in mode.steps:
            assert (grender.TEMPLATES / mode.headers / f"{s.stage}.cuh").is_file(), s.stage
            assert callable(getattr(reference, s.stage)), s.stage
            assert s.call.startswith(f"{s.stage}(")
    for header in (grender.TEMPLATES / "stages").rglob("*.cuh"):
        assert callable(getattr(reference, header.stem, None)), f"{header.name} has no reference function"
        assert "{{" not in header.read_text() and "{%" not in header.read_text(), f"{header.name} is not plain CUDA"


def test_example_configs_are_real_renders():
    declared = {v.name: v for v in DEFAULTS}
    for mode, (name, file) in grender.EXAMPLES.items():
        text = (grender.TEMPLATES / file).read_text()
        v = declared[name]
        assert v.mode == mode
        want = grender.render_config(v, grender.plan(v))
        assert text.split("\n", 1)[1] == want.split("\n", 1)[1], \
            'run: python -c "import generator.render as r; r.write_example_configs()"'


def test_every_header_compiles_alone(tmp_path):
    """An editor or nvcc opens a stage header by itself (against example_config.cuh), for sm_90a as the build does
    (compile.py: the prefill GEMM's wgmma)."""
    exe = nvcc()
    headers = sorted((grender.TEMPLATES / "stages").rglob("*.cuh")) + [
        grender.TEMPLATES / f for f in ("gemv.cuh", "gemm.cuh", "wgmma.cuh", "common.cuh")]

    def one(h):
        return h, subprocess.run([exe, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-x", "cu", "-c",
                                  "-o", os.devnull, str(h)],
                                 capture_output=True, text=True, cwd=tmp_path)
    with ThreadPoolExecutor(4) as pool:
        for h, r in pool.map(one, headers):
            assert r.returncode == 0, f"{h.name}:\n{r.stderr[-2000:]}"


def test_rendered_source_is_self_contained():
    src = grender.render(ONE)
    assert '#include "' not in src  # every project header pasted in, once
    assert src.count("__device__ void attention(") == 1


# ---------------------------------------------------------------- the runtime stands alone

def test_runtime_imports_no_renderer_templates_or_reference():
    code = ("import sys, generator, generator.loader, generator.manifest; "
            "bad = [m for m in ('jinja2', 'generator.render', 'generator.reference', 'generator.compile', "
            "'generator.cli', 'bench') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_library_never_imports_cli_or_bench():
    for f in (ROOT / "generator").rglob("*.py"):
        if f.name in ("cli.py", "__main__.py"):
            continue
        text = f.read_text()
        assert not re.search(r"^\s*(from|import)\s+(bench|generator\.cli|\.cli)\b", text, re.M), f
        assert not re.search(r"^\s*from \. import .*\bcli\b", text, re.M), f


def test_find_entry_without_source_tree(copy_build, monkeypatch, tmp_path):
    """A build directory shipped on its own: no templates to hash, so only its own records are checked."""
    d = copy_build()
    monkeypatch.setattr(gmanifest, "ROOT", tmp_path / "no-source")
    m = json.loads((d / "manifest.json").read_text())
    m["variants"][TINY_NAMES[0]]["sources_sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    entry, cubin = gmanifest.find_entry(TINY_NAMES[0], d)
    assert cubin.is_file() and entry["plan"]["workspace"]["bytes"] > 0


# ---------------------------------------------------------------- stale whenever a defining field changed

@pytest.mark.parametrize("field,old,new", [("rope_theta", "10000.0", "20000.0"), ("norm_eps", "1.0e-5", "1.0e-6")])
def test_changed_parameter_makes_the_build_stale(copy_build, tiny_build, tmp_path, field, old, new):
    d = copy_build()
    vfile = tmp_path / "variants.yaml"
    text = Path(tiny_build["variants"]).read_text()
    a = text.index("tiny-a:")
    b = text.index("tiny-b:")
    vfile.write_text(text[:a] + text[a:b].replace(f"{field}: {old}", f"{field}: {new}") + text[b:])
    m = json.loads((d / "manifest.json").read_text())
    for e in m["variants"].values():
        e["variants_file"] = str(vfile)
    (d / "manifest.json").write_text(json.dumps(m))
    r = run_cli(["list", "--variants", vfile, "--build-dir", d], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"stale ({field})" in r.stdout and r.stdout.count("stale") == 1, r.stdout
    with pytest.raises(gmanifest.LoadError, match=rf"{TINY_NAMES[0]}: build is stale \({field} changed in .*"
                                                  rf"variants.yaml.*megakernel build"):
        gmanifest.find_entry(TINY_NAMES[0], d)
    gmanifest.find_entry(TINY_NAMES[1], d)  # unchanged: still loads
    # the declaration passed in directly wins over the recorded file
    v = next(v for v in gvariants.load(tiny_build["variants"]) if v.name == TINY_NAMES[0])
    gmanifest.find_entry(TINY_NAMES[0], d, v)


def test_rope_scaling_change_is_stale():
    v = next(v for v in DEFAULTS if v.model.rope_scaling)
    entry = {"status": "ok", "params": v.params()}
    scaled = dict(v.model.rope_scaling)
    scaled["factor"] = scaled["factor"] * 2
    v2 = dataclasses.replace(v, model=dataclasses.replace(v.model, rope_scaling=tuple(sorted(scaled.items()))))
    assert gmanifest.status(entry, v2) == "stale (rope_scaling)"
    assert gmanifest.status(entry, v) == "built"
    assert gmanifest.identity(v.params(), "90") != gmanifest.identity(v2.params(), "90")
    assert gmanifest.identity(v.params(), "90") != gmanifest.identity(v.params(), "80")


# ---------------------------------------------------------------- real target architectures

def test_arch_table_is_the_one_place():
    assert targets.arch("90").smem_per_block == 227 * 1024
    assert targets.arch("80").smem_per_block == 163 * 1024
    for sm in ("86", "89", "120"):
        assert targets.arch(sm).smem_per_block == 99 * 1024
    assert targets.arch("90a").sm == "90a" and targets.arch("90a").smem_per_block == 227 * 1024
    for bad in ("75", "70", "abc", "91"):
        with pytest.raises(targets.TargetError, match="^--arch"):
            targets.arch(bad)
    assert targets.runs_on("90", 9, 0) and not targets.runs_on("90", 8, 0) and not targets.runs_on("80", 9, 0)
    assert targets.runs_on("80", 8, 6) and not targets.runs_on("86", 8, 0) and not targets.runs_on("90a", 10, 0)


@pytest.mark.parametrize("sm", ["80", "86", "89", "90", "120"])
def test_every_plan_fits_its_architecture(sm):
    a = targets.arch(sm)
    for v in DEFAULTS:
        try:
            p = grender.plan(v, sm)
        except PlanError as exc:
            assert f"sm_{sm}" in str(exc) and "stage" in str(exc)
            continue
        assert p["smem_bytes"] <= a.smem_per_block and p["arch"] == sm


def test_small_smem_arch_plans_attention_down():
    # head_dim 128: 8 walker warps' rings (the sm_90 plan) need more than sm_86's 99 KB
    v = next(v for v in DEFAULTS if v.name == "llama3-8b_decode_b1_s4096_bf16")
    p90, p86 = grender.plan(v, "90"), grender.plan(v, "86")
    assert p86["consts"]["ATT_WARPS"] < p90["consts"]["ATT_WARPS"]
    assert p86["smem_bytes"] <= 99 * 1024 < p90["smem_bytes"]


def test_refusal_names_the_stage_and_what_helps():
    big_group = gvariants.parse("""
matrix: {mode: [decode], batch: [1], seq_len: [128]}
models:
  g64: {hidden: 2048, heads: 64, kv_heads: 1, head_dim: 256, intermediate: 2048, layers: 1, norm: rmsnorm,
        norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "t.yaml")[0]
    with pytest.raises(PlanError) as info:
        grender.plan(big_group, "86")
    msg = str(info.value)
    assert "attention stage" in msg and "sm_86" in msg and "query heads per KV head" in msg
    assert "lower batch or hidden size" not in msg
    wide = gvariants.parse("""
matrix: {mode: [decode], batch: [64], seq_len: [128]}
models:
  wide: {hidden: 8192, heads: 64, kv_heads: 8, head_dim: 128, intermediate: 8192, layers: 1, norm: rmsnorm,
         norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "t.yaml")[0]
    with pytest.raises(PlanError, match=r"norm\+projection stage.*a batch of at most 13 fits; NORM_GLOBAL=1"):
        grender.plan(wide, overrides={"NORM_GLOBAL": 0})
    assert grender.plan(wide)["consts"]["NORM_GLOBAL"] == 1  # its rows in global memory: no refusal


def test_build_for_a_small_smem_arch(tiny_variants_file, tmp_path):
    d = tmp_path / "build86"
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", d, "--arch", "86", "--only", "tiny-a*"],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    e = json.loads((d / "manifest.json").read_text())["variants"][TINY_NAMES[0]]
    assert e["arch"] == "86" and e["plan"]["arch"] == "86"
    assert e["resources"]["smem_total"] <= 99 * 1024 and e["resources"]["smem_limit"] == 99 * 1024
    # the L1 beside the block: the RTX 3090's 128 KB less the smallest carveout (0 ... 100 KB) holding it + 1 KB
    res = e["resources"]
    carve = min(c for c in (0, 8, 16, 32, 64, 100) if c * 1024 >= res["smem_total"] + 1024)
    assert res["l1_bytes"] == (128 - carve) * 1024 and res["blocks_per_sm"] == 1


def test_unsupported_arch_is_one_line(tiny_variants_file, tmp_path):
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--arch", "75"],
                cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "sm_75" in r.stderr and "mma.sync" in r.stderr and not (tmp_path / "b").exists()


def test_dtype_facts_are_one_table():
    src = grender.render(next(v for v in gvariants.parse(_TINY_C, "t.yaml")))
    assert "typedef __half T;" in src and '#define MMA_AB "f16"' in src and "65504.0f" in src
    assert targets.weight_format("bf16").packing in interface.PACKINGS
    with pytest.raises(targets.TargetError, match="fp8"):
        targets.weight_format("bf16", "fp8")
    with pytest.raises(targets.TargetError, match="needs dtype fp16"):
        targets.weight_format("bf16", "fp16")
    assert os.path.isfile(ROOT / "generator" / "targets.py")


def test_eager_calls_launch_directly_and_tracing_goes_through_the_custom_op(monkeypatch):
    """The custom op's dispatch costs more host time than a small layer's kernel: eager calls skip it; torch.compile
    (is_compiling) sees the op."""
    import torch

    from generator.loader import FusedDecoderLayer
    layer = object.__new__(FusedDecoderLayer)
    calls = []
    layer.launch = lambda x, pos, out: calls.append("launch") or out.fill_(1.0)
    layer.k_cache = layer.v_cache = layer.workspace = torch.zeros(1)
    layer.id = 0
    out = layer._run(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int32))
    assert calls == ["launch"] and bool((out == 1).all())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch.ops.megakernel, "decoder_layer", lambda *a: calls.append("op") or a[0])
    layer._run(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int32))
    assert calls == ["launch", "op"]
