"""A Hugging Face config.json -> the fields of a variants.yaml model entry, read as transformers 5 reads them.

Only what the kernel computes exactly is mapped; anything else (MoE, RoPE scalings other than llama3 / linear / yarn,
and dynamic below max_position_embeddings (Mapped.limit, check_positions), tanh GELU, o_proj or MLP biases, quantized
weights) is an HFConfigError: one line naming the file and the field. A
sliding window is mapped with its size (Mapped.window); one that transformers' forward applies on every layer
(mistral, qwen2/qwen3) becomes the entry's `sliding_window` field, which every path computes. Any other (some layers
only; llama's, which only generate()'s cache applies) takes effect only where the KV cache (seq_len) is longer than the
window, so it is checked against seq_len wherever seq_len is known (check_window: `from-hf --write`, load_hf,
FusedModel.from_hf).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import NamedTuple

from .. import variants as gvariants


class HFConfigError(ValueError):
    """A config.json or checkpoint we cannot map exactly: the message is one line naming the file and the field."""


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# what keeps a near-Llama model_type out (transformers' modeling code for the type), said in its refusal: a user sees
# the math the kernels lack, not only a name missing from a list
UNSUPPORTED_WHY = {
    "gemma": "RMSNorm scaled by (1 + weight), a tanh-GELU gated MLP and embeddings scaled by sqrt(hidden)",
    "gemma2": "RMSNorm scaled by (1 + weight), norms after attention and the MLP, soft-capped logits",
    "gemma3_text": "RMSNorm scaled by (1 + weight), norms after attention and the MLP, two RoPE bases",
    "granite": "embedding, residual and attention multipliers and a logit divisor",
    "phi3": "fused qkv_proj and gate_up_proj weights",
    "gpt2": "LayerNorm, learned absolute positions instead of RoPE and a GELU MLP that is not gated",
    "olmo": "LayerNorm without weights",
    "olmo2": "norms after attention and the MLP, q/k norms over whole projections",
    "stablelm": "LayerNorm and a partial rotary embedding",
    "cohere": "LayerNorm, attention and the MLP in parallel",
    "starcoder2": "LayerNorm and a GELU MLP that is not gated",
    "mixtral": "a mixture of experts", "qwen2_moe": "a mixture of experts", "qwen3_moe": "a mixture of experts",
    "deepseek_v2": "multi-head latent attention and a mixture of experts",
    "deepseek_v3": "multi-head latent attention and a mixture of experts",
}
# num_key_value_heads where config.json has no such key: the transformers config class's default (llama: the heads)
KV_HEADS_ABSENT = {"mistral": 8, "qwen2": 32, "qwen3": 32}
# vocab_size where config.json has no such key: the config class's default (transformers then refuses an embedding of
# another size)
VOCAB_ABSENT = {"llama": 32000, "mistral": 32000, "qwen2": 151936, "qwen3": 151936}
# max_position_embeddings where config.json has no such key: the config class's default (what transformers' RoPE
# scaling and generate then read)
MAX_POSITIONS_ABSENT = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
# hidden_act -> our activation; only functions the kernel computes exactly ("gelu" is HF's exact erf GELU)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16", "float64": "bf16"}
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# variants.yaml's model fields that config.json names otherwise (for messages)
CONFIG_FIELDS = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
                 "intermediate": "intermediate_size", "layers": "num_hidden_layers", "norm_eps": "rms_norm_eps",
                 "activation": "hidden_act"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers 5.24's config defaults where config.json omits the field (MistralConfig, Qwen2Config, Qwen3Config)
MISTRAL_DEFAULT_WINDOW = 4096
QWEN_DEFAULT_WINDOW = 4096
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclasses.dataclass(frozen=True)
class Window:
    """A sliding window as transformers applies it: query p attends to keys p-size+1..p on `layers`."""
    size: int
    source: str              # where it comes from, for messages: "field 'sliding_window' of /x/config.json"
    layers: tuple[int, ...]  # the layers it applies to
    every_layer: bool = False  # on every layer, in transformers' forward too: the entry's sliding_window field
    why: str = "layers"  # why not every_layer: "layers" (some layers only), "llama" (only generate()'s cache) or
    # "chunk" (attention_chunk_size: only generate()'s cache, as a chunked_attention layer)

    def describe(self, n_layers: int) -> str:
        if len(self.layers) == n_layers:
            return f"{self.source}, every layer"
        lo, hi = self.layers[0], self.layers[-1]
        span = (f"layer {lo}" if lo == hi else f"layers {lo}-{hi}" if hi - lo + 1 == len(self.layers)
                else f"{len(self.layers)} layers")
        return f"{self.source}, {span}"


class PositionLimit(NamedTuple):
    """The longest cache (rows) a mapping is exact for: past it transformers computes something the kernels do not
    (dynamic RoPE's frequencies follow the sequence length past max_position_embeddings)."""
    size: int
    source: str  # for messages: "rope_type dynamic in field 'rope_scaling' of /x/config.json"


class Mapped(NamedTuple):
    name: str
    fields: dict          # variants.yaml model fields (rope_scaling omitted when None)
    notes: list[str]      # for YAML comments
    cfg_path: Path
    cfg: dict             # the raw config.json
    window: Window | None
    limit: PositionLimit | None = None

    def model(self, kernel: bool = True) -> gvariants.Model:
        """The validated Model (what Variant(model, "decode", batch, seq_len) needs; kernel=False: without the
        fused kernels' own limits, variants.tile_problem)."""
        return gvariants.parse_model(f"{self.cfg_path}: model '{self.name}'", self.name, self.fields, kernel)[0]


def config_path(path) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_config(path) -> tuple[Path, dict]:
    """A model directory or its config.json -> (config.json path, parsed JSON object). HFConfigError if unreadable."""
    cfg_path = config_path(path)
    try:
        text = cfg_path.read_text()
    except FileNotFoundError:
        raise HFConfigError(f"{cfg_path}: no such file (give a model directory holding config.json, or the "
                            "config.json itself)") from None
    except OSError as exc:
        raise HFConfigError(f"{cfg_path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise HFConfigError(f"{cfg_path}: not a config.json (not UTF-8 text; give a model directory holding "
                            "config.json, or the config.json itself)") from None
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise HFConfigError(f"{cfg_path}: not valid JSON: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise HFConfigError(f"{cfg_path}: not a config.json (JSON nested too deeply to read)") from None
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


def config_dtype(cfg: dict) -> tuple[str, str | None]:
    """(field, its value without a "torch." prefix, None where absent): a config.json's dtype as transformers reads
    it, `dtype` kept over `torch_dtype` where both are given (PreTrainedConfig.__post_init__)."""
    field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    raw = cfg.get(field)
    return field, None if raw is None else str(raw).removeprefix("torch.")


def max_positions(cfg: dict):
    """config.json's max_position_embeddings as transformers reads it (tokens): the field's value where present (any
    JSON value, checked by the caller), the model_type's config class default where absent (MAX_POSITIONS_ABSENT;
    None for a model_type not supported)."""
    return cfg["max_position_embeddings"] if "max_position_embeddings" in cfg else \
        MAX_POSITIONS_ABSENT.get(cfg.get("model_type"))


def _check_int(cfg_path, cfg, field, *, default=None, required=True):
    v = cfg.get(field)
    if v is None:
        if default is not None or not required:
            return default
        raise HFConfigError(f"{cfg_path}: missing field '{field}' (transformers would take its config class's "
                            "default, a shape the file does not state: give the field)")
    if isinstance(v, bool) or not isinstance(v, int):
        raise HFConfigError(f"{cfg_path}: field '{field}' must be an integer, got {v!r}")
    if v <= 0:
        raise HFConfigError(f"{cfg_path}: field '{field}' must be positive, got {v}")
    return v


def _check_number(cfg_path, field, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise HFConfigError(f"{cfg_path}: field '{field}' must be a positive number, got {v!r}")
    return float(v)


def check_bool(cfg_path, cfg, field, default=False) -> bool:
    """config.json's boolean `field` (absent or null: `default`); HFConfigError for any other type (transformers 5's
    config classes refuse a string such as "false", which Python would read as true)."""
    v = cfg.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise HFConfigError(f"{cfg_path}: field '{field}' must be true or false, got {v!r}")
    return v


def _map_rope(cfg_path, cfg, notes: list[str]) -> tuple[float, dict | None, PositionLimit | None]:
    """(rope_theta, rope_scaling, limit) as transformers 5.24 reads them (RotaryEmbeddingConfigMixin.
    convert_rope_params_to_dict / standardize_rope_params): a non-empty legacy `rope_scaling` replaces
    `rope_parameters` whole; a rope_theta (or partial_rotary_factor) inside the chosen dict wins over the top-level
    one, which is only a default; the rope type is `rope_type`, else `type`, else default. `dynamic`
    (_compute_dynamic_ntk_parameters, dynamic_rope_update): default RoPE while every position is below
    max_position_embeddings, so mapped as default RoPE with that limit (PositionLimit)."""
    legacy, params5 = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for field, v in (("rope_scaling", legacy), ("rope_parameters", params5)):
        if v is not None and not isinstance(v, dict):
            raise HFConfigError(f"{cfg_path}: field '{field}' must be an object or null, got {v!r}")
    if legacy:
        where, params = "rope_scaling", legacy
        if params5 and params5 != legacy:
            notes.append("both rope_scaling and rope_parameters given: rope_scaling is used and rope_parameters "
                         "ignored, as transformers does")
    else:
        where, params = "rope_parameters", params5 or {}
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise HFConfigError(f"{cfg_path}: field '{where}.{nested[0]}': per-layer-type RoPE parameters "
                            "are not supported (one RoPE for every layer only)")

    top = cfg.get("rope_theta")
    if "rope_theta" in params and params["rope_theta"] is None:  # (transformers' rotary embedding: None ** x)
        raise HFConfigError(f"{cfg_path}: field '{where}.rope_theta' is null: transformers fails on it (give a number, "
                            "or leave the field out for the top-level rope_theta or the default 10000)")
    if "rope_theta" in params:
        theta = _check_number(cfg_path, f"{where}.rope_theta", params["rope_theta"])
        if top is not None and top != params["rope_theta"]:
            notes.append(f"top-level rope_theta {top} ignored: {where}.rope_theta {params['rope_theta']} takes "
                         "precedence, as in transformers")
    elif top is None and "rope_theta" in cfg:  # (transformers' rotary embedding fails on None ** x)
        raise HFConfigError(f"{cfg_path}: field 'rope_theta' is null: transformers fails on it (give a number, or "
                            "leave the field out for the default 10000)")
    else:
        theta = 10000.0 if top is None else _check_number(cfg_path, "rope_theta", top)

    prf_field = f"{where}.partial_rotary_factor" if "partial_rotary_factor" in params else "partial_rotary_factor"
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    partial = prf is not None and prf != 1 and prf != 1.0
    type_key = "rope_type" if "rope_type" in params else "type"
    rtype = params.get(type_key)
    if rtype is None and type_key in params:  # (transformers looks the type up: KeyError None)
        raise HFConfigError(f"{cfg_path}: field '{where}.{type_key}' is null: transformers fails on it (give a rope "
                            "type, e.g. \"default\", or leave the field out)")
    if rtype in (None, "default"):
        if partial:  # (the model classes' compute_default_rope_parameters: dim = head_dim, the field unread)
            notes.append(f"{prf_field} {prf!r} ignored: transformers' default RoPE for these models rotates the whole "
                         "head_dim")
        return theta, None, None
    if partial:
        raise HFConfigError(f"{cfg_path}: field '{prf_field}' is {prf!r}: partial RoPE is not supported (with RoPE "
                            f"scaling transformers rotates that fraction of head_dim)")
    if rtype == "dynamic":
        # transformers: the frequencies at init (seq_len = max_position_embeddings) are the default ones, recomputed
        # only once a position reaches max_position_embeddings (max_seq_len_cached); the factor is required
        if params.get("factor") is None:
            raise HFConfigError(f"{cfg_path}: missing field '{where}.factor' (needed by dynamic RoPE scaling)")
        _check_number(cfg_path, f"{where}.factor", params["factor"])
        top = max_positions(cfg)
        if isinstance(top, bool) or not isinstance(top, int) or top <= 0:
            raise HFConfigError(f"{cfg_path}: field 'max_position_embeddings' must be a positive integer (dynamic "
                                f"RoPE scales past it), got {top!r}")
        notes.append(f"rope_type dynamic: default RoPE for positions below max_position_embeddings {top} "
                     "(transformers' dynamic NTK scaling changes the frequencies only past it); a longer seq_len is "
                     "refused")
        return theta, None, PositionLimit(top, f"rope_type dynamic in field '{where}' of {cfg_path}")
    if rtype not in gvariants.ROPE_SCALING_TYPES:
        raise HFConfigError(f"{cfg_path}: field '{where}.{type_key}' is {rtype!r}: supported RoPE scaling: "
                            f"{', '.join(gvariants.ROPE_SCALING_TYPES)}, dynamic up to max_position_embeddings "
                            "(or none)")
    if rtype == "linear":  # (transformers' _compute_linear_scaling_rope_parameters: only the factor)
        if params.get("factor") is None:
            raise HFConfigError(f"{cfg_path}: missing field '{where}.factor' (needed by linear RoPE scaling)")
        if extra := sorted(set(params) - {"factor", "rope_theta", "partial_rotary_factor", "rope_type", "type"}):
            notes.append(f"{where}: {', '.join(extra)} not read by linear RoPE scaling (transformers ignores them too)")
        return theta, {"rope_type": "linear",
                       "factor": _check_number(cfg_path, f"{where}.factor", params["factor"])}, None
    if rtype == "yarn":
        return theta, _map_yarn(cfg_path, cfg, where, params, notes), None
    scaling = {"rope_type": "llama3"}
    for key in LLAMA3_KEYS:
        v = params.get(key)
        if key == "original_max_position_embeddings":
            # transformers' precedence: a top-level value, then the rope dict's, then max_position_embeddings
            v = cfg.get(key, v if v is not None else max_positions(cfg))
            if v is None:
                raise HFConfigError(f"{cfg_path}: missing field '{where}.{key}'")
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise HFConfigError(f"{cfg_path}: field '{where}.{key}' must be a positive integer, got {v!r}")
            scaling[key] = v
        else:
            if v is None:
                raise HFConfigError(f"{cfg_path}: missing field '{where}.{key}' (needed by llama3 RoPE scaling)")
            scaling[key] = _check_number(cfg_path, f"{where}.{key}", v)
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:  # (transformers warns and runs it: so do we)
        notes.append(f"{where}.high_freq_factor {scaling['high_freq_factor']} is not above low_freq_factor "
                     f"{scaling['low_freq_factor']} (transformers warns and runs it: no frequency is smoothed)")
    return theta, scaling, None


def _sliding_window(cfg_path, cfg, model_type, layers: int) -> Window | None:
    """The window transformers 5.24 applies, or None (full attention on every layer).

    mistral: `sliding_window`, MistralConfig's default 4096 when the key is absent, none when null (MistralModel
    masks every layer with it). qwen2/qwen3: `sliding_window` (default 4096) only if `use_sliding_window`, on the
    layers that `layer_types` marks sliding_attention; without layer_types, layers >= `max_window_layers` (default
    28) (Qwen2Config.__post_init__). llama: LlamaModel's mask ignores `sliding_window`, but generate()'s cache
    (cache_utils.get_layer_types_and_kwargs) keeps only the last window of keys, so a non-null one counts too,
    unless `layer_types` is given (the cache then follows it: full_attention only, no window). llama and mistral
    without a window and without layer_types: a non-null `attention_chunk_size` makes every cache layer
    chunked_attention, which keeps only that many keys (the forward's mask ignores it), a window of that size."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise HFConfigError(f"{cfg_path}: field 'layer_types' must list one type per layer "
                                f"(num_hidden_layers {layers}), got {layer_types!r}")
        allowed = ("full_attention", "sliding_attention") if model_type in ("qwen2", "qwen3") \
            else ("full_attention",)
        bad = [t for t in layer_types if t not in allowed]
        if bad:
            raise HFConfigError(f"{cfg_path}: field 'layer_types' lists {bad[0]!r}: only "
                                f"{' and '.join(allowed)} layers are supported for {model_type}")

    if model_type in ("qwen2", "qwen3"):
        use = check_bool(cfg_path, cfg, "use_sliding_window")
        size = cfg.get("sliding_window", QWEN_DEFAULT_WINDOW) if use else None
        source = "field 'sliding_window'" + (" (absent: default 4096)" if "sliding_window" not in cfg else "") + \
            f" with use_sliding_window true, of {cfg_path}"
        if layer_types is None:
            first = cfg.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
            if isinstance(first, bool) or not isinstance(first, int):
                raise HFConfigError(f"{cfg_path}: field 'max_window_layers' must be an integer, got {first!r}")
            sliding = tuple(range(max(first, 0), layers)) if size is not None else ()
            source += f" (layers >= max_window_layers {first})"
        else:
            sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
            if sliding and size is None:
                raise HFConfigError(f"{cfg_path}: field 'layer_types' lists 'sliding_attention' but field "
                                    "'use_sliding_window' is false or 'sliding_window' null: transformers has no "
                                    "window for those layers and fails")
        if not sliding:
            return None
    elif model_type == "mistral":
        size = cfg.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
        source = f"field 'sliding_window' of {cfg_path}" if "sliding_window" in cfg else \
            f"field 'sliding_window' absent from {cfg_path}: MistralConfig's default {MISTRAL_DEFAULT_WINDOW}"
        sliding = tuple(range(layers))
    elif layer_types is not None:  # llama: generate()'s cache follows layer_types (full_attention only, above)
        return None
    else:
        size = cfg.get("sliding_window")
        source = f"field 'sliding_window' of {cfg_path}"
        sliding = tuple(range(layers))
    why = "llama" if model_type == "llama" else "layers"
    if size is None and layer_types is None and cfg.get("attention_chunk_size") is not None:
        size, why = cfg["attention_chunk_size"], "chunk"
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise HFConfigError(f"{cfg_path}: field 'attention_chunk_size' must be a positive integer or null, got "
                                f"{size!r}")
        source = f"field 'attention_chunk_size' of {cfg_path}"
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise HFConfigError(f"{cfg_path}: field 'sliding_window' must be a positive integer or null, got {size!r}")
    if size >= gvariants.INT_MAX:  # (no cache holds that many rows: the window never takes effect)
        return None
    return Window(size, source, sliding, why=why)


def _map_yarn(cfg_path, cfg, where: str, params: dict, notes: list[str]) -> dict:
    """yarn's parameters resolved as transformers 5.25 resolves them (standardize_rope_params,
    _compute_yarn_parameters): original_max_position_embeddings a top-level value, else the rope dict's, else
    max_position_embeddings; factor (required), where null, max_position_embeddings / that; attention_factor, where
    null, 0.1 ln(factor) + 1, 1 for a factor <= 1 (with mscale and mscale_all_dim both non-zero: their ratio of that
    form); beta_fast / beta_slow 32 / 1 where null or 0; truncate true where absent (null, 0: false)."""
    def mscale(scale, m=1.0):  # the YaRN paper's Eq. 21 (transformers' yarn_get_mscale)
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    key = "original_max_position_embeddings"
    if key in params and params[key] is None and key not in cfg:  # (transformers fails on it: a division by None)
        raise HFConfigError(f"{cfg_path}: field '{where}.{key}' is null: give the pretraining length")
    old = cfg.get(key, params.get(key, max_positions(cfg)))
    if isinstance(old, bool) or not isinstance(old, int) or old <= 0:
        raise HFConfigError(f"{cfg_path}: field '{where}.{key}' must be a positive integer (else "
                            f"max_position_embeddings), got {'nothing' if old is None else repr(old)}")
    if "factor" not in params:  # (transformers: a required key; null derives it)
        raise HFConfigError(f"{cfg_path}: missing field '{where}.factor' (needed by yarn RoPE scaling)")
    factor = params["factor"]
    if factor is None:
        top = max_positions(cfg)
        if isinstance(top, bool) or not isinstance(top, int) or top <= 0:
            raise HFConfigError(f"{cfg_path}: field '{where}.factor' is null and max_position_embeddings, from which "
                                f"yarn derives it, is {'absent' if top is None else repr(top)}")
        factor = top / old
    factor = _check_number(cfg_path, f"{where}.factor", factor)
    af = params.get("attention_factor")
    if af is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        if ms and ms_all:
            af = mscale(factor, _check_number(cfg_path, f"{where}.mscale", ms)) / mscale(
                factor, _check_number(cfg_path, f"{where}.mscale_all_dim", ms_all))
        else:
            af = mscale(factor)
    if extra := sorted(set(params) - {"factor", key, "attention_factor", "mscale", "mscale_all_dim", "beta_fast",
                                      "beta_slow", "truncate", "rope_theta", "partial_rotary_factor", "rope_type",
                                      "type"}):
        notes.append(f"{where}: {', '.join(extra)} not read by yarn RoPE scaling (transformers ignores them too)")
    truncate = params.get("truncate", True)
    if truncate is None or type(truncate) is int:  # (transformers tests its truth: null and 0 do not truncate)
        truncate = bool(truncate)
    if not isinstance(truncate, bool):
        raise HFConfigError(f"{cfg_path}: field '{where}.truncate' must be true or false, got {truncate!r}")
    return {"rope_type": "yarn", "factor": factor, key: old,
            "beta_fast": _check_number(cfg_path, f"{where}.beta_fast", params.get("beta_fast") or 32),
            "beta_slow": _check_number(cfg_path, f"{where}.beta_slow", params.get("beta_slow") or 1),
            "attention_factor": _check_number(cfg_path, f"{where}.attention_factor", af), "truncate": truncate}


def check_window(window: Window | None, seq_len: int, where: str, n_layers: int | None = None,
                 layer: int | None = None, computed: int | None = None) -> None:
    """A window takes no effect where seq_len <= its size (the cache holds at most that many keys), nor where what
    runs computes it (`computed`: the sliding_window of the variant or layer that runs, equal to the window's size);
    otherwise HFConfigError naming `where` (file and variant), seq_len and the window. `layer`: check only that layer
    (a layer the window does not apply to always passes); `n_layers`: the model's, to say which layers the window
    covers (None: `window.source` says it already)."""
    if window is None or seq_len <= window.size or (layer is not None and layer not in window.layers) \
            or computed == window.size:
        return
    covers = window.source if n_layers is None else window.describe(n_layers)
    if window.every_layer:
        built = "without it" if computed is None else f"with sliding_window {computed}"
        raise HFConfigError(f"{where}: seq_len {seq_len} is longer than sliding_window {window.size} ({covers}), "
                            f"and the variant was built {built}: declare `sliding_window: {window.size}` in its "
                            "variants.yaml entry (`megakernel from-hf` writes it) and build again")
    what = {"llama": "llama's window, which transformers' forward ignores while generate()'s cache applies it",
            "chunk": "chunked attention, which transformers' forward ignores while generate()'s cache keeps only "
                     "that many keys"}.get(window.why, "a window on some layers only")
    kind = "attention_chunk_size" if window.why == "chunk" else "sliding_window"
    raise HFConfigError(f"{where}: seq_len {seq_len} is longer than {kind} {window.size} ({covers}): "
                        f"{what}, is not supported (every layer attends to the whole cache; seq_len <= {window.size} "
                        "is exact)")


def check_positions(limit: PositionLimit | None, seq_len: int, where: str) -> None:
    """A cache (seq_len rows) no longer than the mapping's limit is exact; a longer one is an HFConfigError naming
    `where` (file and variant), seq_len and the limit's source."""
    if limit is None or seq_len <= limit.size:
        return
    raise HFConfigError(f"{where}: seq_len {seq_len} is longer than max_position_embeddings {limit.size} "
                        f"({limit.source}): past it transformers' dynamic RoPE changes its frequencies with the "
                        f"sequence length, which is not supported (seq_len <= {limit.size} is exact)")


def _refuse_unsupported(cfg_path, cfg, model_type):
    for field in MOE_FIELDS:
        v = cfg.get(field)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            raise HFConfigError(f"{cfg_path}: field '{field}' is {v}: mixture-of-experts layers are not supported")
    if cfg.get("quantization_config") is not None:
        raise HFConfigError(f"{cfg_path}: field 'quantization_config' is set: quantized checkpoints are not "
                            "supported (bf16/fp16/fp32 weights only)")
    if cfg.get("per_layer_config"):  # (one shape and one set of constants for every layer only)
        raise HFConfigError(f"{cfg_path}: field 'per_layer_config' is set: per-layer config overrides are not "
                            "supported (every layer alike only)")
    if check_bool(cfg_path, cfg, "use_mrope"):
        raise HFConfigError(f"{cfg_path}: field 'use_mrope' is true: multimodal RoPE is not supported")
    # biases the kernel does not add: o_proj (attention_bias in llama/qwen3 biases o_proj too) and the MLP's
    if model_type in ("llama", "qwen3") and check_bool(cfg_path, cfg, "attention_bias"):
        raise HFConfigError(f"{cfg_path}: field 'attention_bias' is true: it adds an o_proj bias too, which this "
                            "project does not compute, fused or unfused (only qwen2-style q/k/v biases are supported)")
    # (only LlamaConfig's MLP reads mlp_bias: qwen2, qwen3 and mistral have no MLP bias whatever the field says)
    if model_type == "llama" and check_bool(cfg_path, cfg, "mlp_bias"):
        raise HFConfigError(f"{cfg_path}: field 'mlp_bias' is true: MLP biases are not supported, fused or unfused")


def map_config(path, name=None, kernel: bool = True) -> Mapped:
    """A model directory or config.json -> Mapped (validated with variants.yaml's own rules; kernel=False: without
    the fused kernels' own limits, variants.tile_problem). HFConfigError (or VariantError for a shape variants.yaml
    refuses), one line naming the file and the field."""
    cfg_path, cfg = read_config(path)
    model_type = cfg.get("model_type")
    if model_type is None:
        raise HFConfigError(f"{cfg_path}: missing field 'model_type'")
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = f" ({model_type} has {UNSUPPORTED_WHY[model_type]})" if model_type in UNSUPPORTED_WHY else ""
        raise HFConfigError(f"{cfg_path}: field 'model_type' is {model_type!r}: supported are "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}{why}")
    notes: list[str] = []
    mpe = cfg.get("max_position_embeddings")
    if "max_position_embeddings" in cfg and (isinstance(mpe, bool) or not isinstance(mpe, int)):
        # (transformers 5's config classes refuse it: StrictDataclassFieldValidationError, expected int)
        raise HFConfigError(f"{cfg_path}: field 'max_position_embeddings' " + (
            "is null" if mpe is None else f"must be an integer, got {mpe!r}") + ": transformers refuses it (give an "
            f"integer, or leave the field out for {model_type}'s default {MAX_POSITIONS_ABSENT[model_type]})")
    if "max_position_embeddings" not in cfg:  # (what the cache and RoPE scaling are then checked against)
        notes.append(f"no max_position_embeddings in config.json: {MAX_POSITIONS_ABSENT[model_type]}, transformers' "
                     f"default for {model_type}")
    hidden = _check_int(cfg_path, cfg, "hidden_size")
    heads = _check_int(cfg_path, cfg, "num_attention_heads")
    # absent: the config class's default, as transformers reads it (MistralConfig 8, Qwen2Config and Qwen3Config 32,
    # LlamaConfig the heads); null: the heads, as LlamaConfig, Qwen2Config and Qwen3Config set it; MistralConfig
    # refuses a null (transformers 5's field validation), so it is refused here too
    absent = "num_key_value_heads" not in cfg
    if model_type == "mistral" and not absent and cfg["num_key_value_heads"] is None:
        dflt = KV_HEADS_ABSENT["mistral"]  # (the advice to leave it out only where that default serves these heads)
        raise HFConfigError(f"{cfg_path}: field 'num_key_value_heads' is null: transformers' MistralConfig refuses it "
                            "(give an integer" + (f", or leave the field out for its default {dflt})" if heads % dflt == 0
                                                  else ")"))
    kv_heads = _check_int(cfg_path, cfg, "num_key_value_heads",
                          default=KV_HEADS_ABSENT.get(model_type, heads) if absent else heads)
    if absent and model_type in KV_HEADS_ABSENT:
        if heads % kv_heads:  # (said here: variants.yaml's own check would not say where the 8 or 32 came from)
            raise HFConfigError(f"{cfg_path}: no field 'num_key_value_heads': transformers' default for {model_type}, "
                                f"{kv_heads}, does not divide num_attention_heads {heads} (give the field)")
        notes.append(f"no num_key_value_heads in config.json: {kv_heads}, transformers' default for "
                     f"{model_type} (not num_attention_heads {heads})")
    elif kv_heads > 0 and heads % kv_heads:  # (in config.json's names, not variants.yaml's)
        raise HFConfigError(f"{cfg_path}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads} "
                            "(every KV head serves the same number of query heads)")
    head_default = 128 if model_type == "qwen3" else None  # Qwen3Config's default head_dim
    if model_type in ("qwen2", "qwen3") and "head_dim" in cfg and cfg["head_dim"] is None:
        # (Qwen3Config refuses it; Qwen2's rotary embedding fails on it)
        raise HFConfigError(f"{cfg_path}: field 'head_dim' is null: transformers' {model_type} refuses it (give an "
                            "integer, or leave the field out" + (" for its default 128)" if model_type == "qwen3"
                                                                 else ")"))
    if model_type == "llama" and hidden % heads:  # (LlamaConfig.validate_architecture, even with a head_dim)
        raise HFConfigError(f"{cfg_path}: field 'hidden_size' ({hidden}) is not a multiple of num_attention_heads "
                            f"({heads}): LlamaConfig refuses it")
    head_dim = _check_int(cfg_path, cfg, "head_dim", required=False, default=head_default)
    derived = head_dim is None  # as transformers does: hidden_size // num_attention_heads
    if head_dim is None:
        if hidden % heads:
            raise HFConfigError(f"{cfg_path}: field 'hidden_size' ({hidden}) is not divisible by "
                                f"num_attention_heads ({heads}) and there is no head_dim")
        head_dim = hidden // heads
    intermediate = _check_int(cfg_path, cfg, "intermediate_size")
    layers = _check_int(cfg_path, cfg, "num_hidden_layers")
    _refuse_unsupported(cfg_path, cfg, model_type)
    # read with the checkpoint (hf.model._head_names); their types checked here too, so that from-hf refuses what
    # loading it would
    check_bool(cfg_path, cfg, "tie_word_embeddings")
    if "vocab_size" in cfg and (cfg["vocab_size"] is None or _check_int(cfg_path, cfg, "vocab_size") is None):
        raise HFConfigError(f"{cfg_path}: field 'vocab_size' must be an integer, got None")
    window = _sliding_window(cfg_path, cfg, model_type, layers)
    # a window transformers' forward applies on every layer is computed (the sliding_window field); llama's model
    # ignores its window in the forward (the prompt's pass sees every key) while generate()'s cache applies it
    if window is not None and window.why == "layers" and len(window.layers) == layers:
        window = dataclasses.replace(window, every_layer=True)
    elif window is not None:
        notes.append(f"sliding_window {window.size} ({window.describe(layers)}): a window >= seq_len never takes "
                     f"effect, so seq_len <= {window.size} is exact; a longer seq_len is refused (from-hf, load_hf)")

    eps = cfg.get("rms_norm_eps")
    if eps is None and "rms_norm_eps" in cfg:  # (the config classes' strict validation refuses it)
        raise HFConfigError(f"{cfg_path}: field 'rms_norm_eps' is null: transformers refuses it (give a number, or "
                            "leave the field out for the default 1e-6)")
    eps = 1e-6 if eps is None else _check_number(cfg_path, "rms_norm_eps", eps)
    rope_theta, rope_scaling, limit = _map_rope(cfg_path, cfg, notes)

    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise HFConfigError(f"{cfg_path}: field 'hidden_act' is {act!r}: the kernel computes silu or exact (erf) "
                            "gelu only")

    # qwen2 always has q/k/v biases (and none on o_proj); attention_bias elsewhere biases o_proj too (refused
    # above for llama and qwen3; mistral has no biases whatever the field says)
    qkv_bias = model_type == "qwen2"
    qk_norm = model_type == "qwen3"

    dtype_field, key = config_dtype(cfg)
    raw_dtype = cfg.get(dtype_field)
    if key is None:
        dtype = "bf16"
        notes.append("no dtype/torch_dtype in config.json: bf16 assumed")
    else:
        if key not in DTYPES or str(raw_dtype) != key:  # ("torch.float16" as a string: transformers fails on it)
            raise HFConfigError(f"{cfg_path}: field '{dtype_field}' is {raw_dtype!r}: supported are "
                                f"{', '.join(DTYPES)}")
        dtype = DTYPES[key]
        if key in ("float32", "float64"):
            notes.append(f"{dtype_field} {key} in config.json: mapped to bf16 (weights are cast when loaded)")

    fields = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "intermediate": intermediate, "layers": layers, "norm": "rmsnorm", "norm_eps": eps,
              "rope_theta": rope_theta, "rope_scaling": rope_scaling, "activation": ACTIVATIONS[act],
              "qkv_bias": qkv_bias, "qk_norm": qk_norm, "dtype": dtype}
    if rope_scaling is None:
        del fields["rope_scaling"]
    if window is not None and window.every_layer:
        fields["sliding_window"] = window.size
    if name is None:
        name = default_name(cfg_path, model_type)
    # the same rules as variants.yaml (divisibility, head_dim, name, ...); the message names the config file
    try:
        gvariants.parse_model(f"{cfg_path}: model '{name}'", name, fields, kernel)
    except gvariants.VariantError as exc:
        if derived and "'head_dim'" in str(exc):  # a field the config does not have: say where it came from
            raise HFConfigError(f"{exc} (head_dim {head_dim} = hidden_size {hidden} // num_attention_heads "
                                f"{heads}: the config has no head_dim)") from None
        # the message names variants.yaml's field: config.json's name beside it, and for a shape only the fused
        # kernels refuse, that the unfused layers serve it
        text = re.sub(r"field '(\w+)'", lambda m: m.group(0) + (f" (config.json's {CONFIG_FIELDS[m.group(1)]})"
                                                               if m.group(1) in CONFIG_FIELDS else ""), str(exc), count=1)
        if kernel and (why := gvariants.tile_problem(fields)) and why in str(exc):
            text += "; `megakernel generate` serves this checkpoint with the unfused PyTorch layers"
        raise type(exc)(text) from None
    return Mapped(name, fields, notes, cfg_path, cfg, window, limit)


def model_entry(path, name=None) -> tuple[str, dict]:
    """A model directory (or its config.json) -> (variant name, variants.yaml model fields)."""
    m = map_config(path, name)
    return m.name, m.fields


def model_from_hf(path, name=None) -> gvariants.Model:
    """The validated Model (what Variant(model, "decode", batch, seq_len) needs) of a checkpoint's config."""
    return map_config(path, name).model()
