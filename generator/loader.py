"""Prebuilt cubin + HF-named weights -> FusedDecoderLayer, a torch-callable decode step (one cooperative launch).

The loader never compiles: a missing, stale or corrupt build is an error that names the build command.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from . import reference
from .render import plan, render
from .variants import Model, Variant

_LAYERS: "weakref.WeakValueDictionary[int, FusedDecoderLayer]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


class LoadError(RuntimeError):
    """The build for a variant is missing, stale or corrupt (the message says which command fixes it)."""


def _variant_from_entry(entry: dict) -> Variant:
    p = dict(entry["params"])
    mode, batch, seq_len = p.pop("mode"), p.pop("batch"), p.pop("seq_len")
    rs = p.pop("rope_scaling")
    return Variant(Model(**p, rope_scaling=tuple(sorted(rs.items())) if rs else None), mode, batch, seq_len)


def find_entry(name: str, build_dir: str | Path) -> tuple[dict, Path]:
    build_dir = Path(build_dir)
    fix = f"run `megakernel build --build-dir {build_dir} --only '{name}'`"
    try:
        manifest = json.loads((build_dir / "manifest.json").read_text())
    except FileNotFoundError:
        raise LoadError(f"{name}: no build in {build_dir}/ (no manifest.json): {fix}") from None
    except ValueError:
        raise LoadError(f"{name}: {build_dir}/manifest.json is corrupt: {fix}") from None
    entry = manifest.get("variants", {}).get(name)
    if entry is None:
        raise LoadError(f"{name}: not in {build_dir}/manifest.json: declare it in variants.yaml and {fix}")
    if entry["status"] != "ok":
        raise LoadError(f"{name}: its build {entry['status']}: {entry.get('error', '').splitlines()[0]}")
    v = _variant_from_entry(entry)
    if hashlib.sha256(render(v, plan(v)).encode()).hexdigest() != entry.get("source_sha256"):
        raise LoadError(f"{name}: build is stale (templates or generator changed since it was built): {fix}")
    cubin = build_dir / entry["cubin"]
    meta_path = build_dir / entry["object"] / "meta.json"
    try:
        digest = hashlib.sha256(cubin.read_bytes()).hexdigest()
        ok = digest == json.loads(meta_path.read_text())["cubin_sha256"]
    except (OSError, ValueError, KeyError):
        ok = False
    if not ok:
        raise LoadError(f"{name}: {cubin} is missing or corrupt: {fix}")
    return entry, cubin


def _fragment_index() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) inside a 16x16 tile of each lane's 8 elements of an mma.m16n8k16 A fragment, in register order."""
    lane = torch.arange(32)
    gid, tig = lane // 4, lane % 4
    rows = torch.stack([gid, gid, gid + 8, gid + 8, gid, gid, gid + 8, gid + 8], dim=1)
    cols = torch.stack([2 * tig, 2 * tig + 1, 2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9, 2 * tig + 8,
                        2 * tig + 9], dim=1)
    return rows, cols


def to_fragments(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/16, 32, 8]: one 16-byte load gives a lane its A fragment of a 16x16 tile."""
    n, k = w.shape
    rows, cols = _fragment_index()
    tiles = w.reshape(n // 16, 16, k // 16, 16).permute(0, 2, 1, 3)  # [mt, kt, 16, 16]
    return tiles[:, :, rows.to(w.device), cols.to(w.device)].contiguous()


def from_fragments(f: torch.Tensor) -> torch.Tensor:
    mt, kt = f.shape[:2]
    rows, cols = _fragment_index()
    tiles = torch.empty(mt, kt, 16, 16, dtype=f.dtype, device=f.device)
    tiles[:, :, rows.to(f.device), cols.to(f.device)] = f
    return tiles.permute(0, 2, 1, 3).reshape(mt * 16, kt * 16)


def pack_weights(weights: dict[str, torch.Tensor], m: Model) -> dict[str, torch.Tensor]:
    """HF-named tensors -> the kernel's layout: [q; k; v] rows, gate/up rows interleaved (gate_i, up_i), every
    projection in tensor-core fragment order (to_fragments)."""
    W = weights
    packed = {
        "w_qkv": to_fragments(torch.cat([W["self_attn.q_proj.weight"], W["self_attn.k_proj.weight"],
                                         W["self_attn.v_proj.weight"]])),
        "w_o": to_fragments(W["self_attn.o_proj.weight"]),
        "w_gu": to_fragments(torch.stack([W["mlp.gate_proj.weight"], W["mlp.up_proj.weight"]], dim=1)
                             .reshape(2 * m.intermediate, m.hidden)),
        "w_down": to_fragments(W["mlp.down_proj.weight"]),
        "ln1_w": W["input_layernorm.weight"].contiguous(),
        "ln2_w": W["post_attention_layernorm.weight"].contiguous(),
    }
    if m.norm == "layernorm":
        packed["ln1_b"] = W["input_layernorm.bias"].contiguous()
        packed["ln2_b"] = W["post_attention_layernorm.bias"].contiguous()
    if m.qkv_bias:
        packed["b_qkv"] = torch.cat([W["self_attn.q_proj.bias"], W["self_attn.k_proj.bias"],
                                     W["self_attn.v_proj.bias"]]).contiguous()
    if m.qk_norm:
        packed["q_norm_w"] = W["self_attn.q_norm.weight"].contiguous()
        packed["k_norm_w"] = W["self_attn.k_norm.weight"].contiguous()
    return packed


def unpack_weights(packed: dict[str, torch.Tensor], m: Model) -> dict[str, torch.Tensor]:
    """Inverse of pack_weights (for tests and for reading a packed layer back)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    qkv = from_fragments(packed["w_qkv"])
    gu = from_fragments(packed["w_gu"]).view(m.intermediate, 2, m.hidden)
    W = {
        "self_attn.q_proj.weight": qkv[:q], "self_attn.k_proj.weight": qkv[q:q + kv],
        "self_attn.v_proj.weight": qkv[q + kv:], "self_attn.o_proj.weight": from_fragments(packed["w_o"]),
        "mlp.gate_proj.weight": gu[:, 0], "mlp.up_proj.weight": gu[:, 1],
        "mlp.down_proj.weight": from_fragments(packed["w_down"]),
        "input_layernorm.weight": packed["ln1_w"], "post_attention_layernorm.weight": packed["ln2_w"],
    }
    if m.norm == "layernorm":
        W["input_layernorm.bias"], W["post_attention_layernorm.bias"] = packed["ln1_b"], packed["ln2_b"]
    if m.qkv_bias:
        b = packed["b_qkv"]
        W.update({"self_attn.q_proj.bias": b[:q], "self_attn.k_proj.bias": b[q:q + kv],
                  "self_attn.v_proj.bias": b[q + kv:]})
    if m.qk_norm:
        W["self_attn.q_norm.weight"], W["self_attn.k_norm.weight"] = packed["q_norm_w"], packed["k_norm_w"]
    return W


def check_weights(weights: dict, m: Model, dtype: torch.dtype, device: torch.device) -> None:
    expected = reference.weight_shapes(m)
    for name in weights:
        if name not in expected:
            raise ValueError(f"weight '{name}': not a tensor of this layer (expected: {', '.join(expected)})")
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"weight '{name}': missing")
        t = weights[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"weight '{name}': must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"weight '{name}': shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype:
            raise ValueError(f"weight '{name}': dtype {t.dtype}, expected {dtype}")
        if t.device != device:
            raise ValueError(f"weight '{name}': on {t.device}, expected {device}")


class FusedDecoderLayer:
    """One decoder layer of one variant: owns packed weights, the KV cache and the kernel's workspace."""

    def __init__(self, entry: dict, cubin: Path, weights: dict[str, torch.Tensor], device):
        import cupy
        self.name = entry["name"]
        self.variant = _variant_from_entry(entry)
        self.model = m = self.variant.model
        self.plan = entry["plan"]
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device: the fused layer runs on CUDA, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = reference.TORCH_DTYPES[m.dtype]
        check_weights(weights, m, self.dtype, self.device)
        self.packed = pack_weights(weights, m)
        self.inv_freq = reference.inv_freq(m, self.device).float().contiguous()
        B, S = self.variant.batch, self.variant.seq_len
        self.k_cache = torch.zeros(B, m.kv_heads, S, m.head_dim, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        # one buffer for all scratch so the custom op can declare it mutated; views carve it up (16-byte aligned)
        wf, we = self.plan["workspace_floats"], self.plan["workspace_elems"]
        sizes = [("qkv", wf["qkv"] * 4), ("part", wf["part"] * 4), ("h", wf["h"] * 4),
                 ("count", self.plan["counters"] * 4), ("attn", we["attn"] * 2), ("act", we["act"] * 2),
                 ("clock", 8 * 8)]
        offs, total = {}, 0
        for key, nbytes in sizes:
            offs[key] = total
            total += (nbytes + 255) // 256 * 256
        self.workspace = torch.zeros(total, dtype=torch.uint8, device=self.device)
        self._ws_offsets = offs
        self._pos_host = torch.zeros(B, dtype=torch.int32).pin_memory()
        self._pos_dev = torch.zeros(B, dtype=torch.int32, device=self.device)

        with cupy.cuda.Device(self.device.index):
            t0 = time.perf_counter()
            self._module = cupy.RawModule(path=str(cubin), enable_cooperative_groups=True)
            kernel = self._module.get_function("decoder_layer")
            kernel.max_dynamic_shared_size_bytes = self.plan["smem_bytes"]
            self._fn = kernel.kernel  # forces the module load
            self.load_ms = (time.perf_counter() - t0) * 1e3
            self.attributes = kernel.attributes
            from cupy_backends.cuda.api import driver
            occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(self._fn.ptr, self.plan["threads"],
                                                                   self.plan["smem_bytes"])
            sms = cupy.cuda.Device(self.device.index).attributes["MultiProcessorCount"]
        if occ < 1:
            raise RuntimeError(f"{self.name}: no block of {self.plan['threads']} threads with "
                               f"{self.plan['smem_bytes']} B shared memory fits on an SM of this GPU, so the "
                               "cooperative launch cannot have all its blocks resident")
        # the kernel strides over gridDim: any co-resident grid is correct; one block per SM is what was planned
        self.grid = sms * min(occ, 1)
        self.id = next(_IDS)
        _LAYERS[self.id] = self

    STAGES = ("norm+qkv_proj", "attention", "o_proj", "norm+gate_up", "down_proj")

    def stage_us(self) -> dict[str, float]:
        """Time of each stage in the last launch (block 0's SM clock, barrier waits included); synchronises."""
        import cupy
        off = self._ws_offsets["clock"]
        c = self.workspace[off:off + 48].view(torch.int64).cpu().tolist()
        khz = cupy.cuda.Device(self.device.index).attributes["ClockRate"]
        return {s: (c[i + 1] - c[i]) / khz * 1e3 for i, s in enumerate(self.STAGES)}

    # -- weights read back in HF layout (for tests) --
    def weights(self) -> dict[str, torch.Tensor]:
        return unpack_weights(self.packed, self.model)

    def _ptr(self, key: str) -> int:
        return self.workspace.data_ptr() + self._ws_offsets[key]

    def check_inputs(self, x: torch.Tensor, pos: torch.Tensor) -> None:
        B, H = self.variant.batch, self.model.hidden
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, H):
            raise ValueError(f"x: shape {tuple(getattr(x, 'shape', ()))}, expected ({B}, {H})")
        if x.dtype != self.dtype:
            raise ValueError(f"x: dtype {x.dtype}, expected {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"x: on {x.device}, expected {self.device}")
        if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (B,):
            raise ValueError(f"pos: shape {tuple(getattr(pos, 'shape', ()))}, expected ({B},)")
        if pos.dtype != torch.int32:
            raise ValueError(f"pos: dtype {pos.dtype}, expected torch.int32")
        if pos.device.type == "cuda" and pos.device != self.device:
            raise ValueError(f"pos: on {pos.device}, expected {self.device} or the CPU")

    def check_positions(self, pos: torch.Tensor) -> None:
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= self.variant.seq_len:
            raise ValueError(f"pos: values must be in [0, {self.variant.seq_len - 1}] (seq_len), got {lo}..{hi}")

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """One decode step. pos on the CPU is checked on the host and copied asynchronously (no sync); pos on the
        GPU is checked with one device read unless validate=False or a CUDA graph is being captured (then the
        kernel's own guard turns an out-of-range sequence's output into NaN and leaves its cache alone)."""
        self.check_inputs(x, pos)
        if pos.device.type == "cpu":
            self.check_positions(pos)
            self._pos_host.copy_(pos)
            self._pos_dev.copy_(self._pos_host, non_blocking=True)
            pos = self._pos_dev
        elif validate and not torch.cuda.is_current_stream_capturing():
            self.check_positions(pos)
        return torch.ops.megakernel.decoder_layer(x, pos.contiguous(), self.k_cache, self.v_cache, self.workspace,
                                                  self.id)

    def launch(self, x: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        P = self.packed
        ptr = lambda t: np.uint64(t.data_ptr() if t is not None else 0)  # noqa: E731
        args = (ptr(x), ptr(pos), ptr(out), ptr(P["w_qkv"]), ptr(P.get("b_qkv")), ptr(P.get("q_norm_w")),
                ptr(P.get("k_norm_w")), ptr(P["ln1_w"]), ptr(P.get("ln1_b")), ptr(P["w_o"]), ptr(P["ln2_w"]),
                ptr(P.get("ln2_b")), ptr(P["w_gu"]), ptr(P["w_down"]), ptr(self.inv_freq), ptr(self.k_cache),
                ptr(self.v_cache), np.uint64(self._ptr("qkv")), np.uint64(self._ptr("part")),
                np.uint64(self._ptr("count")), np.uint64(self._ptr("attn")), np.uint64(self._ptr("h")),
                np.uint64(self._ptr("act")), np.uint64(self._ptr("clock")))
        # torch's current stream, read at every call (a cached stream would break CUDA-graph capture)
        stream = SimpleNamespace(ptr=torch.cuda.current_stream(self.device).cuda_stream)
        self._fn((self.grid, 1, 1), (self.plan["threads"], 1, 1), args, self.plan["smem_bytes"], stream, True)


@torch.library.custom_op("megakernel::decoder_layer", mutates_args=("k_cache", "v_cache", "workspace"))
def _decoder_layer_op(x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      workspace: torch.Tensor, layer_id: int) -> torch.Tensor:
    out = torch.empty_like(x)
    _LAYERS[layer_id].launch(x, pos, out)
    return out


@_decoder_layer_op.register_fake
def _(x, pos, k_cache, v_cache, workspace, layer_id):
    return torch.empty_like(x)


def load(name: str, weights: dict[str, torch.Tensor], *, build_dir: str | Path = "build",
         device="cuda") -> FusedDecoderLayer:
    """Load variant `name` from a prebuilt build directory with HF-named weights (already on `device`)."""
    entry, cubin = find_entry(name, build_dir)
    return FusedDecoderLayer(entry, cubin, weights, device)
