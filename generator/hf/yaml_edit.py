"""variants.yaml editing: a mapped config as the text of a `models:` entry, and appending it to a file atomically."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import yaml

from .. import variants as gvariants
from .config import (HFConfigError, PositionLimit, Window, check_positions, check_window, map_config,
                     max_positions)

FIELD_ORDER = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "norm", "norm_eps",
               "rope_theta", "rope_scaling", "sliding_window", "activation", "qkv_bias", "qk_norm", "dtype")
# the comment variant_entry_yaml writes for a sliding window; append_entry reads the size back from it
_WINDOW_COMMENT = re.compile(r"^\s*#\s*sliding_window (\d+) \((.*)\): ")
# and for dynamic RoPE's limit (config._map_rope's note)
_DYNAMIC_COMMENT = re.compile(r"^\s*#\s*rope_type dynamic: default RoPE for positions below max_position_embeddings "
                              r"(\d+) ")


def _yaml_line(key, value) -> str:
    """One `key: value` line; a mapping value in flow style ({a: 1, b: 2}), as variants.yaml writes rope_scaling."""
    if isinstance(value, dict):
        flow = yaml.dump(value, Dumper=gvariants.Dumper, sort_keys=False, default_flow_style=True,
                         width=10**9).strip()
        return f"{_yaml_line(key, None).removesuffix(' null')} {flow}"
    return yaml.dump({key: value}, Dumper=gvariants.Dumper, sort_keys=False, default_flow_style=False,
                     width=10**9).rstrip("\n")


def variant_entry_yaml(path, name=None, matrix: list[dict] | None = None) -> str:
    """YAML text of a model directory's (or config.json's) entry, indented to paste under `models:` (two spaces
    for the name, four for fields), with notes as comments; `matrix` ([{"mode": [...], "batch": [...], "seq_len":
    [...]}, ...]): the entry's own matrices (variants.yaml's per-model `matrix:`), checked as variants.yaml checks
    them and against the model's sliding window. HFConfigError / VariantError as map_config."""
    name, fields, notes, cfg_path, cfg = map_config(path, name)[:5]
    def one_line(text) -> str:  # a comment stays one line whatever the path holds (a newline would end it)
        return str(text).replace("\n", "\\n").replace("\r", "\\r")
    lines = [f"  # from {one_line(cfg_path)} (model_type {one_line(cfg['model_type'])})"]
    lines.append("  " + _yaml_line(name, None).removesuffix(" null"))
    lines += [f"    # {one_line(n)}" for n in notes]
    lines += ["    " + _yaml_line(k, fields[k]) for k in FIELD_ORDER if k in fields]
    text = "\n".join(lines) + "\n"
    if matrix is not None:
        flows = [_yaml_line("m", m).removeprefix("m: ") for m in matrix]
        text += "    matrix: " + (flows[0] if len(flows) == 1 else "[" + ", ".join(flows) + "]") + "\n"
        expanded = gvariants.parse(NEW_FILE.format(seq_len=DEFAULT_SEQ_LEN) + text,
                                   f"{cfg_path}: --batch/--seq-len/--prefill-chunks")
        _check_windows(text, name, expanded, f"{cfg_path}")
        trained = trained_positions(cfg, fields.get("rope_scaling"))
        longest = max((n for m in matrix if "decode" in m.get("mode", ()) for n in m.get("seq_len", ())), default=0)
        if trained is not None and longest > trained:  # built and run as asked, but past what the model learned
            text += (f"    # {WARNING_MARK} seq_len {longest} is longer than {context_words(cfg, trained)}: "
                     "positions past it were never trained\n")
    return text


WARNING_MARK = "warning:"  # a comment line of the entry that `from-hf` also prints


def _check_windows(text: str, name: str, expanded, where: str) -> None:
    """The entry's sliding window (its `# sliding_window N (...)` comment in `text`) and dynamic RoPE's limit (its
    `# rope_type dynamic: ...` comment) against the seq_len of each variant of model `name` in `expanded`
    (HFConfigError where a cache is longer than either)."""
    dynamic = next(filter(None, map(_DYNAMIC_COMMENT.match, text.splitlines())), None)
    if dynamic is not None:
        limit = PositionLimit(int(dynamic.group(1)), "rope_type dynamic")
        for v in expanded:
            if v.model.name == name and v.mode == "decode":
                check_positions(limit, v.seq_len, f"{where}: variant '{v.name}'")
    window = next(filter(None, map(_WINDOW_COMMENT.match, text.splitlines())), None)
    if window is not None:
        size, source = int(window.group(1)), window.group(2)
        for v in expanded:
            if v.model.name == name:
                # (a window noted on every layer is llama's or attention_chunk_size's: every other such window is
                # the entry's field)
                why = "layers" if not source.endswith(", every layer") else \
                    "chunk" if "'attention_chunk_size'" in source else "llama"
                check_window(Window(size, source, (), why=why), v.seq_len, f"{where}: variant '{v.name}'")


_MODELS_LINE = re.compile(r"^models:\s*(#.*)?$")
_EMPTY_MODELS_LINE = re.compile(r"^models:\s*\{\s*\}\s*(#.*)?$")
DEFAULT_SEQ_LEN = 4096  # a decode variant's KV rows a sequence where from-hf is given none


def trained_positions(cfg: dict, rope_scaling=None) -> int | None:
    """The positions (tokens) the model is meant to run at: config.json's max_position_embeddings (where absent, the
    config class's default, as transformers reads it: config.max_positions) where it is a positive integer, else None
    (null or not a count: nothing to compare a cache with). With yarn RoPE scaling (`rope_scaling` as the entry maps
    it, a dict or Model.rope_scaling's pairs) the longer of that and factor x original_max_position_embeddings: yarn
    extends the pretraining length by its factor (Peng et al. 2023, arXiv:2309.00071), and Qwen2.5's model cards
    keep max_position_embeddings at the original length beside it."""
    trained = max_positions(cfg)
    if isinstance(trained, bool) or not isinstance(trained, int) or trained <= 0:
        return None
    rs = dict(rope_scaling or ())
    if rs.get("rope_type") == "yarn":
        trained = max(trained, int(rs["factor"] * rs["original_max_position_embeddings"]))
    return trained


def context_words(cfg: dict, positions: int) -> str:
    """How a message names trained_positions' `positions`: config.json's max_position_embeddings, or yarn's extended
    context beside it."""
    mpe = max_positions(cfg)
    return (f"max_position_embeddings {positions}" if positions == mpe
            else f"the {positions} positions yarn RoPE scaling extends max_position_embeddings {mpe} to")


def default_seq_len(cfg: dict) -> int:
    """The KV rows (tokens) a sequence that from-hf gives a model's decode variants unless told: DEFAULT_SEQ_LEN, or
    config.json's max_position_embeddings where that is shorter (positions past it were never trained, and dynamic
    RoPE refuses them)."""
    return min(DEFAULT_SEQ_LEN, trained_positions(cfg) or DEFAULT_SEQ_LEN)


# a variants file that --write starts: decode at batch 1 and 8 over a cache of {seq_len} rows (edit it to taste)
NEW_FILE = ("# variants started by `megakernel from-hf --write`: every model below is built for each combination of\n"
            "# the matrix (a model may give its own `matrix:`); see the project's variants.yaml for more\n"
            "matrix: {{mode: [decode], batch: [1, 8], seq_len: [{seq_len}]}}\n"
            "models:\n")


def _atomic_write_text(path: Path, text: str, newline: str = "\n") -> None:
    real = Path(os.path.realpath(path))  # a symbolic link stays one: its target gets the text (messages: `path`)
    try:
        mode = real.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644
    try:
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    except OSError as exc:
        raise HFConfigError(f"{path}: cannot write variants file: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", newline=newline) as f:  # the file's own line endings (CRLF kept)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise HFConfigError(f"{path}: cannot write variants file: {exc.strerror}") from None
        raise


def append_entry(variants_file, text: str, seq_len: int = DEFAULT_SEQ_LEN) -> None:
    """Append a models entry (variant_entry_yaml's text) under the file's top-level block `models:` mapping, atomically;
    a file that does not exist (or is empty) is started with NEW_FILE's default matrix (decode, batch 1 and 8, caches
    of `seq_len` rows: pass default_seq_len(config) as from-hf does, else 4096). Writes nothing, raising
    HFConfigError / VariantError (one line), when the name is already there, the result does not parse as a
    variants file, or the entry's sliding window (its `# sliding_window N (...)` comment) is shorter than a
    seq_len the file's matrix gives it."""
    path = Path(variants_file)
    try:
        old = path.read_text()
    except FileNotFoundError:
        old = ""
    except OSError as exc:
        raise HFConfigError(f"{path}: cannot read variants file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise HFConfigError(f"{path}: cannot read variants file: not UTF-8 text (byte {exc.start})") from None
    if not old.strip():
        old = NEW_FILE.format(seq_len=seq_len)  # a new (or empty) variants file: a default matrix, then the entry
    # `models: {}` (an empty flow mapping) becomes a block the entry goes under
    old = "".join(re.sub(r"\{\s*\}", "", ln, count=1) if _EMPTY_MODELS_LINE.match(ln.rstrip("\n")) else ln
                  for ln in old.splitlines(keepends=True))
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
    expanded = gvariants.parse(new, str(path))  # the result must still be a valid variants file (VariantError)
    try:
        _check_windows(text, new_name, expanded, str(path))
    except HFConfigError as exc:
        if "matrix:" in text:
            raise
        raise HFConfigError(f"{exc}; give the entry its own matrix (from-hf --seq-len N)") from None
    try:
        crlf = b"\r\n" in path.read_bytes()
    except FileNotFoundError:
        crlf = False
    _atomic_write_text(path, new, "\r\n" if crlf else "\n")


