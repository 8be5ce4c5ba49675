"""Prefill: a prompt chunk per launch. CPU: planning, limits, bad inputs that need no GPU. GPU (marked gpu):
every declared prefill variant and held-out prefill shapes against the fp32 reference at random start positions
(0 and a chunk ending at the last cache row included), cache rows equal to the reference's and no other row
touched, and prefill-then-decode equal to decoding the prompt token by token."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from generator import render as grender, variants as gvariants
from generator.plan import PlanError
from generator.targets import ARCHS

ROOT = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("MEGAKERNEL_SEED", time.time_ns() % 1_000_000))
CACHE_LEN = 4096

# prefill shapes that are not in variants.yaml: odd chunk (not a multiple of 16), batch 3, fp16 + layernorm + gelu
# + qkv bias, head_dim 96, GQA group 3, qk_norm, MHA head_dim 128
HELD_OUT_YAML = """
matrix: {mode: [prefill], batch: [3], seq_len: [40]}
models:
  pf-ln-gelu-fp16:
    {hidden: 512, heads: 8, kv_heads: 2, head_dim: 96, intermediate: 1376, layers: 4, norm: layernorm,
     norm_eps: 1.0e-5, rope_theta: 10000.0, activation: gelu, qkv_bias: true, qk_norm: false, dtype: fp16}
  pf-g3-qknorm:
    {hidden: 1536, heads: 12, kv_heads: 4, head_dim: 128, intermediate: 4096, layers: 4, norm: rmsnorm,
     norm_eps: 1.0e-6, rope_theta: 1000000.0, activation: silu, qkv_bias: false, qk_norm: true, dtype: bf16,
     matrix: {mode: [prefill], batch: [1, 2], seq_len: [100, 300]}}
  pf-mha:
    {hidden: 1024, heads: 8, kv_heads: 8, head_dim: 128, intermediate: 2816, layers: 4, norm: rmsnorm,
     norm_eps: 1.0e-5, rope_theta: 500000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16,
     matrix: {mode: [prefill], batch: [2], seq_len: [33]}}
"""
DECLARED = [v for v in gvariants.load(ROOT / "variants.yaml") if v.mode == "prefill"]
HELD_OUT = gvariants.parse(HELD_OUT_YAML, "prefill-heldout.yaml")


# ---------------------------------------------------------------- CPU

def test_defaults_declare_prefill_for_the_1b_and_8b_shapes():
    got = {(v.model.name, v.batch, v.seq_len) for v in DECLARED}
    want = {(m, b, c) for m in ("llama3.2-1b", "llama3-8b") for b in (1, 4) for c in (16, 64, 128, 512, 2048)}
    assert got == want


@pytest.mark.parametrize("sm", sorted(ARCHS))
def test_every_prefill_variant_plans_within_its_arch(sm):
    for v in DECLARED + HELD_OUT:
        try:
            p = grender.plan(v, sm)
        except PlanError as exc:
            assert f"sm_{sm}" in str(exc)
            continue
        assert p["smem_bytes"] <= ARCHS[sm].smem_per_block
        assert p["rows"] == v.batch * v.seq_len and p["grid_syncs"] == 7
        # the GEMMs' input: sm_90a tiled (whole token tiles x 64-column blocks, gemm.cuh gemm_x), else row-major
        bufs, c, m = p["workspace"]["buffers"], p["consts"], v.model
        ks = {"xn": m.hidden, "attn": m.heads * m.head_dim, "act": m.intermediate}
        assert bufs["q"]["shape"] == [p["rows"], m.heads * m.head_dim]
        for name, k in ks.items():
            if c["GEMM_WGMMA"]:  # whole token tiles, 64-column blocks: a token tile's chunk is one bulk copy
                bn = p["gemm"]["BN"]
                assert bufs[name]["shape"] == [-(-p["rows"] // bn) * bn, -(-k // 64) * 64]
                assert c["GEMM_XROWS"] == bufs[name]["shape"][0] and c["GEMM_XROWS"] % bn == 0
            else:
                assert bufs[name]["shape"] == [p["rows"], k]


def test_from_tiles_reads_every_element_once_in_the_swizzled_blocks():
    import torch
    from generator.interface import from_tiles
    rows, k, xrows = 37, 200, 48  # a partial token tile, a K tail past the last whole 64-column block
    raw = torch.arange(4 * xrows * 64, dtype=torch.int64)
    got = from_tiles(raw, rows, k, xrows)
    assert got.shape == (rows, k) and got.unique().numel() == rows * k  # one-to-one
    # row t's 16-byte chunk c of a block sits at chunk c ^ (t % 8) of the row's 128 bytes (the 128-byte swizzle)
    t, c = 13, 64 + 3 * 8 + 5
    assert int(got[t, c]) == (1 * xrows + t) * 64 + ((3 ^ (t % 8)) * 8) + 5
    # what gemm.cuh copies in one piece: a token tile's rows [t0, t0 + bn) of 64-column block kc are the contiguous
    # run [(kc * xrows + t0) * 64, + bn * 64)
    bn, t0, kc = 16, 16, 2
    run = got[t0:t0 + bn, kc * 64:(kc + 1) * 64].flatten().sort().values
    assert torch.equal(run, torch.arange((kc * xrows + t0) * 64, (kc * xrows + t0 + bn) * 64))


def test_prefill_source_has_its_own_stages_and_compiles_without_spills(tmp_path):
    from generator import compile as gcompile
    v = HELD_OUT[0]
    src = grender.render(v)
    assert "__device__ void kv_append(" in src and "gemm<QKV_DIM, HIDDEN, QKV_KSPLIT, QKV_FULL>" in src
    assert "#include" not in src.replace("#include <", "")
    res = gcompile.build([v], tmp_path / "b", jobs=1, replan_spills=False)  # the default plan itself
    assert not res["errors"], res["errors"]
    r = res["entries"][0]["resources"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0
    # a cache shorter than the chunk (or not an int) is refused at load, in one line naming cache_len, before any
    # GPU is needed (it loaded, and every prefill call then failed on its positions)
    from generator.loader import load
    for bad in (v.seq_len - 1, 0, -5, 64.0, True):
        with pytest.raises(ValueError, match=r"^cache_len: a prefill variant of \d+-token chunks"):
            load(v.name, None, build_dir=tmp_path / "b", device="cuda", cache_len=bad)


@pytest.mark.parametrize("sm", ["80", "100"])
def test_prefill_builds_on_the_mma_sync_path(tmp_path, sm):
    """Off sm_90 the GEMM is mma.sync, whose accumulators have another shape than wgmma's: the wgmma branch must not
    be instantiated there. A prefill variant with several warp columns (48-token tiles) compiles without spills."""
    from generator import compile as gcompile
    v = next(v for v in DECLARED if v.name == "llama3.2-1b_prefill_b4_s16_bf16")
    assert grender.plan(v, sm)["consts"]["GEMM_WGMMA"] == 0 and grender.plan(v, "90")["consts"]["GEMM_WGMMA"] == 1
    res = gcompile.build([v], tmp_path / "b", arch=sm, jobs=1, replan_spills=False)  # the default plan itself
    assert not res["errors"], res["errors"][0]["error"][-800:]
    r = res["entries"][0]["resources"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0


def test_head_dim_64_prefill_plans_on_99_kb_parts():
    """sm_86/89/120 (99 KB a block): the GEMM ring takes shorter K chunks; only attention at head_dim 128 is over."""
    for sm in ("86", "89", "120"):
        for v in DECLARED:
            if v.model.head_dim == 64:
                assert grender.plan(v, sm)["smem_bytes"] <= ARCHS[sm].smem_per_block
            else:
                with pytest.raises(PlanError, match="attention"):
                    grender.plan(v, sm)


# ---------------------------------------------------------------- GPU

gpu = [pytest.mark.gpu]
try:
    import torch
    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
needs_cuda = pytest.mark.skipif(not _cuda, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    from generator import compile as gcompile
    main = Path(os.environ.get("MEGAKERNEL_BUILD", ROOT / "build"))
    decl = gvariants.select(DECLARED, tuple(g for g in os.environ.get("MEGAKERNEL_ONLY", "").split(",") if g))
    decode = [v for v in gvariants.load(ROOT / "variants.yaml") if v.name == "llama3.2-1b_decode_b1_s1024_bf16"]
    from generator.tune import default_tuning_file
    res = gcompile.build(decl + decode, main, tuning_file=default_tuning_file())  # the plans `build` compiles
    assert not res["errors"], res["errors"][0]["error"]
    held = tmp_path_factory.mktemp("prefill-heldout")
    res = gcompile.build(HELD_OUT, held)
    assert not res["errors"], res["errors"][0]["error"]
    return {v.name: main for v in decl + decode} | {v.name: held for v in HELD_OUT}


def _small_enough(v):
    return v.batch * v.seq_len <= 2048  # the fp32 reference of 8192-token chunks is slow; they are timed instead


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("v", [v for v in DECLARED if _small_enough(v)] + HELD_OUT, ids=lambda v: v.name)
def test_prefill_matches_reference(v, builds):
    from generator import reference, verify
    from generator.loader import load
    if v.name not in builds:
        pytest.skip("not selected by MEGAKERNEL_ONLY")
    W = reference.random_weights(v.model, seed=SEED, device="cuda")
    layer = load(v.name, W, build_dir=builds[v.name], cache_len=CACHE_LEN)
    x, start = verify.random_inputs(layer, SEED)
    r = verify.check_step(layer, x, start, weights=W)
    msg = (f"seed {SEED} start {start.tolist()}: rel_err {r['rel_err']:.2e} stage_err {r['stage_err']} "
           f"first bad stage {r['first_bad_stage']} unwritten {r['unwritten']} untouched {r['cache_untouched']}")
    assert verify.passed(r, v.model.dtype), msg


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["llama3.2-1b_prefill_b1_s64_bf16", "llama3-8b_prefill_b1_s16_bf16"])
def test_prefill_split_k_on_a_smaller_grid(builds, name):
    """Split-K's two combines: with every split of a tile resident (the planned grid) each split finishes a slice of
    the tile; on a grid with fewer blocks than tasks (a GPU with fewer SMs) the last split finishes all of it. Both
    against the fp32 reference, twice each (the tile counters reset themselves); the 8B shape's gate_up runs its
    first 132 tiles whole and splits the rest."""
    from generator import reference, verify
    from generator.loader import load
    v = next(v for v in DECLARED if v.name == name)
    if v.name not in builds:
        pytest.skip("not selected by MEGAKERNEL_ONLY")
    c = grender.plan(v)["consts"]
    assert max(c[k] for k in ("QKV_KSPLIT", "O_KSPLIT", "DOWN_KSPLIT")) > 1
    assert name != "llama3-8b_prefill_b1_s16_bf16" or c["GU_FULL"] > 0  # whole tiles first, then the split tail
    W = reference.random_weights(v.model, seed=SEED, device="cuda")
    layer = load(v.name, W, build_dir=builds[v.name], cache_len=CACHE_LEN)
    for grid in (layer.grid, layer.grid // 3, layer.grid):
        layer.grid = grid
        for _ in range(2):
            x, start = verify.random_inputs(layer, SEED + grid)
            r = verify.check_step(layer, x, start, weights=W)
            assert verify.passed(r, v.model.dtype), f"grid {grid}: rel_err {r['rel_err']:.2e} {r['first_bad_stage']}"


@pytest.mark.gpu
@needs_cuda
def test_prefill_then_decode_equals_token_by_token(builds):
    """A 16-token prompt through the prefill kernel then one decode step == the 17 tokens decoded one by one."""
    from generator import reference, verify
    from generator.loader import load
    pf, dec = "llama3.2-1b_prefill_b1_s16_bf16", "llama3.2-1b_decode_b1_s1024_bf16"
    if pf not in builds:
        pytest.skip("not selected by MEGAKERNEL_ONLY")
    m = next(v for v in DECLARED if v.name == pf).model
    W = reference.random_weights(m, seed=SEED + 1, device="cuda")
    a = load(dec, W, build_dir=builds[dec])
    p = load(pf, None, build_dir=builds[pf], packed=a.packed, caches=(a.k_cache, a.v_cache))
    g = torch.Generator(device="cuda").manual_seed(SEED)
    xs = torch.randn(1, 17, m.hidden, generator=g, device="cuda").to(torch.bfloat16)
    a.k_cache.normal_(generator=g)
    a.v_cache.normal_(generator=g)
    k0, v0 = a.k_cache.clone(), a.v_cache.clone()
    p.prefill(xs[:, :16], torch.tensor([0], dtype=torch.int32))
    out_a = a(xs[:, 16], torch.tensor([16], dtype=torch.int32))
    ka = a.k_cache[:, :, :17].clone()
    a.k_cache.copy_(k0)
    a.v_cache.copy_(v0)
    for t in range(17):
        out_b = a(xs[:, t], torch.tensor([t], dtype=torch.int32))
    torch.cuda.synchronize()
    assert verify.rel_err(out_a, out_b) <= 1e-2
    assert verify.rel_err(ka, a.k_cache[:, :, :17]) <= 1e-2
    assert torch.equal(a.k_cache[:, :, 17:], k0[:, :, 17:])  # nothing past the prompt


@pytest.mark.gpu
@needs_cuda
def test_prefill_bad_inputs(builds):
    from generator import reference
    from generator.loader import load
    v = HELD_OUT[0]
    W = reference.random_weights(v.model, seed=1, device="cuda")
    with pytest.raises(ValueError, match="cache_len"):
        load(v.name, W, build_dir=builds[v.name])
    layer = load(v.name, W, build_dir=builds[v.name], cache_len=128)
    x = torch.randn(v.batch, v.seq_len, v.model.hidden, device="cuda").to(layer.dtype)
    ok = torch.zeros(v.batch, dtype=torch.int32)
    for bad, pat in ((x[:, :-1], "^x: shape"), (x.float(), "^x: dtype"), (x[:, 0], "^x: shape")):
        with pytest.raises(ValueError, match=pat):
            layer.prefill(bad, ok)
    with pytest.raises(ValueError, match=r"^start_pos: start positions \(\+ chunk 40\) must be in \[0, 88\]"):
        layer.prefill(x, torch.full((v.batch,), 89, dtype=torch.int32))
    with pytest.raises(ValueError, match="prefill variant: call layer.prefill"):
        layer(x[:, 0], ok)
    with pytest.raises(ValueError, match=r"^packed\['w_o'\]: expected a contiguous"):  # another shape's weights
        load(v.name, None, build_dir=builds[v.name], cache_len=128,
             packed={**layer.packed, "w_o": layer.packed["w_o"][1:]})


@pytest.mark.gpu
@needs_cuda
def test_prefill_layers_loaded_in_turn_read_their_own_tensor_maps(builds):
    """The GEMM reads each weight through a TMA tensor map the loader writes to device memory: a layer loaded after
    another was freed (its maps' memory likely handed out again) must compute with its own weights."""
    import gc
    from generator import reference, verify
    from generator.loader import load
    v = HELD_OUT[0]
    for seed in (SEED + 5, SEED + 6, SEED + 7):
        W = reference.random_weights(v.model, seed=seed, device="cuda")
        layer = load(v.name, W, build_dir=builds[v.name], cache_len=CACHE_LEN)
        x, start = verify.random_inputs(layer, seed)
        r = verify.check_step(layer, x, start, weights=W)
        assert verify.passed(r, v.model.dtype), f"seed {seed}: rel_err {r['rel_err']:.2e} {r['first_bad_stage']}"
        del layer, W
        gc.collect()


@pytest.mark.gpu
@needs_cuda
def test_megakernel_bench_times_prefill_and_records_its_route(tmp_path):
    """`megakernel bench` on a prefill variant: verified, timed against the unfused layer, its row in the results
    file (which the report reads) and its route in --routes-dir (which the runtime follows)."""
    import json
    import subprocess
    import sys
    from generator import routes
    vfile = tmp_path / "v.yaml"
    vfile.write_text(HELD_OUT_YAML)
    name = "pf-mha_prefill_b2_s33_bf16"
    r = subprocess.run([sys.executable, "-m", "generator.cli", "bench", "--variants", str(vfile), "--only", name,
                        "--build-dir", str(tmp_path / "build"), "--out-dir", str(tmp_path / "out"),
                        "--routes-dir", str(tmp_path / "routes"), "--no-compile", "--no-plots", "--seed", str(SEED)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    row, = doc["prefill"]
    assert row["variant"] == name and row["pass"] and row["route"] in ("fused", "unfused") and row["us"] > 0
    got = routes.read_routes(torch.cuda.get_device_name(), tmp_path / "routes")[name]
    assert got["path"] == row["route"] and got["fused_us"] == row["us"]
    from generator.report import latest_bench
    assert latest_bench(tmp_path / "out")[name]["route"] == row["route"]
    assert "routes: 1 prefill variants recorded in" in r.stdout and name in r.stdout
