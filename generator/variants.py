"""variants.yaml -> validated, expanded list of Variant (the first step of the one-way data flow).

Every error is a VariantError whose message is ONE line naming the file, the variant, the field and the rule.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
import re
from pathlib import Path

import yaml


class VariantError(ValueError):
    """Bad variants file: the message is one line (file, variant, field, rule)."""


DTYPES = ("bf16", "fp16")
NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("silu", "gelu")
MODES = ("decode", "prefill")  # prefill: seq_len is the chunk of new tokens per sequence
ROPE_SCALING_TYPES = ("llama3", "linear", "yarn")  # host.inv_freq computes each (the kernels take inv_freq as an
# input; yarn's attention factor scales q and k: host.rope_attention, the kernels' ROPE_ATTN)
INT_MAX = 2**31 - 1  # every size becomes a C int constant of the kernel

# field -> (python types accepted, required?, default)
MODEL_FIELDS: dict[str, tuple[tuple[type, ...], bool, object]] = {
    "hidden": ((int,), True, None),
    "heads": ((int,), True, None),
    "kv_heads": ((int,), True, None),
    "head_dim": ((int,), True, None),
    "intermediate": ((int,), True, None),
    "layers": ((int,), True, None),
    "norm": ((str,), True, None),
    "norm_eps": ((float, int), True, None),
    "rope_theta": ((float, int), True, None),
    "rope_scaling": ((dict, type(None)), False, None),
    "sliding_window": ((int, type(None)), False, None),
    "activation": ((str,), True, None),
    "qkv_bias": ((bool,), True, None),
    "qk_norm": ((bool,), True, None),
    "dtype": ((str,), True, None),
    "matrix": ((dict, list), False, None),
}
MATRIX_FIELDS = ("mode", "batch", "seq_len", "tp")
MATRIX_DEFAULTS = {"tp": [1]}  # optional matrix fields: tensor-parallel degree 1 (one GPU) unless declared
LLAMA3_SCALING_FIELDS = {"rope_type": str, "factor": (int, float), "low_freq_factor": (int, float),
                         "high_freq_factor": (int, float), "original_max_position_embeddings": int}
# yarn: every parameter resolved (generator.hf.config maps transformers' defaults: _compute_yarn_parameters)
YARN_SCALING_FIELDS = {"rope_type": str, "factor": (int, float), "original_max_position_embeddings": int,
                       "beta_fast": (int, float), "beta_slow": (int, float), "attention_factor": (int, float),
                       "truncate": bool}
ROPE_SCALING_FIELDS = {"llama3": LLAMA3_SCALING_FIELDS, "linear": {"rope_type": str, "factor": (int, float)},
                       "yarn": YARN_SCALING_FIELDS}
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# the fields that fix what a layer computes (a built variant serves a checkpoint only where all of them agree; the
# dtype may differ: weights are cast)
FP32_MAX, FP32_TINY = 3.4028234663852886e38, 1.401298464324817e-45  # the largest finite and the smallest positive fp32
LAYER_FIELDS = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "norm", "norm_eps", "rope_theta",
                "rope_scaling", "activation", "qkv_bias", "qk_norm", "sliding_window")


def window_at(window: int | None, rows: int | None) -> int | None:
    """The sliding window (tokens a query attends to, itself included) that takes effect over a KV cache of `rows`
    rows: None where there is none or the cache is no longer than it (a query then sees every row either way);
    rows None (not known yet: a prefill chunk's cache is given at run time): the window."""
    return None if window is None or rows is not None and rows <= window else window


def same_layer(a, b, rows: int | None = None) -> bool:
    """Whether two Models compute the same layer (every LAYER_FIELDS field equal; names, layers and dtype aside);
    their sliding windows compared as they take effect over a cache of `rows` rows (window_at)."""
    return all(getattr(a, f) == getattr(b, f) for f in LAYER_FIELDS if f != "sliding_window") and \
        window_at(a.sliding_window, rows) == window_at(b.sliding_window, rows)


@dataclasses.dataclass(frozen=True)
class Model:
    """One decoder-layer shape (what a model's config fixes)."""
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    norm: str
    norm_eps: float
    rope_theta: float
    activation: str
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    rope_scaling: tuple | None = None  # sorted (key, value) pairs, hashable
    # query p attends to cache rows p - sliding_window + 1 .. p (Mistral's sliding-window attention, transformers'
    # sliding_window_causal mask); None: rows 0 .. p
    sliding_window: int | None = None

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class Variant:
    """A model shape at one point of the matrix: what one kernel is generated for."""
    model: Model
    mode: str
    batch: int
    seq_len: int
    tp: int = 1  # tensor-parallel degree: GPUs that share each layer (Megatron-LM's split, arXiv:1909.08053)

    @property
    def name(self) -> str:
        tp = f"_tp{self.tp}" if self.tp > 1 else ""
        return f"{self.model.name}_{self.mode}_b{self.batch}_s{self.seq_len}_{self.model.dtype}{tp}"

    @property
    def shard(self) -> Model:
        """The layer one GPU computes: heads/tp query heads, kv_heads/tp KV heads and intermediate/tp MLP columns
        (and the matching input columns of o_proj and down_proj); the model itself when tp = 1."""
        return shard_model(self.model, self.tp)

    def params(self) -> dict:
        d = dataclasses.asdict(self.model)
        d["rope_scaling"] = dict(self.model.rope_scaling) if self.model.rope_scaling else None
        if d["sliding_window"] is None:  # (absent, so that builds and tuned plans of before the field keep their
            del d["sliding_window"]      # identity: manifest.identity hashes these)
        d.update(mode=self.mode, batch=self.batch, seq_len=self.seq_len, tp=self.tp)
        return d


def shard_model(m: Model, tp: int) -> Model:
    """Model `m` as one of `tp` GPUs holds it (see Variant.shard). Raises ValueError (one line) where tp does not
    divide the heads, the KV heads (they are not replicated) or the MLP columns into 16-row tiles."""
    if tp == 1:
        return m
    for field, n, unit in (("heads", m.heads, 1), ("kv_heads", m.kv_heads, 1), ("intermediate", m.intermediate, 16)):
        if n % (tp * unit):
            rule = f"a multiple of 16 x tp = {16 * tp}" if unit == 16 else f"divisible by tp = {tp}"
            extra = " (KV heads are split, not replicated)" if field == "kv_heads" else ""
            raise ValueError(f"tp {tp}: field '{field}' ({n}) must be {rule}{extra}")
    return dataclasses.replace(m, heads=m.heads // tp, kv_heads=m.kv_heads // tp, intermediate=m.intermediate // tp)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML silently keeps the last of two equal keys; a duplicate variant name must be an error (a key that
    overrides one merged from an anchor, `<<: *base`, is not a duplicate)."""


def _construct_mapping(loader, node, deep=False):
    # merge keys (`<<: *anchor`) first, as SafeLoader does; a key written here may override a merged one, so only
    # the keys written in this mapping are checked against each other
    own = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
    loader.flatten_mapping(node)
    seen = {}
    for key_node in own:
        key = loader.construct_object(key_node, deep=deep)
        try:
            dup = key in seen
        except TypeError:  # unhashable key: SafeLoader's construct_mapping reports it with its line
            continue
        if dup:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# YAML 1.1's base-60 numbers (`hidden: 4:16` is 256) and leading-zero octal (`010` is 8) read as strings, so they are
# refused as not numbers rather than taken as a value nobody meant: decimal (and 0x, 0b) integers, YAML 1.2's floats
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag not in (_INT, _FLOAT)]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0b[01_]+)$"),
                                       list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
                                       list("-+0123456789."))
# YAML 1.1 (PyYAML) reads 1e-5 and 1e-05 (how HF configs write eps) as strings: take them as floats, as YAML 1.2 does
EXP_FLOAT = ("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
             list("-+0123456789."))
_UniqueKeyLoader.add_implicit_resolver(*EXP_FLOAT)


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings this module's loader reads as floats (a model named 1e5)."""


Dumper.add_implicit_resolver(*EXP_FLOAT)


def _type_name(types):
    return " or ".join({int: "integer", float: "number", str: "string", bool: "boolean", dict: "mapping",
                        type(None): "null", list: "list"}[t] for t in types)


def _yaml(value) -> str:
    """A scalar as YAML spells it (true, null), else Python's repr."""
    return str(value).lower() if isinstance(value, bool) else "null" if value is None else repr(value)


def _check_type(where, field, value, types):
    # bool is an int subclass in Python: `hidden: true` must not pass as 1
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise VariantError(f"{where}: field '{field}' must be {_type_name(types)}, got {_yaml(value)}")


def _parse_matrices(where, raw) -> list[dict]:
    """A matrix, or a list of matrices (e.g. one for decode, one for prefill with its own batches and chunk
    lengths): each is expanded and the variants joined; the same variant twice is an error."""
    if isinstance(raw, list):
        if not raw:
            raise VariantError(f"{where}: field 'matrix' must not be an empty list")
        return [_parse_matrix(where, r) for r in raw]
    return [_parse_matrix(where, raw)]


def _parse_matrix(where, raw) -> dict:
    if not isinstance(raw, dict):
        raise VariantError(f"{where}: field 'matrix' must be a mapping with keys {', '.join(MATRIX_FIELDS)}")
    for key in raw:
        if key not in MATRIX_FIELDS:
            raise VariantError(f"{where}: unknown field 'matrix.{key}' (allowed: {', '.join(MATRIX_FIELDS)})")
    out = {}
    for key in MATRIX_FIELDS:
        if key not in raw and key in MATRIX_DEFAULTS:
            out[key] = MATRIX_DEFAULTS[key]
            continue
        if key not in raw:
            raise VariantError(f"{where}: missing field 'matrix.{key}'")
        vals = raw[key] if isinstance(raw[key], list) else [raw[key]]
        if not vals:
            raise VariantError(f"{where}: field 'matrix.{key}' must not be empty")
        for v in vals:
            if key == "mode":
                if v not in MODES:
                    raise VariantError(f"{where}: field 'matrix.mode' must be one of {', '.join(MODES)}, got {v!r}")
            else:
                _check_type(where, f"matrix.{key}", v, (int,))
                if v <= 0:
                    raise VariantError(f"{where}: field 'matrix.{key}' must be positive, got {v}")
                if v > INT_MAX:
                    raise VariantError(f"{where}: field 'matrix.{key}' must be at most {INT_MAX} (a C int in the "
                                       f"kernel), got {v}")
        if len(set(vals)) != len(vals):
            raise VariantError(f"{where}: field 'matrix.{key}' lists a value twice: {vals}")
        out[key] = vals
    return out


def _parse_rope_scaling(where, raw):
    if raw is None:
        return None
    rtype = raw.get("rope_type")
    if rtype not in ROPE_SCALING_TYPES:
        raise VariantError(f"{where}: field 'rope_scaling.rope_type' must be one of "
                           f"{', '.join(ROPE_SCALING_TYPES)}, got {rtype!r}")
    fields = ROPE_SCALING_FIELDS[rtype]
    for key in raw:
        if key not in fields:
            raise VariantError(f"{where}: unknown field 'rope_scaling.{key}' for rope_type {rtype}")
    for key, types in fields.items():
        if key not in raw:
            raise VariantError(f"{where}: missing field 'rope_scaling.{key}'")
        _check_type(where, f"rope_scaling.{key}", raw[key], types if isinstance(types, tuple) else (types,))
        if types not in (str, bool) and not 0 < raw[key] < math.inf:
            raise VariantError(f"{where}: field 'rope_scaling.{key}' must be positive and finite, got {raw[key]}")
    return tuple(sorted(raw.items()))


def tile_problem(m) -> str | None:
    """Why the fused kernels cannot compute a layer of shape `m` (a Model, or a model entry's fields: the tensor
    cores' 16-wide tiles, attention's head_dim bound), None where they can. The unfused PyTorch layer has no such
    limit: generator.serve runs such a checkpoint unfused (parse_model(kernel=False))."""
    get = m.get if isinstance(m, dict) else lambda k: getattr(m, k)
    if get("head_dim") % 16 or get("head_dim") > 256:
        return f"field 'head_dim' must be a multiple of 16 and at most 256, got {get('head_dim')}"
    if get("hidden") % 16 or get("intermediate") % 16:
        bad = "hidden" if get("hidden") % 16 else "intermediate"
        return f"field '{bad}' must be a multiple of 16 (tensor-core tiles), got {get(bad)}"
    return None


def parse_model(where: str, name: str, raw, kernel: bool = True) -> tuple[Model, dict | None]:
    """Validate one model entry; returns the Model and its own matrix override (or None). kernel=False: without
    the fused kernels' own limits (tile_problem), for a checkpoint served by the unfused layers only."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise VariantError(f"{where}: model name {name!r} must be lower-case letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit (its variants' names start with it)")
    if not isinstance(raw, dict):
        raise VariantError(f"{where}: entry must be a mapping of fields, got {type(raw).__name__}")
    for key in raw:
        if key not in MODEL_FIELDS:
            raise VariantError(f"{where}: unknown field '{key}' (allowed: {', '.join(MODEL_FIELDS)})")
    for key, (types, required, _) in MODEL_FIELDS.items():
        if key not in raw:
            if required:
                raise VariantError(f"{where}: missing field '{key}'")
            continue
        _check_type(where, key, raw[key], types)
    for key in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers"):
        if raw[key] <= 0:
            raise VariantError(f"{where}: field '{key}' must be positive, got {raw[key]}")
        if raw[key] > INT_MAX:
            raise VariantError(f"{where}: field '{key}' must be at most {INT_MAX} (a C int in the kernel), got "
                               f"{raw[key]}")
    w = raw.get("sliding_window")
    if w is not None and not 1 <= w <= INT_MAX:
        raise VariantError(f"{where}: field 'sliding_window' must be a number of tokens in 1..{INT_MAX} (or null), "
                           f"got {w}")
    for key in ("norm_eps", "rope_theta"):
        if not 0 < raw[key] < math.inf:  # also catches .nan and .inf
            raise VariantError(f"{where}: field '{key}' must be positive and finite, got {raw[key]}")
    if not FP32_TINY <= raw["norm_eps"] <= FP32_MAX:  # (the kernel adds it in fp32: 1e300 would be inf there)
        raise VariantError(f"{where}: field 'norm_eps' must be a positive fp32 value ({FP32_TINY:.3g} .. "
                           f"{FP32_MAX:.3g}: the kernels add it in fp32), got {raw['norm_eps']}")
    derived = {"heads x head_dim": raw["heads"] * raw["head_dim"],
               "(heads + 2 kv_heads) x head_dim": (raw["heads"] + 2 * raw["kv_heads"]) * raw["head_dim"],
               "2 x intermediate": 2 * raw["intermediate"]}
    for what, val in derived.items():
        if val > INT_MAX:
            raise VariantError(f"{where}: {what} = {val} must be at most {INT_MAX} (a C int in the kernel)")
    if raw["heads"] % raw["kv_heads"]:
        raise VariantError(f"{where}: field 'heads' ({raw['heads']}) must be divisible by kv_heads "
                           f"({raw['kv_heads']})")
    if kernel and (why := tile_problem(raw)):
        raise VariantError(f"{where}: {why}")
    for key, allowed in (("dtype", DTYPES), ("norm", NORMS), ("activation", ACTIVATIONS)):
        if raw[key] not in allowed:
            raise VariantError(f"{where}: field '{key}' must be one of {', '.join(allowed)}, got {raw[key]!r}")
    model = Model(name=name, **{k: raw[k] for k in MODEL_FIELDS
                                if k not in ("matrix", "rope_scaling", "sliding_window")},
                  rope_scaling=_parse_rope_scaling(where, raw.get("rope_scaling")), sliding_window=w)
    model = dataclasses.replace(model, norm_eps=float(model.norm_eps), rope_theta=float(model.rope_theta))
    matrix = _parse_matrices(where, raw["matrix"]) if "matrix" in raw else None
    return model, matrix


def _model_at_line(text: str, line: int) -> str | None:
    """The name of the `models:` entry whose block holds 0-based `line` (for errors YAML reports by line only)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"^models\s*:", ln)), None)
    if start is None or line <= start:
        return None
    indent = None
    for ln in lines[start + 1:]:
        if ln.strip() and not ln.lstrip().startswith("#"):
            indent = len(ln) - len(ln.lstrip())
            break
    if not indent:
        return None
    for ln in reversed(lines[start + 1:min(line, len(lines) - 1) + 1]):
        if ln.strip() and not ln.lstrip().startswith("#") and len(ln) - len(ln.lstrip()) < indent:
            return None  # left the models block
        m = re.match(rf"^ {{{indent}}}([^\s:#][^:]*?)\s*:", ln)
        if m:
            return m.group(1).strip("'\"")
    return None


def parse(text: str, path: str = "variants.yaml") -> list[Variant]:
    """Parse and validate a variants file's text, expanding every model over its matrix."""
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        owner = _model_at_line(text, mark.line) if mark is not None else None
        where = f" model '{owner}':" if owner else ""
        raise VariantError(f"{path}:{line + ':' if line else ''}{where} YAML syntax error: {problem}") from None
    if doc is None:
        raise VariantError(f"{path}: empty (a mapping with keys 'models' and 'matrix'; see README: variants.yaml)")
    if not isinstance(doc, dict):
        raise VariantError(f"{path}: top level must be a mapping with keys 'models' and 'matrix'")
    if "model_type" in doc and "models" not in doc:  # (JSON is YAML)
        raise VariantError(f"{path}: a Hugging Face config.json, not a variants file (`megakernel from-hf {path} "
                           "--write variants.yaml` declares its variants)")
    for key in doc:
        if key not in ("models", "matrix"):
            raise VariantError(f"{path}: unknown top-level field '{key}' (allowed: models, matrix)")
    if not isinstance(doc.get("models"), dict) or not doc["models"]:
        raise VariantError(f"{path}: field 'models' must be a non-empty mapping of name -> shape")
    default_matrix = _parse_matrices(f"{path}: matrix", doc["matrix"]) if "matrix" in doc else None
    variants: list[Variant] = []
    for name, raw in doc["models"].items():
        where = f"{path}: model '{name}'"
        model, matrix = parse_model(where, name, raw)
        matrix = matrix or default_matrix
        if matrix is None:
            raise VariantError(f"{where}: no matrix (give a top-level 'matrix' or the model's own)")
        seen = set()
        for mx in matrix:
            for mode, batch, seq_len, tp in itertools.product(mx["mode"], mx["batch"], mx["seq_len"], mx["tp"]):
                if tp > 1 and mode != "decode":
                    raise VariantError(f"{where}: field 'matrix.tp' {tp} with mode {mode}: tensor parallel is built "
                                       "for decode only (a TP model's prompts run the unfused TP layer)")
                try:
                    shard_model(model, tp)
                except ValueError as exc:
                    raise VariantError(f"{where}: field 'matrix.tp': {exc}") from None
                v = Variant(model, mode, batch, seq_len, tp)
                if v.name in seen:
                    raise VariantError(f"{where}: two matrices both give {v.name}")
                seen.add(v.name)
                variants.append(v)
    return variants


def load(path: str | Path) -> list[Variant]:
    """A variants file (variants.yaml's format, README) -> its variants. VariantError, one line: unreadable, a model
    directory or config.json given in its place (from-hf turns those into an entry), or what `parse` refuses."""
    path = Path(path)
    if path.is_dir():
        hint = (f": a Hugging Face model directory (`megakernel from-hf {path} --write variants.yaml` declares its "
                "variants)") if (path / "config.json").is_file() else ""
        raise VariantError(f"{path}: a directory, not a variants file{hint}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise VariantError(f"{path}: no such variants file (pass --variants FILE, or start one from a model with "
                           f"`megakernel from-hf MODEL_DIR --write {path}`)") from None
    except OSError as exc:
        raise VariantError(f"{path}: cannot read variants file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise VariantError(f"{path}: cannot read variants file: not UTF-8 text (byte {exc.start})") from None
    return parse(text, str(path))


def select(variants: list[Variant], only: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[Variant]:
    """Filter by name globs (fnmatch): keep those matching any --only, drop those matching any --exclude."""
    kept = [v for v in variants if not only or any(fnmatch.fnmatchcase(v.name, g) for g in only)]
    return [v for v in kept if not any(fnmatch.fnmatchcase(v.name, g) for g in exclude)]
