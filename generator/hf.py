"""Hugging Face checkpoints -> variants.yaml entries, fused layers and a whole fused model.

    config.json          -> model_entry / variant_entry_yaml / append_entry   (`megakernel from-hf`)
    *.safetensors shards -> load_hf (one FusedDecoderLayer) / FusedModel (embeddings + every layer + lm_head)

Only what the kernel computes exactly is mapped: a config with anything else (sliding windows, MoE, other RoPE
scalings, tanh-approximated GELU, o_proj or MLP biases, quantized weights) is refused with a one-line
HFConfigError naming the file and the field, never approximated. Checkpoint problems (a missing tensor, a wrong
shape) are found from the safetensors headers, before any tensor is read or anything touches CUDA.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

import yaml

from . import variants as gvariants


class HFConfigError(ValueError):
    """A config.json or checkpoint we cannot map exactly: the message is one line naming the file and the field."""


class HFCheckpointError(HFConfigError):
    """A checkpoint's tensors do not match its config: one line naming the tensor and the file."""


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# hidden_act -> our activation; only functions the kernel computes exactly ("gelu" is HF's exact erf GELU)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
FIELD_ORDER = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "norm", "norm_eps",
               "rope_theta", "rope_scaling", "activation", "qkv_bias", "qk_norm", "dtype")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# buffers some old checkpoints saved with the layer: recomputed from the config, never used as weights
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------------------------
# config.json -> variants.yaml entry
# ---------------------------------------------------------------------------------------------------------------

def config_path(path) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_config(path) -> tuple[Path, dict]:
    cfg_path = config_path(path)
    try:
        text = cfg_path.read_text()
    except FileNotFoundError:
        raise HFConfigError(f"{cfg_path}: no such file (give a model directory holding config.json, or the "
                            "config.json itself)") from None
    except OSError as exc:
        raise HFConfigError(f"{cfg_path}: cannot read: {exc.strerror}") from None
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise HFConfigError(f"{cfg_path}: not valid JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{cfg_path}: top level must be a JSON object, got {type(cfg).__name__}")
    return cfg_path, cfg


def default_name(cfg_path: Path, model_type: str) -> str:
    """The model directory's name, lower-cased, sanitised to [a-z0-9._-]; for a hub cache snapshot
    (models--org--Name/snapshots/<hash>/) the repository's name; the model_type when nothing usable is left."""
    d = cfg_path.resolve().parent
    raw = d.name
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        raw = d.parent.parent.name.split("--")[-1]
    name = re.sub(r"[^a-z0-9._-]+", "-", raw.lower())
    name = re.sub(r"^[^a-z0-9]+", "", name).rstrip("-")
    return name if gvariants.NAME_RE.match(name or "") else model_type


def _check_int(cfg_path, cfg, field, *, default=None, required=True):
    v = cfg.get(field)
    if v is None:
        if default is not None or not required:
            return default
        raise HFConfigError(f"{cfg_path}: missing field '{field}'")
    if isinstance(v, bool) or not isinstance(v, int):
        raise HFConfigError(f"{cfg_path}: field '{field}' must be an integer, got {v!r}")
    if v <= 0:
        raise HFConfigError(f"{cfg_path}: field '{field}' must be positive, got {v}")
    return v


def _check_number(cfg_path, field, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise HFConfigError(f"{cfg_path}: field '{field}' must be a positive number, got {v!r}")
    return float(v)


def _truthy(v) -> bool:
    return v not in (None, False, 0, "", [], {})


def _map_rope(cfg_path, cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either layout: transformers 5's `rope_parameters` dict (holding rope_theta
    and rope_type) or transformers 4's top-level `rope_theta` plus `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if params is not None:
        where = "rope_parameters"
        if not isinstance(params, dict):
            raise HFConfigError(f"{cfg_path}: field 'rope_parameters' must be an object, got {params!r}")
        nested = [k for k, v in params.items() if isinstance(v, dict)]
        if nested:
            raise HFConfigError(f"{cfg_path}: field 'rope_parameters.{nested[0]}': per-layer-type RoPE parameters "
                                "are not supported (one RoPE for every layer only)")
        theta = params.get("rope_theta", cfg.get("rope_theta"))
    else:
        where = "rope_scaling"
        params = cfg.get("rope_scaling")
        if params is not None and not isinstance(params, dict):
            raise HFConfigError(f"{cfg_path}: field 'rope_scaling' must be an object or null, got {params!r}")
        theta = cfg.get("rope_theta")
    theta_field = "rope_parameters.rope_theta" if where == "rope_parameters" and "rope_theta" in params \
        else "rope_theta"
    theta = 10000.0 if theta is None else _check_number(cfg_path, theta_field, theta)

    prf = (params or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None and prf != 1 and prf != 1.0:
        field = f"{where}.partial_rotary_factor" if params and "partial_rotary_factor" in params \
            else "partial_rotary_factor"
        raise HFConfigError(f"{cfg_path}: field '{field}' is {prf!r}: only full-width RoPE (1.0) is supported")
    if not params:
        return theta, None
    type_key = "rope_type" if "rope_type" in params else "type"
    rtype = params.get(type_key)
    if rtype in (None, "default"):
        return theta, None
    if rtype != "llama3":
        raise HFConfigError(f"{cfg_path}: field '{where}.{type_key}' is {rtype!r}: only llama3 RoPE scaling (or "
                            "none) is supported")
    scaling = {"rope_type": "llama3"}
    for key in LLAMA3_KEYS:
        v = params.get(key)
        if key == "original_max_position_embeddings":
            # transformers' precedence: a top-level value, then the rope dict's, then max_position_embeddings
            v = cfg.get(key, v if v is not None else cfg.get("max_position_embeddings"))
            if v is None:
                raise HFConfigError(f"{cfg_path}: missing field '{where}.{key}'")
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise HFConfigError(f"{cfg_path}: field '{where}.{key}' must be a positive integer, got {v!r}")
            scaling[key] = v
        else:
            if v is None:
                raise HFConfigError(f"{cfg_path}: missing field '{where}.{key}' (needed by llama3 RoPE scaling)")
            scaling[key] = _check_number(cfg_path, f"{where}.{key}", v)
    if scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        raise HFConfigError(f"{cfg_path}: field '{where}.high_freq_factor' must differ from low_freq_factor")
    return theta, scaling


def _refuse_unsupported(cfg_path, cfg, model_type):
    for field in MOE_FIELDS:
        v = cfg.get(field)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            raise HFConfigError(f"{cfg_path}: field '{field}' is {v}: mixture-of-experts layers are not supported")
    if cfg.get("quantization_config") is not None:
        raise HFConfigError(f"{cfg_path}: field 'quantization_config' is set: quantized checkpoints are not "
                            "supported (bf16/fp16/fp32 weights only)")
    if _truthy(cfg.get("use_mrope")):
        raise HFConfigError(f"{cfg_path}: field 'use_mrope' is true: multimodal RoPE is not supported")
    # sliding-window attention: the kernel always attends to the whole cache
    window = cfg.get("sliding_window")
    if _truthy(cfg.get("use_sliding_window")) and window is not None:
        raise HFConfigError(f"{cfg_path}: field 'use_sliding_window' is true (sliding_window {window}): "
                            "sliding-window attention is not supported")
    if model_type == "mistral" and window is not None:
        max_pos = cfg.get("max_position_embeddings")
        if not isinstance(max_pos, int) or window < max_pos:
            raise HFConfigError(f"{cfg_path}: field 'sliding_window' is {window} (max_position_embeddings "
                                f"{max_pos}): sliding-window attention is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        bad = [t for t in layer_types if t != "full_attention"] if isinstance(layer_types, list) else [layer_types]
        if bad:
            raise HFConfigError(f"{cfg_path}: field 'layer_types' lists {bad[0]!r}: only full_attention layers are "
                                "supported")
    # biases the kernel does not add: o_proj (attention_bias in llama/qwen3 biases o_proj too) and the MLP's
    if model_type in ("llama", "qwen3") and _truthy(cfg.get("attention_bias")):
        raise HFConfigError(f"{cfg_path}: field 'attention_bias' is true: it adds an o_proj bias too, which the "
                            "kernel does not compute (only qwen2-style q/k/v biases are supported)")
    if _truthy(cfg.get("mlp_bias")):
        raise HFConfigError(f"{cfg_path}: field 'mlp_bias' is true: MLP biases are not supported")


def _map_config(path, name=None) -> tuple[str, dict, list[str], Path, dict]:
    """-> (name, fields in variants.yaml order, notes for YAML comments, config path, raw config)."""
    cfg_path, cfg = read_config(path)
    model_type = cfg.get("model_type")
    if model_type is None:
        raise HFConfigError(f"{cfg_path}: missing field 'model_type'")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(f"{cfg_path}: field 'model_type' is {model_type!r}: supported are "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    notes = []
    hidden = _check_int(cfg_path, cfg, "hidden_size")
    heads = _check_int(cfg_path, cfg, "num_attention_heads")
    kv_heads = _check_int(cfg_path, cfg, "num_key_value_heads", default=heads)
    head_default = 128 if model_type == "qwen3" else None  # Qwen3Config's default head_dim
    head_dim = _check_int(cfg_path, cfg, "head_dim", required=False, default=head_default)
    if head_dim is None:
        if hidden % heads:
            raise HFConfigError(f"{cfg_path}: field 'hidden_size' ({hidden}) is not divisible by "
                                f"num_attention_heads ({heads}) and there is no head_dim")
        head_dim = hidden // heads
    intermediate = _check_int(cfg_path, cfg, "intermediate_size")
    layers = _check_int(cfg_path, cfg, "num_hidden_layers")
    _refuse_unsupported(cfg_path, cfg, model_type)

    eps = cfg.get("rms_norm_eps")
    eps = 1e-6 if eps is None else _check_number(cfg_path, "rms_norm_eps", eps)
    rope_theta, rope_scaling = _map_rope(cfg_path, cfg)

    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise HFConfigError(f"{cfg_path}: field 'hidden_act' is {act!r}: the kernel computes silu or exact (erf) "
                            "gelu only")

    # qwen2 always has q/k/v biases (and none on o_proj); attention_bias elsewhere biases o_proj too (refused
    # above for llama and qwen3; mistral has no biases whatever the field says)
    qkv_bias = model_type == "qwen2"
    qk_norm = model_type == "qwen3"

    dtype_field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    raw_dtype = cfg.get(dtype_field)
    if raw_dtype is None:
        dtype = "bf16"
        notes.append("no dtype/torch_dtype in config.json: bf16 assumed")
    else:
        key = str(raw_dtype).removeprefix("torch.")
        if key not in DTYPES:
            raise HFConfigError(f"{cfg_path}: field '{dtype_field}' is {raw_dtype!r}: supported are "
                                f"{', '.join(DTYPES)}")
        dtype = DTYPES[key]
        if key == "float32":
            notes.append(f"{dtype_field} float32 in config.json: mapped to bf16 (weights are cast when loaded)")

    fields = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "intermediate": intermediate, "layers": layers, "norm": "rmsnorm", "norm_eps": eps,
              "rope_theta": rope_theta, "rope_scaling": rope_scaling, "activation": ACTIVATIONS[act],
              "qkv_bias": qkv_bias, "qk_norm": qk_norm, "dtype": dtype}
    if rope_scaling is None:
        del fields["rope_scaling"]
    if name is None:
        name = default_name(cfg_path, model_type)
    # the same rules as variants.yaml (divisibility, head_dim, name, ...); the message names the config file
    gvariants.parse_model(f"{cfg_path}: variant '{name}'", name, fields)
    return name, fields, notes, cfg_path, cfg


def model_entry(path, name=None) -> tuple[str, dict]:
    """A model directory (or its config.json) -> (variant name, variants.yaml model fields)."""
    name, fields, _, _, _ = _map_config(path, name)
    return name, fields


def model_from_hf(path, name=None) -> gvariants.Model:
    """The validated Model (what Variant(model, "decode", batch, seq_len) needs) of a checkpoint's config."""
    name, fields, _, cfg_path, _ = _map_config(path, name)
    return gvariants.parse_model(f"{cfg_path}: variant '{name}'", name, fields)[0]


def _yaml_line(key, value) -> str:
    """One `key: value` line; a mapping value in flow style ({a: 1, b: 2}), as variants.yaml writes rope_scaling."""
    if isinstance(value, dict):
        flow = yaml.safe_dump(value, sort_keys=False, default_flow_style=True, width=10**9).strip()
        return f"{_yaml_line(key, None).removesuffix(' null')} {flow}"
    return yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False, width=10**9).rstrip("\n")


def variant_entry_yaml(path, name=None) -> str:
    """YAML text of the entry, indented to paste under `models:` (two spaces for the name, four for fields)."""
    name, fields, notes, cfg_path, cfg = _map_config(path, name)
    lines = [f"  # from {cfg_path} (model_type {cfg['model_type']})"]
    lines.append("  " + _yaml_line(name, None).removesuffix(" null"))
    lines += [f"    # {n}" for n in notes]
    lines += ["    " + _yaml_line(k, fields[k]) for k in FIELD_ORDER if k in fields]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# appending to variants.yaml
# ---------------------------------------------------------------------------------------------------------------

_MODELS_LINE = re.compile(r"^models:\s*(#.*)?$")


def _atomic_write_text(path: Path, text: str) -> None:
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise HFConfigError(f"{path}: cannot write variants file: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise HFConfigError(f"{path}: cannot write variants file: {exc.strerror}") from None
        raise


def append_entry(variants_file, text: str) -> None:
    """Append a models entry (variant_entry_yaml's text) under the file's top-level block `models:` mapping,
    atomically; refuses a name already there, and writes nothing unless the result parses as a variants file."""
    path = Path(variants_file)
    try:
        old = path.read_text()
    except OSError as exc:
        raise HFConfigError(f"{path}: cannot read variants file: {exc.strerror}") from None
    try:
        entry = yaml.safe_load("models:\n" + text)
    except yaml.YAMLError as exc:
        raise HFConfigError(f"{path}: the entry to append is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("models"), dict) or len(entry["models"]) != 1:
        raise HFConfigError(f"{path}: the entry to append must be exactly one 'name:' mapping indented under "
                            "models:")
    (new_name,) = entry["models"]
    try:
        doc = yaml.safe_load(old)
    except yaml.YAMLError:
        gvariants.parse(old, str(path))  # raises the VariantError with the line of the syntax error
        raise
    existing = doc.get("models") if isinstance(doc, dict) else None
    if isinstance(existing, dict) and new_name in existing:
        raise HFConfigError(f"{path}: field 'models' already has an entry '{new_name}' (choose another with --name)")

    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if _MODELS_LINE.match(ln.rstrip("\n"))), None)
    if start is None:
        raise HFConfigError(f"{path}: field 'models' not found as a top-level block mapping ('models:' on a line "
                            "of its own)")
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    # blank lines and top-level comments just before the next top-level key belong to that key
    insert = end
    while insert > start + 1 and (not lines[insert - 1].strip() or
                                  (end < len(lines) and lines[insert - 1].startswith("#"))):
        insert -= 1
    # follow the file's indentation of entry names
    indent = next((len(ln) - len(ln.lstrip(" ")) for ln in lines[start + 1:end]
                   if ln.strip() and not ln.lstrip().startswith("#")), 2)
    body = text if text.endswith("\n") else text + "\n"
    if indent != 2:
        def reindent(ln: str) -> str:
            if not ln.strip():
                return ln
            lead = len(ln) - len(ln.lstrip(" "))
            return " " * max(0, lead + indent - 2) + ln[lead:]
        body = "".join(reindent(ln) for ln in body.splitlines(keepends=True))
    before = "".join(lines[:insert])
    if before and not before.endswith("\n"):
        before += "\n"
    new = before + body + "".join(lines[insert:])
    gvariants.parse(new, str(path))  # the result must still be a valid variants file (raises VariantError)
    _atomic_write_text(path, new)


# ---------------------------------------------------------------------------------------------------------------
# safetensors checkpoints -> fused layers
# ---------------------------------------------------------------------------------------------------------------

class _Checkpoint:
    """A model directory: its mapped config and where each tensor lives (from the safetensors headers only)."""

    def __init__(self, path):
        self.cfg_path, self.cfg = read_config(path)
        self.dir = self.cfg_path.parent
        self.model = model_from_hf(self.cfg_path)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        self.files: dict[str, Path] = {}      # tensor name -> shard
        if index.exists():
            self.index_path = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise HFCheckpointError(f"{index}: not a safetensors index (no 'weight_map' object)") from None
            for tensor, shard in weight_map.items():
                self.files[tensor] = self.dir / shard
        elif single.exists():
            self.index_path = single
            for tensor in self._open(single).keys():
                self.files[tensor] = single
        else:
            raise HFCheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json (only "
                                    "safetensors checkpoints are supported)")
        self.prefix = "model." if any(t.startswith("model.layers.") for t in self.files) else ""
        self._handles: dict[Path, object] = {}

    def _open(self, file: Path):
        from safetensors import safe_open
        try:
            return safe_open(str(file), framework="pt")
        except FileNotFoundError:
            raise HFCheckpointError(f"{file}: shard listed in {self.index_path.name} is missing") from None
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise HFCheckpointError(f"{file}: not a readable safetensors file: {str(exc).splitlines()[0]}") \
                from None

    def handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file]

    def where(self, tensor: str) -> Path:
        file = self.files.get(tensor)
        if file is None:
            raise HFCheckpointError(f"{self.index_path}: tensor '{tensor}' is missing")
        if tensor not in self.handle(file).keys():
            raise HFCheckpointError(f"{file}: tensor '{tensor}' is missing (listed in {self.index_path.name})")
        return file

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self.handle(self.where(tensor)).get_slice(tensor).get_shape())

    def check(self, tensor: str, shape: tuple[int, ...]) -> None:
        got = self.shape(tensor)
        if got != tuple(shape):
            raise HFCheckpointError(f"{self.where(tensor)}: tensor '{tensor}' has shape {got}, expected "
                                    f"{tuple(shape)} (from {self.cfg_path.name})")

    def get(self, tensor: str):
        return self.handle(self.where(tensor)).get_tensor(tensor)

    def check_layer(self, i: int) -> dict[str, str]:
        """Shapes of every tensor of layer i against reference.weight_shapes; -> {short name: full name}."""
        from . import reference
        layers = self.model.layers
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers:
            raise HFConfigError(f"{self.cfg_path}: layer_idx {i!r} out of range: field 'num_hidden_layers' is "
                                f"{layers}")
        pre = f"{self.prefix}layers.{i}."
        expected = reference.weight_shapes(self.model)
        names = {}
        for short, shape in expected.items():
            self.check(pre + short, shape)
            names[short] = pre + short
        for tensor in self.files:
            if tensor.startswith(pre) and tensor[len(pre):] not in expected \
                    and not tensor.endswith(IGNORED_SUFFIXES):
                raise HFCheckpointError(f"{self.files[tensor]}: tensor '{tensor}' is not computed by the kernel "
                                        f"(a layer of {self.cfg_path.name}'s shape has: {', '.join(expected)})")
        return names


def _built_variant(name: str, build_dir):
    """The Variant recorded in the build directory's manifest (LoadError naming the build command otherwise)."""
    from . import loader
    entry, _ = loader.find_entry(name, build_dir)
    return loader._variant_from_entry(entry)


_COMPARED = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "norm", "norm_eps", "rope_theta",
             "rope_scaling", "activation", "qkv_bias", "qk_norm")


def _check_variant_fits(ck: _Checkpoint, v) -> None:
    """The built variant must compute exactly this checkpoint's layer (its dtype may differ: weights are cast)."""
    for field in _COMPARED:
        a, b = getattr(v.model, field), getattr(ck.model, field)
        if field == "rope_scaling":
            a, b = dict(a) if a else None, dict(b) if b else None
        if a != b:
            raise HFConfigError(f"{ck.cfg_path}: variant '{v.name}' was built with {field}={a!r} but the config "
                                f"gives {field}={b!r}")


def _variant_name(variant) -> str:
    if isinstance(variant, gvariants.Variant):
        return variant.name
    if not isinstance(variant, str):
        raise TypeError(f"variant: a built variant's name (str), got {type(variant).__name__}")
    return variant


def _load_layer(ck: _Checkpoint, layer_idx: int, name: str, v, build_dir, device):
    from . import loader, reference
    names = ck.check_layer(layer_idx)  # every shape check: headers only, no tensor read, no CUDA
    dtype = reference.TORCH_DTYPES[v.model.dtype]
    weights = {short: ck.get(full).to(device=device, dtype=dtype) for short, full in names.items()}
    return loader.load(name, weights, build_dir=build_dir, device=device)


def load_hf(path, layer_idx: int, variant, build_dir="build", device="cuda"):
    """Layer `layer_idx` of a safetensors checkpoint as a FusedDecoderLayer of the built variant `variant`.

    Checks, in order and before touching CUDA: the config maps (HFConfigError), every tensor of the layer exists
    with the shape the config gives (HFCheckpointError naming the tensor and the file), the variant is built and
    computes exactly this layer (LoadError / HFConfigError). Then the tensors are read, cast to the variant's
    dtype, moved to `device` and handed to generator.loader.load."""
    ck = _Checkpoint(path)
    ck.check_layer(layer_idx)
    name = _variant_name(variant)
    v = _built_variant(name, build_dir)
    _check_variant_fits(ck, v)
    return _load_layer(ck, layer_idx, name, v, build_dir, device)


class FusedModel:
    """A whole checkpoint: embeddings, every layer as a fused kernel, final norm and lm_head in torch.

    The KV caches live in the layers (capacity = the variant's seq_len); every sequence of the batch is at its own
    position, given to step()."""

    def __init__(self, layers, embed, norm_weight, lm_head, model, variant, device):
        self.layers = layers
        self.embed = embed
        self.norm_weight = norm_weight
        self.lm_head = lm_head
        self.model = model          # the checkpoint's Model (config)
        self.variant = variant      # the built Variant (batch, seq_len, dtype)
        self.device = device
        self.dtype = embed.dtype

    @property
    def batch(self) -> int:
        return self.variant.batch

    @property
    def seq_len(self) -> int:
        return self.variant.seq_len

    @property
    def vocab(self) -> int:
        return self.embed.shape[0]

    @classmethod
    def from_hf(cls, path, variant, build_dir="build", device="cuda") -> "FusedModel":
        import torch

        from . import reference
        ck = _Checkpoint(path)
        for i in range(ck.model.layers):  # every tensor checked before anything is read
            ck.check_layer(i)
        H = ck.model.hidden
        embed_name, norm_name = f"{ck.prefix}embed_tokens.weight", f"{ck.prefix}norm.weight"
        vocab = ck.shape(embed_name)[0] if embed_name in ck.files else ck.cfg.get("vocab_size")
        if not isinstance(vocab, int) or vocab <= 0:
            raise HFCheckpointError(f"{ck.index_path}: tensor '{embed_name}' is missing")
        ck.check(embed_name, (vocab, H))
        ck.check(norm_name, (H,))
        tie = bool(ck.cfg.get("tie_word_embeddings", False))
        head_name = None if tie else "lm_head.weight"
        if head_name is not None:
            ck.check(head_name, (vocab, H))
        name = _variant_name(variant)
        v = _built_variant(name, build_dir)
        _check_variant_fits(ck, v)

        dtype = reference.TORCH_DTYPES[v.model.dtype]
        dev = torch.device(device)
        layers = [_load_layer(ck, i, name, v, build_dir, dev) for i in range(ck.model.layers)]
        if layers:
            dev = layers[0].device  # "cuda" -> "cuda:N"
        embed = ck.get(embed_name).to(device=dev, dtype=dtype)
        norm_w = ck.get(norm_name).to(device=dev, dtype=torch.float32)
        lm_head = embed if head_name is None else ck.get(head_name).to(device=dev, dtype=dtype)
        return cls(layers, embed, norm_w, lm_head, ck.model, v, dev)

    def _check_batch(self, what: str, n: int) -> None:
        if n != self.batch:
            raise ValueError(f"{what}: batch {n}, but variant '{self.variant.name}' was built for batch "
                             f"{self.batch}")

    def step(self, token_ids, pos):
        """token_ids [B] (int), pos [B] int32 (each sequence's position) -> logits [B, vocab] float32."""
        import torch

        from . import reference
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError(f"token_ids: a 1-d integer tensor [batch], got shape "
                             f"{tuple(getattr(token_ids, 'shape', ()))}")
        self._check_batch("token_ids", token_ids.shape[0])
        if not isinstance(pos, torch.Tensor):
            pos = torch.as_tensor(pos, dtype=torch.int32)
        if pos.dtype != torch.int32 or tuple(pos.shape) != (self.batch,):
            raise ValueError(f"pos: an int32 tensor of shape ({self.batch},), got {pos.dtype} "
                             f"{tuple(pos.shape)}")
        with torch.no_grad():
            ids = token_ids.to(self.device).long()
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab:
                raise ValueError(f"token_ids: values must be in [0, {self.vocab - 1}], got {lo}..{hi}")
            x = self.embed[ids]
            if self.layers:
                self.layers[0].check_positions(pos.cpu())  # once, on the host; the layers then skip the check
            pos_dev = pos.to(self.device)
            for layer in self.layers:
                x = layer(x, pos_dev, validate=False)
            h = reference.norm(x, self.norm_weight, None, self.model)
            return (h.to(self.lm_head.dtype) @ self.lm_head.T).float()

    def generate(self, input_ids, max_new_tokens: int):
        """Greedy decoding: input_ids [B, T] -> [B, T + max_new_tokens]. The prompt is fed token by token through
        the decode kernel (every sequence at the same position)."""
        import torch
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids: a 2-d integer tensor [batch, tokens], got shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        B, T = input_ids.shape
        self._check_batch("input_ids", B)
        if T < 1 or max_new_tokens < 0:
            raise ValueError(f"input_ids: at least one token, and max_new_tokens >= 0 (got {T}, {max_new_tokens})")
        if T + max_new_tokens - 1 > self.seq_len:
            raise ValueError(f"input_ids: {T} prompt + {max_new_tokens} new tokens need {T + max_new_tokens - 1} "
                             f"cache rows, over variant '{self.variant.name}''s seq_len {self.seq_len}")
        out = [input_ids[:, t].to(self.device).long() for t in range(T)]
        if max_new_tokens == 0:
            return input_ids.clone()
        for t in range(T + max_new_tokens - 1):
            logits = self.step(out[t], torch.full((B,), t, dtype=torch.int32))
            if t >= T - 1:
                out.append(logits.argmax(dim=-1))
        return torch.stack(out, dim=1).to(input_ids.device)
