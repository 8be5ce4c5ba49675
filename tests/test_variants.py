"""variants.yaml: parsing, expansion, name globs, and one-line errors for every kind of bad input.

BAD_CASES is also used by test_cli.py (the CLI must turn each into exit 2 and leave build/ untouched).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import re

import pytest
import yaml

from generator.targets import ARCHS

from generator import render as grender, variants as gvariants
from generator.variants import VariantError
SM90_SMEM = ARCHS["90"].smem_per_block

from conftest import ROOT

DEFAULT_MODELS = ("qwen2.5-0.5b", "llama3.2-1b", "qwen3-1.7b", "llama3-8b", "qwen2.5-7b")

TINY = {"hidden": 64, "heads": 2, "kv_heads": 1, "head_dim": 32, "intermediate": 128, "layers": 1,
        "norm": "rmsnorm", "norm_eps": 1.0e-5, "rope_theta": 10000.0, "activation": "silu", "qkv_bias": False,
        "qk_norm": False, "dtype": "bf16"}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "attention_factor": 1.1386, "truncate": False}  # (every field resolved: from-hf's form)


def doc_text(**changes) -> str:
    """A valid one-model file (`tiny`) with fields changed (None deletes a field)."""
    model = copy.deepcopy(TINY)
    for k, v in changes.items():
        if v is None:
            model.pop(k)
        else:
            model[k] = v
    return yaml.safe_dump({"matrix": {"mode": ["decode"], "batch": [1], "seq_len": [64]},
                           "models": {"tiny": model}}, sort_keys=False)


GOOD_TEXT = doc_text()
# line numbers below refer to this layout: "models:" then "  tiny:" then one field a line
TINY_LINES = GOOD_TEXT.splitlines()


def _replace_line(field: str, new: str) -> str:
    lines = list(TINY_LINES)
    i = next(i for i, l in enumerate(lines) if l.strip().startswith(f"{field}:"))
    lines[i] = new
    return "\n".join(lines) + "\n", i + 1


def _syntax_colon():
    text, line = _replace_line("heads", "    heads: 2: 3")
    return text, [f"line {line}", "YAML syntax error", "mapping values are not allowed"]


def _syntax_tab():
    text, line = _replace_line("heads", "\theads: 2")
    return text, [f"line {line}", "YAML syntax error", "cannot start any token"]


def _duplicate_variant():
    # PyYAML keeps the last of two equal keys unless told otherwise: a second `tiny:` must be an error
    text = GOOD_TEXT + "  tiny:\n" + "".join(f"    {l.strip()}\n" for l in TINY_LINES
                                            if l.startswith("    "))
    line = len(GOOD_TEXT.splitlines()) + 1
    return text, [f"line {line}", "duplicate key 'tiny'"]


def _duplicate_field():
    text, line = _replace_line("heads", "    heads: 2\n    heads: 4")
    return text, [f"line {line + 1}", "duplicate key 'heads'"]


# id -> (file text, substrings the one-line message must contain besides the file name).
# Each names the variant (where the file got that far), the field and the rule.
V = "model 'tiny'"
BAD_CASES = {
    "unknown-key": (doc_text(hiden=64), [V, "unknown field 'hiden'", "allowed:"]),
    "missing-key": (doc_text(intermediate=None), [V, "missing field 'intermediate'"]),
    "type-str-for-int": (doc_text(hidden="64"), [V, "field 'hidden'", "must be integer", "'64'"]),
    "type-bool-for-int": (doc_text(hidden=True), [V, "field 'hidden'", "must be integer", "got true"]),
    "type-float-for-int": (doc_text(heads=2.0), [V, "field 'heads'", "must be integer"]),
    "type-int-for-bool": (doc_text(qkv_bias=1), [V, "field 'qkv_bias'", "must be boolean"]),
    "type-str-for-float": (doc_text(norm_eps="small"), [V, "field 'norm_eps'", "must be number"]),
    "type-list-for-str": (doc_text(norm=["rmsnorm"]), [V, "field 'norm'", "must be string"]),
    "yaml-syntax-colon": _syntax_colon(),
    "yaml-syntax-tab": _syntax_tab(),
    "heads-not-divisible": (doc_text(heads=6, kv_heads=4), [V, "field 'heads'", "divisible by kv_heads"]),
    "over-c-int": (doc_text(intermediate=2**40), [V, "field 'intermediate'", "at most 2147483647", "C int"]),
    "seq-len-over-c-int": (GOOD_TEXT.replace("- 64", "- 3000000000"),
                           ["field 'matrix.seq_len'", "at most 2147483647"]),
    "head-dim-not-16x": (doc_text(head_dim=40), [V, "field 'head_dim'", "multiple of 16", "got 40"]),
    "head-dim-over-256": (doc_text(head_dim=272), [V, "field 'head_dim'", "at most 256", "got 272"]),
    "hidden-not-16x": (doc_text(hidden=72), [V, "field 'hidden'", "must be a multiple of"]),
    "hidden-zero": (doc_text(hidden=0), [V, "field 'hidden'", "must be positive"]),
    "heads-negative": (doc_text(heads=-2), [V, "field 'heads'", "must be positive"]),
    "kv-heads-zero": (doc_text(kv_heads=0), [V, "field 'kv_heads'", "must be positive"]),
    "intermediate-zero": (doc_text(intermediate=0), [V, "field 'intermediate'", "must be positive"]),
    "head-dim-negative": (doc_text(head_dim=-32), [V, "field 'head_dim'", "must be positive"]),
    "norm-eps-zero": (doc_text(norm_eps=0.0), [V, "field 'norm_eps'", "must be positive"]),
    "norm-eps-nan": (doc_text(norm_eps=float("nan")), [V, "field 'norm_eps'", "finite"]),
    "norm-eps-past-fp32": (doc_text(norm_eps=1e300), [V, "field 'norm_eps'", "positive fp32 value", "got 1e+300"]),
    "batch-zero": (GOOD_TEXT.replace("batch:\n  - 1", "batch:\n  - 0"), ["matrix", "field 'matrix.batch'",
                                                                          "must be positive"]),
    "seq-len-negative": (GOOD_TEXT.replace("seq_len:\n  - 64", "seq_len:\n  - -64"),
                         ["matrix", "field 'matrix.seq_len'", "must be positive"]),
    "unknown-dtype": (doc_text(dtype="fp8"), [V, "field 'dtype'", "must be one of bf16, fp16", "'fp8'"]),
    "unknown-norm": (doc_text(norm="batchnorm"), [V, "field 'norm'", "must be one of rmsnorm, layernorm"]),
    "unknown-activation": (doc_text(activation="relu"), [V, "field 'activation'", "must be one of silu, gelu"]),
    "unknown-mode": (GOOD_TEXT.replace("- decode", "- training"), ["field 'matrix.mode'", "must be one of"]),
    "unknown-rope-type": (doc_text(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
                          [V, "field 'rope_scaling.rope_type'", "must be one of llama3, linear, yarn"]),
    "linear-rope-llama3-field": (doc_text(rope_scaling={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}),
                                 [V, "unknown field 'rope_scaling.low_freq_factor' for rope_type linear"]),
    "linear-rope-no-factor": (doc_text(rope_scaling={"rope_type": "linear"}), [V, "missing field 'rope_scaling.factor'"]),
    "yarn-rope-unresolved": (doc_text(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 4096}),
                             [V, "missing field 'rope_scaling.beta_fast'"]),
    "yarn-rope-truncate": (doc_text(rope_scaling={**YARN, "truncate": 1}),
                           [V, "field 'rope_scaling.truncate' must be"]),
    "duplicate-variant-name": _duplicate_variant(),
    "duplicate-field": _duplicate_field(),
    "bad-variant-name": (GOOD_TEXT.replace("  tiny:", "  Tiny Model:"), ["'Tiny Model'", "lower-case"]),
    "unknown-top-level": (GOOD_TEXT + "modles: {}\n", ["unknown top-level field 'modles'"]),
    "empty-file": ("", ["empty", "'models' and 'matrix'"]),
    "not-a-mapping": ("[1, 2]", ["top level must be a mapping"]),
}


def check_one_line(msg: str, path: str, expect: list[str]) -> None:
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    assert msg.startswith(path), f"message does not start with the file name {path!r}: {msg!r}"
    for s in expect:
        assert s in msg, f"{s!r} not in {msg!r}"


# ---------------------------------------------------------------- the default file

def test_default_file_expands_to_67_named_variants():
    vs = gvariants.load(ROOT / "variants.yaml")
    names = [v.name for v in vs]
    assert len(vs) == 67  # 5 models x 9 decode + 2 models x 10 prefill + llama3-70b decode b1, b8 over 2 GPUs
    assert len(set(names)) == 67
    expected = {f"{m}_decode_b{b}_s{s}_bf16"
                for m, b, s in itertools.product(DEFAULT_MODELS, (1, 4, 8), (1024, 4096, 32768))}
    expected |= {f"{m}_prefill_b{b}_s{s}_bf16"
                 for m, b, s in itertools.product(("llama3.2-1b", "llama3-8b"), (1, 4), (16, 64, 128, 512, 2048))}
    expected |= {f"llama3-70b_decode_b{b}_s4096_bf16_tp2" for b in (1, 8)}
    assert set(names) == expected
    assert "llama3.2-1b_decode_b1_s4096_bf16" in names


def test_default_models_have_their_features():
    models = {v.model.name: v.model for v in gvariants.load(ROOT / "variants.yaml")}
    assert models["qwen3-1.7b"].qk_norm and models["qwen3-1.7b"].head_dim == 128
    assert models["qwen2.5-7b"].qkv_bias and models["qwen2.5-0.5b"].qkv_bias
    assert not models["llama3-8b"].qkv_bias and not models["llama3-8b"].qk_norm
    assert dict(models["llama3.2-1b"].rope_scaling)["rope_type"] == "llama3"
    assert models["llama3-8b"].group == 4 and models["qwen2.5-0.5b"].group == 7


def test_every_default_variant_plans_within_budget_and_renders():
    for v in gvariants.load(ROOT / "variants.yaml"):
        p = grender.plan(v)  # raises PlanError if over the shared-memory budget
        assert p["smem_bytes"] <= SM90_SMEM
        src = grender.render(v, p)
        assert 'extern "C" __global__' in src and "decoder_layer" in src
        assert "{{" not in src and "{%" not in src
        length = "SEQ_LEN" if v.mode == "decode" else "CHUNK"
        assert re.search(rf"\bBATCH\s*=\s*{v.batch}\b", src) and re.search(rf"\b{length}\s*=\s*{v.seq_len}\b", src)


def test_params_round_trip_the_fields():
    v = gvariants.parse(GOOD_TEXT, "t.yaml")[0]
    p = v.params()
    for k, val in TINY.items():
        assert p[k] == val
    assert (p["mode"], p["batch"], p["seq_len"], p["rope_scaling"]) == ("decode", 1, 64, None)


# ---------------------------------------------------------------- good input

def test_per_model_matrix_overrides_and_numbers_are_normalised():
    text = yaml.safe_dump({
        "matrix": {"mode": ["decode"], "batch": [1, 2], "seq_len": [64]},
        "models": {
            "a": dict(TINY, rope_theta=10000, norm_eps=1),  # integers where floats are expected
            "b": dict(TINY, matrix={"mode": "decode", "batch": 4, "seq_len": [32, 128]},
                      rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        }})
    vs = gvariants.parse(text, "t.yaml")
    assert [v.name for v in vs] == ["a_decode_b1_s64_bf16", "a_decode_b2_s64_bf16",
                                    "b_decode_b4_s32_bf16", "b_decode_b4_s128_bf16"]
    a = vs[0].model
    assert isinstance(a.rope_theta, float) and isinstance(a.norm_eps, float)
    b = vs[2]
    assert b.params()["rope_scaling"] == {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hash(b)  # frozen and hashable, rope_scaling included


def test_exponent_floats_without_a_dot_are_numbers():
    # YAML 1.1 would read these as strings; HF's config.json writes eps as 1e-05
    text = GOOD_TEXT.replace("norm_eps: 1.0e-05", "norm_eps: 1e-05").replace("rope_theta: 10000.0", "rope_theta: 1E4")
    assert "norm_eps: 1e-05" in text and "rope_theta: 1E4" in text
    m = gvariants.parse(text, "t.yaml")[0].model
    assert (m.norm_eps, m.rope_theta) == (1e-5, 10000.0)
    with pytest.raises(VariantError, match="field 'hidden' must be integer, got 64.0"):
        gvariants.parse(text.replace("hidden: 64", "hidden: 6.4e1"), "t.yaml")


@pytest.mark.parametrize("written,shown", [("4:16", "'4:16'"), ("0100", "'0100'"), ("1:4.0", "'1:4.0'")])
def test_yaml_1_1_base_60_and_octal_numbers_are_refused(written, shown):
    """PyYAML reads `4:16` as 256 (base 60) and `0100` as 64 (octal): taken as strings, refused in one line."""
    with pytest.raises(VariantError, match=f"field 'hidden' must be integer, got {re.escape(shown)}"):
        gvariants.parse(GOOD_TEXT.replace("hidden: 64", f"hidden: {written}"), "t.yaml")
    for same in ("0x40", "0b1000000", "6_4"):  # (YAML 1.1's hex, binary and underscores stay numbers)
        assert gvariants.parse(GOOD_TEXT.replace("hidden: 64", f"hidden: {same}"), "t.yaml")[0].model.hidden == 64


def test_a_yaml_error_without_a_line_has_no_empty_field():
    with pytest.raises(VariantError) as exc:
        gvariants.parse("models:\x00\n", "t.yaml")  # (a reader error: no line mark)
    assert str(exc.value).startswith("t.yaml: YAML syntax error")


def test_select_globs():
    vs = gvariants.load(ROOT / "variants.yaml")
    sel = gvariants.select
    assert {v.name for v in sel(vs, ("llama3.2-1b_*",))} == {
        f"llama3.2-1b_decode_b{b}_s{s}_bf16" for b in (1, 4, 8) for s in (1024, 4096, 32768)} | {
        f"llama3.2-1b_prefill_b{b}_s{s}_bf16" for b in (1, 4) for s in (16, 64, 128, 512, 2048)}
    assert len(sel(vs, ("*_decode_b1_*",))) == 16  # 5 models x 3 cache lengths + llama3-70b tp2
    assert len(sel(vs, ("*_decode_b1_*", "*_decode_b8_*"))) == 32  # several --only: union
    assert len(sel(vs, ("*_decode_*",), ("*_s32768_*",))) == 32
    assert [v.name for v in sel(vs, ("llama3-8b_*",), ("*_b4_*", "*_b8_*", "*_s1024_*", "*_s32768_*", "*prefill*"))] == [
        "llama3-8b_decode_b1_s4096_bf16"]
    assert sel(vs, ("nothing*",)) == []
    assert sel(vs) == vs
    assert sel(vs, ("LLAMA*",)) == []  # case-sensitive, as names are lower-case


# ---------------------------------------------------------------- bad input: one line each

def test_bad_cases_are_valid_yaml_variations_of_a_good_file():
    assert len(gvariants.parse(GOOD_TEXT, "t.yaml")) == 1


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_gives_one_line_error(case, tmp_path):
    text, expect = BAD_CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(VariantError) as info:
        gvariants.load(path)
    check_one_line(str(info.value), str(path), expect)
    assert info.value.__cause__ is None or info.value.__suppress_context__


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(VariantError) as info:
        gvariants.load(tmp_path / "nope.yaml")
    check_one_line(str(info.value), str(tmp_path / "nope.yaml"), ["no such variants file", "--variants FILE"])


def test_binary_file_is_one_line(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\xff\xfe\x00\x01models")
    with pytest.raises(VariantError) as info:
        gvariants.load(p)
    check_one_line(str(info.value), str(p), ["not UTF-8"])


def test_unhashable_key_is_one_line():
    with pytest.raises(VariantError) as info:
        gvariants.parse(GOOD_TEXT + "  ? [a, b]\n  : 1\n", "t.yaml")
    check_one_line(str(info.value), "t.yaml", ["line", "unhashable key"])


def test_every_field_is_checked_for_presence():
    required = [k for k, (_, req, _) in gvariants.MODEL_FIELDS.items() if req]
    assert set(required) == set(TINY)
    for k in required:
        with pytest.raises(VariantError, match=f"missing field '{k}'"):
            gvariants.parse(doc_text(**{k: None}), "t.yaml")


def test_bool_is_not_an_int_anywhere():
    for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers"):
        with pytest.raises(VariantError, match=f"field '{k}' must be integer, got true"):
            gvariants.parse(doc_text(**{k: True}), "t.yaml")
    with pytest.raises(VariantError, match="matrix.batch"):
        gvariants.parse(GOOD_TEXT.replace("batch:\n  - 1", "batch:\n  - true"), "t.yaml")


def test_duplicate_field_error_names_the_variant():
    text = ("matrix: {mode: [decode], batch: [1], seq_len: [64]}\n"
            "models:\n  tiny-a:\n    hidden: 256\n  tiny-b:\n    hidden: 256\n    heads: 4\n    heads: 8\n")
    with pytest.raises(VariantError) as e:
        gvariants.parse(text, "v.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("v.yaml: line 8:") and "model 'tiny-b'" in msg
    assert "duplicate key 'heads'" in msg


def test_yaml_merge_keys_are_read_as_pyyaml_reads_them():
    """`<<: *base` (valid YAML; the defaults use anchors): a model may take another's fields and override some; a
    key written twice in the same mapping is still a duplicate."""
    assert "  tiny:\n" in GOOD_TEXT and GOOD_TEXT.rstrip().endswith("dtype: bf16")  # (the models come last)
    base = GOOD_TEXT.replace("  tiny:\n", "  tiny: &a\n") + "  tiny-b:\n    <<: *a\n    dtype: fp16\n"
    vs = {v.model.name: v for v in gvariants.parse(base, "m.yaml")}
    assert vs["tiny-b"].model.dtype == "fp16" and vs["tiny"].model.dtype == "bf16"
    assert vs["tiny-b"].model.hidden == vs["tiny"].model.hidden  # (a field merged from the anchor)
    with pytest.raises(VariantError, match="duplicate key 'dtype'"):
        gvariants.parse(base + "    dtype: bf16\n", "m.yaml")


def test_derived_sizes_over_a_c_int_are_refused():
    """Each field fits a C int but heads x head_dim does not: the file is refused in one line (the kernel's
    constants and buffer sizes are C ints; nvcc only warns when one wraps); what only the plan derives (buffer
    sizes) is refused by the planner."""
    with pytest.raises(VariantError, match=r"model 'tiny': heads x head_dim = 17179869184 must be at most"):
        gvariants.parse(doc_text(heads=2**27, kv_heads=2**27, head_dim=128), "t.yaml")
    # a prefill of 4 x 2^30 tokens: each field fits, the launch's token rows do not
    text = GOOD_TEXT.replace("- decode", "- prefill").replace("- 64", "- 1073741824").replace("- 1\n", "- 4\n")
    v = gvariants.parse(text, "t.yaml")[0]
    with pytest.raises(grender.PlanError, match=r"ROWS = 4294967296 is over a C int .* smaller shape"):
        grender.plan(v)


def test_sliding_window_field():
    """sliding_window: a positive number of tokens or null (full attention); one line otherwise. It takes effect only
    over a cache longer than itself (window_at), and same_layer compares windows there; a model without one keeps
    the parameters (and so the build identity and tuned plans) it had before the field existed."""
    v = gvariants.parse(doc_text(sliding_window=48), "w.yaml")[0]
    assert v.model.sliding_window == 48 and v.params()["sliding_window"] == 48
    plain = gvariants.parse(GOOD_TEXT, "g.yaml")[0]
    assert plain.model.sliding_window is None and "sliding_window" not in plain.params()
    null = GOOD_TEXT.replace("  tiny:\n", "  tiny:\n    sliding_window: null\n")
    assert "sliding_window: null" in null and gvariants.parse(null, "n.yaml")[0].model == plain.model
    for bad, want in ((0, "must be a number of tokens in 1..2147483647"), (-3, "in 1..2147483647"),
                      (2**31, "in 1..2147483647"),
                      (True, "must be"), ("64", "must be"), (2.5, "must be")):
        with pytest.raises(VariantError) as exc:
            gvariants.parse(doc_text(sliding_window=bad), "b.yaml")
        assert "sliding_window" in str(exc.value) and want in str(exc.value) and "\n" not in str(exc.value), bad
    assert [gvariants.window_at(48, r) for r in (32, 48, 49, None)] == [None, None, 48, 48]
    assert gvariants.window_at(None, 10) is None
    assert gvariants.same_layer(v.model, plain.model, 48) and not gvariants.same_layer(v.model, plain.model, 64)
    assert not gvariants.same_layer(v.model, plain.model)


def test_sliding_window_plans_attention_for_its_rows():
    """A decode variant attends to at most the window's rows: WINDOW is set where the cache is longer, and the
    static split is planned for the window's rows (a window as long as the cache changes nothing); prefill always
    carries it (its cache is given at run time)."""
    from generator.modes import decode, prefill
    from generator.targets import ARCHS
    arch = ARCHS["90"]
    base = gvariants.parse(doc_text(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816), "p.yaml")[0]
    win = gvariants.parse(doc_text(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                                   sliding_window=1000), "w.yaml")[0]
    at = {}
    for name, v in (("base", base), ("win", win)):
        for seq in (1000, 8192):
            c = decode.plan(dataclasses.replace(v, seq_len=seq), arch)["consts"]
            at[name, seq] = (c["WINDOW"], c["ATT_C"], c["ATT_NSPLIT"])
    assert at["win", 1000] == at["base", 1000] and at["win", 1000][0] == 0
    assert at["win", 8192][0] == 1000 and at["win", 8192][1:] == at["base", 1000][1:]
    assert at["base", 8192][0] == 0 and at["base", 8192][2] > at["win", 8192][2]
    c = prefill.plan(dataclasses.replace(win, mode="prefill", seq_len=64), arch)["consts"]
    assert c["WINDOW"] == 1000
    assert prefill.plan(dataclasses.replace(base, mode="prefill", seq_len=64), arch)["consts"]["WINDOW"] == 0
