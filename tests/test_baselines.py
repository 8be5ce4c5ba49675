"""The serving-style baselines against the fp32 reference: ServingLayer on the CPU in fp32 (eager and traced
fullgraph), FlashInferLayer's availability rules and page table; on a GPU (marked gpu), ServingLayer compiled and
captured in a CUDA graph, and FlashInferLayer captured in a CUDA graph, at bf16.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench import flashinfer_layer as fil
from bench.serving_layer import ServingLayer, make_serving_step
from generator import reference
from generator.variants import Model
from generator.verify import rel_err

from conftest import ROOT, cli_env

LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 64), ("rope_type", "llama3"))


def model(name="t", *, hidden=64, heads=4, kv_heads=1, head_dim=16, intermediate=96, norm="rmsnorm",
          activation="silu", qkv_bias=False, qk_norm=False, dtype="bf16", rope_scaling=None) -> Model:
    return Model(name=name, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 intermediate=intermediate, layers=1, norm=norm, norm_eps=1e-5, rope_theta=10000.0,
                 activation=activation, qkv_bias=qkv_bias, qk_norm=qk_norm, dtype=dtype, rope_scaling=rope_scaling)


CPU_MODELS = [
    model("mha-group1", heads=4, kv_heads=4),
    model("gqa-group4", hidden=128, heads=8, kv_heads=2, head_dim=32, intermediate=160),
    model("gqa-group7-qknorm", hidden=112, heads=7, kv_heads=1, head_dim=16, qk_norm=True),
    model("qkv-bias", heads=6, kv_heads=2, qkv_bias=True, rope_scaling=LLAMA3),
    model("layernorm-gelu", hidden=96, heads=6, kv_heads=3, head_dim=32, intermediate=160, norm="layernorm",
          activation="gelu", qkv_bias=True, qk_norm=True, dtype="fp16"),
]


def _setup(m: Model, batch: int, seq_len: int, seed: int, device="cpu", dtype=torch.float32):
    """A ServingLayer with random weights and a random cache, plus input and positions (0 and seq_len-1 included)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    W = reference.random_weights(m, seed=seed, device=device, dtype=dtype)
    layer = ServingLayer(W, m, batch, seq_len, device=device)
    layer.k_cache.copy_(torch.randn(layer.k_cache.shape, generator=g))
    layer.v_cache.copy_(torch.randn(layer.v_cache.shape, generator=g))
    x = torch.randn(batch, m.hidden, generator=g).to(device=device, dtype=dtype)
    pos = torch.randint(0, seq_len, (batch,), generator=g, dtype=torch.int32)
    pos[0], pos[-1] = 0, seq_len - 1
    return W, layer, x, pos.to(device)


def _reference(W, layer, x, pos, m):
    kc, vc = layer.k_cache.clone(), layer.v_cache.clone()
    return reference.decoder_layer(x, pos, W, kc, vc, m), kc, vc


@pytest.mark.parametrize("m", CPU_MODELS, ids=lambda m: m.name)
def test_serving_layer_matches_reference_fp32(m):
    W, layer, x, pos = _setup(m, batch=4, seq_len=40, seed=3)
    ref, kc, vc = _reference(W, layer, x, pos, m)
    out = layer(x, pos)
    assert out.shape == (4, m.hidden) and out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-4
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    torch.testing.assert_close(layer.k_cache, kc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.v_cache, vc, rtol=1e-5, atol=1e-5)
    # a second step at the next positions reads the row the first wrote
    pos2 = (pos + 1).clamp_max(39)
    ref2 = reference.decoder_layer(out, pos2, W, kc, vc, m)
    assert rel_err(layer(out, pos2), ref2) <= 1e-4
    torch.testing.assert_close(layer.k_cache, kc, rtol=1e-5, atol=1e-5)


def test_serving_step_traces_fullgraph_once_for_a_stack():
    """make_serving_step traces without graph breaks, and two layers of one shape share one graph."""
    from torch._dynamo.utils import counters
    m = CPU_MODELS[2]
    torch._dynamo.reset()
    counters.clear()
    for seed in (5, 6):
        W, layer, x, pos = _setup(m, batch=3, seq_len=24, seed=seed)
        ref, kc, vc = _reference(W, layer, x, pos, m)
        out = make_serving_step(layer, backend="aot_eager")(x, pos)
        assert rel_err(out, ref) <= 1e-4
        torch.testing.assert_close(layer.k_cache, kc, rtol=1e-5, atol=1e-5)
    assert int(counters["stats"]["unique_graphs"]) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("m, words", [
    (model(head_dim=80, hidden=160, heads=2, kv_heads=1), "head_dim 80"),
    (model(dtype="fp16", head_dim=64, hidden=128, heads=2), "dtype fp16"),
    (model(norm="layernorm", head_dim=64, hidden=128, heads=2), "norm layernorm"),
    (model(activation="gelu", head_dim=128, hidden=256, heads=2), "activation gelu"),
    (model(qk_norm=True, head_dim=128, hidden=256, heads=2), "qk_norm"),
])
def test_flashinfer_unavailable_shapes(m, words):
    why = fil.flashinfer_available(m)
    assert why.startswith("FlashInfer: not available for this shape (") and words in why and "\n" not in why
    with pytest.raises(RuntimeError, match="not available"):
        fil.FlashInferLayer(reference.random_weights(m), m, 1, 32, device="cpu")


def test_flashinfer_not_installed(monkeypatch):
    m = model(head_dim=64, hidden=128, heads=4, kv_heads=1)
    for name in [k for k in sys.modules if k == "flashinfer" or k.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now fails as if absent
    assert fil.flashinfer_available(m) == "flashinfer not installed"
    with pytest.raises(RuntimeError, match="flashinfer not installed"):
        fil.FlashInferLayer(reference.random_weights(m), m, 1, 32, device="cpu")


def test_flashinfer_module_imports_lazily():
    """Importing the module (as the benchmark does everywhere) never imports flashinfer."""
    code = "import sys, bench.flashinfer_layer; assert 'flashinfer' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_page_table():
    # seq_len 40 -> 3 pages a sequence; kv lengths 1, 16, 17, 40
    indptr, indices, last = fil.page_table(torch.tensor([0, 15, 16, 39]), 3)
    assert indptr.tolist() == [0, 1, 2, 4, 7] and indptr.dtype == torch.int32
    assert indices.tolist() == [0, 3, 6, 7, 9, 10, 11]
    assert last.tolist() == [1, 16, 1, 8]


# ---------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_MODELS = [
    model("llama-ish-hd64", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024),
    model("mha-hd128-bias", hidden=512, heads=4, kv_heads=4, head_dim=128, intermediate=768, qkv_bias=True),
    model("group2-hd128", hidden=1024, heads=8, kv_heads=4, head_dim=128, intermediate=1536, rope_scaling=LLAMA3),
    model("group7-hd64", hidden=448, heads=7, kv_heads=1, head_dim=64, intermediate=896),
    model("qwen3-ish", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1024, qk_norm=True),
    model("ln-gelu-fp16", hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=768, norm="layernorm",
          activation="gelu", dtype="fp16"),
]
BATCH, SEQ = 3, 300


def _gpu_inputs(m: Model, seed: int, positions: str):
    dtype = reference.TORCH_DTYPES[m.dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    W = reference.random_weights(m, seed=seed, device="cuda")
    kc = torch.randn(BATCH, m.kv_heads, SEQ, m.head_dim, generator=g, device="cuda").to(dtype)
    vc = torch.randn(kc.shape, generator=g, device="cuda").to(dtype)
    x = torch.randn(BATCH, m.hidden, generator=g, device="cuda").to(dtype)
    if positions == "full":
        pos = torch.full((BATCH,), SEQ - 1, dtype=torch.int32, device="cuda")
    else:
        pos = torch.tensor([0, 17, SEQ - 1], dtype=torch.int32, device="cuda")
    return W, kc, vc, x, pos


def _graphed(step):
    from bench.timing import graph_of
    holder = {}

    def run():
        holder["out"] = step()
    g = graph_of(run)
    g.replay()
    torch.cuda.synchronize()
    return holder["out"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("positions", ["full", "mixed"])
@pytest.mark.parametrize("m", GPU_MODELS, ids=lambda m: m.name)
def test_serving_layer_compiled_graphed_matches_reference(m, positions):
    W, kc, vc, x, pos = _gpu_inputs(m, seed=11, positions=positions)
    layer = ServingLayer(W, m, BATCH, SEQ, device="cuda")
    assert layer.attention == "flash_varlen"  # the GPU models' head_dims are FlashAttention-2's (torch >= 2.4)
    layer.k_cache.copy_(kc)
    layer.v_cache.copy_(vc)
    ref = reference.decoder_layer(x, pos, W, kc, vc, m)
    step = make_serving_step(layer)
    out = _graphed(lambda: step(x, pos))
    assert out.dtype == x.dtype and rel_err(out, ref) <= 1e-2
    _check_rows(layer.k_cache, layer.v_cache, kc, vc, pos)


def _check_rows(k, v, kc, vc, pos):
    """The appended rows (b, :, pos[b]) as the reference wrote them; every other row untouched."""
    rows, p = torch.arange(BATCH, device="cuda"), pos.long()
    assert rel_err(k[rows, :, p], kc[rows, :, p]) <= 1e-2 and rel_err(v[rows, :, p], vc[rows, :, p]) <= 1e-2
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool, device="cuda")
    keep[rows, p] = False
    assert torch.equal(k.transpose(1, 2)[keep], kc.transpose(1, 2)[keep])
    assert torch.equal(v.transpose(1, 2)[keep], vc.transpose(1, 2)[keep])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("positions", ["full", "mixed"])
@pytest.mark.parametrize("m", GPU_MODELS, ids=lambda m: m.name)
def test_flashinfer_layer_graphed_matches_reference(m, positions):
    why = fil.flashinfer_available(m)
    if why:
        pytest.skip(why)
    W, kc, vc, x, pos = _gpu_inputs(m, seed=12, positions=positions)
    layer = fil.FlashInferLayer(W, m, BATCH, SEQ, device="cuda", positions=pos.cpu())
    layer.load_kv(kc, vc)
    dk, dv = layer.dense_kv()
    assert torch.equal(dk, kc) and torch.equal(dv, vc)
    ref = reference.decoder_layer(x, pos, W, kc, vc, m)
    out = _graphed(lambda: layer(x, pos))
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 1e-2
    _check_rows(*layer.dense_kv(), kc, vc, pos)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", GPU_MODELS[:2], ids=lambda m: m.name)
def test_flashinfer_replan_between_replays(m):
    """Capture at pos = seq_len-1, then set_positions + new pos values, replay: the graph follows the new plan."""
    why = fil.flashinfer_available(m)
    if why:
        pytest.skip(why)
    W, kc, vc, x, pos_full = _gpu_inputs(m, seed=13, positions="full")
    pos = pos_full.clone()
    layer = fil.FlashInferLayer(W, m, BATCH, SEQ, device="cuda")
    layer.load_kv(kc, vc)
    holder = {}
    from bench.timing import graph_of
    g = graph_of(lambda: holder.__setitem__("out", layer(x, pos)))
    mixed = torch.tensor([0, 17, SEQ - 1], dtype=torch.int32)
    layer.set_positions(mixed)
    pos.copy_(mixed)
    layer.load_kv(kc, vc)
    ref = reference.decoder_layer(x, pos, W, kc, vc, m)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(holder["out"], ref) <= 1e-2
