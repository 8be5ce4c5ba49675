"""generator.serve and generator.unfused: dispatch and padding choices, the fallback warning, sampling, generate on
the CPU (unfused path) against transformers; on a GPU (marked gpu): padded == unpadded, graph == eager, seeded
sampling reproducible, unfused numerics against the reference, fused against unfused."""
from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from generator import hf, reference, sampler, serve
from generator.serve import Choice, ServeError, decode_choice, prefill_plan
from generator.unfused import UnfusedLayer
from generator.variants import Model as Shape, Variant
from hf_util import NEAR_TIE_RMS, greedy_agreement, randomize, rope_kwargs

transformers = pytest.importorskip("transformers")

SHAPE = Shape(name="t", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2, norm="rmsnorm",
              norm_eps=1e-5, rope_theta=10000.0, activation="silu", qkv_bias=True, qk_norm=True, dtype="bf16")


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------------------------------------------------
# dispatch: pure functions
# ------------------------------------------------------------------------------------------------------------

DEC = {1: "m_decode_b1_s64_bf16", 4: "m_decode_b4_s64_bf16", 8: "m_decode_b8_s64_bf16"}


@pytest.mark.parametrize("live,batch", [(1, 1), (2, 4), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_decode_picks_the_smallest_declared_batch_that_fits(live, batch):
    ch = decode_choice(live, DEC, {}, 64)
    assert ch == Choice("fused", DEC[batch], batch, ch.why) and ch.missing is None
    assert ("padding" in ch.why) == (batch > live)


def test_decode_falls_back_to_unfused_at_the_live_batch():
    ch = decode_choice(9, DEC, {}, 64)
    assert (ch.path, ch.variant, ch.batch, ch.missing) == ("unfused", None, 9, ("decode", 9, 64))
    assert ch.why == "no declared decode variant of batch >= 9"
    assert decode_choice(1, {}, {}, 64).why == "no fused decode variant loaded"  # e.g. --device cpu
    # a variant routed unfused is skipped for the next one that fits
    ch = decode_choice(3, DEC, {DEC[4]: "unfused"}, 64)
    assert (ch.path, ch.variant, ch.batch) == ("fused", DEC[8], 8)
    ch = decode_choice(5, DEC, {DEC[8]: "unfused"}, 64)
    assert (ch.path, ch.batch, ch.missing) == ("unfused", 5, None)  # declared, routed away: no warning
    with pytest.raises(ServeError, match="unfused=False"):
        decode_choice(9, DEC, {}, 64, unfused=False)
    with pytest.raises(ServeError, match="at least one"):
        decode_choice(0, DEC, {}, 64)


PRE = {(4, 512): "p_b4_s512", (4, 128): "p_b4_s128", (1, 128): "p_b1_s128", (8, 2048): "p_b8_s2048"}


def spans(pieces):
    return [(p.start, p.length, p.choice.path, p.choice.variant, p.choice.batch) for p in pieces]


def test_prefill_splits_into_declared_chunks_largest_first():
    assert spans(prefill_plan(1000, 2, PRE, {})) == [
        (0, 512, "fused", "p_b4_s512", 4), (512, 128, "fused", "p_b4_s128", 4), (640, 128, "fused", "p_b4_s128", 4),
        (768, 128, "fused", "p_b4_s128", 4), (896, 104, "unfused", None, 2)]
    # batch 1 takes the batch-1 chunk; batch 5 only the batch-8 one
    assert spans(prefill_plan(256, 1, PRE, {}))[0][3] == "p_b1_s128"
    assert spans(prefill_plan(4100, 5, PRE, {})) == [
        (0, 2048, "fused", "p_b8_s2048", 8), (2048, 2048, "fused", "p_b8_s2048", 8), (4096, 4, "unfused", None, 5)]
    # the measured route sends the 512 chunk to the unfused path: 128s instead
    assert [p[1] for p in spans(prefill_plan(600, 2, PRE, {"p_b4_s512": "unfused"}))] == [128] * 4 + [88]


def test_prefill_plan_minimises_the_measured_time():
    # as measured on an H200 (routes/nvidia-h200.json, Llama-3.2-1B): only the 16-token chunk is faster fused
    pre = {(1, c): f"p_b1_s{c}" for c in (16, 64, 128, 512, 2048)}
    us = {16: (140.3, 154.1), 64: (160.0, 158.7), 128: (231.8, 168.6), 512: (499.7, 252.1), 2048: (1777.2, 703.1)}
    costs = {f"p_b1_s{c}": {"fused_us": f, "unfused_us": u} for c, (f, u) in us.items()}
    routes = {n: "fused" if costs[n]["fused_us"] <= costs[n]["unfused_us"] else "unfused" for n in costs}
    plan = lambda n: spans(prefill_plan(n, 1, pre, routes, costs=costs))  # noqa: E731
    assert plan(16) == [(0, 16, "fused", "p_b1_s16", 1)]
    # eight fused 16-token chunks (8 x 140 us) lose to one unfused 128-token piece (169 us): not chunked
    assert plan(128) == [(0, 128, "unfused", None, 1)]
    assert plan(20) == [(0, 20, "unfused", None, 1)]
    assert plan(5000) == [(0, 2048, "unfused", None, 1), (2048, 2048, "unfused", None, 1),
                          (4096, 904, "unfused", None, 1)]
    # without measurements: the largest fused chunk that fits, as before
    assert [p[1] for p in spans(prefill_plan(48, 1, pre, routes))] == [16, 16, 16]


def test_prefill_without_variants_is_unfused_in_bounded_pieces_naming_the_missing_variant():
    ps = prefill_plan(5000, 3, {}, {}, max_unfused=2048)
    assert spans(ps) == [(0, 2048, "unfused", None, 3), (2048, 2048, "unfused", None, 3),
                         (4096, 904, "unfused", None, 3)]
    assert ps[0].choice.missing == ("prefill", 3, 2048) and ps[2].choice.missing == ("prefill", 3, 512)
    dec = decode_choice(3, DEC, {}, 64)
    ps = prefill_plan(7, 3, {}, {}, decode=dec, unfused=False)
    assert spans(ps) == [(0, 7, "fused-decode", DEC[4], 4)]
    with pytest.raises(ServeError, match="unfused=False"):
        prefill_plan(7, 9, {}, {}, decode=decode_choice(9, DEC, {}, 64), unfused=False)
    with pytest.raises(ServeError, match="at least one token"):
        prefill_plan(0, 1, PRE, {})


def test_decode_variants_must_share_one_seq_len():
    vs = [Variant(SHAPE, "decode", 1, 64), Variant(SHAPE, "decode", 4, 128), Variant(SHAPE, "prefill", 1, 32)]
    with pytest.raises(ServeError) as exc:
        serve.common_seq_len(vs)
    assert "64" in str(exc.value) and "128" in str(exc.value) and "\n" not in str(exc.value)
    assert serve.common_seq_len(vs[::2]) == 64 and serve.common_seq_len(vs[2:]) is None


def test_length_check_is_one_clear_line():
    serve.check_length([5, 3], 60, 64)
    with pytest.raises(ServeError) as exc:
        serve.check_length([5, 3], 61, 64)
    assert "65 cache rows" in str(exc.value) and "capacity 64" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ServeError, match="max_new_tokens"):
        serve.check_length([1], 0, 64)
    serve.check_length([64], 1, 64)  # the prompt fills the cache: its next token still comes
    with pytest.raises(ServeError, match=r"longest prompt \(70 tokens\) is over the cache capacity 64 rows by itself"):
        serve.check_length([70, 3], 1, 64)


def test_missing_entry_declares_the_shape():
    """The warning's entry: the model's fields with the shape's own matrix, named after the model and the shape (so
    the entries of several warnings, or one beside the model's own entry, paste as distinct keys), in the served
    dtype where given."""
    entry = "  # from x/config.json (model_type llama)\n  m:\n    hidden: 64\n    dtype: bf16\n"
    text = serve.missing_entry(entry, "decode", 3, 4096)
    assert text.endswith("    matrix: {mode: [decode], batch: [3], seq_len: [4096]}\n")
    import yaml
    m = yaml.safe_load("models:\n" + text)["models"]
    assert list(m) == ["m-decode-b3-s4096-bf16"] and m["m-decode-b3-s4096-bf16"]["matrix"]["batch"] == [3]
    text = serve.missing_entry(entry, "decode", 1, 4096, tp=2)  # a tensor-parallel model's
    assert yaml.safe_load("models:\n" + text)["models"]["m-decode-b1-s4096-tp2-bf16"]["matrix"]["tp"] == [2]
    both = entry + serve.missing_entry(entry, "prefill", 3, 8) + serve.missing_entry(entry, "decode", 3, 64, dtype="fp16")
    m = yaml.safe_load("models:\n" + both)["models"]  # (the duplicate-key loader of variants.yaml: test_variants)
    assert list(m) == ["m", "m-prefill-b3-s8-bf16", "m-decode-b3-s64-fp16"] and m["m-decode-b3-s64-fp16"]["dtype"] == "fp16"
    assert "  m-decode-b3-s64-bf16:" in serve.missing_entry(entry, "decode", 3, 64, dtype="bf16")  # (beside fp16's)
    # a model served from a pasted entry: its name holds one tag, the new shape's (not the old one's too)
    again = serve.missing_entry(entry.replace("  m:", "  m-decode-b3-s64-bf16:"), "decode", 5, 64, dtype="bf16")
    assert "  m-decode-b5-s64-bf16:" in again
    assert m["m-prefill-b3-s8-bf16"]["dtype"] == "bf16"  # (no dtype given, e.g. served in fp32: the entry's own)
    f32 = entry.replace("    hidden", "    # torch_dtype float32 in config.json: mapped to bf16 (weights are cast when "
                        "loaded)\n    hidden")  # the entry's note follows the served dtype
    assert "float32 in config.json: served in fp16 (weights" in serve.missing_entry(f32, "decode", 3, 64, dtype="fp16")
    assert "mapped to bf16" in serve.missing_entry(f32, "decode", 3, 64)


def test_memory_plan_and_refusal():
    p = serve.plan_memory(SHAPE, vocab=1000, tied=False, elt=2, max_batch=4, cache_len=64, fused=True, unfused=False,
                          workspace_bytes=1000)
    assert p["kv_caches"] == 2 * 2 * 4 * 2 * 64 * 16 * 2 and p["weights_unfused"] == 0
    assert p["total"] == sum(v for k, v in p.items() if k != "total")
    serve.check_fits(p, p["total"], 2 * p["total"], "x")
    with pytest.raises(ServeError) as exc:
        serve.check_fits(p, p["total"] - 1, 2 * p["total"], "model")
    assert "free" in str(exc.value) and "\n" not in str(exc.value)


# ------------------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------------------

def _sample(logits, temp, k=0, p=1.0, seed=0, step=None):
    B = logits.shape[0]
    step = torch.arange(B) if step is None else step
    return serve.sample_tokens(logits, torch.full((B,), float(temp)), torch.full((B,), k), torch.full((B,), float(p)),
                               torch.full((B,), seed), step)


def test_sampling_greedy_topk1_and_reproducible():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_sample(logits, 0.0), logits.argmax(-1))
    assert torch.equal(_sample(logits, 1.0, k=1), logits.argmax(-1))
    assert torch.equal(_sample(logits, 1.0, p=1e-6), logits.argmax(-1))
    a, b = _sample(logits, 1.0, seed=5), _sample(logits, 1.0, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, _sample(logits, 1.0, seed=6))
    top3 = logits.topk(3).indices
    s = _sample(logits, 2.0, k=3, seed=1)
    assert all(int(s[i]) in top3[i].tolist() for i in range(16))


def test_sampling_shortcuts_draw_the_same_tokens():
    """candidates (torch.topk of the largest logits, for top_k > 0) and nucleus=False (top_p 1, top_k off: nothing
    ranked) draw the tokens the full sort draws, for the same seeds (random logits: no ties), rows of different
    top_k included."""
    B, V = 64, 1000
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(3)) * 3
    t, seed, step = torch.full((B,), 0.7), torch.arange(B) * 13, torch.arange(B) + 5
    for k, p in ((50, 0.9), (50, 1.0), (1, 1.0), (7, 0.5)):
        ks = torch.full((B,), k) if k > 1 else torch.ones(B, dtype=torch.long)
        ks[::3] = max(1, k // 2)  # (some rows keep fewer than the candidates)
        pp = torch.full((B,), p)
        full = serve.sample_tokens(logits, t, ks, pp, seed, step)
        assert torch.equal(serve.sample_tokens(logits, t, ks, pp, seed, step, candidates=k), full), (k, p)
    off = torch.zeros(B, dtype=torch.long)
    full = serve.sample_tokens(logits, t, off, torch.ones(B), seed, step)
    assert torch.equal(serve.sample_tokens(logits, t, off, torch.ones(B), seed, step, nucleus=False), full)
    assert len(set(full.tolist())) > 20  # (draws, not the argmax)


def test_top_k_keeps_the_ties_at_the_kth_logit():
    """As transformers' TopKLogitsWarper: every token tied with the k-th largest logit stays in (bf16 logits tie
    often), on the full sort's path and the candidates' (which rank a few more than k)."""
    N = 20000
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]]).expand(N, 5).contiguous()
    want = torch.tensor([math.e, 1, 1, 1, 0]) / (math.e + 3)
    for kw in ({}, {"candidates": 4}, {"candidates": 5}):
        s = serve.sample_tokens(logits, torch.ones(N), torch.full((N,), 2), torch.ones(N), torch.full((N,), 9),
                                torch.arange(N), **kw)
        assert torch.allclose(torch.bincount(s, minlength=5).float() / N, want, atol=0.015), kw


def test_seeds_past_32_bits_draw_other_tokens():
    """A seed's high 32 bits count (seed and seed + 2^32 differ); seeds below 2^32 keep their streams."""
    step = torch.arange(8)
    lo = serve.uniform_noise(torch.full((8,), 5), step, 100)
    assert not torch.equal(lo, serve.uniform_noise(torch.full((8,), 5 + 2 ** 32), step, 100))
    h = serve._mix32(serve._mix32(torch.full((8,), 5)) ^ step)  # the stream before the high bits were mixed in
    x = serve._mix32((h[:, None] + torch.arange(100)[None, :] * 0x9E3779B1) & serve._M32)
    assert torch.equal(lo, ((x >> 8).float() + 0.5) * (1.0 / (1 << 24)))


def test_sampling_follows_the_distribution():
    N = 20000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[None].expand(N, 4).contiguous()
    s = _sample(logits, 1.0, seed=11, step=torch.arange(N))
    freq = torch.bincount(s, minlength=4).float() / N
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015), freq
    # top_p 0.7: {0.5, 0.3} renormalised; temperature 0.5 sharpens
    freq = torch.bincount(_sample(logits, 1.0, p=0.7, seed=2, step=torch.arange(N)), minlength=4).float() / N
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015), freq
    freq = torch.bincount(_sample(logits, 0.5, seed=3, step=torch.arange(N)), minlength=4).float() / N
    want = torch.tensor([0.25, 0.09, 0.0225, 0.0025])
    assert torch.allclose(freq, want / want.sum(), atol=0.015), freq
    # the same through the shortcuts: top-2 by candidates, and no ranking at all
    s = serve.sample_tokens(logits, torch.ones(N), torch.full((N,), 2), torch.ones(N), torch.full((N,), 4),
                            torch.arange(N), candidates=2)
    assert torch.allclose(torch.bincount(s, minlength=4).float() / N, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    s = serve.sample_tokens(logits, torch.ones(N), torch.zeros(N, dtype=torch.long), torch.ones(N),
                            torch.full((N,), 5), torch.arange(N), nucleus=False)
    assert torch.allclose(torch.bincount(s, minlength=4).float() / N, torch.tensor([0.5, 0.3, 0.15, 0.05]),
                          atol=0.015)


# ------------------------------------------------------------------------------------------------------------
# the unfused layer against the reference
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_unfused_decode_and_prefill_equal_the_reference(dtype, tol, device="cpu"):
    m, B, L = SHAPE, 3, 32
    W = reference.random_weights(m, seed=1, device=device, dtype=dtype)
    Wf = {k: v.float() for k, v in W.items()}
    kc = torch.zeros(4, m.kv_heads, L, m.head_dim, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    u = UnfusedLayer(W, m, kc, vc)
    rk, rv = torch.zeros_like(kc[:B]).float(), torch.zeros_like(vc[:B]).float()
    g = torch.Generator().manual_seed(2)
    # prefill 6 tokens at start 0, then 3 decode steps at per-sequence positions
    x = torch.randn(B, 6, m.hidden, generator=g).to(device)
    out = u.prefill(x.to(dtype), torch.zeros(B, dtype=torch.int32, device=device), kv_len=6)
    ref = torch.stack([reference.decoder_layer(x[:, t], torch.full((B,), t), Wf, rk, rv, m) for t in range(6)], 1)
    assert rel(out, ref) <= tol
    for step in range(3):
        pos = torch.tensor([6 + step, 4 + step, 2 + step], dtype=torch.int32, device=device)  # rewrites rows
        x = torch.randn(B, m.hidden, generator=g).to(device)
        out = u.decode(x.to(dtype), pos)
        ref = reference.decoder_layer(x, pos.long(), Wf, rk, rv, m)
        assert rel(out, ref) <= tol, step
    assert rel(kc[:B, :, :9], rk[:, :, :9]) <= tol
    # a bound on the rows attention reads (serve.kv_bucket's) gives the step unbounded's result: the rows past each
    # position are masked either way (the step rewrites the same cache rows: idempotent); and the rows past the bound
    # are not read at all (NaN there would reach the output through attention's weighted sum)
    whole = u.decode(x.to(dtype), pos)
    kc[:, :, 16:], vc[:, :, 16:] = float("nan"), float("nan")
    for rows in (int(pos.max()) + 1, 16):
        got = u.decode(x.to(dtype), pos, kv_len=rows)
        assert torch.isfinite(got).all() and rel(got, whole) <= (1e-6 if dtype == torch.float32 else 1e-2), rows
    for rows in (0, L + 1):
        with pytest.raises(ValueError, match=f"kv_len {rows}: must be 1..{L}"):
            u.decode(x.to(dtype), pos, kv_len=rows)
    with pytest.raises(ValueError, match="kv_len 5: must be 6.."):
        u.prefill(torch.zeros(B, 6, m.hidden, dtype=dtype, device=device), pos, kv_len=5)
    with pytest.raises(ValueError, match="self_attn.q_norm.weight"):
        UnfusedLayer({k: v for k, v in W.items() if "q_norm" not in k}, m, kc, vc)
    with pytest.raises(ValueError, match="k_cache"):
        UnfusedLayer(W, m, kc[:, :1], vc)


# ------------------------------------------------------------------------------------------------------------
# the whole model on the CPU (unfused path) against transformers
# ------------------------------------------------------------------------------------------------------------

def make_llama(d, seed=0, **over):
    T = transformers
    kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=96, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, **rope_kwargs(T.LlamaConfig, 10000.0))
    kw.update(over)
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**kw)).eval()
    randomize(model, seed)
    model.save_pretrained(d)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve") / "tiny-llama"
    return make_llama(d), d


def cpu_model(d, **kw):
    kw = {"build_dir": d / "no-build", "device": "cpu", "cache_len": 48, "dtype": torch.float32, "max_batch": 4,
          **kw}
    return serve.Model.from_hf(d, **kw)


def generate_beside(model, hfm, prompts, n):
    """model.generate(prompts, n) greedy (the CPU's one-line fallback warning silenced) beside transformers' greedy
    generate of each prompt alone: a prompt's (our tokens, our logits [n, vocab], transformers' sequence
    [1, len + n], its logits [n, vocab])."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model.generate(prompts, n, output_logits=True)
    out = []
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = hfm.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
            out.append((got.tokens[b], torch.stack([lg[b] for lg in got.logits]), ref,
                        hfm(input_ids=ref[:, :-1]).logits[0, len(p) - 1:]))
    return out


def test_a_shape_no_kernel_computes_is_served_unfused(tmp_path):
    """A checkpoint whose shape the fused kernels cannot compute (head_dim 12, hidden 72, intermediate 100: not the
    tensor cores' multiples of 16) is served by the unfused layers, as transformers runs it (greedy tokens equal),
    said once in a MissingVariantWarning that names the field; naming variants for it is one ServeError; the
    variants.yaml path (from-hf) still refuses it."""
    d = tmp_path / "odd"
    hfm = make_llama(d, hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=2,
                     head_dim=12)
    want = hfm.generate(torch.tensor([[1, 2, 3, 4, 5]]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = cpu_model(d)
        got = model.generate([[1, 2, 3, 4, 5]], 8).tokens[0]
    assert got == want
    said = [str(w.message) for w in caught if issubclass(w.category, serve.MissingVariantWarning)]
    assert len(said) == 1 and "no fused kernel computes this shape (field 'head_dim' must be a multiple of 16" \
        in said[0], said
    with pytest.raises(serve.ServeError, match=r"^variants: no fused kernel computes .*variants=\[\] serves them"):
        cpu_model(d, variants=["odd_decode_b1_s48_bf16"])
    from generator import hf, variants as gvariants
    with pytest.raises(gvariants.VariantError, match="field 'head_dim' must be a multiple of 16"):
        hf.model_from_hf(d)


def test_dtype_by_name(tiny):
    """dtype as variants.yaml and `--dtype` name it ('bf16', 'fp32'), or torch's ('float32'), or a torch dtype; any
    other is one ServeError naming what is taken."""
    _, d = tiny
    assert cpu_model(d, dtype="fp32").dtype == torch.float32
    assert cpu_model(d, dtype="bfloat16").dtype == torch.bfloat16
    for bad in ("int8", "float64", torch.int32):
        with pytest.raises(serve.ServeError, match=r"^dtype: .*'bf16'") as info:
            cpu_model(d, dtype=bad)
        assert "\n" not in str(info.value)


def test_positions_past_max_position_embeddings_are_warned_through_the_api(tmp_path):
    """generate reaching positions the config never trained (max_position_embeddings) runs as asked and warns
    (serve.PositionWarning), through the Python API as the CLI does; within it, no warning."""
    d = tmp_path / "short-llama"
    make_llama(d, max_position_embeddings=16)
    m = cpu_model(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error", serve.PositionWarning)
        m.generate([[1, 2, 3]], 14)  # positions up to 3 + 14 - 1 = 16
        with pytest.raises(ServeError, match="^temperature"):  # a call refused is refused, not warned about first
            m.generate([[1, 2, 3, 4]], 14, temperature=-1)
    with pytest.warns(serve.PositionWarning, match=r"up to 17 positions .*max_position_embeddings 16"):
        out = m.generate([[1, 2, 3, 4], [5]], 14)
    assert len(out.tokens[0]) == 14
    with warnings.catch_warnings():  # once a model (a server's every long request would repeat it)
        warnings.simplefilter("error", serve.PositionWarning)
        m.generate([[1, 2, 3, 4, 5]], 14)
    from conftest import run_cli  # the CLI says it once, in its options' words; a refused call: the error alone
    r = run_cli(["generate", d, "--ids", "1,2,3,4", "--max-new-tokens", "14", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 0 and r.stderr.count("never trained") == 1 and "--max-new-tokens - 1" in r.stderr, r.stderr
    r = run_cli(["generate", d, "--ids", "1,2,200", "--max-new-tokens", "14", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode != 0 and "never trained" not in r.stderr and r.stderr.startswith("error: --ids"), r.stderr
    # yarn extends the pretraining length by its factor: its context is factor x original (hf.trained_positions)
    y = tmp_path / "yarn-llama"
    make_llama(y, max_position_embeddings=8, **rope_kwargs(transformers.LlamaConfig, 10000.0, {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}))
    m = cpu_model(y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", serve.PositionWarning)
        m.generate([[1, 2, 3]], 14)  # positions up to 16 = 2 x 8
    with pytest.warns(serve.PositionWarning, match=r"up to 17 positions .*past the 16 positions yarn RoPE scaling "
                                                   r"extends max_position_embeddings 8 to"):
        m.generate([[1, 2, 3, 4]], 14)


def test_a_cache_over_cpu_memory_is_refused_in_one_line(tiny):
    """--device cpu plans its memory as a GPU model does: a cache that would not fit is one ServeError, before any
    tensor is allocated (it was the allocator's traceback)."""
    _, d = tiny
    with pytest.raises(serve.ServeError, match=r"GiB of CPU memory .* lower max_batch or cache_len"):
        cpu_model(d, cache_len=10**9)


def test_generate_matches_transformers_with_prompts_of_different_lengths(tiny):
    hfm, d = tiny
    model = cpu_model(d)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate(prompts, 12, output_logits=True)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = hfm.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            ref_logits = hfm(input_ids=ref[:, :-1]).logits[0, len(p) - 1:]
        assert got.tokens[b] == ref[0, len(p):].tolist(), b
        assert got.sequences[b] == ref[0].tolist()
        ours = torch.stack([lg[b] for lg in got.logits])
        assert rel(ours, ref_logits) <= 1e-4
    # on the CPU the fallback is said once, in one line (no fused kernel runs there: a variants.yaml entry a shape, as
    # a GPU warns, was a flood, a trial found), not a hint to build for the CPU nor a claim on what is built
    msgs = [str(w.message) for w in caught if issubclass(w.category, serve.MissingVariantWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("device cpu: every call runs the unfused PyTorch layers") \
        and "\n" not in msgs[0] and "no built" not in msgs[0], msgs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(prompts, 2)  # warned already
    st = {(r["mode"], r["variant"]): r for r in model.stats()}
    assert st[("decode", "unfused b3")]["calls"] == 12 and st[("decode", "unfused b3")]["tokens"] == 36
    assert st[("prefill", "unfused b3")]["calls"] == 2
    # prompts of 7, 2 and 4 tokens, twice: 26 real tokens; the rest of the 3 x 7 computed twice is padding
    assert st[("prefill", "unfused b3")]["tokens"] == 26 and st[("prefill", "unfused b3")]["padded_tokens"] == 16
    p = model.paths(3, 7)
    assert p["decode"].path == "unfused" and len(p["layers"]) == 2


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}])
def test_rope_scaling_generates_as_transformers(tmp_path, scaling):
    """A checkpoint with linear RoPE scaling (transformers' every frequency / factor) or yarn (frequencies blended
    over a ramp of dimensions, cos and sin x its attention factor) is served as transformers runs it; the same weights
    without the scaling give other logits (the case is not vacuous)."""
    T = transformers
    d = tmp_path / scaling["rope_type"]
    hfm = make_llama(d, seed=7, **rope_kwargs(T.LlamaConfig, 10000.0, scaling))
    plain = make_llama(tmp_path / "plain", seed=7)  # the same weights, default RoPE
    model = cpu_model(d)
    assert dict(model.shape.rope_scaling).items() >= scaling.items()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 1]]
    for b, (tokens, ours, ref, ref_logits) in enumerate(generate_beside(model, hfm, prompts, 10)):
        with torch.no_grad():
            plain_logits = plain(input_ids=ref[:, :-1]).logits[0, len(prompts[b]) - 1:]
        assert tokens == ref[0, len(prompts[b]):].tolist(), b
        assert rel(ours, ref_logits) <= 1e-4 < 1e-2 < rel(plain_logits, ref_logits), b


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_generates_as_transformers(tmp_path, family):
    """A Mistral checkpoint (or a Qwen2 one whose every layer slides: use_sliding_window, max_window_layers 0) whose
    window (8 tokens) is shorter than its prompts and the cache (48 rows): the prompt pieces and decode steps attend
    to the last 8 rows, as transformers' sliding_window_causal mask and its sliding cache do (tokens and logits
    equal its generate); the same weights with full attention give other logits."""
    T = transformers
    cfg_cls, model_cls = (T.MistralConfig, T.MistralForCausalLM) if family == "mistral" else \
        (T.Qwen2Config, T.Qwen2ForCausalLM)
    kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, **rope_kwargs(cfg_cls, 10000.0))
    if family == "qwen2":
        kw.update(use_sliding_window=True, max_window_layers=0)
    hfms = {}
    for window in (8, None):
        torch.manual_seed(9)
        extra = {"sliding_window": window} if family == "mistral" or window else {"use_sliding_window": False}
        hfms[window] = model_cls(cfg_cls(**{**kw, **extra})).eval()
        randomize(hfms[window], 9)
        hfms[window].save_pretrained(tmp_path / f"w{window}")
    model = cpu_model(tmp_path / "w8")
    assert model.shape.sliding_window == 8
    prompts = [list(range(3, 17)), [5, 1, 4]]  # 14 tokens: past the window already in the prompt
    for b, (tokens, ours, ref, ref_logits) in enumerate(generate_beside(model, hfms[8], prompts, 12)):
        with torch.no_grad():
            full_logits = hfms[None](input_ids=ref[:, :-1]).logits[0, len(prompts[b]) - 1:]
        assert tokens == ref[0, len(prompts[b]):].tolist(), b
        assert rel(ours, ref_logits) <= 1e-4 < 1e-2 < rel(full_logits, ref_logits), b


def test_dynamic_rope_generates_as_transformers_up_to_max_position_embeddings(tmp_path):
    """rope_type dynamic (NTK scaling past max_position_embeddings, here 48): a cache no longer than that is served
    with the default frequencies, as transformers runs it (tokens and logits equal its generate); a longer cache is
    refused in one line, and past 48 transformers' frequencies do change (the refusal is needed)."""
    T = transformers
    d = tmp_path / "dynamic"
    hfm = make_llama(d, seed=5, max_position_embeddings=48,
                     **rope_kwargs(T.LlamaConfig, 10000.0, {"rope_type": "dynamic", "factor": 2.0}))
    model = cpu_model(d)  # (cache_len 48)
    entry = hf.variant_entry_yaml(d)
    assert "rope_type dynamic: default RoPE for positions below max_position_embeddings 48" in entry
    assert model.shape.rope_scaling is None
    prompts = [list(range(2, 20)), [7, 3]]
    for b, (tokens, ours, ref, ref_logits) in enumerate(generate_beside(model, hfm, prompts, 12)):
        assert tokens == ref[0, len(prompts[b]):].tolist() and rel(ours, ref_logits) <= 1e-4, b
    with pytest.raises(hf.HFConfigError) as exc:
        cpu_model(d, cache_len=64)
    msg = str(exc.value)
    assert "\n" not in msg and "seq_len 64 is longer than max_position_embeddings 48" in msg and "dynamic" in msg
    plain = make_llama(tmp_path / "plain", seed=5, max_position_embeddings=48)  # the same weights, default RoPE
    ids = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # (a forward reaching position 59 scales every position's frequencies)
        short = rel(hfm(input_ids=ids[:, :48]).logits, plain(input_ids=ids[:, :48]).logits)
        long = rel(hfm(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert short <= 1e-5 < 1e-3 < long


def test_partial_rotary_factor_without_scaling_is_ignored_as_transformers_ignores_it(tmp_path):
    """partial_rotary_factor with default RoPE: the model classes' compute_default_rope_parameters rotate the whole
    head_dim (the field unread), so the checkpoint is served as transformers runs it, with a note; with RoPE scaling
    (which would rotate that fraction) it stays refused in one line."""
    T = transformers
    d = tmp_path / "prf"
    hfm = make_llama(d, seed=13, partial_rotary_factor=0.5)
    entry = hf.variant_entry_yaml(d)
    assert "partial_rotary_factor 0.5 ignored: transformers' default RoPE" in entry
    model = cpu_model(d)
    prompts = [[4, 5, 6, 7, 8, 9], [2]]
    for b, (tokens, ours, ref, ref_logits) in enumerate(generate_beside(model, hfm, prompts, 8)):
        assert tokens == ref[0, len(prompts[b]):].tolist() and rel(ours, ref_logits) <= 1e-4, b
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFConfigError, match="partial_rotary_factor' is 0.5: partial RoPE is not supported"):
        hf.variant_entry_yaml(d)


@pytest.mark.parametrize("shard,legacy,tied", [(False, False, True), (False, True, False), (True, False, False)])
def test_a_pytorch_checkpoint_generates_as_transformers(tmp_path, shard, legacy, tied):
    """A checkpoint saved as PyTorch files (pytorch_model.bin in torch.save's zip format or the legacy one, or shards
    with other names and their pytorch_model.bin.index.json), which transformers loads where a directory has neither
    model.safetensors nor its index: served with the same tokens and logits as transformers' own generate from that
    directory (bf16 weights and a tied head saved under both names too; an entry that is no tensor warned unused, as
    transformers reports it unexpected); beside a model.safetensors the safetensors file is read, as transformers
    reads it."""
    T = transformers
    d = tmp_path / "bin"
    sd = make_llama(d, seed=11, tie_word_embeddings=tied).to(torch.bfloat16 if tied else torch.float32).state_dict()
    (d / "model.safetensors").unlink()  # (transformers 5 saves safetensors only: the files as older versions wrote them)
    if shard:
        names = sorted(sd)
        parts = [names[:len(names) // 2], names[len(names) // 2:]]
        files = [f"part-{i + 1}.pt" for i in range(2)]  # (any name: transformers reads what is not .safetensors
        for f, part in zip(files, parts):                # with torch.load)
            torch.save({k: sd[k].clone() for k in part}, d / f)
        (d / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, part in zip(files, parts) for k in part}}))
    else:
        torch.save({**sd, "step": 3}, d / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    ref_model = T.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # (transformers' own read)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = cpu_model(d)
    unused = [str(w.message) for w in caught if issubclass(w.category, hf.HFUnusedTensorsWarning)]
    assert unused == ([] if shard else [unused[0]]) and (shard or "(step)" in unused[0]), unused
    assert model.checkpoint_bytes == sum(f.stat().st_size for f in d.iterdir() if f.suffix in (".bin", ".pt"))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1]]
    for b, (tokens, ours, ref, ref_logits) in enumerate(generate_beside(model, ref_model, prompts, 8)):
        assert tokens == ref[0, len(prompts[b]):].tolist() and rel(ours, ref_logits) <= 1e-4, b
    assert hf._Checkpoint(d).index_path.name == ("pytorch_model.bin.index.json" if shard else "pytorch_model.bin")
    make_llama(tmp_path / "st", seed=12)  # a model.safetensors beside the .bin: transformers reads it, so do we
    (tmp_path / "st" / "model.safetensors").rename(d / "model.safetensors")
    assert hf._Checkpoint(d).index_path.name == "model.safetensors"


@pytest.mark.parametrize("rows,cache_len,want", [(1, 4096, 256), (256, 4096, 256), (257, 4096, 512),
                                                  (4000, 4096, 4096), (1, 48, 48), (3000, 100000, 4096)])
def test_kv_bucket(rows, cache_len, want):
    assert serve.kv_bucket(rows, cache_len) == want
    for bad in (0, cache_len + 1):
        with pytest.raises(ValueError, match=f"kv_bucket: {bad} rows needed, the cache holds 1..{cache_len}"):
            serve.kv_bucket(bad, cache_len)


def test_unfused_decode_reads_the_cache_rows_its_positions_need(tiny, monkeypatch):
    """The unfused decode step attends over kv_bucket(largest position + 1) rows, not the whole cache (a trial
    found its cost following cache_len: 2,571 tokens/s at cache_len 64, 169 at 100,000), with the same tokens."""
    hfm, d = tiny
    model = cpu_model(d)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [8, 9]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the CPU's one-line fallback warning)
        whole = model.generate(prompts, 10, output_logits=True)
        seen = []
        real = UnfusedLayer.decode

        def spy(self, x, pos, kv_len=None):
            seen.append(kv_len)
            return real(self, x, pos, kv_len)
        monkeypatch.setattr(UnfusedLayer, "decode", spy)
        monkeypatch.setattr(serve, "KV_BUCKET_MIN", 16)
        got = model.generate(prompts, 10, output_logits=True)
    # 9 decode steps of 2 layers, the longest sequence at positions 13 .. 21: 16 rows for 3 steps, then 32
    assert seen == [16] * 6 + [32] * 12
    assert got.tokens == whole.tokens
    assert all(rel(a, b) <= 1e-6 for a, b in zip(got.logits, whole.logits))


def test_stream_stop_tokens_and_sampling(tiny):
    _, d = tiny
    model = cpu_model(d)
    greedy = model.generate([[1, 2, 3], [4, 5]], 10).tokens
    stop = greedy[0][3]
    seen = []
    out = model.generate([[1, 2, 3], [4, 5]], 10, stop_tokens=[stop], callback=lambda b, t: seen.append((b, t)))
    assert out.tokens[0] == greedy[0][:greedy[0].index(stop) + 1]
    assert out.tokens[1] == (greedy[1][:greedy[1].index(stop) + 1] if stop in greedy[1] else greedy[1])
    assert sorted(seen) == sorted((b, t) for b in range(2) for t in out.tokens[b])
    assert list(model.stream([[1, 2, 3]], 4)) == [(0, t) for t in greedy[0][:4]]
    # on the CPU no step runs ahead of what was delivered: none after the stop token (the GPU overlaps one)
    model.reset_stats()
    one = model.generate([[1, 2, 3]], 10, stop_tokens=[stop]).tokens[0]
    assert sum(r["calls"] for r in model.stats() if r["mode"] == "decode") == len(one) - 1 < 9
    it = model.stream([[1, 2, 3]], 10, stop_tokens=[stop])  # a consumer that takes the stop token and no more
    assert [next(it) for _ in one] == [(0, t) for t in one]
    assert model.generate([[1, 2, 3]], 2).tokens[0] == greedy[0][:2]  # the model is not held by it
    it.close()
    with pytest.raises(ServeError, match="^device: fused variants run on CUDA"):  # not the build's absence
        cpu_model(d, variants=["no-such-variant"])
    a = model.generate([[1, 2, 3], [4, 5]], 10, temperature=0.9, top_k=20, top_p=0.95, seed=7).tokens
    b = model.generate([[1, 2, 3], [4, 5]], 10, temperature=0.9, top_k=20, top_p=0.95, seed=7).tokens
    c = model.generate([[1, 2, 3], [4, 5]], 10, temperature=0.9, top_k=20, top_p=0.95, seed=8).tokens
    assert a == b and a != c
    # top-p's mask: the prefix reaching top_p; top_p 1 keeps all, also where the fp32 cumulative sum reaches 1 early
    probs = torch.tensor([[0.6, 0.4000001, 1e-7, 1e-7], [0.5, 0.3, 0.15, 0.05]])
    keep = serve.nucleus_keep(probs, torch.tensor([1.0, 0.8]))
    assert keep.tolist() == [[True] * 4, [True, True, False, False]]
    assert serve.nucleus_keep(probs, torch.tensor([0.9999999, 0.95]))[0].tolist() == [True, True, False, False]
    # settings per sequence (a server's requests): each sequence draws as it would alone with its own settings
    # (its own seed), greedy rows included, whatever the draw shape the batch needs
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    for temps, ks, ps in (([0.9, 0.0, 1.3], [20, 0, 5], [0.95, 1.0, 1.0]),  # top-k on in every sampled row
                          ([0.9, 0.7, 1.3], [20, 0, 5], [0.95, 0.8, 1.0])):  # top-k on and off: the sort
        per = model.generate(prompts, 8, temperature=temps, top_k=ks, top_p=ps, seed=[7, 8, 9])
        for i, pr in enumerate(prompts):
            one = model.generate([pr], 8, temperature=temps[i], top_k=ks[i], top_p=ps[i], seed=[7, 8, 9][i])
            assert per.tokens[i] == one.tokens[0], (temps, i)
    assert model.generate(prompts, 8, temperature=0.9, seed=7).tokens == \
        model.generate(prompts, 8, temperature=[0.9] * 3, seed=[7, 7 + 7919, 7 + 2 * 7919]).tokens == \
        model.generate(prompts, 8, temperature=np.full(3, 0.9), seed=torch.tensor([7, 7 + 7919, 7 + 2 * 7919])).tokens
    for kw, match in (({"temperature": [0.9, 0.5]}, r"^temperature: .*one per sequence \(3\), got 2 values"),
                      ({"top_k": [1, 2, -1], "temperature": 0.5}, r"^top_k: .*one per sequence, got -1"),
                      ({"seed": [1, 2, 2 ** 62], "temperature": 0.5}, r"^seed: an integer in \[0, 2\*\*62\)")):
        with pytest.raises(ServeError, match=match):
            model.generate(prompts, 2, **kw)


@pytest.mark.parametrize("kwargs,match", [
    ({"prompts": [[1, 2], [3]] * 3}, "max_batch = 4"),
    ({"prompts": [[1, 96]]}, r"\[0, 95\]"),
    ({"prompts": [[]]}, "non-empty"),
    ({"prompts": [[1]], "max_new_tokens": 49}, "cache capacity 48"),
    ({"prompts": [[1]], "temperature": -1.0}, "temperature"),
    ({"prompts": [[1]], "top_p": 0.0}, "top_p"),
    ({"prompts": [[1]], "top_k": 1.5}, "top_k"),
])
def test_bad_requests_are_one_line_errors(tiny, kwargs, match):
    _, d = tiny
    model = cpu_model(d)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ServeError, match=match) as exc:
        model.generate(kwargs.pop("prompts"), **kwargs)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("kw,said", [
    ({"path": None}, "^path: a model directory"),
    ({"group": "x"}, "^group: a torch.distributed process group"),
    ({"gpu_name": 5}, "^gpu_name: "),
    ({"variants": 5}, "^variants: built variant names"),
    ({"unfused": "no"}, "^unfused: True or False"),
    ({"build_dir": 5}, "^build_dir: a directory"),
    ({"build_dir": None}, "^build_dir: a directory"),
    ({"cache_len": None, "default_cache_len": "x"}, "^default_cache_len: rows per sequence"),
])
def test_from_hf_arguments_are_named_when_wrong(tiny, kw, said):
    """Each argument from_hf takes is checked for its type and named (a helper's trial found torch's and pathlib's own
    errors for these, or none)."""
    _, d = tiny
    kw = {"path": d, "build_dir": d / "no-build", "device": "cpu", "cache_len": 48, **kw}
    with pytest.raises(ServeError, match=said) as exc:
        serve.Model.from_hf(kw.pop("path"), **kw)
    assert "\n" not in str(exc.value)


def test_one_generation_at_a_time_and_lenient_arguments(tiny):
    """Two streams interleaved on one model (or a generate from a callback) would share its KV caches: the second
    is refused in one line and the first goes on unharmed; an int stop token, a numpy prompt and a top_k past the
    vocabulary are taken as transformers takes them; a callback that is no function, a fused head on the CPU and a
    device that is neither cuda nor cpu are one-line errors before anything runs; top_k/top_p at temperature 0
    warn once (they have no effect), pointing at the caller's line."""
    import numpy as np
    _, d = tiny
    model = cpu_model(d)
    ref = model.generate([[5, 6, 7]], 6, stop_tokens=[]).tokens[0]
    s1 = model.stream([[5, 6, 7]], 6, stop_tokens=[])
    first = [next(s1)[1]]
    with pytest.raises(ServeError, match="^another generate\\(\\) or stream\\(\\) is under way"):
        next(model.stream([[8, 9]], 6, stop_tokens=[]))
    with pytest.raises(ServeError, match="under way"):
        model.generate([[8, 9]], 2)
    assert first + [t for _, t in s1] == ref  # the first stream, unharmed
    with pytest.raises(ServeError, match="under way"):
        model.generate([[5, 6, 7]], 3, callback=lambda b, t: model.generate([[8, 9]], 2))
    s2 = model.stream([[5, 6, 7]], 6, stop_tokens=[])
    next(s2)
    s2.close()  # a closed stream frees the model
    assert model.generate([[5, 6, 7]], 6, stop_tokens=[]).tokens[0] == ref
    s3 = model.stream([[5, 6, 7]], 6, stop_tokens=[])
    assert [next(s3)[1] for _ in range(6)] == ref  # exactly its tokens taken: s3 is paused, but done with the model
    assert model.generate([[5, 6, 7]], 6, stop_tokens=[]).tokens[0] == ref
    s4 = model.stream([[5, 6, 7]], 1, stop_tokens=[])
    assert next(s4)[1] == ref[0]  # one token: no decode step follows
    assert model.generate([[5, 6, 7]], 2, stop_tokens=[]).tokens[0] == ref[:2]
    del s3, s4
    stop = ref[1]
    assert model.generate([[5, 6, 7]], 6, stop_tokens=stop).tokens[0] == ref[:ref.index(stop) + 1]
    assert model.generate(np.array([[5, 6, 7]]), 6, stop_tokens=[]).tokens[0] == ref
    assert model.generate(np.array([5, 6, 7]), 6, stop_tokens=[]).tokens[0] == ref
    assert model.generate([np.array([5, 6, 7]), torch.tensor([8, 9])], 6, stop_tokens=torch.tensor(stop)).tokens[0] \
        == ref[:ref.index(stop) + 1]
    with pytest.raises(ServeError, match=r"^prompts\[0\]: token ids must be integers"):
        model.generate(np.array([[5, "x"]], dtype=object), 2)
    big = model.generate([[5, 6, 7]], 4, temperature=1.0, top_k=10**30, seed=3).tokens
    assert big == model.generate([[5, 6, 7]], 4, temperature=1.0, top_k=0, seed=3).tokens
    for kw, match in (({"callback": 5}, "^callback: a function"), ({"stop_tokens": 2.5}, "^stop_tokens: integer")):
        with pytest.raises(ServeError, match=match):
            model.generate([[5, 6, 7]], 3, **kw)
    with pytest.raises(ServeError, match="^fused_head: the fused head runs on a CUDA GPU"):
        model.fused_head = True
    model.fused_head = False  # (off is fine anywhere)
    for dev in ("gpu", "meta", 3.5):
        with pytest.raises(ServeError, match="^device: 'cuda', 'cuda:N' or 'cpu', got"):
            serve.Model.from_hf(d, variants=[], cache_len=48, device=dev)
    with pytest.raises(ServeError, match="^cache_len: rows per sequence, an integer >= 2, got 1$"):
        cpu_model(d, variants=[], cache_len=1)
    from generator.hf import HFPrecisionWarning
    with pytest.warns(HFPrecisionWarning, match="the unfused layers run in fp16") as rec:  # as an fp16 variant warns
        cpu_model(d, variants=[], dtype=torch.float16)
    assert [w.filename for w in rec if w.category is HFPrecisionWarning] == [__file__]
    with pytest.warns(UserWarning, match="temperature 0 decodes greedily: top_k 5 has no effect") as rec:
        model.generate([[5, 6, 7]], 2, top_k=5)  # (only the settings given: top_p 1 is off)
    assert [w.filename for w in rec if "greedily" in str(w.message)] == [__file__]
    fresh = cpu_model(d)  # its warnings not yet given: each points at the line that asked, through stream() too
    with pytest.warns(UserWarning) as rec:
        list(fresh.stream([[5, 6, 7], [8]], 2, top_p=0.5))
    said = {type(w.message).__name__ if "greedily" not in str(w.message) else "greedy": w.filename for w in rec}
    assert said == {"MissingVariantWarning": __file__, "greedy": __file__}, said
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once a model
        model.generate([[5, 6, 7]], 2, top_p=0.5)
    with pytest.warns(UserWarning, match="temperature 0 decodes greedily: seed 3 has no effect"):
        cpu_model(d).generate([[5, 6, 7], [8]], 2, seed=3)  # a seed too (the default 0 is said nothing of)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fresh = cpu_model(d)
        warnings.simplefilter("ignore", serve.MissingVariantWarning)
        fresh.generate([[5, 6, 7], [8]], 2, seed=0)


def test_stats_and_logits_stop_with_the_sequences(tiny):
    """Sequences that stop early: stats count their later rows as padding (not real tokens), the step that ran
    after the last stop (the host reads each step's tokens while the next runs) adds no token and no logits entry
    (one entry per new token of the longest sequence, as transformers' output_logits); paths()/head_path() refuse
    what generate would."""
    _, d = tiny
    model = cpu_model(d)
    ref = model.generate([[5, 6, 7], [8, 9]], 8, stop_tokens=[]).tokens
    stop = ref[0][2]
    model.reset_stats()
    g = model.generate([[5, 6, 7], [8, 9]], 8, stop_tokens=stop, output_logits=True)
    assert g.tokens[0] == ref[0][:ref[0].index(stop) + 1]
    assert len(g.logits) == max(len(t) for t in g.tokens)
    dec = [r for r in model.stats() if r["mode"] == "decode"]
    real = sum(len(t) for t in g.tokens) - 2  # the first tokens come from the prefill
    assert sum(r["tokens"] for r in dec) == real, dec
    assert sum(r["tokens"] + r["padded_tokens"] for r in dec) == sum(r["calls"] for r in dec) * g.decode_choice.batch
    assert sum(r["calls"] for r in dec) in (max(len(t) for t in g.tokens) - 1, max(len(t) for t in g.tokens))
    launched = []  # a stream closed early: every launched step is a call, none lost
    step = model._step
    model._step = lambda *a, **k: (launched.append(1), step(*a, **k))[1]
    for take in (1, 2, 4):
        model.reset_stats()
        s = model.stream([[5, 6, 7], [8, 9]], 8, stop_tokens=[])
        for _ in range(take):
            next(s)
        s.close()
        dec = [r for r in model.stats() if r["mode"] == "decode"]
        assert sum(r["calls"] for r in dec) == len(launched) and sum(r["tokens"] for r in dec) <= 2 * len(launched)
        launched.clear()
    del model._step
    for bad, match in (({"batch": 5}, r"^batch: sequences in \[1, 4\]"), ({"batch": 2.5}, "^batch"),
                       ({"prompt_len": 49}, r"^prompt_len: tokens in \[1, 48\]"), ({"prompt_len": 0}, "^prompt_len")):
        with pytest.raises(ServeError, match=match):
            model.paths(**bad)
    with pytest.raises(ServeError, match="^batch"):
        model.head_path(0)
    # which draw a sampled step takes, and generate's refusals for the settings
    assert model.draw_path(0, 5, 0.9) == "greedy" and model.draw_path(0.7, 5, 0.9) == "torch (on cpu)"
    assert model.draw_path(0.0) == "greedy" and model.draw_path([0.0, 0.0], top_k=[5, 0]) == "greedy"
    for bad, match in (((-1, 0, 1.0), "^temperature"), ((float("nan"), 0, 1.0), "^temperature"),
                       ((0.7, 5.5, 1.0), "^top_k"), ((0.7, -1, 1.0), "^top_k"), ((0.7, 5, 0.0), "^top_p")):
        with pytest.raises(ServeError, match=match):
            model.draw_path(*bad)
    V = model.vocab
    assert model._check_sampling(2, 0.5, V, 1.0)[1] == [0, 0]  # a top-k of the whole vocabulary: off
    NC = sampler.NUCLEUS_CANDIDATES
    assert model._draw_shape([1.0], [2], [0.9]) == (min(V, 128), True, min(V, 128))
    assert model._draw_shape([1.0], [V - 1], [1.0]) == (V, False, V) and model._draw_shape([0.0], [5], [0.5]) is None
    assert model._draw_shape([1.0], [0], [1.0]) == (0, False, 0)  # temperature only: nothing ranked
    # per sequence: the sampled rows decide; top-k on and off mixed sorts the vocabulary in torch (each row's own
    # top-k) and ranks at least NUCLEUS_CANDIDATES in the fused draw (as many as the top-k rows need)
    assert model._draw_shape([0.0, 1.0], [0, 3], [1.0, 1.0]) == (min(V, 128), False, min(V, 128))
    assert model._draw_shape([0.7, 1.0], [0, 3], [1.0, 1.0]) == (0, True, NC)
    assert model._draw_shape([0.7, 1.0], [0, V - 1], [1.0, 1.0]) == (0, True, max(V, NC))
    assert model._draw_shape([0.7, 1.0], [0, 0], [1.0, 0.9]) == (0, True, NC)
    assert model.draw_path([0.0, 0.0], 5, 1.0) == "greedy" and model.draw_path([0.0, 0.5], [0, 3], 1.0) == \
        "torch (on cpu)"


def test_bad_configurations_are_one_line_errors(tiny):
    _, d = tiny
    with pytest.raises(ServeError, match="cache_len"):
        serve.Model.from_hf(d, build_dir=d / "none", device="cpu")
    with pytest.raises(ServeError, match="max_batch"):
        cpu_model(d, max_batch=0)
    with pytest.raises(ServeError, match="single string"):
        cpu_model(d, variants="x")
    with pytest.raises(ServeError, match="^device: fused variants run on CUDA"):  # (on the CPU, before the build)
        cpu_model(d, variants=["tiny-llama_decode_b1_s48_bf16"])
    if not torch.cuda.is_available():  # the default device without a GPU: one line, before any tensor is read
        with pytest.raises(ServeError, match="no CUDA GPU is visible"):
            serve.Model.from_hf(d, build_dir=d / "none", variants=[], cache_len=48)


def test_the_cache_length_defaults_where_no_decode_variant_fixes_it(tiny):
    """default_cache_len (generate's longest prompt + new tokens) stands in for cache_len where no decode variant
    fixes it; a cache_len given wins."""
    _, d = tiny
    assert cpu_model(d, variants=[], cache_len=None, default_cache_len=10).cache_len == 10
    assert cpu_model(d, variants=[], cache_len=20, default_cache_len=10).cache_len == 20
    with pytest.raises(serve.ServeError, match="no decode variant fixes the cache length"):
        cpu_model(d, variants=[], cache_len=None)


def test_memory_report_on_the_cpu(tiny):
    _, d = tiny
    model = cpu_model(d)
    mem = model.memory()
    assert mem["kv_caches"] == 2 * 2 * 4 * 2 * 48 * 32 * 4 and mem["weights_fused"] == 0
    assert mem["weights_unfused"] == 2 * serve.layer_weight_bytes(model.shape, 4)
    assert mem["checkpoint_bytes"] == (d / "model.safetensors").stat().st_size


def test_cli_generate_on_the_cpu(tiny, cli, tmp_path):
    _, d = tiny
    r = cli(["generate", d, "--ids", "1,2,3", "--ids", "4,5", "--max-new-tokens", "5", "--device", "cpu",
             "--cache-len", "32", "--build-dir", tmp_path / "b"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "time to first token" in r.stderr and "tokens/s" in r.stderr and "every layer" in r.stderr
    assert "[0] " in r.stdout and "[1] " in r.stdout
    # a --build-dir that the CPU does not read is said (a trial found it silently unused)
    assert f"note: --build-dir {tmp_path / 'b'}: not read on the CPU" in r.stderr, r.stderr
    r = cli(["generate", d, "--ids", "1,x", "--device", "cpu", "--cache-len", "32"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --ids")
    r = cli(["generate", d, "--ids", "1", "--max-new-tokens", "40", "--device", "cpu", "--cache-len", "32"],
            cwd=tmp_path)
    assert r.returncode == 2 and "cache capacity 32" in r.stderr and r.stderr.count("\n") == 1
    # no --cache-len on the CPU: prompt + new tokens; a bad device is one line. The float32 checkpoint runs in
    # float32 on the CPU, as transformers loads it (no fused kernel runs there): no note
    r = cli(["generate", d, "--ids", "1,2,3", "--max-new-tokens", "4", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 0 and "warning" not in r.stderr and "note:" not in r.stderr, r.stderr
    # the default device: the GPU where torch sees one, else the CPU's unfused layers, said in one note
    import torch
    r2 = cli(["generate", d, "--ids", "1,2,3", "--max-new-tokens", "4"], cwd=tmp_path)
    assert r2.returncode == 0, r2.stderr
    if not torch.cuda.is_available():
        assert "note: no CUDA GPU visible" in r2.stderr and "run on the CPU" in r2.stderr, r2.stderr
        assert r2.stdout == r.stdout, (r.stdout, r2.stdout)
        r2 = cli(["generate", d, "--ids", "1", "--device", "cuda"], cwd=tmp_path)
        assert r2.returncode == 2 and "no CUDA GPU visible" in r2.stderr and "--device cpu" in r2.stderr, r2.stderr
    # generation_config.json asking for sampling: this greedy run says so (transformers' generate() would sample)
    ds = tmp_path / "sampling"
    shutil.copytree(d, ds)
    (ds / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6, "top_p": 0.9}')
    r = cli(["generate", ds, "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu", "--dtype", "fp32"],
            cwd=tmp_path)
    # (its top_k is transformers' default, 50: generate() fills what the file leaves unset)
    assert r.returncode == 0 and "generation_config.json asks for sampling (temperature 0.6, top_k 50, top_p 0.9, " \
        "as transformers' generate() fills it)" in r.stderr and "--temperature 0.6 --top-k 50 --top-p 0.9" in \
        r.stderr, r.stderr
    r = cli(["generate", ds, "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu", "--dtype", "fp32",
             "--temperature", "0.6", "--seed", "1"], cwd=tmp_path)
    assert r.returncode == 0 and "asks for sampling" not in r.stderr and "sampled draw: decode torch (on cpu)" in \
        r.stderr, r.stderr
    (ds / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')  # greedy: nothing said
    r = cli(["generate", ds, "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu", "--dtype", "fp32"],
            cwd=tmp_path)
    assert r.returncode == 0 and "asks for sampling" not in r.stderr, r.stderr
    # one new token: no decode step ran, so no decode rate (it read "0.0 tokens/s")
    r = cli(["generate", d, "--ids", "1,2,3", "--max-new-tokens", "1", "--device", "cpu", "--temperature", "0.5"],
            cwd=tmp_path)
    assert r.returncode == 0 and "no decode step" in r.stderr and "tokens/s" not in r.stderr, r.stderr
    assert "sampled draw" not in r.stderr, r.stderr  # (no decode step drew)
    # past the positions the model was trained on (max_position_embeddings 256): generated as asked, and said
    r = cli(["generate", d, "--ids", "1,2,3", "--max-new-tokens", "255", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 0 and "257 positions" in r.stderr and "max_position_embeddings 256" in r.stderr, r.stderr
    r = cli(["generate", tmp_path / "nonexist", "--ids", "1"], cwd=tmp_path)  # the path first, on any machine
    assert r.returncode == 2 and "no such file or directory" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")  # a symlink loop: its own reason, not "no such"
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    r = cli(["generate", tmp_path / "loop-a", "--ids", "1"], cwd=tmp_path)
    assert r.returncode == 2 and "cannot read: Too many levels of symbolic links" in r.stderr \
        and r.stderr.count("\n") == 1, r.stderr
    (tmp_path / "empty").mkdir()
    r = cli(["generate", tmp_path / "empty", "--ids", "1"], cwd=tmp_path)
    assert r.returncode == 2 and "no config.json" in r.stderr and r.stderr.count("\n") == 1
    r = cli(["generate", d, "--ids", "1", "--device", "tpu"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --device") and "Traceback" not in r.stderr
    # a torch device the model does not run on; fewer sequences than prompts (no prompt dropped without a word)
    r = cli(["generate", d, "--ids", "1", "--device", "meta", "--cache-len", "16"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "error: --device meta: the model runs on cuda, cuda:N or cpu (or auto)\n", r.stderr
    r = cli(["generate", d, "--ids", "1,2", "--ids", "3", "--ids", "4", "--batch", "2", "--device", "cpu"],
            cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --batch 2: fewer sequences than the 3 prompts") \
        and r.stderr.count("\n") == 1, r.stderr
    r = cli(["generate", d, "--ids", "1", "--device", "cpu", "--variant", "x_decode_b1_s64_bf16"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --variant")
    # fp32 on the CPU (an fp32 checkpoint as transformers runs it)
    r = cli(["generate", d, "--ids", "1,2,3", "--max-new-tokens", "3", "--device", "cpu", "--dtype", "fp32"],
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # --stop: its first generated token as a stop token ends the sequence there; `none` runs to --max-new-tokens
    gen = ["generate", d, "--ids", "1,2,3", "--max-new-tokens", "6", "--device", "cpu"]
    r = cli(gen + ["--stop", "none"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    toks = r.stdout.split()  # one sequence: its token ids streamed on one line
    assert len(toks) == 6, r.stdout
    r = cli(gen + ["--stop", toks[0]], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == toks[:1], r.stdout
    # bad values a user types: each one line, no traceback
    base = ["generate", d, "--device", "cpu", "--max-new-tokens", "2"]
    for extra, want in ((["--ids", "1,,2"], "--ids: comma-separated integers (no empty item)"),
                        (["--ids", "1", "--stop", "5000"], "error: --stop: integer token ids in [0,"),
                        (["--ids", "1", "--ids", "2,99999"],
                         "error: --ids (sequence 1, counting from 0): token ids must be integers"),
                        (["--ids", "1", "--temperature", "nan"], "error: --temperature: a finite number"),
                        (["--ids", "1", "--cache-len", "2", "--max-new-tokens", "5"], "error: --max-new-tokens: "),
                        (["--ids", "1", "--temperature", "inf"], "--temperature"),
                        (["--ids", "1", "--seed", str(2 ** 70)], "--seed")):
        r = cli(base + extra, cwd=tmp_path)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
        assert r.stderr.count("\n") == 1, (extra, r.stderr)  # one line


def test_has_tokenizer_files_names_a_directory_without_one(tmp_path):
    """--prompt on a model directory with no tokenizer file is refused in our words before transformers is asked (a
    trial found its error embedded cut mid-sentence); any file a tokenizer may be read from counts."""
    from generator.cli import has_tokenizer_files
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "generation_config.json").write_text("{}")
    assert not has_tokenizer_files(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model", "qwen.tiktoken",
                 "tekken.json", "source.spm"):
        (tmp_path / name).write_text("")
        assert has_tokenizer_files(tmp_path), name
        (tmp_path / name).unlink()


def test_cli_prompt_with_a_tokenizer_config_alone_says_the_tokenizer_is_empty(cli, tmp_path):
    """A Qwen2 directory whose only tokenizer file is tokenizer_config.json: transformers 5 builds a tokenizer of one
    token that encodes text to nothing; that is said (a review found "give some text" said instead)."""
    d = tmp_path / "qwen"
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=256)).save_pretrained(d)
    (d / "tokenizer_config.json").write_text("{}")
    r = cli(["generate", d, "--prompt", "Hello there", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 2 and "encodes text to nothing; give --ids instead" in r.stderr \
        and r.stderr.count("\n") == 1, r.stderr


def _word_tokenizer(d, n: int) -> None:
    """A word-level tokenizer of `n` ids ("<unk>" and w1 .. w{n-1}) saved into model directory `d`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, n)}}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>").save_pretrained(d)


def test_cli_prompt_tokenizer_and_checkpoint_that_disagree(tiny, cli, tmp_path):
    """A tokenizer of more ids than the checkpoint's vocab_size (96): a prompt word past it is said as the
    tokenizer's id, not as ids the user gave; one of fewer (24): the generated ids it has no token for are counted
    in a note (they print as nothing; a trial found an empty line and no word why)."""
    _, d = tiny
    big, small = tmp_path / "big", tmp_path / "small"
    for dst, n in ((big, 120), (small, 24)):
        shutil.copytree(d, dst)
        _word_tokenizer(dst, n)
    r = cli(["generate", big, "--prompt", "w3 w100", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 2 and "--prompt 'w3 w100': the tokenizer gives id 100, past config.json's vocab_size " \
        "96" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = cli(["generate", small, "--prompt", "w3 w5", "--device", "cpu", "--max-new-tokens", "12", "--stop", "none"],
            cwd=tmp_path)
    from generator.serve import Model
    ids = Model.from_hf(small, device="cpu", cache_len=16, dtype="fp32").generate([[3, 5]], 12, stop_tokens=[])
    far = sum(t >= 24 for t in ids.tokens[0])
    assert far, ids.tokens  # (the tiny model's greedy ids: some past the 24 the tokenizer has)
    assert r.returncode == 0 and f"note: {far} generated token{'s' * (far > 1)} past the tokenizer's 24 ids (the " \
        "checkpoint's vocab_size is 96) printed as nothing" in r.stderr, r.stderr


def test_cli_prompt_reads_the_config_first_and_takes_config_json_itself(tiny, cli, tmp_path):
    """Session 67's trial: with --prompt, a config.json that is not JSON was said as a missing tokenizer (and --ids
    then said the real fault), and config.json given itself (as --ids takes it) found no tokenizer beside it."""
    _, d = tiny
    good = tmp_path / "good"
    shutil.copytree(d, good)
    _word_tokenizer(good, 24)
    r = cli(["generate", good / "config.json", "--prompt", "w3 w5", "--device", "cpu", "--max-new-tokens", "2"],
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (good / "config.json").write_text("{ not json")
    r = cli(["generate", good, "--prompt", "w3", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 2 and "config.json: not valid JSON" in r.stderr and "tokenizer" not in r.stderr \
        and r.stderr.count("\n") == 1, r.stderr


def test_cli_prompt_the_tokenizer_cannot_encode(tiny, cli, tmp_path):
    """Session 67's trial: a word-level tokenizer whose unk token is not in its vocabulary fails on an unknown word
    (tokenizers raises): one line naming the prompt and the model directory, not a traceback."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    _, d = tiny
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    t = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1, 24)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=t).save_pretrained(bad)
    r = cli(["generate", bad, "--prompt", "w3 hello", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 2 and "--prompt 'w3 hello': the tokenizer of" in r.stderr and "could not encode it" in \
        r.stderr and "give --ids" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_cli_generate_faults_of_a_new_users_trial(tiny, cli, tmp_path):
    """Session 45's trial: a model directory without tokenizer files (transformers 5 builds a tokenizer of one token
    for Qwen2's, which encodes text to nothing) said the prompt encodes to no tokens; a float64 config was refused though transformers loads it; a
    build into a model directory wrote a build there; `clean /` advised to cd out of the root."""
    _, d = tiny
    r = cli(["generate", d, "--prompt", "Hello there", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 2 and "--prompt needs a tokenizer in the model directory" in r.stderr \
        and "give --ids" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    d64 = tmp_path / "f64"
    shutil.copytree(d, d64)
    cfg = json.loads((d64 / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float64"
    (d64 / "config.json").write_text(json.dumps(cfg))
    r = cli(["generate", d64, "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu", "--dtype", "bf16"],
            cwd=tmp_path)
    assert r.returncode == 0 and "note: config.json's dtype float64 ran as bfloat16" not in r.stderr, r.stderr
    r = cli(["generate", d64, "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr  # (float32 on the CPU, the nearest to float64)
    before = sorted(p.name for p in Path(d).iterdir())
    root = Path(__file__).resolve().parent.parent
    r = cli(["build", "--variants", root / "variants.yaml", "--build-dir", d, "--only",
             "qwen2.5-0.5b_decode_b1_s1024*"], cwd=tmp_path)
    assert r.returncode == 2 and "not a megakernel build directory (no manifest.json, and it holds config.json" \
        in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert sorted(p.name for p in Path(d).iterdir()) == before  # nothing written into the model's directory
    (tmp_path / "mine" / "objects").mkdir(parents=True)  # an objects/ of someone else's files: no build's either
    (tmp_path / "mine" / "objects" / "thesis.tex").write_text("x")
    r = cli(["build", "--variants", root / "variants.yaml", "--build-dir", tmp_path / "mine", "--only",
             "qwen2.5-0.5b_decode_b1_s1024*"], cwd=tmp_path)
    assert r.returncode == 2 and "it holds objects/thesis.tex" in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["objects"]
    r = cli(["clean", "--build-dir", "/"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "error: /: the file system's root; not removing it\n", r.stderr


def test_model_generate_checks_its_values_and_takes_numpy_ids(tiny):
    import numpy as np
    _, d = tiny
    model = cpu_model(d)
    a = model.generate([[1, 2, 3]], 3).tokens
    assert model.generate([list(np.array([1, 2, 3]))], 3).tokens == a
    for kw, want in (({"seed": 2 ** 70, "temperature": 1.0}, "seed: an integer in [0, 2**62)"),
                     ({"temperature": float("inf")}, "temperature: a finite number"),
                     ({"stop_tokens": [10 ** 6]}, "stop_tokens: integer token ids in [0,"),
                     # nested (a 2-d list or tensor): the same line, not an unhashable-type TypeError
                     ({"stop_tokens": [[5]]}, "stop_tokens: one flat list of integer token ids in [0, "),
                     ({"stop_tokens": torch.tensor([[5]])}, "], got [[5]]"),
                     ({"stop_tokens": "82"}, "], got '82'")):  # (not its characters as ids)
        with pytest.raises(serve.ServeError, match=re.escape(want)):
            model.generate([[1, 2, 3]], 3, **kw)
    # numpy's integers wherever an integer is asked (a new user's trial: max_new_tokens refused them)
    assert model.generate([[1, 2, 3]], np.int64(3)).tokens == a
    # one sequence as a 1-d tensor, as it takes a flat list (a new user's trial: refused)
    assert model.generate(torch.tensor([1, 2, 3]), 3).tokens == a
    with pytest.raises(serve.ServeError, match="a 2-d integer tensor"):
        model.generate(torch.ones(1, 1, 3, dtype=torch.long), 3)
    # numpy arrays as tensors (session 67's trial: a 3-d one was said as ids, a float one as a value), a meta tensor
    # and output_logits not a bool: one ServeError each
    assert model.generate(np.array([[1, 2, 3]]), 3).tokens == a
    for bad, want in ((np.zeros((1, 2, 3), dtype=np.int64), "got torch.int64 (1, 2, 3)"),
                      (np.ones((1, 2)), "got torch.float64 (1, 2)"),
                      (torch.tensor([[3]], device="meta"), "the meta device holds no ids")):
        with pytest.raises(serve.ServeError, match=re.escape(want)):
            model.generate(bad, 3)
    with pytest.raises(serve.ServeError, match="output_logits: True or False, got 'no'"):
        model.generate([[1, 2, 3]], 3, output_logits="no")
    with pytest.raises(serve.ServeError, match="max_new_tokens: a positive integer, got True"):
        model.generate([[1, 2, 3]], True)
    _, d = tiny
    m2 = serve.Model.from_hf(d, device="cpu", cache_len=np.int64(model.cache_len), max_batch=np.int32(2))
    assert (m2.cache_len, m2.max_batch) == (model.cache_len, 2) and type(m2.cache_len) is int


# ------------------------------------------------------------------------------------------------------------
# GPU: the fused variants of a built tiny model
# ------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny llama checkpoint and its decode variants b1 and b4 (seq_len 64), built by the CLI."""
    from conftest import run_cli
    root = tmp_path_factory.mktemp("serve_gpu")
    d = root / "tiny-llama"
    hfm = make_llama(d, seed=3)
    vfile = root / "variants.yaml"
    vfile.write_text("matrix: {mode: [decode], batch: [1, 4], seq_len: [64]}\nmodels:\n")
    r = run_cli(["from-hf", d, "--write", vfile], cwd=root)
    assert r.returncode == 0, r.stderr
    r = run_cli(["build", "--variants", vfile, "--build-dir", root / "build", "--only", "*decode*"], cwd=root,
                timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    return hfm, d, root / "build"


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]


@gpu
@needs_cuda
def test_gpu_padded_batch_equals_unpadded(built):
    _, d, build = built
    model = serve.Model.from_hf(d, build_dir=build)
    assert sorted(model.decode_variants) == [1, 4]
    got = model.generate(PROMPTS, 16, output_logits=True)  # batch 3 on the b4 variant: one padding sequence
    assert got.decode_choice.batch == 4 and got.decode_choice.path == "fused"
    for b, p in enumerate(PROMPTS):
        one = model.generate([p], 16, output_logits=True)
        assert one.decode_choice.batch == 1
        # the two plans round differently: equal tokens up to a near-tie (prompt [10, 11, 12, 13] meets a top-two gap
        # of 0.0017 rms within its 16 tokens), equal logits up to it
        a = greedy_agreement(got.tokens[b], one.tokens[0], torch.stack([lg[b] for lg in got.logits]),
                             torch.stack([lg[0] for lg in one.logits]))
        assert a["logits_rel"] <= 3e-2 and a.get("tie_gap", 0.0) <= NEAR_TIE_RMS, (b, a)
    st = {r["variant"]: r for r in model.stats() if r["mode"] == "decode"}
    assert st[model.decode_variants[4]]["padded_tokens"] == 15


@gpu
@needs_cuda
def test_gpu_cache_len_no_variant_holds_runs_decode_unfused_warned(built):
    """Auto-chosen variants and a cache_len none of their seq_lens is: a warning naming the way back (their seq_len),
    and decode served unfused (a trial found a hard error here), its logits transformers' fp32 ones."""
    hfm, d, build = built
    with pytest.warns(UserWarning, match=r"cache_len 100: no built decode variant holds 100 rows.*cache_len=64"):
        model = serve.Model.from_hf(d, build_dir=build, cache_len=100)
    # (the caches hold the build's largest decode batch all the same: a trial on the GPU found max_batch 1 here)
    assert model.decode_variants == {} and model.cache_len == 100 and model.max_batch == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the missing variant's warning)
        got = model.generate(PROMPTS, 8, output_logits=True)
    assert got.decode_choice.path == "unfused"
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hfm(input_ids=torch.tensor([p + got.tokens[b][:-1]])).logits[0, len(p) - 1:]
        assert rel(torch.stack([lg[b] for lg in got.logits]).cpu(), ref) <= 3e-2


@gpu
@needs_cuda
def test_gpu_unfused_decode_graphs_a_kv_bucket(built, monkeypatch):
    """The unfused decode step in CUDA graphs, one a kv_bucket (8, 16, 32 rows here) as the positions grow: the
    replays equal direct steps, and the logits transformers' fp32 ones."""
    hfm, d, build = built
    monkeypatch.setattr(serve, "KV_BUCKET_MIN", 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (cache_len 100: no variant holds it)
        model = serve.Model.from_hf(d, build_dir=build, cache_len=100)
        a = model.generate(PROMPTS, 20, output_logits=True)  # the longest prompt 7: positions 7 .. 25
        assert a.decode_choice.path == "unfused"
        assert sorted(k[-1] for k in model._graphs if k[0] == "unfused") == [8, 16, 32]
        model.use_graphs = False
        b = model.generate(PROMPTS, 20, output_logits=True)
    assert a.tokens == b.tokens
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hfm(input_ids=torch.tensor([p + a.tokens[i][:-1]])).logits[0, len(p) - 1:]
        assert rel(torch.stack([lg[i] for lg in a.logits]).cpu(), ref) <= 3e-2


@gpu
@needs_cuda
def test_gpu_a_stream_taken_to_its_stop_token_frees_the_model(built):
    """A consumer that takes a stream's tokens up to its stop token and no more (the GPU path overlaps a step) leaves
    the model free: a generation on another thread runs, with the tokens a fresh one gives."""
    import threading
    _, d, build = built
    model = serve.Model.from_hf(d, build_dir=build)
    greedy = model.generate([PROMPTS[0]], 12).tokens[0]
    stop = greedy[4]
    want = greedy[:greedy.index(stop) + 1]
    it = model.stream([PROMPTS[0]], 12, stop_tokens=[stop])
    assert [next(it) for _ in want] == [(0, t) for t in want]
    got = []
    th = threading.Thread(target=lambda: got.append(model.generate([PROMPTS[1]], 6).tokens[0]))
    th.start()
    th.join(60)
    assert got == [serve.Model.from_hf(d, build_dir=build).generate([PROMPTS[1]], 6).tokens[0]]
    assert list(it) == []  # (nothing after the stop)


@gpu
@needs_cuda
def test_gpu_graph_replay_equals_direct_steps(built):
    _, d, build = built
    model = serve.Model.from_hf(d, build_dir=build)
    for kw in ({}, {"temperature": 0.8, "top_k": 10, "seed": 1}):
        model.use_graphs = True
        a = model.generate(PROMPTS, 20, output_logits=True, **kw)
        model.use_graphs = False
        b = model.generate(PROMPTS, 20, output_logits=True, **kw)
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert model.memory()["graphs"] > 0


@gpu
@needs_cuda
def test_gpu_fused_head_serves_and_agrees_with_torchs(built):
    """The head kernel (generator.lm_head) serves batch 1..8; its logits are torch's head's within one rounding
    to bf16 (both round; fp32 sums in other orders); switching it off drops the captured steps."""
    _, d, build = built
    model = serve.Model.from_hf(d, build_dir=build)
    assert model.head_path(1) == "fused" and model.head_path(3) == "fused"
    assert model.head_path(9).startswith("torch (batch 9")
    a = model.generate(PROMPTS, 6, output_logits=True)
    assert model._graphs
    model.fused_head = False
    assert model.head_path(1) == "torch (fused_head off)" and not model._graphs
    b = model.generate(PROMPTS, 6, output_logits=True)
    x, y = a.logits[0], b.logits[0]  # the prompts' last positions: the same hidden states into both heads
    assert ((x - y).abs() <= y.abs() * 2 ** -7 + 1e-6).all()
    # switched back on, new prompt lengths capture new prefill graphs (their memory pool went with the old graphs:
    # capturing into it again failed in torch's allocator) and the same prompts give the same tokens
    model.fused_head = True
    for n in (3, 9, 17):
        model.generate([list(range(1, n + 1))], 4)
    assert model.generate(PROMPTS, 6).tokens == a.tokens


@gpu
@needs_cuda
def test_gpu_sampled_runs_reproducible_with_a_seed(built):
    _, d, build = built
    model = serve.Model.from_hf(d, build_dir=build)
    kw = dict(temperature=1.0, top_p=0.9, seed=123)
    a, b = model.generate(PROMPTS, 24, **kw), model.generate(PROMPTS, 24, **kw)
    assert a.tokens == b.tokens and a.tokens != model.generate(PROMPTS, 24, **{**kw, "seed": 124}).tokens


@gpu
@needs_cuda
@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_k=10, top_p=0.9), dict(temperature=1.2),
                                dict(temperature=0.7, top_k=3), dict(temperature=0.9, top_p=0.8)])
def test_gpu_fused_draw_is_sample_tokens(built, kw):
    """A sampled generation's decode steps draw with the fused sampler (generator.sampler, top-p alone included);
    every token is what serve.sample_tokens draws from that step's logits (seed + 7919 b, the position it takes)."""
    _, d, build = built
    model = serve.Model.from_hf(d, build_dir=build)
    assert model.draw_path(**{"top_k": 0, "top_p": 1.0, **kw}) == "fused"
    assert model.draw_path(0.7, 0, 0.9) == "fused"  # (top-p without top-k: the kernel's own ranking)
    assert model.draw_path(0.7, 10 ** 9, 1.0) == "fused"  # (a top-k of the whole vocabulary is off)
    out = model.generate(PROMPTS, 12, seed=5, output_logits=True, stop_tokens=[], **kw)
    k, p = kw.get("top_k", 0), kw.get("top_p", 1.0)
    assert model._sampler is not None and model.draw_path(kw["temperature"], k, p) == "fused"  # (built, not warned)
    B = len(PROMPTS)
    differ = 0
    for i, lg in enumerate(out.logits):
        lg = lg[:B].float()
        want = serve.sample_tokens(lg, torch.full((B,), kw["temperature"], device=lg.device),
                                   torch.full((B,), k, device=lg.device), torch.full((B,), p, device=lg.device),
                                   torch.tensor([5 + 7919 * b for b in range(B)], device=lg.device),
                                   torch.tensor([len(q) + i for q in PROMPTS], device=lg.device))
        differ += sum(int(want[b]) != out.tokens[b][i] for b in range(B))
    assert differ <= 1, f"{differ} of {B * len(out.logits)} tokens differ from sample_tokens' draw"


@gpu
@needs_cuda
def test_gpu_fallback_numerics_equal_the_reference(built):
    hfm, d, build = built
    test_unfused_decode_and_prefill_equal_the_reference(torch.bfloat16, 1e-2, device="cuda")
    # the unfused fallback (batch 5: no variant) and the fused path agree with transformers fp32 on the logits
    fused = serve.Model.from_hf(d, build_dir=build, max_batch=5)
    with pytest.warns(serve.MissingVariantWarning, match="batch: \\[5\\]"):
        fb = fused.generate(PROMPTS + [[1], [2, 3]], 8, output_logits=True)
    assert fb.decode_choice.path == "unfused"
    fz = fused.generate(PROMPTS, 8, output_logits=True)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hfm(input_ids=torch.tensor([p + fz.tokens[b][:-1]])).logits[0, len(p) - 1:]
        assert rel(torch.stack([lg[b] for lg in fz.logits]).cpu(), ref) <= 3e-2
    assert any(r["path"] == "unfused" for r in fused.stats()) and any(r["path"] == "fused" for r in fused.stats())


def test_every_built_variant_offered_keeps_one_seq_len(tmp_path):
    """A default build declares several KV lengths; from_hf with no `variants` keeps the decode variants of
    cache_len (else of the longest) and, on a GPU, names the others in one warning (serve.keep_one_seq_len); naming
    both is still a ServeError. A prefill chunk longer than the chosen cache is left out with a warning
    (serve.drop_long_prefill; named: a ServeError), not loaded. On the CPU no built variant is offered (they run on
    CUDA): the model serves unfused, as `generate --device cpu` does."""
    from conftest import run_cli
    from generator import manifest
    d = tmp_path / "tiny-llama"
    make_llama(d, seed=4)
    vfile = tmp_path / "variants.yaml"
    vfile.write_text("matrix: [{mode: [decode], batch: [1], seq_len: [32, 64]}, {mode: [prefill], batch: [1], "
                     "seq_len: [48]}]\nmodels:\n")
    assert run_cli(["from-hf", d, "--write", vfile], cwd=tmp_path).returncode == 0
    r = run_cli(["build", "--variants", vfile, "--build-dir", tmp_path / "build"], cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    entries = manifest.read_manifest(tmp_path / "build")["variants"]
    names = sorted(entries)
    assert len(names) == 3
    pf = next(n for n in names if "_prefill_" in n)
    vs = [manifest.variant_from_entry(entries[n]) for n in names]
    for cache_len, keep, other in ((None, 64, 32), (32, 32, 64), (64, 64, 32)):
        kept, dropped, k = serve.keep_one_seq_len(vs, cache_len)
        assert k == keep and [v.name for v in kept if v.mode == "decode"] == [n for n in names if f"_s{keep}_" in n]
        assert dropped == [n for n in names if f"_s{other}_" in n] and pf in [v.name for v in kept]
        left, long = serve.drop_long_prefill(kept, keep)
        assert long == ([pf] if keep == 32 else []) and (pf in [v.name for v in left]) == (keep != 32)
    assert serve.keep_one_seq_len(vs[:1] + vs[2:], None)[1] == []  # one seq_len: nothing left out
    # a cache_len none of them holds: no decode variant kept (decode runs unfused, warned), the prefill one kept
    for some in (vs, vs[:1] + vs[2:]):
        kept, dropped, k = serve.keep_one_seq_len(some, 100)
        assert k is None and [v.name for v in kept] == [pf] and pf not in dropped and len(dropped) == len(some) - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing offered on the CPU: no choice to warn about
        # (dtype given: the fp32 checkpoint's HFPrecisionWarning is not what this checks)
        m = serve.Model.from_hf(d, build_dir=tmp_path / "build", device="cpu", cache_len=64, dtype="bf16")
    assert m.fused == {} and m.unfused is not None
    with pytest.raises(serve.ServeError, match="mix seq_len"):
        serve.common_seq_len(vs)
    # named variants on the CPU: the device is what is wrong, said first (a new user's trial, session 45: a cache
    # length mismatch was named instead)
    for kw in ({"variants": names}, {"cache_len": 32, "variants": [n for n in names if "_s32_" in n or n == pf]},
               {"cache_len": 16, "variants": [n for n in names if "_s64_" in n]}):
        with pytest.raises(serve.ServeError, match="^device: fused variants run on CUDA, got cpu"):
            serve.Model.from_hf(d, build_dir=tmp_path / "build", device="cpu", **kw)


def test_generate_errors_name_the_options_the_user_gave():
    """cli._as_options: a ServeError's leading argument name becomes the generate option, only where the user gave
    that option (stop tokens the command took from the config keep their name), prompts become --ids / --prompt,
    torch dtypes the --dtype names (but not a quoted value from config.json), anything else passes through unchanged."""
    from generator.cli import _as_options
    assert _as_options("stop_tokens: integer token ids in [0, 9], got 12", "--ids", {"--stop"}) == \
        "--stop: integer token ids in [0, 9], got 12"
    assert _as_options("stop_tokens: integer token ids in [0, 9], got 12", "--ids", set()).startswith("stop_tokens: ")
    assert _as_options("prompts: 3 sequences, but ...", "--prompt", set()) == "--prompt: 3 sequences, but ..."
    assert _as_options("prompts[2]: a non-empty list", "--ids", set()) == \
        "--ids (sequence 2, counting from 0): a non-empty list"
    assert _as_options("dtype: torch.float16 but the variants are torch.bfloat16", "--ids", {"--dtype"}) == \
        "--dtype: fp16 but the variants are bf16"
    assert _as_options("variants: mix dtypes bf16, fp16", "--ids", set()) == "variants: mix dtypes bf16, fp16"
    refused = "m/config.json: field 'dtype' is 'torch.float16': supported are float32"  # (config.json's own words)
    assert _as_options(refused, "--ids", {"--dtype"}) == refused
    assert _as_options("a message: without a known name", "--ids", {"--stop"}) == "a message: without a known name"
    with pytest.raises(serve.ServeError) as exc:  # the memory check's own words, in the command's options
        serve.check_fits({"weights_fused": 1 << 30, "kv_caches": 8 << 30, "total": 9 << 30}, 1 << 30, 80 << 30, "model")
    assert _as_options(str(exc.value), "--ids", set()).endswith(
        ": fewer sequences or a lower --cache-len / --max-new-tokens (on a GPU also fewer --variant)"), str(exc.value)
    with pytest.raises(serve.ServeError) as exc:  # (no fused weights: no variants to load fewer of)
        serve.check_fits({"kv_caches": 9 << 30, "total": 9 << 30}, 1 << 30, 80 << 30, "model")
    assert str(exc.value).endswith("free: lower max_batch or cache_len (or max_new_tokens)"), str(exc.value)
    assert _as_options(str(exc.value), "--ids", set()).endswith(
        ": fewer sequences or a lower --cache-len / --max-new-tokens"), str(exc.value)


def test_eos_token_ids_are_read_as_transformers_reads_them(tiny, tmp_path):
    """The default stop tokens, as transformers' generate reads them: where the directory holds
    generation_config.json, that file's eos_token_id alone (an instruct model's end-of-turn ids often live only there;
    a file that sets none means none), else config.json's; a value that is not integer token ids is one ServeError
    naming its file, before any weight is read."""
    import json
    import shutil
    _, d = tiny
    c = tmp_path / "ck"
    shutil.copytree(d, c)
    (c / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((c / "config.json").read_text())
    assert serve.eos_token_ids(c, {**cfg, "eos_token_id": [5, 6]}) == [5, 6]
    assert serve.eos_token_ids(c, {**cfg, "eos_token_id": None}) == []
    (c / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert serve.eos_token_ids(c, cfg) == [7, 9]
    assert cpu_model(c).eos == (7, 9)
    for gen in ({"eos_token_id": None}, {"bos_token_id": 1}):  # the file sets none: none (not config.json's)
        (c / "generation_config.json").write_text(json.dumps(gen))
        assert serve.eos_token_ids(c, {**cfg, "eos_token_id": 5}) == []
    for bad in ("2", 2.0, [1, "x"], True):
        (c / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(serve.ServeError, match=re.escape(f"{c / 'generation_config.json'}: eos_token_id: ")):
            cpu_model(c)
    (c / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(serve.ServeError, match="top level must be a JSON object"):
        serve.eos_token_ids(c, cfg)
    (c / "generation_config.json").unlink()
    with pytest.raises(serve.ServeError, match=re.escape(f"{c / 'config.json'}: eos_token_id: ")):
        serve.eos_token_ids(c, {**cfg, "eos_token_id": "2"})
    # an id past the vocabulary (kept, as transformers keeps it: it can never be generated) is said in a warning,
    # once, where the checkpoint's stop tokens are used (not with stop tokens of the caller's)
    import warnings
    (c / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 100000, -1]}))
    model = cpu_model(c)
    assert model.eos == (7, 100000, -1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate([[1, 2]], 2, stop_tokens=[])
        model.generate([[1, 2]], 2)
        model.generate([[1, 2]], 2)
    far = [w for w in caught if "outside the vocabulary" in str(w.message)]
    assert len(far) == 1 and re.search(r"eos_token_id 100000, -1: outside the vocabulary \(\d+ tokens\)",
                                       str(far[0].message))


def test_a_streamed_sequence_prints_all_its_text_whatever_the_tokenizers_clean_up():
    """generate's one-sequence stream (cli.TextStream): what the clean-up of spaces would rewrite in text already
    printed (Llama-3's tokenizers: " ' " to "'") must not stop the rest printing (it did: the text cut off, exit 0);
    a character split over tokens is held back until whole; without a tokenizer, ids and spaces."""
    from generator.cli import TextStream

    class Tok:  # a byte-level tokenizer whose clean-up joins " '" as transformers' clean_up_tokenization does
        pieces = {1: b"'", 2: b" ", 3: b"n", 4: b"\xc3", 5: b"\xa9", 9: b"</s>"}  # 9: a special token

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
            ids = [i for i in ids if not (skip_special_tokens and i == 9)]
            text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
            return text.replace(" '", "'") if clean_up_tokenization_spaces else text

    out = []
    s = TextStream(Tok(), out.append)
    for t in (1, 2, 1, 3, 3, 4, 5, 3, 9):
        s.add(t)
    s.flush()
    assert "".join(out) == "' 'nn\u00e9n" and all("\ufffd" not in x for x in out), out  # (no "</s>")
    ids = []
    s = TextStream(None, ids.append)
    for t in (7, 8):
        s.add(t)
    s.flush()
    assert "".join(ids) == "7 8"  # (no trailing space)


def test_an_fp32_checkpoint_runs_as_transformers_loads_it_on_the_cpu(tiny, tmp_path):
    """On the CPU (no fused kernel runs there) Model.from_hf without a dtype runs a float32 checkpoint in float32,
    as transformers loads it (a new user's trial: bf16 there made the default CPU run differ from transformers'),
    with no HFPrecisionWarning; bf16 asked for, no warning either. A config that names no dtype: the weights'
    stored one, as transformers 5 loads it (float32 here)."""
    import warnings

    from generator.hf import HFPrecisionWarning
    _, d = tiny
    bare = tmp_path / "bare"
    shutil.copytree(d, bare)
    cfg = json.loads((bare / "config.json").read_text())
    for k in ("dtype", "torch_dtype"):
        cfg.pop(k, None)
    (bare / "config.json").write_text(json.dumps(cfg))
    for path, dtype, want in ((d, None, torch.float32), (d, torch.float32, torch.float32),
                              (d, torch.bfloat16, torch.bfloat16), (bare, None, torch.float32)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", HFPrecisionWarning)
            m = serve.Model.from_hf(path, build_dir=d / "no-build", device="cpu", cache_len=16, dtype=dtype)
        assert m.dtype == want, (path, dtype, m.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_fp32_checkpoint_run_in_bf16_on_a_gpu_is_said_through_the_api_too(tiny):
    """On a GPU Model.from_hf without a dtype runs a float32 checkpoint in bf16 (the fused kernels' dtype): one
    HFDowncastWarning (an HFPrecisionWarning, so the CLI can drop it by class for its own note) says so, as the CLI's
    note does; asked for, no warning."""
    import warnings

    from generator.hf import HFDowncastWarning, HFPrecisionWarning
    _, d = tiny
    with pytest.warns(HFPrecisionWarning, match="field '(torch_)?dtype' is float32 but the model runs in bfloat16") \
            as rec:
        m = serve.Model.from_hf(d, build_dir=d / "no-build", variants=[], device="cuda", cache_len=16)
    assert [w.category for w in rec if issubclass(w.category, HFPrecisionWarning)] == [HFDowncastWarning]
    assert m.dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPrecisionWarning)
        serve.Model.from_hf(d, build_dir=d / "no-build", variants=[], device="cuda", cache_len=16,
                            dtype=torch.float32)
