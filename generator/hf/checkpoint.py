"""A checkpoint directory: which file holds each tensor, its shape and dtype, from the headers only (safetensors), or
from a PyTorch checkpoint's pickled metadata with its storages memory-mapped (pytorch_model.bin, as transformers reads
one where a directory has no safetensors file)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .config import HFConfigError, map_config

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"  # (transformers' WEIGHTS_NAME / WEIGHTS_INDEX_NAME)
BIN_INDEX = "pytorch_model.bin.index.json"
# torch dtypes as safetensors names them (the names `dtype` returns)
_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8", "uint8": "U8",
             "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2"}
# buffers some old checkpoints saved with the layer: recomputed from the config, never used as weights
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFCheckpointError(HFConfigError):
    """A checkpoint's tensors do not match its config: one line naming the tensor and the file."""


def _unusable(file: Path) -> str | None:
    """Why a weights path that should be a readable file is not one (safetensors says "not found" for each), or
    None where it is one."""
    if file.is_file() and os.access(file, os.R_OK):
        return None
    if file.is_symlink() and not file.exists():
        return f"a symbolic link to a missing file ({os.readlink(file)})"
    return "not a file" if file.exists() and not file.is_file() else \
        "cannot read it (permission denied)" if file.exists() else "no such file"


def weights_file(cfg_path: Path, cfg: dict) -> Path:
    """The file transformers 5.25 loads from a local directory (modeling_utils._get_resolved_checkpoint_files): the
    config's `transformers_weights` if set, else model.safetensors, else model.safetensors.index.json, else
    pytorch_model.bin, else pytorch_model.bin.index.json. A model.safetensors wins over an index next to it (e.g. a
    stale one left by an earlier sharded save)."""
    d = cfg_path.parent
    explicit = cfg.get("transformers_weights")
    if explicit is not None:
        p = (d / str(explicit)).resolve()
        if not str(explicit).endswith((".safetensors", ".safetensors.index.json")) or d.resolve() not in p.parents:
            raise HFCheckpointError(f"{cfg_path}: field 'transformers_weights' is {explicit!r}: must name a "
                                    "*.safetensors or *.safetensors.index.json file inside the model directory")
        if not p.is_file():
            raise HFCheckpointError(f"{p}: no such file (named by field 'transformers_weights' of {cfg_path})")
        return d / str(explicit)
    names = (SINGLE, INDEX, BIN, BIN_INDEX)
    for name in names:
        if (d / name).is_file():
            return d / name
    for name in names:  # there, but not a file: said as such, not as absent
        if (d / name).is_symlink() or (d / name).exists():
            raise HFCheckpointError(f"{d / name}: {_unusable(d / name)}")
    raise HFCheckpointError(f"{d}: no {SINGLE}, {INDEX}, {BIN} or {BIN_INDEX} (the weights transformers would load)")


class _SafeFile:
    """A safetensors file's tensors: names, shapes and dtypes from its header; a tensor read on get()."""

    def __init__(self, file: Path):
        from safetensors import safe_open
        self._f = safe_open(str(file), framework="pt")

    def keys(self):
        return self._f.keys()

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(tensor).get_shape())

    def dtype(self, tensor: str) -> str:
        return self._f.get_slice(tensor).get_dtype()

    def get(self, tensor: str):
        return self._f.get_tensor(tensor)


class _TorchFile:
    """A PyTorch checkpoint file's tensors as transformers reads one (modeling_utils.load_state_dict: torch.load with
    weights_only=True on the CPU, memory-mapped where the file is a zip archive, torch.save's format since 1.6: a
    tensor's bytes are read when it is used; a legacy file is read whole here). Entries that are not tensors are
    named with the tensors (so unused, they are warned as transformers reports unexpected keys) and refused if a
    weight's name holds one."""

    def __init__(self, file: Path):
        import zipfile

        import torch
        sd = torch.load(str(file), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        if not isinstance(sd, dict) or not any(isinstance(t, torch.Tensor) for t in sd.values()):
            raise ValueError("not a state dict of named tensors")
        self.file, self._sd = file, sd

    def keys(self):
        return self._sd.keys()

    def _tensor(self, tensor: str):
        import torch
        t = self._sd[tensor]
        if not isinstance(t, torch.Tensor):
            raise HFCheckpointError(f"{self.file}: entry '{tensor}' holds a {type(t).__name__}, not a tensor")
        return t

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(self._tensor(tensor).shape)

    def dtype(self, tensor: str) -> str:
        t = str(self._tensor(tensor).dtype).removeprefix("torch.")
        return _ST_DTYPE.get(t, t.upper())

    def get(self, tensor: str):
        return self._tensor(tensor)


def _why_unreadable(file: Path, exc: Exception) -> str:
    """One line on why a weights file did not open: an empty file or a Git LFS pointer said as such (the weights not
    fetched), else the library's message without terminal colours, for torch.load's weights_only refusal its
    "Unsupported ..." line (the cause; its advice to load unsafely is not ours to give)."""
    import re
    try:
        with open(file, "rb") as f:
            head = f.read(24)
        if not head:
            return "an empty file (0 bytes)"
        if head.startswith(b"version https://git-lfs"):
            return "a Git LFS pointer, not the weights (fetch them: git lfs pull)"
        if file.suffix != ".safetensors" and not head.startswith((b"PK\x03\x04", b"\x80")):
            # (torch.save writes a zip archive, or before torch 1.6 a pickle, protocol 2+: torch.load's own error
            # on anything else can be a bare KeyError of the first byte)
            return f"neither a zip archive (torch.save's format) nor a pickle: it starts {head[:8]!r}"
    except OSError:
        pass
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if m := re.search(r"Unsupported .*?(?: by default|$)", text, re.M):  # (torch's WeightsUnpickler line)
        return m.group(0)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {line}" if len(line) < 12 else line  # (a bare "101" says nothing alone)


class _Checkpoint:
    """A model directory: its mapped config (`mapped`, `model`) and where each tensor lives (`files`: tensor name ->
    file). Every error is an HFConfigError / HFCheckpointError naming the file; no tensor is read until get()."""

    def __init__(self, path, kernel: bool = True):
        self.mapped = map_config(path, kernel=kernel)  # (kernel=False: a shape only the unfused layers compute)
        self.cfg_path, self.cfg = self.mapped.cfg_path, self.mapped.cfg
        self.dir = self.cfg_path.parent
        self.model = self.mapped.model(kernel)
        self.index_path = weights_file(self.cfg_path, self.cfg)
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        if self.index_path.name.endswith(".index.json"):
            try:
                index = json.loads(self.index_path.read_text())
            except OSError as exc:
                raise HFCheckpointError(f"{self.index_path}: cannot read it ({exc.strerror or exc})") from None
            except ValueError as exc:  # (JSONDecodeError, UnicodeDecodeError)
                raise HFCheckpointError(f"{self.index_path}: not valid JSON ({str(exc).splitlines()[0]})") from None
            try:
                items = index["weight_map"].items()
            except (KeyError, TypeError, AttributeError):
                raise HFCheckpointError(f"{self.index_path}: not a checkpoint index (no 'weight_map' object)") \
                    from None
            for tensor, shard in items:
                self.files[tensor] = self.dir / shard
        else:
            for tensor in self.handle(self.index_path).keys():
                self.files[tensor] = self.index_path
        self.prefix = "model." if any(t.startswith("model.layers.") for t in self.files) else ""

    def _open(self, file: Path):
        if why := _unusable(file):
            raise HFCheckpointError(f"{file}: {why}" + (f" (a shard listed in {self.index_path.name})"
                                                         if file != self.index_path else ""))
        torch_file = not file.name.endswith(".safetensors")  # (as transformers' load_state_dict decides)
        try:
            return _TorchFile(file) if torch_file else _SafeFile(file)
        except FileNotFoundError:
            raise HFCheckpointError(f"{file}: shard listed in {self.index_path.name} is missing") from None
        except Exception as exc:  # safetensors and torch.load raise their own error types for a corrupt file
            what = "PyTorch checkpoint (loaded as transformers does: weights_only)" if torch_file else "safetensors file"
            raise HFCheckpointError(f"{file}: not a readable {what}: {_why_unreadable(file, exc)}") from None

    def handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file]

    def where(self, tensor: str) -> Path:
        """The file holding `tensor`; HFCheckpointError if it is not in the checkpoint."""
        file = self.files.get(tensor)
        if file is None:
            raise HFCheckpointError(f"{self.index_path}: tensor '{tensor}' is missing")
        if tensor not in self.handle(file).keys():
            raise HFCheckpointError(f"{file}: tensor '{tensor}' is missing (listed in {self.index_path.name})")
        return file

    def shape(self, tensor: str) -> tuple[int, ...]:
        return self.handle(self.where(tensor)).shape(tensor)

    def dtype(self, tensor: str) -> str:
        """The stored dtype as safetensors names it: "BF16", "F16", "F32", ..."""
        return self.handle(self.where(tensor)).dtype(tensor)

    def check(self, tensor: str, shape: tuple[int, ...]) -> None:
        """HFCheckpointError unless `tensor` is stored as floats (BF16, F16, F32, F64: a quantized or integer tensor
        is not a weight this loader can cast) with `shape`."""
        got = self.shape(tensor)
        if got != tuple(shape):
            raise HFCheckpointError(f"{self.where(tensor)}: tensor '{tensor}' has shape {got}, expected "
                                    f"{tuple(shape)} (from {self.cfg_path.name})")
        if (dt := self.dtype(tensor)) not in ("BF16", "F16", "F32", "F64"):
            raise HFCheckpointError(f"{self.where(tensor)}: tensor '{tensor}' is stored as {dt}: expected floating "
                                    "point (BF16, F16 or F32; quantized checkpoints are not supported)")

    def get(self, tensor: str):
        """The tensor as stored (CPU, its own dtype)."""
        return self.handle(self.where(tensor)).get(tensor)

    def check_layer(self, i: int) -> dict[str, str]:
        """Shapes of every tensor of layer i against reference.weight_shapes; -> {short name: full name}."""
        from .. import reference
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
