"""Hugging Face checkpoints (CPU, offline): our reference layer equals transformers' decoder layer on the same weights,
positions and cache; `megakernel from-hf` maps the published configs of real models to variants.yaml's entries and
refuses what the kernel does not compute; load_hf finds checkpoint problems before anything touches CUDA."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from generator import hf, reference, variants as gvariants
from generator.verify import rel_err as rel  # noqa: E402
from hf_util import hf_decode_step, randomize, rope_kwargs  # noqa: E402

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------------------
# the published config.json of real checkpoints (as on the Hugging Face hub)
# ---------------------------------------------------------------------------------------------------------------

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
MISTRAL_7B_V0_3 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768,
}
LLAMA3_8_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}

# (directory name, config, entry of variants.yaml, fields that differ from that entry)
REAL = [
    ("Llama-3.2-1B", LLAMA_3_2_1B, "llama3.2-1b", {}),
    ("Llama-3.1-8B", LLAMA_3_1_8B, "llama3-8b", {"rope_scaling": LLAMA3_8_SCALING}),
    ("Qwen2.5-0.5B", QWEN2_5_0_5B, "qwen2.5-0.5b", {}),
    ("Qwen2.5-7B", QWEN2_5_7B, "qwen2.5-7b", {}),
    ("Qwen3-1.7B", QWEN3_1_7B, "qwen3-1.7b", {}),
]


def write_config(tmp_path: Path, dirname: str, cfg: dict) -> Path:
    d = tmp_path / dirname
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def cli_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["NO_COLOR"] = "1"
    return env


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`megakernel ARGS` (python -m generator.cli: this checkout, the interpreter running the tests)."""
    return subprocess.run([sys.executable, "-m", "generator.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=cli_env(), timeout=300)


def variants_yaml_models() -> dict:
    return yaml.safe_load((ROOT / "variants.yaml").read_text())["models"]


# ---------------------------------------------------------------------------------------------------------------
# config.json -> variants.yaml entry
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dirname,cfg,entry,override", REAL, ids=[r[0] for r in REAL])
def test_real_configs_map_to_variants_yaml_entries(tmp_path, dirname, cfg, entry, override):
    d = write_config(tmp_path, dirname, cfg)
    name, fields = hf.model_entry(d)
    assert name == dirname.lower()
    expected = {k: v for k, v in variants_yaml_models()[entry].items() if k != "matrix"}
    expected.update(override)
    assert fields == expected
    # a config.json path gives the same entry
    assert hf.model_entry(d / "config.json") == (name, fields)


@pytest.mark.parametrize("dirname,cfg,entry,override", REAL, ids=[r[0] for r in REAL])
def test_cli_from_hf_prints_a_pasteable_entry(tmp_path, dirname, cfg, entry, override):
    d = write_config(tmp_path, dirname, cfg)
    r = run_cli("from-hf", d)
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load("models:\n" + r.stdout)
    name, fields = hf.model_entry(d)
    assert doc["models"] == {name: fields}
    # pasted under models: of a file with a matrix, it parses with the same rules as variants.yaml
    vs = gvariants.parse("matrix: {mode: decode, batch: 1, seq_len: 1024}\nmodels:\n" + r.stdout)
    assert [v.name for v in vs] == [f"{name}_decode_b1_s1024_bf16"]


def test_console_script(tmp_path):
    exe = shutil.which("megakernel")
    if exe is None:
        pytest.skip("megakernel is not installed on PATH")
    d = write_config(tmp_path, "Qwen3-1.7B", QWEN3_1_7B)
    r = subprocess.run([exe, "from-hf", str(d), "--name", "q3"], capture_output=True, text=True, timeout=120,
                       env=cli_env())
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load("models:\n" + r.stdout)["models"]["q3"]["qk_norm"] is True


def test_mistral_without_sliding_window_maps(tmp_path):
    d = write_config(tmp_path, "Mistral-7B-Instruct-v0.3", MISTRAL_7B_V0_3)
    name, fields = hf.model_entry(d)
    assert name == "mistral-7b-instruct-v0.3"
    assert fields == {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336,
                      "layers": 32, "norm": "rmsnorm", "norm_eps": 1e-5, "rope_theta": 1e6, "activation": "silu",
                      "qkv_bias": False, "qk_norm": False, "dtype": "bf16"}
    # a window (transformers' Mistral applies it on every layer) is the entry's sliding_window field
    d2 = write_config(tmp_path, "m2", {**MISTRAL_7B_V0_3, "sliding_window": 32768})
    assert hf.model_entry(d2)[1] == {**fields, "sliding_window": 32768}


def test_dynamic_rope_maps_to_default_rope_up_to_max_position_embeddings(tmp_path):
    """rope_type dynamic: transformers' frequencies are the default ones until a position reaches
    max_position_embeddings, so the entry has no rope_scaling and a note; a cache longer than that is refused in one
    line by from-hf's own matrix and by --write into a file whose matrix has one, the file untouched."""
    cfg = {**_without(LLAMA_3_1_8B, "rope_scaling"), "max_position_embeddings": 8192,
           "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    d = write_config(tmp_path, "dyn", cfg)
    m = hf.map_config(d)
    assert "rope_scaling" not in m.fields and m.limit.size == 8192 and m.fields["rope_theta"] == 500000.0
    assert any(n.startswith("rope_type dynamic: default RoPE for positions below max_position_embeddings 8192")
               for n in m.notes)
    assert run_cli("from-hf", d, "--seq-len", "8192").returncode == 0
    r = run_cli("from-hf", d, "--seq-len", "4096,16384")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "seq_len 16384 is longer than max_position_embeddings 8192" in r.stderr and "dynamic" in r.stderr
    f = tmp_path / "v.yaml"
    f.write_text("matrix: {mode: [decode], batch: [1], seq_len: [4096, 32768]}\nmodels:\n")
    before = f.read_text()
    r = run_cli("from-hf", d, "--write", f)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "seq_len 32768" in r.stderr, r.stderr
    assert f.read_text() == before


def test_from_hf_default_cache_stops_at_max_position_embeddings(tmp_path):
    """Unless told (--seq-len), from-hf's caches are 4096 rows or max_position_embeddings where shorter: in the file
    --write starts and in the entry's own matrix, so a short-context model is neither warned of untrained positions
    nor, under dynamic RoPE, refused; a longer one keeps 4096 (a trial found 4096 everywhere)."""
    for mpe, want in ((256, 256), (131072, 4096)):
        d = write_config(tmp_path, f"m{mpe}", {**LLAMA_3_2_1B, "max_position_embeddings": mpe})
        r = run_cli("from-hf", d, "--write", tmp_path / f"m{mpe}.yaml")
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
        assert {v.seq_len for v in gvariants.load(tmp_path / f"m{mpe}.yaml")} == {want}
        r = run_cli("from-hf", d, "--batch", "2")
        assert r.returncode == 0 and f"seq_len: [{want}]" in r.stdout and "warning" not in r.stderr, r.stderr
    dyn = write_config(tmp_path, "dyn", {**_without(LLAMA_3_1_8B, "rope_scaling"), "max_position_embeddings": 128,
                                         "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    r = run_cli("from-hf", dyn, "--write", tmp_path / "dyn.yaml")
    assert r.returncode == 0, r.stderr
    assert {v.seq_len for v in gvariants.load(tmp_path / "dyn.yaml")} == {128}
    r = run_cli("from-hf", dyn, "--batch", "1", "--prefill-chunks", "256")  # (the message names that default)
    assert r.returncode == 2 and "default 128" in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_absent_max_position_embeddings_is_transformers_default(tmp_path, model_type):
    """A config.json without max_position_embeddings is read with the config class's default, as transformers reads
    it (a trial found it taken as unknown): the limit dynamic RoPE is exact up to, yarn's original length, from-hf's
    default cache, and a note that says where the number came from."""
    import transformers as T
    cfg = {"model_type": model_type, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 128, "rope_theta": 1e4,
           "torch_dtype": "bfloat16", "sliding_window": None, "use_sliding_window": False}
    d = write_config(tmp_path, "plain", cfg)
    want = T.AutoConfig.from_pretrained(d).max_position_embeddings
    m = hf.map_config(d)
    assert f"no max_position_embeddings in config.json: {want}, transformers' default for {model_type}" in m.notes
    assert hf.trained_positions(m.cfg) == want
    r = run_cli("from-hf", d, "--batch", "1")
    assert r.returncode == 0 and f"seq_len: [{min(4096, want)}]" in r.stdout, r.stderr + r.stdout
    dyn = hf.map_config(write_config(tmp_path, "dyn", {**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    assert dyn.limit.size == want
    yarn = write_config(tmp_path, "yarn", {**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert hf.model_entry(yarn)[1]["rope_scaling"]["original_max_position_embeddings"] == want


def test_yarn_context_is_factor_times_the_original_length(tmp_path):
    """yarn RoPE scaling extends the pretraining length by its factor, and Qwen2.5's model cards leave
    max_position_embeddings at the original length beside it: a cache within factor x original is not warned of
    (a trial found "never trained" said of a yarn model's whole extended context), one past it is, naming that
    context; without yarn the limit stays max_position_embeddings."""
    cfg = {"model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 128, "rope_theta": 1e6,
           "torch_dtype": "bfloat16", "max_position_embeddings": 32768, "use_sliding_window": False,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    d = write_config(tmp_path, "yarn", cfg)
    m = hf.map_config(d)
    assert hf.trained_positions(m.cfg, m.fields["rope_scaling"]) == 131072
    assert hf.trained_positions(m.cfg) == 32768  # (the field alone)
    r = run_cli("from-hf", d, "--seq-len", "65536,131072")
    assert r.returncode == 0 and "never trained" not in r.stderr + r.stdout, r.stderr
    r = run_cli("from-hf", d, "--seq-len", "262144")
    warn = ("seq_len 262144 is longer than the 131072 positions yarn RoPE scaling extends max_position_embeddings "
            "32768 to: positions past it were never trained")
    assert r.returncode == 0 and warn in r.stderr and f"# warning: {warn}" in r.stdout, r.stderr
    plain = write_config(tmp_path, "plain", {**cfg, "rope_scaling": None})
    assert "longer than max_position_embeddings 32768" in run_cli("from-hf", plain, "--seq-len", "65536").stderr


def test_transformers5_rope_parameters_layout(tmp_path):
    old = hf.model_entry(write_config(tmp_path, "a", LLAMA_3_1_8B))[1]
    cfg = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")}
    cfg["rope_parameters"] = {**LLAMA_3_1_8B["rope_scaling"], "rope_theta": 500000.0}
    cfg["dtype"] = "bfloat16"
    assert hf.model_entry(write_config(tmp_path, "b", cfg))[1] == old
    # default rope_type: no scaling; no rope at all: theta 10000
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    fields = hf.model_entry(write_config(tmp_path, "c", cfg))[1]
    assert "rope_scaling" not in fields and fields["rope_theta"] == 123456.0
    del cfg["rope_parameters"]
    fields = hf.model_entry(write_config(tmp_path, "d", cfg))[1]
    assert "rope_scaling" not in fields and fields["rope_theta"] == 10000.0


def test_qwen_yarn_recipe_maps_with_transformers_defaults(tmp_path):
    """Qwen2.5's long-context recipe (config.json's legacy rope_scaling {type: yarn, factor: 4,
    original_max_position_embeddings: 32768}) maps with every parameter transformers leaves to its defaults resolved;
    an attention_factor given is kept, mscale / mscale_all_dim give their ratio, and a null factor is
    max_position_embeddings / original."""
    recipe = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    _, fields = hf.model_entry(write_config(tmp_path, "q", {**QWEN2_5_7B, "rope_scaling": recipe}))
    assert fields["rope_scaling"] == pytest.approx({"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "attention_factor": 0.1 * math.log(4) + 1,
                                                    "truncate": True})
    for extra, af in (({"attention_factor": 1.5}, 1.5),
                      ({"mscale": 1.0, "mscale_all_dim": 0.5}, (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))):
        _, fields = hf.model_entry(write_config(tmp_path, "q", {**QWEN2_5_7B, "rope_scaling": {**recipe, **extra}}))
        assert fields["rope_scaling"]["attention_factor"] == pytest.approx(af)
    cfg = {**QWEN2_5_7B, "max_position_embeddings": 131072, "rope_scaling": {**recipe, "factor": None}}
    _, fields = hf.model_entry(write_config(tmp_path, "q", cfg))
    assert fields["rope_scaling"]["factor"] == 4.0


ROPE_FORMS = [  # (model_type, config.json's RoPE fields): the forms transformers resolves differently
    ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}}),  # (original: max_pos)
    ("llama", {"original_max_position_embeddings": 4096,  # (a top-level value wins over the dict's)
               "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                                "beta_fast": 16, "beta_slow": 2, "truncate": False}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0}}),  # (one mscale alone: unused)
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": None}}),  # (null: no truncation)
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8192,
                                "attention_factor": 1.25}}),
    # llama3's band with high_freq_factor not above low_freq_factor (transformers warns and runs it)
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                                "original_max_position_embeddings": 8192}}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192}}),
]


@pytest.mark.parametrize("model_type,rope", ROPE_FORMS)
def test_rope_frequencies_and_factor_equal_transformers(tmp_path, model_type, rope):
    """host.inv_freq and host.rope_attention of the mapped entry are transformers' rotary embedding's inv_freq (bit
    for bit) and attention_scaling, for each form of yarn's parameters config.json may give, and llama3's with an
    empty smoothing band."""
    import transformers as T
    from generator import host
    cfg = {"model_type": model_type, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 128,
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "torch_dtype": "bfloat16", **rope}
    d = write_config(tmp_path, model_type, cfg)
    m = hf.model_from_hf(d)
    config = T.AutoConfig.from_pretrained(d)
    rot = {"llama": T.models.llama.modeling_llama.LlamaRotaryEmbedding,
           "qwen2": T.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
           "qwen3": T.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding}[model_type](config)
    assert torch.equal(host.inv_freq(m), rot.inv_freq)
    assert host.rope_attention(m) == pytest.approx(rot.attention_scaling, rel=1e-12)


def test_defaults_and_names(tmp_path):
    minimal = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 1024,
               "num_hidden_layers": 2}
    name, fields = hf.model_entry(write_config(tmp_path, "My Model (v2)!", minimal))
    assert name == "my-model-v2"
    assert fields["kv_heads"] == 8 and fields["head_dim"] == 64 and fields["rope_theta"] == 10000.0
    assert fields["activation"] == "silu" and fields["dtype"] == "bf16" and fields["qkv_bias"] is False
    # a hub cache snapshot is named after its repository, not its commit hash
    snap = tmp_path / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "0123abcd"
    assert hf.model_entry(write_config(snap.parent, snap.name, LLAMA_3_2_1B))[0] == "llama-3.2-1b"
    # nothing usable in the directory name: the model_type
    assert hf.model_entry(write_config(tmp_path, "___", minimal))[0] == "llama"
    assert hf.model_entry(write_config(tmp_path, "x", minimal), name="mine")[0] == "mine"
    # qwen3's default head_dim is 128, not hidden/heads
    q3 = {k: v for k, v in QWEN3_1_7B.items() if k != "head_dim"}
    assert hf.model_entry(write_config(tmp_path, "q3", q3))[1]["head_dim"] == 128


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_kv_heads_absent_or_null_read_as_transformers_reads_them(tmp_path, model_type):
    """No num_key_value_heads in config.json: the config class's default (Mistral 8, Qwen2 / Qwen3 32, Llama the
    heads), not the heads (a new user's trial: the kernel was declared with the wrong shape and the checkpoint then
    refused); null: the heads, or refused in one line where the config class refuses it (MistralConfig). Checked
    against transformers' own reading of the same file."""
    cfg = {"model_type": model_type, "hidden_size": 1024, "num_attention_heads": 64, "intermediate_size": 256,
           "num_hidden_layers": 2, "head_dim": 16}
    d = write_config(tmp_path, "absent", cfg)
    want = transformers.AutoConfig.from_pretrained(d).num_key_value_heads
    assert hf.model_entry(d)[1]["kv_heads"] == want
    assert ("no num_key_value_heads" in hf.variant_entry_yaml(d)) == (want != 64)
    null = write_config(tmp_path, "null", {**cfg, "num_key_value_heads": None})
    if model_type == "mistral":  # (transformers 5 refuses it: StrictDataclassFieldValidationError; 4.x took the heads)
        with pytest.raises(hf.HFConfigError, match=r"field 'num_key_value_heads' is null: transformers' MistralConfig"
                                                   r" refuses it \(give an integer, or leave the field out for its "
                                                   r"default 8\)"):
            hf.model_entry(null)
        with pytest.raises(hf.HFConfigError, match=r"refuses it \(give an integer\)$"):  # (8 would not divide 14)
            hf.model_entry(write_config(tmp_path, "null14", {**cfg, "num_attention_heads": 14, "hidden_size": 224,
                                                             "num_key_value_heads": None}))
    else:
        want_null = transformers.AutoConfig.from_pretrained(null).num_key_value_heads
        assert hf.model_entry(null)[1]["kv_heads"] == want_null == 64
    if model_type != "llama":  # a default that cannot serve these heads: said where it came from, in one line
        with pytest.raises(hf.HFConfigError, match=f"no field 'num_key_value_heads': transformers' default for "
                                                   f"{model_type}, {want}, does not divide num_attention_heads 14"):
            hf.model_entry(write_config(tmp_path, "odd", {**cfg, "num_attention_heads": 14, "hidden_size": 224}))
    # given, and not dividing the heads: config.json's names, not variants.yaml's
    with pytest.raises(hf.HFConfigError, match="num_key_value_heads 3 does not divide num_attention_heads 64"):
        hf.model_entry(write_config(tmp_path, "given", {**cfg, "num_key_value_heads": 3}))


def test_float32_checkpoint_maps_to_bf16_with_a_comment(tmp_path):
    d = write_config(tmp_path, "f32", {**QWEN2_5_0_5B, "torch_dtype": "float32"})
    assert hf.model_entry(d)[1]["dtype"] == "bf16"
    text = hf.variant_entry_yaml(d)
    assert any(ln.strip().startswith("#") and "float32" in ln for ln in text.splitlines())
    d16 = write_config(tmp_path, "f16", {**QWEN2_5_0_5B, "torch_dtype": "float16"})
    assert hf.model_entry(d16)[1]["dtype"] == "fp16"


def test_entry_yaml_quotes_names_yaml_would_retype(tmp_path):
    """A name that YAML would read as a number is quoted, as variants.yaml's loader reads it (1e5 and 1e-3 too: the
    loader takes exponent floats as YAML 1.2 does; a trial found them written bare and read back as 100000.0); a
    name not starting with a letter or digit is refused saying so."""
    d = write_config(tmp_path, "1.5", QWEN2_5_0_5B)
    text = hf.variant_entry_yaml(d)
    assert list(yaml.safe_load("models:\n" + text)["models"]) == ["1.5"]
    for name in ("1e5", "1e-3", "1.0e5", "1_0"):
        text = hf.variant_entry_yaml(d, name)
        (v,) = gvariants.parse("matrix: {mode: [decode], batch: [1], seq_len: [64]}\nmodels:\n" + text, "x.yaml")
        assert v.model.name == name, text
    with pytest.raises(gvariants.VariantError, match=r"model name '.inf' must be .*, starting with a letter or digit"):
        hf.variant_entry_yaml(d, ".inf")


# ---------------------------------------------------------------------------------------------------------------
# refusals: exit 2, one `error:` line naming the file and the field
# ---------------------------------------------------------------------------------------------------------------

def _without(cfg, *keys):
    return {k: v for k, v in cfg.items() if k not in keys}


REFUSED = [
    ("model_type", {**LLAMA_3_2_1B, "model_type": "mixtral"}),
    # a near-Llama type: the refusal says what keeps it out (a new user's trial: it named only the type)
    ("'granite': supported are llama, mistral, qwen2, qwen3 (granite has embedding, residual and attention "
     "multipliers and a logit divisor)", {**LLAMA_3_2_1B, "model_type": "granite"}),
    ("(gemma2 has RMSNorm scaled by (1 + weight)", {**LLAMA_3_2_1B, "model_type": "gemma2"}),
    ("(phi3 has fused qkv_proj and gate_up_proj weights)", {**LLAMA_3_2_1B, "model_type": "phi3"}),
    ("model_type", _without(LLAMA_3_2_1B, "model_type")),
    # a window is checked against seq_len where that is known (tests/test_hf_faults.py); here only a bad one
    ("sliding_window", {**MISTRAL_7B_V0_3, "sliding_window": 0}),
    ("layer_types", {**QWEN2_5_7B, "layer_types": ["full_attention"] * 27 + ["sliding_attention"]}),
    ("num_local_experts", {**MISTRAL_7B_V0_3, "num_local_experts": 8}),
    ("num_experts", {**QWEN2_5_7B, "num_experts": 64}),
    ("rope_scaling.rope_type", {**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "longrope", "factor": 4.0,
                                                                  "original_max_position_embeddings": 32768}}),
    ("rope_scaling.truncate", {**QWEN2_5_7B, "rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": "no"}}),
    # (transformers: factor a required key, a null original length a division by None)
    ("rope_scaling.factor", {**QWEN2_5_7B, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 8}}),
    ("original_max_position_embeddings' is null", {**QWEN2_5_7B, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": None}}),
    ("rope_scaling.attention_factor", {**QWEN2_5_7B, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                      "attention_factor": -1.0}}),
    ("rope_scaling.type", {**QWEN2_5_7B, "rope_scaling": {"type": "longrope", "factor": 2.0}}),
    ("rope_scaling.factor", {**QWEN2_5_7B, "rope_scaling": {"type": "linear"}}),  # (linear: its factor needed)
    ("rope_scaling.factor", {**QWEN2_5_7B, "rope_scaling": {"rope_type": "linear", "factor": "2"}}),
    ("rope_parameters.factor", {**_without(LLAMA_3_1_8B, "rope_scaling"),  # (dynamic: its factor needed)
                                "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5}}),
    ("max_position_embeddings", {**_without(LLAMA_3_1_8B, "rope_scaling"), "max_position_embeddings": None,
                                 "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),  # (absent: the default)
    # (transformers 5's config classes refuse a null or a non-integer: a null was read as no limit, a trial found)
    ("'max_position_embeddings' is null: transformers refuses it (give an integer, or leave the field out for "
     "llama's default 2048)", {**LLAMA_3_2_1B, "max_position_embeddings": None}),
    ("'max_position_embeddings' must be an integer, got '4096'", {**QWEN2_5_7B, "max_position_embeddings": "4096"}),
    ("'rope_parameters.rope_theta' is null: transformers fails on it", {
        **_without(LLAMA_3_2_1B, "rope_scaling"), "rope_parameters": {"rope_type": "default", "rope_theta": None}}),
    ("rope_scaling.low_freq_factor", {**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                        "high_freq_factor": 4.0}}),
    ("partial_rotary_factor", {**LLAMA_3_2_1B, "partial_rotary_factor": 0.5}),
    ("hidden_act", {**LLAMA_3_2_1B, "hidden_act": "gelu_pytorch_tanh"}),
    ("hidden_act", {**LLAMA_3_2_1B, "hidden_act": "relu"}),
    ("torch_dtype", {**LLAMA_3_2_1B, "torch_dtype": "int8"}),
    ("attention_bias", {**LLAMA_3_2_1B, "attention_bias": True}),
    ("mlp_bias", {**LLAMA_3_2_1B, "mlp_bias": True}),
    ("quantization_config", {**QWEN2_5_7B, "quantization_config": {"quant_method": "awq", "bits": 4}}),
    ("use_mrope", {**QWEN2_5_7B, "use_mrope": True}),
    ("hidden_size", _without(LLAMA_3_2_1B, "hidden_size")),
    ("num_hidden_layers", {**LLAMA_3_2_1B, "num_hidden_layers": "16"}),
    # variants.yaml's field named with config.json's beside it; a shape only the fused kernels refuse: where it runs
    ("field 'intermediate' (config.json's intermediate_size) must be a multiple of 16 (tensor-core tiles), got 700; "
     "`megakernel generate` serves this checkpoint with the unfused PyTorch layers",
     {**LLAMA_3_2_1B, "intermediate_size": 700}),
    ("head_dim", {**LLAMA_3_2_1B, "head_dim": 72}),      # the variants.yaml rule (multiple of 16), via parse_model
    # no head_dim: derived as transformers does, and the message says from what
    ("hidden_size 2000 // num_attention_heads 16", {**_without(LLAMA_3_2_1B, "head_dim"), "hidden_size": 2000,
                                                    "num_attention_heads": 16,
                                                    "num_key_value_heads": 4}),
    ("num_key_value_heads 7 does not divide", {**LLAMA_3_2_1B, "num_key_value_heads": 7}),
    # transformers 5's config classes refuse these types (a string "false" would read as true)
    ("use_sliding_window", {**QWEN2_5_7B, "use_sliding_window": "false"}),
    ("attention_bias", {**LLAMA_3_2_1B, "attention_bias": "false"}),
    ("'use_mrope' must be true or false", {**QWEN2_5_7B, "use_mrope": "false"}),
    ("head_dim", {**QWEN3_1_7B, "head_dim": None}),  # (Qwen3Config: an int; absent: 128)
    ("torch_dtype", {**LLAMA_3_2_1B, "torch_dtype": "torch.float16"}),
    ("tie_word_embeddings", {**LLAMA_3_2_1B, "tie_word_embeddings": "false"}),
    ("vocab_size", {**LLAMA_3_2_1B, "vocab_size": None}),
    ("vocab_size", {**LLAMA_3_2_1B, "vocab_size": 1.5e5}),
]


@pytest.mark.parametrize("field,cfg", REFUSED, ids=[f"{i}-{f}" for i, (f, _) in enumerate(REFUSED)])
def test_refusals_exit_2_with_one_error_line(tmp_path, field, cfg):
    d = write_config(tmp_path, "model", cfg)
    with pytest.raises((hf.HFConfigError, gvariants.VariantError)) as exc:
        hf.model_entry(d)
    assert "\n" not in str(exc.value) and str(d / "config.json") in str(exc.value) and field in str(exc.value)
    r = run_cli("from-hf", d)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert str(d / "config.json") in lines[0] and field in lines[0]


def test_unsupported_model_types_said_are_transformers_types():
    """Each model_type whose refusal names what keeps it out is one transformers knows, and none is supported (a
    misspelt key would never be said)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from generator.hf.config import SUPPORTED_MODEL_TYPES, UNSUPPORTED_WHY
    assert set(UNSUPPORTED_WHY) <= set(CONFIG_MAPPING_NAMES) and not set(UNSUPPORTED_WHY) & set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", None])
def test_unreadable_config_exit_2(tmp_path, content):
    d = tmp_path / "m"
    d.mkdir()
    if content is not None:
        (d / "config.json").write_text(content)
    r = run_cli("from-hf", d)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "config.json" in lines[0], r.stderr


# ---------------------------------------------------------------------------------------------------------------
# --write
# ---------------------------------------------------------------------------------------------------------------

def test_write_appends_and_still_parses(tmp_path):
    vfile = tmp_path / "variants.yaml"
    shutil.copy(ROOT / "variants.yaml", vfile)
    before = gvariants.load(vfile)
    d = write_config(tmp_path, "Mistral-7B-Instruct-v0.3", MISTRAL_7B_V0_3)
    r = run_cli("from-hf", d, "--write", vfile)
    assert r.returncode == 0, r.stderr
    after = gvariants.load(vfile)
    new = [v for v in after if v.model.name == "mistral-7b-instruct-v0.3"]
    assert len(new) == 9 and len(after) == len(before) + 9  # expanded over the file's matrix
    assert vfile.read_text().startswith((ROOT / "variants.yaml").read_text().rstrip("\n"))
    # a second time: refused, file untouched
    text = vfile.read_text()
    r = run_cli("from-hf", d, "--write", vfile)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mistral-7b-instruct-v0.3" in lines[0]
    assert vfile.read_text() == text
    # under another name it goes in
    r = run_cli("from-hf", d, "--write", vfile, "--name", "mistral-b")
    assert r.returncode == 0, r.stderr
    assert "mistral-b" in {v.model.name for v in gvariants.load(vfile)}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".variants.yaml")]  # no temp file left
    assert "never trained" not in r.stderr  # (the file's longest seq_len 32768 is within 32768)
    # a model trained on fewer positions than the file's matrix gives it: said once, as with its own matrix
    short = write_config(tmp_path, "short", {**MISTRAL_7B_V0_3, "max_position_embeddings": 2048})
    r = run_cli("from-hf", short, "--write", vfile, "--name", "mistral-short")
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if "never trained" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: seq_len 32768") and "max_position_embeddings 2048" in warn[0]


def test_write_through_a_symbolic_link_keeps_the_link(tmp_path):
    """A variants file linked in from elsewhere (a config repository): its target gets the entry, the link stays
    (the atomic replace turned the link into a regular file, leaving the real file without the entry)."""
    real = tmp_path / "repo" / "variants.yaml"
    real.parent.mkdir()
    shutil.copy(ROOT / "variants.yaml", real)
    link = tmp_path / "variants.yaml"
    link.symlink_to(real)
    d = write_config(tmp_path, "Mistral-7B-Instruct-v0.3", MISTRAL_7B_V0_3)
    r = run_cli("from-hf", d, "--write", link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert "mistral-7b-instruct-v0.3" in {v.model.name for v in gvariants.load(real)}
    assert not [p for p in real.parent.iterdir() if p.name.startswith(".variants.yaml")]


def test_write_inserts_inside_models_when_other_keys_follow(tmp_path):
    vfile = tmp_path / "v.yaml"
    vfile.write_text("# header\nmodels:\n    a:\n        hidden: 512\n        heads: 8\n        kv_heads: 8\n"
                     "        head_dim: 64\n        intermediate: 1024\n        layers: 2\n        norm: rmsnorm\n"
                     "        norm_eps: 1.0e-5\n        rope_theta: 10000.0\n        activation: silu\n"
                     "        qkv_bias: false\n        qk_norm: false\n        dtype: bf16\n\n"
                     "# the matrix\nmatrix: {mode: [decode], batch: [1], seq_len: [64]}\n")
    d = write_config(tmp_path, "Qwen3-1.7B", QWEN3_1_7B)
    hf.append_entry(vfile, hf.variant_entry_yaml(d))
    names = [v.name for v in gvariants.load(vfile)]
    assert names == ["a_decode_b1_s64_bf16", "qwen3-1.7b_decode_b1_s64_bf16"]
    text = vfile.read_text()
    assert text.index("qwen3-1.7b:") < text.index("# the matrix") < text.index("matrix:")
    assert "\n    qwen3-1.7b:\n      " in text  # the file's own indentation
    # a file with Windows line endings keeps them, every line
    crlf = tmp_path / "crlf.yaml"
    crlf.write_bytes((ROOT / "variants.yaml").read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    hf.append_entry(crlf, hf.variant_entry_yaml(write_config(tmp_path, "Mistral-7B-Instruct-v0.3", MISTRAL_7B_V0_3)))
    raw = crlf.read_bytes()
    assert b"mistral-7b-instruct-v0.3:" in raw and raw.count(b"\n") == raw.count(b"\r\n") > 100


def test_write_refuses_what_would_not_parse(tmp_path):
    vfile = tmp_path / "v.yaml"
    vfile.write_text("models:\n  a: {hidden: 512}\n")  # no matrix anywhere: the new entry could not expand
    original = vfile.read_text()
    d = write_config(tmp_path, "Qwen3-1.7B", QWEN3_1_7B)
    with pytest.raises(gvariants.VariantError):
        hf.append_entry(vfile, hf.variant_entry_yaml(d))
    assert vfile.read_text() == original
    vfile.write_bytes(b"models:\n  a: {hidden: \xff}\n")  # not UTF-8: one line, untouched
    r = run_cli("from-hf", d, "--write", vfile)
    assert r.returncode == 2 and "not UTF-8 text" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert vfile.read_bytes() == b"models:\n  a: {hidden: \xff}\n"
    r = run_cli("from-hf", d, "--write", tmp_path / "no-such-dir" / "v.yaml")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "no-such-dir").exists()


def test_write_starts_a_new_variants_file_and_fills_an_empty_models(tmp_path):
    """--write to a file that does not exist starts one with a default matrix; `models: {}` takes the entry."""
    d = write_config(tmp_path, "Qwen3-1.7B", QWEN3_1_7B)
    new = tmp_path / "new.yaml"
    r = run_cli("from-hf", d, "--write", new)
    assert r.returncode == 0, r.stderr
    vs = gvariants.load(new)
    assert vs and {v.mode for v in vs} == {"decode"} and {v.model.hidden for v in vs} == {2048}
    empty = tmp_path / "empty.yaml"
    empty.write_text("matrix: {mode: [decode], batch: [1], seq_len: [128]}\nmodels: {}   # none yet\n")
    r = run_cli("from-hf", d, "--write", empty)
    assert r.returncode == 0, r.stderr
    assert [v.seq_len for v in gvariants.load(empty)] == [128] and "# none yet" in empty.read_text()
    zero = tmp_path / "zero.yaml"
    zero.write_text("")
    r = run_cli("from-hf", d, "--write", zero)
    assert r.returncode == 0, r.stderr
    assert gvariants.load(zero)


# ---------------------------------------------------------------------------------------------------------------
# tiny random models: our reference layer == transformers' decoder layer
# ---------------------------------------------------------------------------------------------------------------

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


LLAMA3_TINY_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}  # wavelengths 16..64: all three bands in play
LINEAR_TINY_SCALING = {"rope_type": "linear", "factor": 4.0}
YARN_TINY_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # ramp over dims 6..12
YARN_TINY_MAPPED = {**YARN_TINY_SCALING, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.1 * math.log(4) + 1,
                    "truncate": True}  # (transformers' defaults, resolved)
SCALING = {"llama3-scaling": LLAMA3_TINY_SCALING, "linear-scaling": LINEAR_TINY_SCALING,  # the scaled kinds: as mapped
           "yarn-scaling": YARN_TINY_MAPPED}


def tiny_models():
    T = transformers
    no_hd = {k: v for k, v in TINY.items() if k != "head_dim"}
    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(TINY, **rope_kwargs(T.LlamaConfig, 10000.0))),
        "llama3-scaling": (T.LlamaConfig, T.LlamaForCausalLM, dict(
            TINY, **rope_kwargs(T.LlamaConfig, 500000.0, LLAMA3_TINY_SCALING))),
        "linear-scaling": (T.LlamaConfig, T.LlamaForCausalLM, dict(
            TINY, **rope_kwargs(T.LlamaConfig, 500000.0, LINEAR_TINY_SCALING))),
        "yarn-scaling": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(  # (Qwen's long-context recipe)
            no_hd, tie_word_embeddings=True, **rope_kwargs(T.Qwen2Config, 1e6, YARN_TINY_SCALING))),
        "qwen2-bias": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(
            no_hd, tie_word_embeddings=True, **rope_kwargs(T.Qwen2Config, 1e6))),
        "qwen3-qknorm": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(
            TINY, num_attention_heads=8, rms_norm_eps=1e-6, **rope_kwargs(T.Qwen3Config, 1e6))),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(
            TINY, sliding_window=None, **rope_kwargs(T.MistralConfig, 1e6))),
        "mistral-window": (T.MistralConfig, T.MistralForCausalLM, dict(  # (the step at 37 sees rows 22 .. 37)
            TINY, sliding_window=16, **rope_kwargs(T.MistralConfig, 1e6))),
    }


def make_tiny(kind: str, tmp_path: Path, seed: int = 0, save_dtype=None):
    cfg_cls, model_cls, kwargs = tiny_models()[kind]
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    if save_dtype is not None:
        model = model.to(save_dtype)
    d = tmp_path / f"tiny-{kind}"
    model.save_pretrained(d)
    return model, d


@pytest.mark.parametrize("kind", list(tiny_models()))
def test_reference_layer_equals_transformers(tmp_path, kind):
    model, d = make_tiny(kind, tmp_path)
    m = hf.model_from_hf(d)  # the mapping of the config transformers itself wrote
    cfg = model.config
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim) == (cfg.hidden_size, cfg.num_attention_heads,
                                                           cfg.num_key_value_heads, 64)
    assert m.qkv_bias == (kind in ("qwen2-bias", "yarn-scaling")) and m.qk_norm == (kind == "qwen3-qknorm")
    assert dict(m.rope_scaling or {}) == pytest.approx(SCALING.get(kind, {}))
    assert m.rope_theta == {"llama": 1e4, "llama3-scaling": 5e5, "linear-scaling": 5e5}.get(kind, 1e6)
    B, P, CAP = 2, 37, 64
    ids = torch.randint(0, cfg.vocab_size, (B, P + 1), generator=torch.Generator().manual_seed(1))
    ins, outs, before, after = hf_decode_step(model, ids, P)
    ck = hf._Checkpoint(d)
    pos = torch.full((B,), P, dtype=torch.int32)
    for i in range(m.layers):
        # the weights as load_hf reads them from the safetensors file
        W = {short: ck.get(full) for short, full in ck.check_layer(i).items()}
        assert all(torch.equal(W[k], v) for k, v in model.model.layers[i].state_dict().items())
        k_before, v_before = before[i]
        assert k_before.shape == (B, m.kv_heads, P, m.head_dim)
        kc = torch.zeros(B, m.kv_heads, CAP, m.head_dim)
        vc = torch.zeros_like(kc)
        kc[:, :, :P], vc[:, :, :P] = k_before, v_before
        x = ins[i][:, 0]
        out = reference.decoder_layer(x, pos, W, kc, vc, m)
        err = rel(out, outs[i][:, 0])
        assert err <= 1e-5, f"{kind} layer {i}: relative error {err:.2e}"
        # the appended cache row is transformers' post-RoPE k and v at position P
        assert rel(kc[:, :, P], after[i][0][:, :, P]) <= 1e-5
        assert rel(vc[:, :, P], after[i][1][:, :, P]) <= 1e-5
        assert kc[:, :, P + 1:].abs().sum() == 0


def test_reference_sliding_window_equals_transformers(tmp_path):
    """Mistral's sliding window (transformers' sliding_window_causal mask: query p sees keys p - 15 .. p), in effect
    from position 16: the reference's prompt pass and its decode step at position 40 equal transformers' layers
    (a whole forward, hooks on every layer); full attention gives another output (the case is not vacuous)."""
    T = transformers
    d = tmp_path / "tiny-mistral-window"
    torch.manual_seed(0)
    model = T.MistralForCausalLM(T.MistralConfig(**dict(TINY, sliding_window=16,
                                                        **rope_kwargs(T.MistralConfig, 1e6)))).eval()
    randomize(model, 0)
    model.save_pretrained(d)
    m = hf.model_from_hf(d)
    assert m.sliding_window == 16
    B, P = 2, 40
    ids = torch.randint(0, model.config.vocab_size, (B, P + 1), generator=torch.Generator().manual_seed(1))
    ins, outs, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, a, kw, i=i: ins.__setitem__(i, (a[0] if a else kw["hidden_states"]).detach().clone()),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda mod, a, kw, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out).detach()),
            with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        W = layer.state_dict()
        res = {}
        for label, mm in (("window", m), ("full", dataclasses.replace(m, sliding_window=None))):
            kc = torch.zeros(B, m.kv_heads, 64, m.head_dim)
            vc = torch.zeros_like(kc)
            prompt = reference.prefill_layer(ins[i][:, :P], torch.zeros(B, dtype=torch.int32), W, kc, vc, mm)
            step = reference.decoder_layer(ins[i][:, P], torch.full((B,), P), W, kc, vc, mm)
            res[label] = (rel(prompt, outs[i][:, :P]), rel(step, outs[i][:, P]))
        assert max(res["window"]) <= 1e-5 < 1e-3 < min(res["full"]), (i, res)


@pytest.mark.parametrize("kind", list(SCALING))
def test_rope_scaling_changes_the_result(tmp_path, kind):
    """The scaled cases are not vacuous: the same layer without scaling gives a different output."""
    model, d = make_tiny(kind, tmp_path)
    m = hf.model_from_hf(d)
    B, P = 2, 37
    ids = torch.randint(0, 128, (B, P + 1), generator=torch.Generator().manual_seed(1))
    ins, outs, before, _ = hf_decode_step(model, ids, P)
    W = model.model.layers[0].state_dict()
    res = {}
    for label, mm in (("scaled", m), ("plain", gvariants.Model(**{**m.__dict__, "rope_scaling": None}))):
        kc = torch.zeros(B, m.kv_heads, 64, m.head_dim)
        vc = torch.zeros_like(kc)
        kc[:, :, :P], vc[:, :, :P] = before[0]
        res[label] = rel(reference.decoder_layer(ins[0][:, 0], torch.full((B,), P), W, kc, vc, mm), outs[0][:, 0])
    assert res["scaled"] <= 1e-5 < 1e-3 < res["plain"]


# ---------------------------------------------------------------------------------------------------------------
# load_hf: checkpoint problems are found from the safetensors headers, before the build dir or CUDA
# ---------------------------------------------------------------------------------------------------------------

def _rewrite_single(d: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return f


@pytest.fixture
def tiny_llama(tmp_path):
    return make_tiny("llama", tmp_path)[1]


def test_load_hf_missing_tensor(tiny_llama, tmp_path):
    f = _rewrite_single(tiny_llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(hf.HFCheckpointError) as exc:
        hf.load_hf(tiny_llama, 1, variant="nothing-built", build_dir=tmp_path / "no-build", device="cpu")
    msg = str(exc.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and str(f) in msg and "\n" not in msg
    assert not torch.cuda.is_initialized()


def test_load_hf_wrong_shape(tiny_llama, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:64].clone()
    f = _rewrite_single(tiny_llama, edit)
    with pytest.raises(hf.HFCheckpointError) as exc:
        hf.load_hf(tiny_llama, 0, variant="nothing-built", build_dir=tmp_path / "no-build", device="cuda")
    msg = str(exc.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and str(f) in msg and "(64, 256)" in msg
    assert "(128, 256)" in msg
    assert not torch.cuda.is_initialized()


def test_load_hf_tensor_the_kernel_does_not_compute(tiny_llama, tmp_path):
    f = _rewrite_single(tiny_llama, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias",
                                                             torch.zeros(256)))
    with pytest.raises(hf.HFCheckpointError) as exc:
        hf.load_hf(tiny_llama, 0, variant="nothing-built", build_dir=tmp_path / "no-build")
    assert "model.layers.0.self_attn.o_proj.bias" in str(exc.value) and str(f) in str(exc.value)


def test_load_hf_sharded_checkpoint_names_the_shard(tmp_path):
    from safetensors.torch import load_file, save_file
    model, _ = make_tiny("qwen2-bias", tmp_path)
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="300KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    ck = hf._Checkpoint(d)
    for i in range(3):
        ck.check_layer(i)  # every layer is found across the shards
    name = "model.layers.2.self_attn.v_proj.bias"
    shard = d / index[name]
    tensors = load_file(str(shard))
    tensors[name] = torch.zeros(3)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(hf.HFCheckpointError) as exc:
        hf.load_hf(d, 2, variant="x", build_dir=tmp_path / "no-build")
    assert name in str(exc.value) and str(shard) in str(exc.value) and "(3,)" in str(exc.value)
    # listed in the index but absent from its shard
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(hf.HFCheckpointError) as exc:
        hf.load_hf(d, 2, variant="x", build_dir=tmp_path / "no-build")
    assert name in str(exc.value) and str(shard) in str(exc.value)
    # not in the index at all
    index_doc = json.loads((d / "model.safetensors.index.json").read_text())
    del index_doc["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    with pytest.raises(hf.HFCheckpointError) as exc:
        hf.load_hf(d, 2, variant="x", build_dir=tmp_path / "no-build")
    assert name in str(exc.value) and "model.safetensors.index.json" in str(exc.value)
    # an index that is no JSON, or JSON without a weight_map: each said as such, in one line
    for text, want in (("{bad", r"index.json: not valid JSON \(Expecting property name"),
                       ('{"metadata": {}}', r"index.json: not a checkpoint index \(no 'weight_map' object\)$")):
        (d / "model.safetensors.index.json").write_text(text)
        with pytest.raises(hf.HFCheckpointError, match=want):
            hf._Checkpoint(d)


def test_load_hf_bad_layer_index_and_no_checkpoint(tiny_llama, tmp_path):
    with pytest.raises(hf.HFConfigError, match="num_hidden_layers"):
        hf.load_hf(tiny_llama, 3, variant="x", build_dir=tmp_path / "no-build")
    d = write_config(tmp_path, "config-only", QWEN3_1_7B)
    with pytest.raises(hf.HFCheckpointError, match="model.safetensors"):
        hf.load_hf(d, 0, variant="x", build_dir=tmp_path / "no-build")


def test_load_hf_then_needs_a_build(tiny_llama, tmp_path):
    from generator.loader import LoadError
    with pytest.raises(LoadError, match="megakernel build"):
        hf.load_hf(tiny_llama, 0, variant="x", build_dir=tmp_path / "no-build")


def test_load_hf_refuses_a_variant_that_computes_another_layer(tiny_llama, tmp_path, monkeypatch):
    m = hf.model_from_hf(tiny_llama)
    other = gvariants.Variant(gvariants.Model(**{**m.__dict__, "norm_eps": 1e-6}), "decode", 1, 64)
    monkeypatch.setattr(hf.model, "_built_variant", lambda name, build_dir: other)
    with pytest.raises(hf.HFConfigError, match="norm_eps"):
        hf.load_hf(tiny_llama, 0, variant=other.name, build_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# FusedModel plumbing on the CPU, with the reference standing in for the kernel
# ---------------------------------------------------------------------------------------------------------------

class ReferenceLayer:
    """What loader.load returns, computed by generator.reference (fp32 caches) instead of the cubin."""

    def __init__(self, variant, weights, device):
        self.variant, self.model, self.device = variant, variant.model, torch.device(device)
        self.W = weights
        shape = (variant.batch, self.model.kv_heads, variant.seq_len, self.model.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)

    def check_positions(self, pos):
        assert 0 <= int(pos.min()) and int(pos.max()) < self.variant.seq_len

    def __call__(self, x, pos, *, validate=True):
        return reference.decoder_layer(x, pos, self.W, self.k_cache, self.v_cache, self.model).to(x.dtype)


@pytest.mark.parametrize("kind", ["llama3-scaling", "qwen2-bias", "qwen3-qknorm"])
def test_fused_model_plumbing_matches_transformers(tmp_path, monkeypatch, kind):
    from generator import loader
    model, d = make_tiny(kind, tmp_path)
    m = hf.model_from_hf(d, name="tiny")
    B, T, NEW = 2, 5, 12
    v = gvariants.Variant(m, "decode", B, 32)
    loads = []
    monkeypatch.setitem(reference.TORCH_DTYPES, "bf16", torch.float32)  # exact comparison: fp32 end to end
    monkeypatch.setattr(hf.model, "_built_variant", lambda name, build_dir: v)
    monkeypatch.setattr(loader, "load", lambda name, weights, build_dir, device:
                        loads.append(name) or ReferenceLayer(v, weights, device))
    fm = hf.FusedModel.from_hf(d, variant=v.name, build_dir=tmp_path / "b", device="cpu")
    assert loads == [v.name] * m.layers and fm.vocab == model.config.vocab_size
    assert (fm.lm_head is fm.embed) == (kind == "qwen2-bias")  # tie_word_embeddings

    prompt = torch.randint(0, fm.vocab, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)
        ref_logits = model(input_ids=ref_seq).logits
    assert ref_seq.shape == (B, T + NEW)
    for t in range(T + NEW - 1):
        ours = fm.step(ref_seq[:, t], torch.full((B,), t, dtype=torch.int32))
        assert ours.dtype == torch.float32 and ours.shape == (B, fm.vocab)
        assert rel(ours, ref_logits[:, t]) <= 1e-4, f"step {t}"
    out = fm.generate(prompt, NEW)
    assert torch.equal(out, ref_seq)
    with pytest.raises(ValueError, match="batch"):
        fm.step(torch.zeros(B + 1, dtype=torch.long), torch.zeros(B + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_len"):
        fm.generate(prompt, 32)


def test_mlp_bias_is_llamas_field_only(tmp_path):
    """mlp_bias: only LlamaConfig's MLP reads it (refused there: REFUSED); qwen2, qwen3 and mistral have no MLP
    bias whatever the field says, as transformers builds them: mapped as without it."""
    for name, cfg in (("qwen2", QWEN2_5_7B), ("qwen3", QWEN3_1_7B), ("mistral", MISTRAL_7B_V0_3)):
        _, a = hf.model_entry(write_config(tmp_path, f"{name}-a", {**cfg, "mlp_bias": True}))
        _, b = hf.model_entry(write_config(tmp_path, f"{name}-b", cfg))
        assert a == b, name


def test_vocab_size_and_tie_read_as_transformers_reads_them(tmp_path):
    """vocab_size absent: the config class's default (LlamaConfig 32000), which transformers then refuses against
    an embedding of other rows; null or not an integer: refused; tie_word_embeddings must be a boolean (a string
    "false" is refused, not read as true). Each one line naming config.json."""
    _, d = make_tiny("llama", tmp_path)
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for edit, match in ((lambda c: c.pop("vocab_size"), "has no field 'vocab_size', so transformers takes its default 32000"),
                        (lambda c: c.update(vocab_size=None), "field 'vocab_size' must be an integer, got None"),
                        (lambda c: c.update(tie_word_embeddings="false"),
                         "field 'tie_word_embeddings' must be true or false, got 'false'")):
        c = dict(cfg)
        edit(c)
        cfg_path.write_text(json.dumps(c))
        with pytest.raises((hf.HFCheckpointError, hf.HFConfigError)) as exc:
            hf.FusedModel.from_hf(d, variant="x", build_dir=tmp_path / "no-build")
        assert match in str(exc.value) and "\n" not in str(exc.value) and str(cfg_path) in str(exc.value)


def test_generation_config_logits_processors_are_named(tmp_path):
    """generation_config.json's logits-processing fields that transformers' generate() applies (repetition penalty,
    n-gram ban, suppressed tokens, a minimum length, ...) and `megakernel generate` does not: listed for its note;
    no-op values and absent files list nothing."""
    from generator.cli import processors_ignored
    g = tmp_path / "generation_config.json"
    assert processors_ignored(tmp_path) == ""
    g.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05,
                             "eos_token_id": [2, 3]}))
    assert processors_ignored(tmp_path) == "generation_config.json sets repetition_penalty 1.05"
    g.write_text(json.dumps({"eos_token_id": 2, "min_new_tokens": 10, "suppress_tokens": [5, 6],
                             "no_repeat_ngram_size": 3, "repetition_penalty": 1.0}))
    assert processors_ignored(tmp_path) == ("generation_config.json sets no_repeat_ngram_size 3, min_new_tokens 10, "
                                            "suppress_tokens [5, 6]")
    g.write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    assert processors_ignored(tmp_path) == ""
    g.unlink()  # (no such file: transformers takes config.json's generation fields)
    write_config(tmp_path, ".", {**LLAMA_3_2_1B, "repetition_penalty": 1.2})
    assert processors_ignored(tmp_path) == "config.json sets repetition_penalty 1.2"


def test_fused_model_needs_lm_head_unless_tied(tmp_path):
    from safetensors.torch import load_file, save_file
    _, d = make_tiny("llama", tmp_path)
    f = d / "model.safetensors"
    t = load_file(str(f))
    del t["lm_head.weight"]
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(hf.HFCheckpointError, match="lm_head.weight"):
        hf.FusedModel.from_hf(d, variant="x", build_dir=tmp_path / "no-build")


# ---------------------------------------------------------------------------------------------------------------
# the user's path end to end, up to the GPU: from-hf --write, megakernel build (nvcc needs no device), load_hf
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built_tiny(tmp_path_factory):
    try:
        from cupy.cuda import get_nvcc_path
        nvcc = get_nvcc_path()
    except Exception:  # noqa: BLE001 - no CuPy or no CUDA toolkit: nothing to build with
        nvcc = None
    if not nvcc:
        pytest.skip("no nvcc: cannot build a variant")
    root = tmp_path_factory.mktemp("hf_build")
    _, d = make_tiny("llama", root)  # saved in fp32: mapped to bf16, weights cast when loaded
    vfile = root / "variants.yaml"
    vfile.write_text("matrix: {mode: [decode], batch: [1], seq_len: [64]}\nmodels:\n")
    r = run_cli("from-hf", d, "--write", vfile, cwd=root)
    assert r.returncode == 0, r.stderr
    r = run_cli("build", "--variants", vfile, "--build-dir", root / "build", "-j", "2", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    return d, root / "build", "tiny-llama_decode_b1_s64_bf16"


def test_built_variant_passes_every_check_up_to_the_gpu(built_tiny):
    from generator.loader import LoadError
    d, build, name = built_tiny
    # every check passed: the loader itself refuses a CPU device
    with pytest.raises(ValueError, match="runs on CUDA") as exc:
        hf.load_hf(d, 1, variant=name, build_dir=build, device="cpu")
    assert not isinstance(exc.value, hf.HFConfigError)
    with pytest.raises(ValueError, match="runs on CUDA") as exc:
        hf.FusedModel.from_hf(d, variant=name, build_dir=build, device="cpu")
    assert not isinstance(exc.value, hf.HFConfigError)
    with pytest.raises(LoadError, match="not in"):
        hf.load_hf(d, 1, variant="tiny-llama_decode_b2_s64_bf16", build_dir=build, device="cpu")


def test_built_variant_of_another_shape_is_refused(built_tiny, tmp_path):
    d, build, name = built_tiny
    d2 = tmp_path / "other-eps"
    shutil.copytree(d, d2)
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFConfigError) as exc:
        hf.load_hf(d2, 0, variant=name, build_dir=build, device="cpu")
    msg = str(exc.value)
    assert "norm_eps" in msg and str(d2 / "config.json") in msg and name in msg and "\n" not in msg


def test_from_hf_gives_the_entry_its_own_matrix(tmp_path):
    """from-hf --batch/--seq-len/--prefill-chunks: the entry carries its own matrix (printed and --write), checked
    as variants.yaml checks one and against the sliding window; bad values are one line, nothing written; a window
    shorter than the file's matrix says how to give the entry its own."""
    # (llama's window, which transformers' forward ignores and generate()'s cache applies, is still refused
    # beyond it: the matrix's checks against a window below)
    d = write_config(tmp_path, "mistral", {**MISTRAL_7B_V0_3, "model_type": "llama",
                                           "architectures": ["LlamaForCausalLM"], "sliding_window": 4096})
    r = run_cli("from-hf", d, "--batch", "1,4", "--seq-len", "2048")
    assert r.returncode == 0 and "    matrix: {mode: [decode], batch: [1, 4], seq_len: [2048]}" in r.stdout, r.stderr
    f = tmp_path / "v.yaml"
    r = run_cli("from-hf", d, "--write", f, "--batch", "2", "--prefill-chunks", "64,512")
    assert r.returncode == 0 and f"started {f}" in r.stderr, r.stderr
    names = sorted(v.name for v in gvariants.load(f))
    assert names == ["mistral_decode_b2_s4096_bf16", "mistral_prefill_b2_s512_bf16", "mistral_prefill_b2_s64_bf16"]
    before = f.read_text()
    f.write_text(before.replace("seq_len: [4096]}\nmodels:", "seq_len: [4096, 8192]}\nmodels:"))
    before = f.read_text()
    r = run_cli("from-hf", d, "--write", f, "--name", "other")  # the file's matrix: 8192 > the window
    assert r.returncode == 2 and "from-hf --seq-len N" in r.stderr, r.stderr
    for args, want in ((["--seq-len", "8192"], "longer than sliding_window 4096"),
                       (["--batch", "1,x"], "--batch: comma-separated integers"),
                       (["--batch", "0"], "--batch: positive integers")):
        r = run_cli("from-hf", d, "--write", f, "--name", "other", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], (args, r.stderr)
    assert f.read_text() == before
    # a cache past the positions the model was trained on: built as asked, said on stderr and in the entry
    d8 = write_config(tmp_path / "short", "mistral", {**MISTRAL_7B_V0_3, "max_position_embeddings": 8192})
    r = run_cli("from-hf", d8, "--seq-len", "4096,32768")
    warn = "seq_len 32768 is longer than max_position_embeddings 8192"
    assert r.returncode == 0 and warn in r.stderr and f"# warning: {warn}" in r.stdout, r.stderr
    assert warn not in run_cli("from-hf", d8, "--seq-len", "8192").stderr


def test_own_matrix_checks_chunks_against_the_cache_and_hints_the_default_seq_len(tmp_path):
    """--prefill-chunks longer than the decode variants' cache is one line; a sliding window shorter than the
    default --seq-len the user never typed says to pass it."""
    d = write_config(tmp_path, "l", LLAMA_3_2_1B)
    r = run_cli("from-hf", d, "--seq-len", "1000", "--prefill-chunks", "512,4096")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "a chunk of 4096 tokens does not fit the decode variants' cache of 1000 rows" in r.stderr
    assert run_cli("from-hf", d, "--seq-len", "1000", "--prefill-chunks", "512").returncode == 0
    d = write_config(tmp_path, "sw", {**LLAMA_3_2_1B, "sliding_window": 2048})
    r = run_cli("from-hf", d, "--prefill-chunks", "1024")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "sliding_window 2048" in r.stderr and "default --seq-len 4096: pass --seq-len" in r.stderr
    assert run_cli("from-hf", d, "--seq-len", "2048", "--prefill-chunks", "1024").returncode == 0


def test_own_matrix_warns_of_variants_the_build_would_refuse(tmp_path):
    """--batch past what a block's shared memory holds (batch 256: the projections' partial sums alone, the rows
    being in global memory past batch 25): the entry is printed, and one warning line per variant the planner
    refuses says why (before the user waits on a build to learn it)."""
    d = write_config(tmp_path, "m", MISTRAL_7B_V0_3)
    r = run_cli("from-hf", d, "--batch", "1,8,256")
    assert r.returncode == 0 and "batch: [1, 8, 256]" in r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: `megakernel build` will refuse")]
    assert len(lines) == 1 and "_decode_b256_" in lines[0] and "a batch of at most 227 fits" in lines[0], r.stderr
    assert "refuse" not in run_cli("from-hf", d, "--batch", "1,8").stderr


def test_write_warns_of_variants_the_files_matrix_makes_that_build_would_refuse(tmp_path):
    """--write into a file whose matrix holds a batch too large for this shape: the entry is appended, and a warning
    line names each of its variants the planner refuses; 0 or a negative in --batch / --prefill-chunks is one error
    line."""
    f = tmp_path / "v.yaml"
    f.write_text("matrix: {mode: [decode], batch: [1, 256], seq_len: [4096]}\nmodels:\n"
                 "  tiny: {hidden: 512, heads: 8, kv_heads: 2, head_dim: 64, intermediate: 1024, layers: 2, "
                 "norm: rmsnorm, norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, "
                 "qk_norm: false, dtype: bf16}\n")
    d = write_config(tmp_path, "m", MISTRAL_7B_V0_3)
    r = run_cli("from-hf", d, "--write", f)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: `megakernel build` will refuse")]
    assert len(lines) == 1 and "m_decode_b256_" in lines[0], r.stderr  # the appended entry's only
    for opt in ("--batch", "--prefill-chunks"):
        r = run_cli("from-hf", d, opt, "0")
        assert r.returncode == 2 and r.stderr.strip() == f"error: {opt}: positive integers, got '0'", r.stderr
