"""Config and checkpoint faults read as transformers 5 reads them (CPU, offline; every config and checkpoint is built
here): sliding windows against seq_len, rope_scaling vs rope_parameters, tied lm_head, model.safetensors vs an index,
fp16 variants of bf16 models."""
from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import pytest
import torch

from generator import hf, loader, reference, variants as gvariants
from generator.verify import rel_err as rel
from test_hf import (LLAMA_3_1_8B, MISTRAL_7B_V0_3, QWEN2_5_7B, TINY, ReferenceLayer, make_tiny, run_cli,
                     write_config)
from hf_util import randomize, rope_kwargs

transformers = pytest.importorskip("transformers")

MATRIX = "matrix: {{mode: [decode], batch: [1], seq_len: {seq}}}\nmodels:\n"


def hf_config(d):
    return transformers.AutoConfig.from_pretrained(d)


def one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def fake_build(monkeypatch, v):
    """load_hf / FusedModel see `v` as built, and get ReferenceLayers (fp32, CPU) instead of cubins."""
    monkeypatch.setattr(hf.model, "_built_variant", lambda name, build_dir: v)
    monkeypatch.setattr(loader, "load", lambda name, weights, build_dir, device: ReferenceLayer(v, weights, device))


# ---------------------------------------------------------------------------------------------------------------
# 1a/1b sliding windows: read as transformers does, then checked against seq_len
# ---------------------------------------------------------------------------------------------------------------

def test_mistral_without_sliding_window_key_has_transformers_default_window(tmp_path):
    cfg = {k: v for k, v in MISTRAL_7B_V0_3.items() if k != "sliding_window"}
    d = write_config(tmp_path, "mistral-v0.1-like", cfg)
    assert hf_config(d).sliding_window == 4096  # MistralConfig's default, applied by transformers
    # computed on every layer (the entry's field): any seq_len is exact
    text = hf.variant_entry_yaml(d)
    assert "    sliding_window: 4096\n" in text and "# sliding_window" not in text
    ok = tmp_path / "ok.yaml"
    ok.write_text(MATRIX.format(seq=[1024, 4096, 32768]))
    hf.append_entry(ok, text)
    assert [(v.seq_len, v.model.sliding_window) for v in gvariants.load(ok)] == [(1024, 4096), (4096, 4096),
                                                                                   (32768, 4096)]
    m = hf.map_config(d)
    assert m.window.size == 4096 and m.window.layers == tuple(range(32)) and "absent" in m.window.source
    assert m.window.every_layer
    # an explicit null is full attention (Mistral-7B-v0.3)
    assert hf.map_config(write_config(tmp_path, "v03", MISTRAL_7B_V0_3)).window is None


def test_llama_window_is_checked_against_seq_len(tmp_path):
    """llama's sliding_window: transformers' LlamaModel ignores it in the forward and generate()'s cache applies it,
    so it is not computed: a seq_len past it is refused."""
    d = write_config(tmp_path, "llama-window", {**MISTRAL_7B_V0_3, "model_type": "llama",
                                                "architectures": ["LlamaForCausalLM"], "sliding_window": 4096})
    text = hf.variant_entry_yaml(d)
    assert "# sliding_window 4096 (" in text and "seq_len <= 4096 is exact" in text
    # a window >= every seq_len never takes effect: appended
    ok = tmp_path / "ok.yaml"
    ok.write_text(MATRIX.format(seq=[1024, 4096]))
    hf.append_entry(ok, text)
    assert [v.seq_len for v in gvariants.load(ok)] == [1024, 4096]
    # seq_len 32768 > 4096: refused in one line naming both files and both fields; file untouched
    bad = tmp_path / "bad.yaml"
    bad.write_text(MATRIX.format(seq=[1024, 4096, 32768]))
    before = bad.read_text()
    with pytest.raises(hf.HFConfigError) as exc:
        hf.append_entry(bad, text)
    msg = one_line(exc)
    assert all(s in msg for s in (str(bad), "seq_len 32768", "sliding_window 4096", str(d / "config.json"),
                                  "_s32768_"))
    assert bad.read_text() == before
    r = run_cli("from-hf", d, "--write", bad)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "sliding_window 4096" in r.stderr
    assert "llama's window, which transformers' forward ignores" in r.stderr and "some layers" not in r.stderr
    assert "llama's window, which transformers' forward ignores" in msg
    assert not hf.map_config(d).window.every_layer
    # a window no cache can exceed never takes effect: none (transformers runs it as given)
    huge = write_config(tmp_path, "mistral-huge", {**MISTRAL_7B_V0_3, "sliding_window": 10**12})
    assert hf.map_config(huge).window is None and "sliding_window" not in hf.model_entry(huge)[1]


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_attention_chunk_size_is_the_window_generates_cache_keeps(tmp_path, model_type):
    """attention_chunk_size (no sliding_window, no layer_types): transformers' cache makes every layer
    chunked_attention and keeps only that many keys (cache_utils.get_layer_types_and_kwargs) while the forward's mask
    ignores it, so it is a window that is not computed: seq_len past it refused, as llama's sliding_window."""
    base = {**MISTRAL_7B_V0_3, "model_type": model_type, "sliding_window": None, "attention_chunk_size": 8}
    d = write_config(tmp_path, f"{model_type}-chunk8", base)
    types, kwargs = transformers.cache_utils.get_layer_types_and_kwargs(hf_config(d))
    assert set(types) == {"chunked_attention"} and kwargs[0]["sliding_window"] == 8
    m = hf.map_config(d)
    assert m.window.size == 8 and m.window.why == "chunk" and not m.window.every_layer
    assert "sliding_window" not in m.fields
    text = hf.variant_entry_yaml(d)
    assert "attention_chunk_size" in text and "seq_len <= 8 is exact" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(MATRIX.format(seq=[8, 16]))
    before = bad.read_text()
    with pytest.raises(hf.HFConfigError) as exc:
        hf.append_entry(bad, text)
    assert "chunked attention" in one_line(exc) and "seq_len 16 is longer than attention_chunk_size 8" in one_line(exc)
    assert bad.read_text() == before
    # layer_types given: the cache follows it (full attention), as does a sliding_window's branch for llama
    lt = write_config(tmp_path, f"{model_type}-chunk8-lt", {**base, "layer_types": ["full_attention"] * 32})
    assert set(transformers.cache_utils.get_layer_types_and_kwargs(hf_config(lt))[0]) == {"full_attention"}
    assert hf.map_config(lt).window is None
    with pytest.raises(hf.HFConfigError, match="attention_chunk_size' must be a positive integer"):
        hf.map_config(write_config(tmp_path, f"{model_type}-chunk0", {**base, "attention_chunk_size": 0}))


def test_llama_sliding_window_with_layer_types_is_no_window(tmp_path):
    """llama with layer_types (full_attention): generate()'s cache follows layer_types, the forward ignores the
    window: full attention (it was refused past the window before)."""
    d = write_config(tmp_path, "llama-sw-lt", {**MISTRAL_7B_V0_3, "model_type": "llama", "sliding_window": 8,
                                               "layer_types": ["full_attention"] * 32})
    assert set(transformers.cache_utils.get_layer_types_and_kwargs(hf_config(d))[0]) == {"full_attention"}
    assert hf.map_config(d).window is None


@pytest.mark.parametrize("over,model_type,field", [
    ({"rope_theta": None}, "llama", "'rope_theta' is null"),
    ({"rope_scaling": {"rope_type": None, "factor": 2.0}}, "llama", "'rope_scaling.rope_type' is null"),
    ({"rms_norm_eps": None}, "mistral", "'rms_norm_eps' is null"),
    ({"head_dim": None}, "qwen2", "'head_dim' is null"),
    ({"hidden_size": 96 * 32 + 16, "head_dim": 128}, "llama", "not a multiple of num_attention_heads"),
    ({"per_layer_config": {"1": {"rms_norm_eps": 0.01}}}, "llama", "'per_layer_config' is set"),
])
def test_configs_transformers_refuses_are_refused_in_one_line(tmp_path, over, model_type, field):
    """A null where transformers needs a value (or a shape its config class refuses): one line, not a guess."""
    d = write_config(tmp_path, "bad", {**MISTRAL_7B_V0_3, "model_type": model_type, **over})
    with pytest.raises(Exception):  # transformers itself refuses it, or fails building the model
        cfg = hf_config(d)
        cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM}[model_type]
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 1, 64, 64, 16
        cls(cfg)
    with pytest.raises(hf.HFConfigError) as exc:
        hf.map_config(d)
    assert field in one_line(exc)


def test_config_json_nested_too_deep_is_one_line(tmp_path):
    d = tmp_path / "deep"
    d.mkdir()
    (d / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(hf.HFConfigError, match="nested too deeply"):
        hf.map_config(d)


def test_a_path_with_a_newline_stays_in_its_comment(tmp_path):
    d = write_config(tmp_path, "odd\n  injected: 1", {**MISTRAL_7B_V0_3, "sliding_window": 4096})
    text = hf.variant_entry_yaml(d)
    assert "\n  injected: 1" not in text and all(line.startswith("  ") for line in text.splitlines())
    assert not any(line.strip().startswith("injected") for line in text.splitlines())


@pytest.mark.parametrize("over,window_layers", [
    ({"use_sliding_window": True}, None),                            # max_window_layers 28 = every layer: none slide
    ({"use_sliding_window": True, "max_window_layers": 20}, range(20, 28)),
    ({"use_sliding_window": True, "max_window_layers": 20, "sliding_window": None}, None),
    ({"use_sliding_window": False, "max_window_layers": 0, "sliding_window": 512}, None),
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 27 + ["sliding_attention"],
      "sliding_window": 4096}, [27]),
])
def test_qwen2_window_layers_as_transformers_reads_them(tmp_path, over, window_layers):
    d = write_config(tmp_path, "q", {**QWEN2_5_7B, **over})
    t = hf_config(d)
    theirs = [i for i, lt in enumerate(t.layer_types) if lt == "sliding_attention"]
    assert hf.model_entry(d)[0] == "q"  # mapped, not refused: the window is checked against seq_len later
    w = hf.map_config(d).window
    assert (w.layers if w else []) == tuple(theirs) if theirs else w is None
    assert theirs == (list(window_layers) if window_layers is not None else [])
    if w:
        assert w.size == t.sliding_window


def test_window_shorter_than_seq_len_is_refused_per_layer(tmp_path, monkeypatch):
    """Layer 2 of a tiny qwen2 slides over 16 keys: a seq_len 32 variant computes it wrongly (transformers' output
    really differs beyond the window) and is refused; layers 0-1 and a seq_len 16 variant are exact."""
    T = transformers
    kw = {k: v for k, v in TINY.items() if k != "head_dim"}
    cfg = T.Qwen2Config(**kw, use_sliding_window=True, sliding_window=16, max_window_layers=2,
                        **rope_kwargs(T.Qwen2Config, 1e6))
    assert cfg.layer_types == ["full_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(cfg).eval()
    randomize(model, 0)
    d = tmp_path / "tiny-qwen2-window"
    model.save_pretrained(d)
    m = hf.model_from_hf(d, name="tiny")
    for seq_len, refused in ((32, True), (16, False)):
        v = gvariants.Variant(m, "decode", 2, seq_len)
        fake_build(monkeypatch, v)
        hf.load_hf(d, 1, variant=v.name, build_dir=tmp_path, device="cpu")  # a full-attention layer
        if refused:
            with pytest.raises(hf.HFConfigError) as exc:
                hf.load_hf(d, 2, variant=v.name, build_dir=tmp_path, device="cpu")
            msg = one_line(exc)
            assert "seq_len 32" in msg and "sliding_window 16" in msg and str(d / "config.json") in msg
            assert "a window on some layers only" in msg
            with pytest.raises(hf.HFConfigError, match="sliding_window 16"):
                hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
        else:
            # window == seq_len: never takes effect; our full-attention layers give transformers' logits
            monkeypatch.setitem(reference.TORCH_DTYPES, "bf16", torch.float32)
            fm = hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
            ids = torch.randint(0, fm.vocab, (2, 16), generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                ref = model(input_ids=ids).logits
            for t in range(16):
                assert rel(fm.step(ids[:, t], torch.full((2,), t, dtype=torch.int32)), ref[:, t]) <= 1e-4
    # generate without --cache-len: the cache is the prompt + new tokens, so the line says to ask for fewer
    from conftest import run_cli
    r = run_cli(["generate", d, "--ids", "1,2", "--max-new-tokens", "20", "--device", "cpu"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "seq_len 21 is longer than sliding_window 16" in r.stderr, r.stderr
    assert "--max-new-tokens - 1 rows: ask for fewer new tokens, or give a shorter prompt" in r.stderr, r.stderr
    # beyond the window transformers' layer really differs from full attention: the refusal is needed
    full = T.Qwen2ForCausalLM(T.Qwen2Config(**kw, **rope_kwargs(T.Qwen2Config, 1e6))).eval()
    full.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, full(input_ids=ids).logits
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-5) and rel(a[:, 20:], b[:, 20:]) > 1e-3


def test_a_variants_window_must_be_the_checkpoints_where_it_applies(tmp_path, monkeypatch):
    """A Mistral checkpoint with a 16-token window on every layer and one without: a built variant serves a layer only
    where it computes the same window over its cache (gvariants.window_at): an entry without the field (an older
    from-hf's) up to a cache of 16 rows, and past it refused in one line saying what to declare; one with another
    window, or a window the checkpoint lacks, refused where that window applies; through load_hf and
    FusedModel.from_hf. A windowed variant's fused model gives transformers' logits past the window."""
    T = transformers
    dirs = {}
    for window in (16, None):
        torch.manual_seed(0)
        model = T.MistralForCausalLM(T.MistralConfig(**TINY, sliding_window=window,
                                                     **rope_kwargs(T.MistralConfig, 1e6))).eval()
        randomize(model, 0)
        d = dirs[window] = tmp_path / f"tiny-mistral-{window}"
        model.save_pretrained(d)
    windowed = hf.model_from_hf(dirs[16], name="tiny")
    assert windowed.sliding_window == 16 and hf.model_from_hf(dirs[None], name="tiny").sliding_window is None
    plain, w8 = (dataclasses.replace(windowed, sliding_window=w) for w in (None, 8))
    cases = [(dirs[16], plain, 16, None), (dirs[16], plain, 32, "and the variant was built without it: declare "
                                                                "`sliding_window: 16`"),
             (dirs[16], windowed, 32, None), (dirs[16], w8, 32, "sliding_window=8 but the config gives "
                                                               "sliding_window=16"),
             (dirs[None], windowed, 16, None), (dirs[None], windowed, 32, "sliding_window=16 but the config gives "
                                                                         "sliding_window=None")]
    for d, m, seq_len, refused in cases:
        v = gvariants.Variant(m, "decode", 2, seq_len)
        fake_build(monkeypatch, v)
        if refused:
            with pytest.raises(hf.HFConfigError) as exc:
                hf.load_hf(d, 0, variant=v.name, build_dir=tmp_path, device="cpu")
            assert refused in one_line(exc), (d.name, m.sliding_window, seq_len)
            with pytest.raises(hf.HFConfigError):
                hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
        else:
            hf.load_hf(d, 0, variant=v.name, build_dir=tmp_path, device="cpu")
    v = gvariants.Variant(windowed, "decode", 2, 32)
    fake_build(monkeypatch, v)
    monkeypatch.setitem(reference.TORCH_DTYPES, "bf16", torch.float32)
    fm = hf.FusedModel.from_hf(dirs[16], variant=v.name, build_dir=tmp_path, device="cpu")
    ids = torch.randint(0, fm.vocab, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = T.MistralForCausalLM.from_pretrained(dirs[16]).eval()(input_ids=ids).logits
    for t in range(30):
        assert rel(fm.step(ids[:, t], torch.full((2,), t, dtype=torch.int32)), ref[:, t]) <= 1e-4, t


# ---------------------------------------------------------------------------------------------------------------
# 1c RoPE: rope_scaling vs rope_parameters, rope_theta inside vs outside, as transformers 5 standardises them
# ---------------------------------------------------------------------------------------------------------------

L3 = LLAMA_3_1_8B["rope_scaling"]
ROPE_CASES = {
    # a non-empty legacy rope_scaling replaces rope_parameters whole; theta from the top level
    "scaling-beats-parameters": {"rope_theta": 500000.0, "rope_scaling": L3,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # a rope_theta inside the dict beats the top-level one
    "theta-inside-scaling": {"rope_theta": 500000.0, "rope_scaling": {**L3, "rope_theta": 1e6}},
    "theta-inside-parameters": {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 1e6}},
    # an empty rope_scaling does not replace rope_parameters
    "empty-scaling": {"rope_theta": 500000.0, "rope_scaling": {}, "rope_parameters": {**L3, "rope_theta": 2e5}},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_fields_read_as_transformers_does(tmp_path, case):
    cfg = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("rope_scaling", "rope_theta")}
    d = write_config(tmp_path, case, {**cfg, **ROPE_CASES[case]})
    theirs = dict(hf_config(d).rope_parameters)
    m = hf.model_from_hf(d)
    assert m.rope_theta == theirs.pop("rope_theta")
    assert dict(m.rope_scaling or {}) == ({} if theirs["rope_type"] == "default" else theirs)
    if case == "scaling-beats-parameters":
        assert "rope_parameters ignored" in hf.variant_entry_yaml(d)
    if case.startswith("theta-inside"):
        assert "top-level rope_theta 500000.0 ignored" in hf.variant_entry_yaml(d)


def test_rope_scaling_precedence_changes_the_layer(tmp_path):
    """Real numbers: a tiny llama whose config.json has a llama3 rope_scaling and a default rope_parameters; our
    reference layer with the mapping equals transformers' layer (which uses rope_scaling)."""
    from hf_util import hf_decode_step
    model, d = make_tiny("llama3-scaling", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = cfg.pop("rope_parameters")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    model = transformers.LlamaForCausalLM.from_pretrained(d).eval()
    assert model.config.rope_parameters["rope_type"] == "llama3"
    m = hf.model_from_hf(d)
    B, P = 1, 40
    ids = torch.randint(0, 128, (B, P + 1), generator=torch.Generator().manual_seed(1))
    ins, outs, before, _ = hf_decode_step(model, ids, P)
    kc = torch.zeros(B, m.kv_heads, 64, m.head_dim)
    vc = torch.zeros_like(kc)
    kc[:, :, :P], vc[:, :, :P] = before[0]
    out = reference.decoder_layer(ins[0][:, 0], torch.full((B,), P), model.model.layers[0].state_dict(), kc, vc, m)
    assert rel(out, outs[0][:, 0]) <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# 2 checkpoints: tied lm_head, model.safetensors vs an index
# ---------------------------------------------------------------------------------------------------------------

def _edit_single(d, edit):
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return t


@pytest.mark.parametrize("shipped", ["different", "equal", "only-lm-head"])
def test_tied_embeddings_with_a_shipped_lm_head(tmp_path, monkeypatch, shipped):
    model, d = make_tiny("qwen2-bias", tmp_path)  # tie_word_embeddings true: saved without lm_head.weight

    def edit(t):
        emb = t["model.embed_tokens.weight"]
        t["lm_head.weight"] = emb.clone() if shipped == "equal" else torch.randn(emb.shape)
        if shipped == "only-lm-head":
            del t["model.embed_tokens.weight"]
    t = _edit_single(d, edit)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    m = hf.model_from_hf(d, name="tiny")
    v = gvariants.Variant(m, "decode", 2, 32)
    fake_build(monkeypatch, v)
    monkeypatch.setitem(reference.TORCH_DTYPES, "bf16", torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fm = hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
    ours_warned = [str(w.message) for w in caught if "tie_word_embeddings" in str(w.message)]
    assert torch.equal(fm.lm_head, theirs.lm_head.weight)
    assert torch.equal(fm.embed, theirs.model.embed_tokens.weight)
    assert torch.equal(fm.lm_head, t["lm_head.weight"])
    if shipped == "different":
        assert len(ours_warned) == 1 and "\n" not in ours_warned[0] and "lm_head.weight" in ours_warned[0]
        assert str(d / "model.safetensors") in ours_warned[0] and str(d / "config.json") in ours_warned[0]
        assert theirs.lm_head.weight.data_ptr() != theirs.model.embed_tokens.weight.data_ptr()
    else:
        assert not ours_warned and fm.lm_head is fm.embed
    ids = torch.randint(0, fm.vocab, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
    for i in range(6):
        assert rel(fm.step(ids[:, i], torch.full((2,), i, dtype=torch.int32)), ref[:, i]) <= 1e-4


def _two_saves(tmp_path):
    """A directory holding model.safetensors (seed 1) and a complete sharded copy of another model (seed 0)."""
    T = transformers
    cfg_cls, model_cls, kwargs = T.LlamaConfig, T.LlamaForCausalLM, dict(TINY, **rope_kwargs(T.LlamaConfig, 1e4))
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        mdl = model_cls(cfg_cls(**kwargs)).eval()
        randomize(mdl, seed)
        models.append(mdl)
    d = tmp_path / "both"
    models[0].save_pretrained(d, max_shard_size="300KB")
    assert (d / "model.safetensors.index.json").exists() and not (d / "model.safetensors").exists()
    return models, d


def test_single_file_wins_over_an_index_next_to_it(tmp_path):
    from safetensors.torch import save_file
    models, d = _two_saves(tmp_path)
    save_file({k: v.contiguous() for k, v in models[1].state_dict().items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    theirs = transformers.LlamaForCausalLM.from_pretrained(d)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(theirs.state_dict()[name], models[1].state_dict()[name])  # transformers read the single file
    ck = hf._Checkpoint(d)
    assert ck.index_path == d / "model.safetensors"
    assert torch.equal(ck.get(name), theirs.state_dict()[name])


def test_stale_index_left_by_a_resave_as_one_file(tmp_path, monkeypatch):
    models, d = _two_saves(tmp_path)
    models[1].save_pretrained(d)  # transformers removes the old shards but leaves the index behind
    assert (d / "model.safetensors.index.json").exists() and not list(d.glob("model-0*"))
    theirs = transformers.LlamaForCausalLM.from_pretrained(d)
    m = hf.model_from_hf(d, name="tiny")
    v = gvariants.Variant(m, "decode", 1, 32)
    fake_build(monkeypatch, v)
    monkeypatch.setitem(reference.TORCH_DTYPES, "bf16", torch.float32)
    fm = hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
    assert torch.equal(fm.lm_head, theirs.lm_head.weight)
    assert torch.equal(fm.layers[2].W["mlp.down_proj.weight"], theirs.model.layers[2].mlp.down_proj.weight)


def test_transformers_weights_field_names_the_file(tmp_path):
    models, d = _two_saves(tmp_path)
    models[1].save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "transformers_weights": "model.safetensors.index.json"}))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(transformers.LlamaForCausalLM.from_pretrained(d).state_dict()[name],
                       models[0].state_dict()[name])
    assert torch.equal(hf._Checkpoint(d).get(name), models[0].state_dict()[name])
    (d / "config.json").write_text(json.dumps({**cfg, "transformers_weights": "../x.safetensors"}))
    with pytest.raises(hf.HFCheckpointError, match="transformers_weights"):
        hf._Checkpoint(d)


# ---------------------------------------------------------------------------------------------------------------
# 3 fp16 variants of bf16 models warn: fp16 overflows above 65,504 where bf16 does not
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("saved,variant_dtype,warns", [
    (torch.bfloat16, "fp16", True), (None, "fp16", True),        # bf16 and fp32 checkpoints cast to fp16
    (torch.bfloat16, "bf16", False), (torch.float16, "fp16", False),
])
def test_fp16_variant_of_a_bf16_model_warns(tmp_path, monkeypatch, saved, variant_dtype, warns):
    assert torch.isinf(torch.tensor(70000.0).half()) and torch.isfinite(torch.tensor(70000.0).bfloat16())
    _, d = make_tiny("llama", tmp_path, save_dtype=saved)
    m = hf.model_from_hf(d, name="tiny")
    v = gvariants.Variant(gvariants.Model(**{**m.__dict__, "dtype": variant_dtype}), "decode", 1, 32)
    fake_build(monkeypatch, v)
    for load in (lambda: hf.load_hf(d, 0, variant=v.name, build_dir=tmp_path, device="cpu"),
                 lambda: hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load()
        ours = [str(w.message) for w in caught if issubclass(w.category, hf.HFPrecisionWarning)]
        assert len(ours) == int(warns)
        if warns:
            assert "\n" not in ours[0] and "65504" in ours[0] and v.name in ours[0]
            assert str(d / "config.json") in ours[0] and "dtype" in ours[0]


def test_checkpoint_faults_a_user_makes_are_one_line_errors(tmp_path, monkeypatch):
    """A config whose vocab_size disagrees with the embedding's rows (transformers refuses it), no GPU (the loader's
    LoadError), an integer weight tensor (not castable: a quantized checkpoint), a config.json that is not text (the
    safetensors file given as the config): each an error naming the file, before any tensor is read."""
    model, d = make_tiny("qwen2-bias", tmp_path)
    m = hf.model_from_hf(d, name="tiny")
    v = gvariants.Variant(m, "decode", 2, 32)
    fake_build(monkeypatch, v)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 7}))
    with pytest.raises(hf.HFCheckpointError, match="has .* rows, but field 'vocab_size'"):
        hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
    (d / "config.json").write_text(json.dumps(cfg))
    with monkeypatch.context() as mp:  # no GPU: the loader's own error, not torch's assertion
        mp.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(loader.LoadError, match="no CUDA device here"):
            hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path)
    _edit_single(d, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight",
                                            t["model.layers.0.self_attn.q_proj.weight"].to(torch.int32)))
    with pytest.raises(hf.HFCheckpointError, match="stored as I32: expected floating point"):
        hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
    with pytest.raises(hf.HFConfigError, match="not a config.json \\(not UTF-8 text"):
        hf.model_from_hf(d / "model.safetensors")


def test_weights_files_that_are_there_but_not_readable_are_named_as_such(tmp_path):
    """model.safetensors as a link to nothing, as a directory, a shard of an index missing, and a pytorch_model.bin
    (read where no safetensors file is, as transformers reads it) that is empty, holds no tensor, holds a numpy array
    (torch.load's weights_only refusal: its cause said) or is a Git LFS pointer: each one line naming what it is,
    not "missing" (a new user's trial)."""
    _, d = make_tiny("llama", tmp_path)
    real = tmp_path / "weights.safetensors"
    (d / "model.safetensors").rename(real)
    (d / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(hf.HFCheckpointError, match="model.safetensors: a symbolic link to a missing file"):
        hf._Checkpoint(d)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    with pytest.raises(hf.HFCheckpointError, match="model.safetensors: not a file$"):
        hf._Checkpoint(d)
    (d / "model.safetensors").rmdir()
    (d / "pytorch_model.bin").write_bytes(b"")  # (read where no safetensors file is: this one is empty)
    with pytest.raises(hf.HFCheckpointError, match=r"pytorch_model.bin: not a readable PyTorch checkpoint \(loaded "
                                                   r"as transformers does: weights_only\): an empty file \(0 bytes\)$"):
        hf._Checkpoint(d)
    (d / "pytorch_model.bin").unlink()
    import numpy as np
    import torch
    for obj, why in (({"step": 3}, "not a state dict of named tensors$"),  # (no tensor at all)
                     ({"model.embed_tokens.weight": np.zeros(2)}, "Unsupported global: [^\n\x1b]+$")):
        torch.save(obj, d / "pytorch_model.bin")
        with pytest.raises(hf.HFCheckpointError, match="pytorch_model.bin: not a readable PyTorch checkpoint .*: " + why):
            hf._Checkpoint(d)
    (d / "pytorch_model.bin").write_text("hello")  # (torch.load's own error: a bare KeyError 101, the "e")
    with pytest.raises(hf.HFCheckpointError, match="pytorch_model.bin: not a readable .*: neither a zip archive "
                                                   r"\(torch.save's format\) nor a pickle: it starts b'hello'$"):
        hf._Checkpoint(d)
    (d / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    with pytest.raises(hf.HFCheckpointError, match="pytorch_model.bin: not a readable .*: a Git LFS pointer, not the "
                                                   "weights \\(fetch them: git lfs pull\\)$"):
        hf._Checkpoint(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(hf.HFCheckpointError, match="no model.safetensors, model.safetensors.index.json, "
                                                   "pytorch_model.bin or pytorch_model.bin.index.json"):
        hf._Checkpoint(d)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(hf.HFCheckpointError, match="model-00001-of-00002.safetensors: no such file \\(a shard listed "
                                                   "in model.safetensors.index.json\\)"):
        hf._Checkpoint(d).where("model.embed_tokens.weight")  # (a shard is opened when a tensor is looked up)


def test_tensors_the_config_does_not_use_are_warned(tmp_path, monkeypatch):
    """A config with fewer layers than the checkpoint, or a tensor no layer or head uses: one warning line naming
    them (transformers reports unexpected keys), and the model still loads."""
    model, d = make_tiny("qwen2-bias", tmp_path)
    _edit_single(d, lambda t: t.__setitem__("model.foo", torch.zeros(3)))
    cfg = json.loads((d / "config.json").read_text())
    fewer = {**cfg, "num_hidden_layers": cfg["num_hidden_layers"] - 1}
    if "layer_types" in cfg:
        fewer["layer_types"] = cfg["layer_types"][:-1]
    (d / "config.json").write_text(json.dumps(fewer))
    m = hf.model_from_hf(d, name="tiny")
    v = gvariants.Variant(m, "decode", 2, 32)
    fake_build(monkeypatch, v)
    monkeypatch.setitem(reference.TORCH_DTYPES, "bf16", torch.float32)
    with pytest.warns(hf.HFUnusedTensorsWarning) as caught:
        hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path, device="cpu")
    msg = str(caught[0].message)
    last = cfg["num_hidden_layers"] - 1
    assert "\n" not in msg and "model.foo" in msg and f"model.layers.{last}." in msg and "not read" in msg


def test_the_layers_input_errors_name_the_argument_as_typed():
    """A prefill layer's positions are `start_pos` in its errors (it said `pos`), a position that is no tensor says
    what it must be (it said `shape ()`), and weights=None without packed= is one ValueError (a TypeError)."""
    import torch

    from generator import loader
    from generator.variants import Model, Variant
    m = Model(name="t", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=1, norm="rmsnorm",
              norm_eps=1e-5, rope_theta=1e4, activation="silu", qkv_bias=False, qk_norm=False, dtype="bf16")
    for mode, chunk, name in (("decode", 1, "pos"), ("prefill", 16, "start_pos")):
        layer = object.__new__(loader.FusedDecoderLayer)  # its checks only: no GPU, no kernel
        layer.variant, layer.model, layer.mode = Variant(m, mode, 2, 16 if mode == "prefill" else 64), m, mode
        layer.dtype, layer.device, layer.cache_len = torch.bfloat16, torch.device("cpu"), 64
        x = torch.zeros((2, 64) if mode == "decode" else (2, 16, 64), dtype=torch.bfloat16)
        for pos, match in (([0, 1], rf"^{name}: an int32 tensor of shape \(2,\), got list$"),
                           (3, rf"^{name}: an int32 tensor of shape \(2,\), got int$"),
                           (torch.zeros(3, dtype=torch.int32), rf"^{name}: shape \(3,\), expected \(2,\)$"),
                           (torch.zeros(2), rf"^{name}: dtype torch.float32, expected torch.int32$")):
            with pytest.raises(ValueError, match=match):
                layer.check_inputs(x, pos)
        last = 64 - chunk
        with pytest.raises(ValueError, match=rf"^{name}: .* must be in \[0, {last}\]"):
            layer.check_positions(torch.tensor([0, last + 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="^weights: a dict of the layer's tensors by name .* got NoneType$"):
        loader.check_weights(None, m, torch.bfloat16, torch.device("cpu"))
    import types  # any mapping is a dict of weights
    with pytest.raises(ValueError, match="^weight '.*': missing$"):
        loader.check_weights(types.MappingProxyType({}), m, torch.bfloat16, torch.device("cpu"))
