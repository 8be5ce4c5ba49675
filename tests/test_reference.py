"""The fp32 PyTorch reference (the ground truth the GPU tests judge the kernel by) against an independent float64
evaluation of the same math written here with explicit loops; weight packing; the loader's checks that need no GPU.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from generator import host, loader, reference
from generator.loader import LoadError
from generator.variants import Model, Variant

from conftest import TINY_NAMES

RMS = Model(name="t-rms", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=1, norm="rmsnorm",
            norm_eps=1e-5, rope_theta=10000.0, activation="silu", qkv_bias=False, qk_norm=False, dtype="bf16")
LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 64), ("rope_type", "llama3"))
# head_dim 32, theta 5e5: wavelengths 6.3 .. 1.4e6 cover all three llama3 regimes (>= 16 high, 16..64, > 64 low)
LN = Model(name="t-ln", hidden=96, heads=6, kv_heads=2, head_dim=32, intermediate=160, layers=1, norm="layernorm",
           norm_eps=1e-6, rope_theta=500000.0, activation="gelu", qkv_bias=True, qk_norm=True, dtype="fp16",
           rope_scaling=LLAMA3)
SEQ = 24


# ---------------------------------------------------------------- float64, independently

def inv_freq64(m: Model) -> np.ndarray:
    """HF's RoPE frequencies, one by one (llama3 rope_scaling: keep high, divide low, blend the band between)."""
    out = []
    for i in range(m.head_dim // 2):
        f = 1.0 / m.rope_theta ** (2 * i / m.head_dim)
        if m.rope_scaling:
            s = dict(m.rope_scaling)
            old = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / f
            if wavelen < old / s["high_freq_factor"]:
                pass
            elif wavelen > old / s["low_freq_factor"]:
                f = f / s["factor"]
            else:
                t = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
                f = (1 - t) * f / s["factor"] + t * f
        out.append(f)
    return np.array(out)


def layer64(x, pos, W, kc, vc, m: Model, store=lambda row: row):
    """One decode step in float64 numpy, sequence by sequence, head by head. kc, vc [B, kv, S, hd] are updated;
    store(row) is what a cache of the model dtype keeps of a new row."""
    W = {k: v.double().numpy() for k, v in W.items()}
    hd, half, group = m.head_dim, m.head_dim // 2, m.heads // m.kv_heads
    inv = inv_freq64(m)

    def norm(v, w, b):
        if m.norm == "layernorm":
            mu = sum(v) / len(v)
            var = sum((e - mu) ** 2 for e in v) / len(v)
            return np.array([(e - mu) / math.sqrt(var + m.norm_eps) for e in v]) * w + b
        return v / math.sqrt(sum(e * e for e in v) / len(v) + m.norm_eps) * w

    def head_norm(t, w):
        return t / math.sqrt(np.dot(t, t) / hd + m.norm_eps) * w if m.qk_norm else t

    def rope(t, p):
        r = np.empty(hd)
        for i in range(half):
            c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
            r[i] = t[i] * c - t[i + half] * s
            r[i + half] = t[i + half] * c + t[i] * s
        return r

    def act(g):
        if m.activation == "gelu":
            return 0.5 * g * (1 + math.erf(g / math.sqrt(2)))
        return g / (1 + math.exp(-g))

    out = np.empty_like(x)
    for b in range(x.shape[0]):
        p = int(pos[b])
        xn = norm(x[b], W["input_layernorm.weight"], W.get("input_layernorm.bias"))
        proj = {}
        for name in ("q", "k", "v"):
            y = W[f"self_attn.{name}_proj.weight"] @ xn
            if m.qkv_bias:
                y = y + W[f"self_attn.{name}_proj.bias"]
            proj[name] = y
        q = [rope(head_norm(proj["q"][h * hd:(h + 1) * hd], W.get("self_attn.q_norm.weight")), p)
             for h in range(m.heads)]
        for j in range(m.kv_heads):
            kc[b, j, p] = store(rope(head_norm(proj["k"][j * hd:(j + 1) * hd], W.get("self_attn.k_norm.weight")), p))
            vc[b, j, p] = store(proj["v"][j * hd:(j + 1) * hd])
        attn = np.zeros(m.heads * hd)
        for h in range(m.heads):
            j = h // group
            scores = [np.dot(q[h], kc[b, j, t]) / math.sqrt(hd) for t in range(p + 1)]
            top = max(scores)
            e = [math.exp(s - top) for s in scores]
            attn[h * hd:(h + 1) * hd] = sum(e[t] * vc[b, j, t] for t in range(p + 1)) / sum(e)
        h1 = x[b] + W["self_attn.o_proj.weight"] @ attn
        hn = norm(h1, W["post_attention_layernorm.weight"], W.get("post_attention_layernorm.bias"))
        g, u = W["mlp.gate_proj.weight"] @ hn, W["mlp.up_proj.weight"] @ hn
        out[b] = h1 + W["mlp.down_proj.weight"] @ np.array([act(gi) * ui for gi, ui in zip(g, u)])
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(m: Model, batch: int, seed: int, cache_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, m.hidden, generator=g)
    kc = torch.randn(batch, m.kv_heads, SEQ, m.head_dim, generator=g).to(cache_dtype)
    vc = torch.randn(batch, m.kv_heads, SEQ, m.head_dim, generator=g).to(cache_dtype)
    pos = torch.randint(0, SEQ, (batch,), generator=g, dtype=torch.int32)
    pos[0], pos[-1] = SEQ - 1, 0  # a full cache and an empty one
    return x, pos, kc, vc


@pytest.mark.parametrize("m", [RMS, LN], ids=["rmsnorm-silu", "layernorm-gelu-bias-qknorm-llama3"])
def test_reference_matches_float64(m):
    W = reference.random_weights(m, seed=1, dtype=torch.float32)
    x, pos, kc, vc = inputs(m, batch=4, seed=2)
    assert len(set(pos.tolist())) > 2  # different positions per sequence
    kc64, vc64 = kc.double().numpy().copy(), vc.double().numpy().copy()
    out = reference.decoder_layer(x, pos, W, kc, vc, m)
    out64 = layer64(x.double().numpy(), pos.numpy(), W, kc64, vc64, m)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert rel(out, out64) <= 1e-5, rel(out, out64)
    assert rel(kc, kc64) <= 1e-5 and rel(vc, vc64) <= 1e-5
    idx = torch.arange(4)
    assert rel(kc[idx, :, pos.long()], kc64[idx.numpy(), :, pos.numpy()]) <= 1e-5  # the appended rows themselves


@pytest.mark.parametrize("m", [RMS, LN], ids=["bf16", "fp16"])
def test_reference_with_caches_in_the_model_dtype(m):
    # the caches keep the model dtype, as the kernel's do: the new k and v are rounded before attention reads them
    dt = reference.TORCH_DTYPES[m.dtype]
    W = reference.random_weights(m, seed=3, dtype=torch.float32)
    x, pos, kc, vc = inputs(m, batch=3, seed=4, cache_dtype=dt)
    kc64, vc64 = kc.double().numpy().copy(), vc.double().numpy().copy()
    out = reference.decoder_layer(x, pos, W, kc, vc, m)
    assert kc.dtype == dt and vc.dtype == dt
    out64 = layer64(x.double().numpy(), pos.numpy(), W, kc64, vc64, m,
                    store=lambda row: torch.from_numpy(row).to(dt).double().numpy())
    assert rel(out, out64) <= 1e-5, rel(out, out64)
    assert rel(kc.double(), kc64) <= 1e-5 and rel(vc.double(), vc64) <= 1e-5


def test_llama3_frequencies_cover_all_regimes():
    f = inv_freq64(LN)
    base = np.array([1.0 / LN.rope_theta ** (2 * i / LN.head_dim) for i in range(LN.head_dim // 2)])
    ratio = f / base
    assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 1 / 8)
    assert ((ratio < 1 - 1e-9) & (ratio > 1 / 8 + 1e-9)).any()  # at least one blended frequency
    assert rel(host.inv_freq(LN).numpy(), f) <= 1e-6


# ---------------------------------------------------------------- weight packing

@pytest.mark.parametrize("m", [RMS, LN], ids=["rmsnorm", "layernorm-bias-qknorm"])
def test_pack_unpack_round_trip(m):
    W = reference.random_weights(m, seed=5)
    packed = loader.pack_weights(W, m)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    assert packed["w_qkv"].numel() == (q + 2 * kv) * m.hidden
    assert packed["w_gu"].numel() == 2 * m.intermediate * m.hidden
    assert all(t.is_contiguous() for t in packed.values())
    # the row order inside the kernel's tile layout (from_fragments undoes the tiling where there is one):
    # [q; k; v], and gate and up interleaved (row 2i is gate_i, row 2i+1 is up_i)
    rows = getattr(loader, "from_fragments", lambda t: t)
    assert torch.equal(rows(packed["w_gu"])[0::2], W["mlp.gate_proj.weight"])
    assert torch.equal(rows(packed["w_gu"])[1::2], W["mlp.up_proj.weight"])
    assert torch.equal(rows(packed["w_qkv"])[q:q + kv], W["self_attn.k_proj.weight"])
    back = loader.unpack_weights(packed, m)
    assert set(back) == set(W) == set(reference.weight_shapes(m))
    for k in W:
        assert back[k].dtype == W[k].dtype and torch.equal(back[k], W[k]), k


# ---------------------------------------------------------------- loader checks without a GPU

def test_find_entry_accepts_a_good_build(tiny_build):
    entry, cubin = loader.find_entry(TINY_NAMES[2], tiny_build["dir"])
    assert entry["name"] == TINY_NAMES[2] and cubin.read_bytes()[:4] == b"\x7fELF"
    v = loader._variant_from_entry(entry)
    assert isinstance(v, Variant) and v.name == TINY_NAMES[2] and dict(v.model.rope_scaling)["factor"] == 8.0


def test_find_entry_missing_build_dir(tmp_path):
    with pytest.raises(LoadError) as info:
        loader.find_entry(TINY_NAMES[0], tmp_path / "build")
    assert "megakernel build" in str(info.value) and TINY_NAMES[0] in str(info.value)


def test_find_entry_variant_not_built(tiny_build):
    with pytest.raises(LoadError) as info:
        loader.find_entry("other_decode_b1_s64_bf16", tiny_build["dir"])
    assert "not in" in str(info.value) and "megakernel build" in str(info.value)


def test_find_entry_stale_build(copy_build):
    d = copy_build()
    m = json.loads((d / "manifest.json").read_text())
    m["variants"][TINY_NAMES[0]]["sources_sha256"] = "f" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(LoadError) as info:
        loader.find_entry(TINY_NAMES[0], d)
    assert "stale" in str(info.value) and "megakernel build" in str(info.value)
    loader.find_entry(TINY_NAMES[1], d)  # the others are still fine


@pytest.mark.parametrize("how", ["flipped-byte", "truncated", "missing"])
def test_find_entry_corrupt_cubin(copy_build, how):
    d = copy_build()
    cubin = d / TINY_NAMES[0] / "kernel.cubin"
    data = bytearray(cubin.read_bytes())
    if how == "flipped-byte":
        data[100] ^= 1
        cubin.write_bytes(bytes(data))
    elif how == "truncated":
        cubin.write_bytes(bytes(data[: len(data) // 2]))
    else:
        cubin.unlink()
    with pytest.raises(LoadError) as info:
        loader.find_entry(TINY_NAMES[0], d)
    assert "missing or corrupt" in str(info.value) and "megakernel build" in str(info.value)


def test_find_entry_corrupt_manifest(copy_build):
    d = copy_build()
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(LoadError, match="megakernel build"):
        loader.find_entry(TINY_NAMES[0], d)


def test_load_refuses_a_cpu_device(tiny_build):
    m = loader._variant_from_entry(loader.find_entry(TINY_NAMES[0], tiny_build["dir"])[0]).model
    W = reference.random_weights(m, seed=0)
    with pytest.raises(ValueError, match="CUDA"):
        loader.load(TINY_NAMES[0], W, build_dir=tiny_build["dir"], device="cpu")
    # no device torch knows, a build_dir that is a file or no path: one line each, not torch's / pathlib's errors
    with pytest.raises(ValueError, match=r"device: the fused layer runs on CUDA \('cuda' or 'cuda:N'\), got 'tpu'"):
        loader.load(TINY_NAMES[0], W, build_dir=tiny_build["dir"], device="tpu")
    with pytest.raises(LoadError, match="is not a directory"):
        loader.load(TINY_NAMES[0], W, build_dir=tiny_build["dir"] / "manifest.json")
    with pytest.raises(LoadError, match=r"build_dir=None: a directory path"):
        loader.load(TINY_NAMES[0], W, build_dir=None)


def _weights(m):
    return reference.random_weights(m, seed=6)


@pytest.mark.parametrize("m", [RMS, LN], ids=["rmsnorm", "layernorm"])
def test_check_weights(m):
    cpu, dt = torch.device("cpu"), reference.TORCH_DTYPES[m.dtype]
    loader.check_weights(_weights(m), m, dt, cpu)  # a complete set passes

    W = _weights(m)
    del W["mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"weight 'mlp\.up_proj\.weight': missing"):
        loader.check_weights(W, m, dt, cpu)

    W = _weights(m)
    W["self_attn.rotary_emb.inv_freq"] = torch.zeros(m.head_dim // 2)
    with pytest.raises(ValueError, match=r"weight 'self_attn\.rotary_emb\.inv_freq': not a tensor of this layer"):
        loader.check_weights(W, m, dt, cpu)

    W = _weights(m)
    W["self_attn.o_proj.weight"] = W["self_attn.o_proj.weight"][:, :-8].contiguous()
    with pytest.raises(ValueError, match=r"weight 'self_attn\.o_proj\.weight': shape"):
        loader.check_weights(W, m, dt, cpu)

    W = _weights(m)
    W["input_layernorm.weight"] = W["input_layernorm.weight"].float()
    with pytest.raises(ValueError, match=r"weight 'input_layernorm\.weight': dtype torch\.float32"):
        loader.check_weights(W, m, dt, cpu)

    W = _weights(m)
    W["mlp.down_proj.weight"] = W["mlp.down_proj.weight"].numpy() if dt == torch.float16 else [1.0]
    with pytest.raises(ValueError, match=r"weight 'mlp\.down_proj\.weight': must be a torch\.Tensor"):
        loader.check_weights(W, m, dt, cpu)


def test_check_weights_knows_optional_tensors():
    # a layernorm/bias/qk-norm model needs its extra tensors; a plain one must not be given them
    W = _weights(LN)
    for k in ("input_layernorm.bias", "self_attn.q_proj.bias", "self_attn.k_norm.weight"):
        W2 = dict(W)
        del W2[k]
        with pytest.raises(ValueError, match=f"'{k}': missing"):
            loader.check_weights(W2, LN, torch.float16, torch.device("cpu"))
    W = _weights(RMS)
    W["self_attn.q_proj.bias"] = torch.zeros(RMS.heads * RMS.head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a tensor of this layer"):
        loader.check_weights(W, RMS, torch.bfloat16, torch.device("cpu"))



@pytest.mark.parametrize("m", [RMS, LN], ids=["rmsnorm", "layernorm"])
def test_random_inputs_fail_a_norm_that_shares_one_rows_statistics(m, monkeypatch):
    """verify.random_inputs (the GPU checks' inputs) gives each row its own scale and mean, so a kernel whose norm
    took one row's statistics for every row fails the checks' tolerance by a wide margin (standard-normal rows all
    have rms ~1: at hidden 2048 such a fault moved the output ~1 %, at the bf16 tolerance)."""
    from types import SimpleNamespace
    from generator import verify
    B = 8
    layer = SimpleNamespace(device="cpu", variant=SimpleNamespace(batch=B), chunk=1, cache_len=SEQ, mode="decode",
                            model=m, dtype=torch.float32,
                            k_cache=torch.empty(B, m.kv_heads, SEQ, m.head_dim),
                            v_cache=torch.empty(B, m.kv_heads, SEQ, m.head_dim))
    x, pos = verify.random_inputs(layer, seed=5)
    rms = x.pow(2).mean(-1).sqrt()
    assert rms.max() / rms.min() > 2 and x.mean(-1).abs().max() > 0.1

    def row0_stats_norm(t, w, b, mm):  # the fault: row 0's mean and 1/rms for every row
        t = t.float()
        if mm.norm == "layernorm":
            mean, var = t[:1].mean(-1, keepdim=True), t[:1].var(-1, unbiased=False, keepdim=True)
            return (t - mean) * torch.rsqrt(var + mm.norm_eps) * w.float() + b.float()
        return t * torch.rsqrt(t[:1].pow(2).mean(-1, keepdim=True) + mm.norm_eps) * w.float()

    W = reference.random_weights(m, seed=6, dtype=torch.float32)
    good = reference.decoder_layer(x, pos, W, layer.k_cache.clone(), layer.v_cache.clone(), m)
    monkeypatch.setattr(reference, "norm", row0_stats_norm)
    bad = reference.decoder_layer(x, pos, W, layer.k_cache.clone(), layer.v_cache.clone(), m)
    assert verify.rel_err(bad, good) > 5 * verify.REL_TOL["bf16"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA device")
def test_random_weights_on_a_missing_cuda_device_is_one_line():
    """random_weights(device="cuda") where torch sees no GPU: one ValueError line (torch's own error is a
    multi-line RuntimeError about ATen_cuda), saying to use the CPU."""
    from generator.reference import random_weights
    from generator.variants import load
    m = load(Path(__file__).resolve().parent.parent / "variants.yaml")[0].model
    with pytest.raises(ValueError, match=r"random_weights\(device='cuda'\): no CUDA device here") as err:
        random_weights(m, device="cuda")
    assert "\n" not in str(err.value)


def test_rebuild_advice_names_the_inputs_the_build_used(tmp_path):
    """The stale / corrupt build's advice rebuilds from the recorded inputs: the tuning file always, as an absolute
    path (one under tuning/ too: a bare build picks by what tuning/ holds), the variants file where it is not
    ./variants.yaml; a default build's advice is the bare command."""
    from generator.manifest import ROOT as PKG, rebuild_advice
    name = "m_decode_b1_s1024_bf16"
    e = {"variants_file": str(tmp_path / "mine.yaml"), "tuning": {"file": "tuning/nvidia-h200.json"}}
    assert rebuild_advice(tmp_path / "b", name, e) == (
        f"run `megakernel build --build-dir {tmp_path / 'b'} --only '{name}' --variants {tmp_path / 'mine.yaml'} "
        f"--tuned-for {PKG / 'tuning' / 'nvidia-h200.json'}`")
    e = {"variants_file": str(Path("variants.yaml").resolve()), "tuning": None}
    assert rebuild_advice(Path("build"), name, e) == f"run `megakernel build --only '{name}'`"
    assert set(reference.random_weights(RMS, device=None)) == set(reference.random_weights(RMS))  # None: the CPU
