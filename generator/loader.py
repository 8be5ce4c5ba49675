"""Prebuilt cubin + HF-named weights -> FusedDecoderLayer, a torch-callable layer step (one launch, cooperative
unless its plan says COOP 0).

The runtime stands alone: it reads the build directory's manifest (generator.manifest) and the kernel interface
(generator.interface), never the templates, the renderer or the reference. It never compiles: a missing, stale or
corrupt build, or one made for another GPU architecture, is an error that names the build command.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Mapping
import os
import time
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from .collectives import AllReduce
from .host import inv_freq
from .interface import (ARGS, CLOCK_SLOTS, KV_TENSOR_MAPS, PACKED, TENSOR_MAP_BYTES, TENSOR_MAPS, from_frag, from_ll,
                        from_tiles, on_engine, pack_weights,
                        packed_shapes, shard_weights, unpack_weights, weight_shapes)
from .interface import from_fragments, to_fragments  # noqa: F401  (re-exported: callers import them from here)
from .manifest import LoadError, build_dir_flag, find_entry, variant_from_entry
from .targets import runs_on, torch_dtype, weight_format
from .variants import Model

_variant_from_entry = variant_from_entry  # the name callers used before generator.manifest existed
_LAYERS: "weakref.WeakValueDictionary[int, FusedDecoderLayer]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: unset or empty is `default`; 1/on/true/yes and 0/off/false/no (any case);
    anything else is a LoadError naming it (a typo must not silently keep the default)."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise LoadError(f"{name}: 0/off/false/no or 1/on/true/yes, got {os.environ[name]!r}")


def check_weights(weights: dict, m: Model, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError naming the first tensor of `weights` that is extra, missing, or of the wrong shape
    (interface.weight_shapes), dtype or device."""
    expected = weight_shapes(m)
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights: a dict of the layer's tensors by name ({', '.join(expected)}), or None with "
                         f"packed= another layer's .packed; got {type(weights).__name__}")
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


def tp_rank(group, tp: int, name: str) -> int:
    """This process's rank in torch.distributed process group `group` of a variant built for `tp` GPUs; ValueError
    (one line) where the group is missing, of another size, or given to a tp = 1 variant."""
    if tp == 1:
        if group is not None and torch.distributed.get_world_size(group) != 1:
            raise ValueError(f"group: {name} is built for one GPU (tp 1), got a process group of "
                             f"{torch.distributed.get_world_size(group)}")
        return 0
    if group is None:
        raise ValueError(f"group: {name} is split over tp = {tp} GPUs: pass the torch.distributed process group "
                         "(NCCL, one process per GPU) that runs it")
    size = torch.distributed.get_world_size(group)
    if size != tp:
        raise ValueError(f"group: {name} is built for tp = {tp} GPUs, the process group has {size}")
    return torch.distributed.get_rank(group)


# cuLaunchKernelEx (CUDA driver API, cuda.h): a decode step's cooperative launch with programmatic dependent launch
# (PDL) on sm_90+, so the next layer's launch is scheduled while this one runs and its blocks take each SM as ours
# leave (templates/kernel.cu.j2: griddepcontrol). MEGAKERNEL_PDL=0 launches without it (cuLaunchCooperativeKernel).
_ATTR_COOPERATIVE, _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 2, 6  # CUlaunchAttributeID


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def _launch_kernel_ex():
    """libcuda's cuLaunchKernelEx and cuGetErrorString (ctypes), loaded once."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn, err = lib.cuLaunchKernelEx, lib.cuGetErrorString
    fn.restype, err.restype = ctypes.c_int, ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return fn, err


def pdl_config(grid: int, threads: int, smem: int, *, cooperative: bool) -> _LaunchConfig:
    """A cuLaunchKernelEx configuration of `grid` blocks x `threads` threads with `smem` bytes of dynamic shared
    memory, launched with programmatic dependent launch (the kernel's griddepcontrol.wait orders it after the
    previous launch in the stream) and, where `cooperative`, as a cooperative launch (grid-wide barriers). Its
    stream is set per launch (launch_pdl)."""
    ids = ((_ATTR_COOPERATIVE,) if cooperative else ()) + (_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION,)
    attrs = (_LaunchAttr * len(ids))()
    for a, aid in zip(attrs, ids):
        a.id, a.value.i = aid, 1
    cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, None, attrs, len(ids))
    cfg.keep = attrs  # (the struct points into the array: it lives as long as the config)
    return cfg


def launch_pdl(config: _LaunchConfig, stream: int, fn_ptr: int, params_addr: int) -> None:
    """cuLaunchKernelEx of the kernel `fn_ptr` (a CUfunction) with the driver's argument array at `params_addr`
    on `stream` (a CUstream handle), configured by pdl_config. Raises RuntimeError with the driver's message where it
    refuses the launch."""
    launch_ex, err_str = _launch_kernel_ex()
    config.hStream = stream
    rc = launch_ex(ctypes.byref(config), fn_ptr, params_addr, None)
    if rc:
        msg = ctypes.c_char_p()
        err_str(rc, ctypes.byref(msg))
        raise RuntimeError(f"{(msg.value or b'unknown error').decode()} (CUresult {rc}, cuLaunchKernelEx with "
                           "programmatic dependent launch; MEGAKERNEL_PDL=0 launches without)")


def _encode_tiled(name: str, what: str, maps: list, device) -> torch.Tensor:
    """cuTensorMapEncodeTiled (CUDA driver API) of each (label, tensor, sizes, strides, box, swizzle) in `maps`:
    16-bit elements, sizes and box innermost first, strides in bytes of the dims above the innermost, zeros past
    the edges, L2 promotion 256 B; swizzle as CUtensorMapSwizzle (0 none, 3 the 128-byte swizzle). Returns the maps as
    uint8 [len(maps), TENSOR_MAP_BYTES] on `device` (the kernel reads them from global memory). Raises LoadError
    (naming the variant `name` and `what` needs them) where the driver has no cuTensorMapEncodeTiled (CUDA < 12) or
    refuses one."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError) as e:
        raise LoadError(f"{name}: {what} need the CUDA driver's cuTensorMapEncodeTiled (CUDA 12+ driver): {e}") \
            from None
    fn.restype = ctypes.c_int
    host = bytearray(len(maps) * TENSOR_MAP_BYTES + 64)
    base = (ctypes.c_char * len(host)).from_buffer(host)
    off = (-ctypes.addressof(base)) % 64  # CUtensorMap is 64-byte aligned
    for i, (label, w, sizes, strides, box, swizzle) in enumerate(maps):
        assert w.element_size() == 2 and w.is_contiguous(), (label, w.dtype, w.shape)
        r = len(sizes)
        rc = fn(ctypes.c_void_p(ctypes.addressof(base) + off + i * TENSOR_MAP_BYTES),
                ctypes.c_int(1),   # CU_TENSOR_MAP_DATA_TYPE_UINT16: a copy, any 16-bit element
                ctypes.c_uint32(r), ctypes.c_void_p(w.data_ptr()),
                (ctypes.c_uint64 * r)(*sizes), (ctypes.c_uint64 * (r - 1))(*strides),
                (ctypes.c_uint32 * r)(*box), (ctypes.c_uint32 * r)(*([1] * r)),
                ctypes.c_int(0), ctypes.c_int(swizzle),  # no interleave
                ctypes.c_int(3), ctypes.c_int(0))  # L2 promotion 256 B; out-of-bounds elements are zeros
        if rc:
            raise LoadError(f"{name}: cuTensorMapEncodeTiled refused {label} {tuple(w.shape)} with a box of "
                            f"{list(reversed(box))} (CUresult {rc})")
    raw = bytes(host[off:off + len(maps) * TENSOR_MAP_BYTES])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(maps), TENSOR_MAP_BYTES).to(device)


def _tensor_maps(name: str, packed: dict, box_rows: int, box_k: int, device) -> torch.Tensor:
    """The TMA tensor maps of the prefill GEMM's weights (interface.TENSOR_MAPS order; templates/gemm.cuh): each
    packed weight [N/16, K/16, 32, 8] (16-bit elements) as a 3-D tensor [N/16][K/16][256] with a box of
    [box_rows][box_k][256] (a ring stage's chunk of a weight tile), no swizzle (the ring keeps the packed order).
    Returns uint8 [len(TENSOR_MAPS), 128] on `device`; raises LoadError as _encode_tiled."""
    maps = []
    for arg in TENSOR_MAPS:
        w = packed[arg]  # contiguous 16-bit [N/16, K/16, 32, 8] on the device (checked by the caller)
        assert tuple(w.shape[2:]) == (32, 8), (arg, w.shape)
        mts, kts = w.shape[:2]
        maps.append((arg, w, (256, kts, mts), (512, kts * 512), (256, box_k, box_rows), 0))
    return _encode_tiled(name, "the prefill GEMM's TMA tensor maps", maps, device)


def _cache_maps(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, device) -> torch.Tensor:
    """The TMA tensor maps of decode attention's caches (ATT_TMA; interface.KV_TENSOR_MAPS order;
    templates/stages/attention.cuh): each cache [batch, kv_heads, rows, head_dim] as a 2-D tensor
    [batch x kv_heads x rows][head_dim] with a box of 16 rows x 64 dims (a K or V tile's 64-dim part; dims past
    head_dim are zeros) in the 128-byte swizzle. Returns uint8 [2, 128] on `device`; raises LoadError as
    _encode_tiled."""
    maps = []
    for label, c in zip(KV_TENSOR_MAPS, (k_cache, v_cache)):
        hd = c.shape[-1]
        maps.append((label, c, (hd, c.numel() // hd), (hd * c.element_size(),), (64, 16), 3))
    return _encode_tiled(name, "decode attention's cache tensor maps (ATT_TMA)", maps, device)


def _max_active_clusters(fn_ptr: int, grid: int, threads: int, smem: int) -> int:
    """cuOccupancyMaxActiveClusters: how many of the kernel's compiled clusters (__cluster_dims__) can be resident
    at once (a cluster's blocks share one GPC, so this can be fewer than SMs / cluster size)."""
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_int(0)
    cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, None, None, 0)
    rc = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn_ptr), ctypes.byref(cfg))
    if rc:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed (CUresult {rc})")
    return n.value


class FusedDecoderLayer:
    """One decoder layer of one variant: holds the packed weights, the KV cache and the kernel's workspace (each
    may be shared with other layers: load()'s packed, caches, share_workspace).

    k_cache, v_cache: [batch, kv_heads / tp, cache rows, head_dim] in the variant's dtype (bf16/fp16), updated in
    place at each step's positions; the cache rows are a decode variant's seq_len, a prefill variant's cache_len (its
    seq_len is the chunk). Built by generator.load(); raises LoadError (build for another GPU, no CUDA) or
    ValueError (a weight of the wrong name, shape, dtype or device; a bad process group) before anything is launched.
    With tensor parallel (variant tp > 1) this process holds its rank's part of the layer (`shard`: heads, KV heads
    and MLP columns / tp) and a step is one launch per part with an all-reduce of its partial sum between
    (interface.TP_SPLIT; plan "kernels"; generator.collectives: symmetric memory or NCCL).
    `pdl`: whether its launches use programmatic dependent launch (decode, tp = 1, sm_90+, unless MEGAKERNEL_PDL=0).
    """

    def __init__(self, entry: dict, cubin: Path, weights: dict[str, torch.Tensor] | None, device, *,
                 packed: dict | None = None, caches: tuple | None = None, cache_len: int | None = None,
                 group=None, allreduce: str = "auto", share_workspace: "FusedDecoderLayer | None" = None):
        import cupy
        self.name = entry["name"]
        self.variant = variant_from_entry(entry)
        self.model = m = self.variant.model
        self.shard = sm = self.variant.shard  # what this GPU holds (the model itself when tp = 1)
        self.tp = self.variant.tp
        self.group = group
        self.rank = tp_rank(group, self.tp, self.name)
        self.mode = self.variant.mode
        self.plan = entry["plan"]
        chunk = self.variant.seq_len
        if self.mode == "prefill" and cache_len is not None and (
                isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < chunk):
            raise ValueError(f"cache_len: a prefill variant of {chunk}-token chunks needs a cache of at least {chunk} "
                             f"rows per sequence (an int), got {cache_len!r}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):  # torch's multi-line list of device types
            raise ValueError(f"device: the fused layer runs on CUDA ('cuda' or 'cuda:N'), got {device!r}") from None
        if self.device.type != "cuda":
            raise ValueError(f"device: the fused layer runs on CUDA, got {self.device}")
        if not torch.cuda.is_available():
            raise LoadError(f"{self.name}: no CUDA device here (torch.cuda.is_available() is False): the fused layer "
                            "runs on an NVIDIA GPU")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(self.device)
        built = entry.get("arch", "90")
        if not runs_on(built, major, minor):
            raise LoadError(f"{self.name}: built for sm_{built}, but {torch.cuda.get_device_name(self.device)} is "
                            f"sm_{major}{minor}: run `megakernel build --arch {major}{minor} --only '{self.name}'"
                            f"{build_dir_flag(Path(cubin).parent.parent)}`")
        self.dtype = torch_dtype(m.dtype)
        packing = weight_format(m.dtype).packing
        if packed is not None:  # another layer's packed weights (one copy serves every variant of a layer)
            need = {p.arg for p in PACKED if p.when(sm)}
            if not isinstance(packed, dict) or set(packed) != need:
                raise ValueError(f"packed: expected another layer's .packed with {', '.join(sorted(need))}, got "
                                 f"{', '.join(sorted(packed)) if isinstance(packed, dict) else type(packed).__name__}")
            want = packed_shapes(sm)
            for k, t in sorted(packed.items()):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != want[k] or t.dtype != self.dtype \
                        or t.device != self.device or not t.is_contiguous():
                    got = (f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))} on "
                           f"{getattr(t, 'device', '?')}" + ("" if getattr(t, "is_contiguous", lambda: 1)() else
                                                             ", not contiguous"))
                    raise ValueError(f"packed['{k}']: expected a contiguous {self.dtype} tensor {list(want[k])} on "
                                     f"{self.device} (this layer's shape), got {got}")
            self.packed = packed
        else:
            check_weights(weights, m, self.dtype, self.device)
            self.packed = pack_weights(shard_weights(weights, self.tp, self.rank), sm, packing)
        self.inv_freq = inv_freq(m, self.device).float().contiguous()
        B = self.variant.batch
        if self.mode == "decode":
            if cache_len not in (None, self.variant.seq_len):
                raise ValueError(f"cache_len: a decode variant's cache holds seq_len = {self.variant.seq_len} rows, "
                                 f"got {cache_len}")
            cache_len = self.variant.seq_len
        if caches is not None:
            k, v = caches
            want = (sm.kv_heads, cache_len or k.shape[2], m.head_dim)
            for nm, c in (("k_cache", k), ("v_cache", v)):
                if not isinstance(c, torch.Tensor) or c.dim() != 4 or c.shape[0] < B or tuple(c.shape[1:]) != want \
                        or c.dtype != self.dtype or c.device != self.device or not c.is_contiguous():
                    raise ValueError(f"{nm}: expected a contiguous {self.dtype} tensor [>= {B}, {want[0]}, "
                                     f"{want[1]}, {want[2]}] on {self.device}, got "
                                     f"{getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))}")
            cache_len = k.shape[2]
            if self.mode == "prefill" and cache_len < chunk:
                raise ValueError(f"caches: a prefill variant of {chunk}-token chunks needs a cache of at least {chunk} "
                                 f"rows per sequence, got {cache_len}")
            self.k_cache, self.v_cache = k[:B], v[:B]  # the first B sequences: a contiguous view
        else:
            if cache_len is None:
                raise ValueError(f"cache_len: a {self.mode} variant needs the cache length (rows per sequence) or "
                                 "caches=(k_cache, v_cache)")
            self.k_cache = torch.zeros(B, sm.kv_heads, cache_len, m.head_dim, dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros_like(self.k_cache)
        self.cache_len = int(cache_len)
        # one buffer for all scratch so the custom op can declare it mutated; the manifest's layout carves it up
        self._buffers = self.plan["workspace"]["buffers"]
        nbytes = self.plan["workspace"]["bytes"]
        if share_workspace is not None:  # layers of one variant launched one after another need one scratch: the
            # kernel leaves it as the next launch of the same plan needs it (counters back at zero, or with the LL
            # hand-offs the epoch and counters one launch on)
            other = share_workspace
            if not isinstance(other, FusedDecoderLayer) or other.name != self.name or other.device != self.device \
                    or other.plan["consts"] != self.plan["consts"]:
                raise ValueError(f"share_workspace: another layer of {self.name} on {self.device}, got "
                                 f"{getattr(other, 'name', type(other).__name__)}")
            self.workspace = other.workspace
        else:
            self.workspace = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

        with cupy.cuda.Device(self.device.index):
            t0 = time.perf_counter()
            self._module = cupy.RawModule(path=str(cubin), enable_cooperative_groups=True)
            from cupy_backends.cuda.api import driver
            self._driver = driver
            # one kernel per launch of a step (several with tensor parallel): (function, the partial sum its launch
            # leaves for an all-reduce, or None)
            self._fns, occ = [], 1 << 30
            for k in self.plan["kernels"]:
                kernel = self._module.get_function(k["name"])
                kernel.max_dynamic_shared_size_bytes = self.plan["smem_bytes"]
                self._fns.append((kernel.kernel, k["reduce"]))  # .kernel forces the module load
                occ = min(occ, driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    kernel.kernel.ptr, self.plan["threads"], self.plan["smem_bytes"]))
            self.load_ms = (time.perf_counter() - t0) * 1e3
            self.attributes = kernel.attributes
            sms = cupy.cuda.Device(self.device.index).attributes["MultiProcessorCount"]
        if occ < 1:
            raise RuntimeError(f"{self.name}: no block of {self.plan['threads']} threads with "
                               f"{self.plan['smem_bytes']} B shared memory fits on an SM of this GPU, so the "
                               "cooperative launch cannot have all its blocks resident")
        # the kernel strides over gridDim: any co-resident grid (of whole clusters with NORM_CLUSTER) is correct; one
        # block per SM is what was planned
        self._resident = sms * occ  # (blocks that can be resident at once: COOP 0's grid barriers need them all)
        # COOP 0 (decode plan knob): launched without the cooperative attribute (its grid barriers count in the
        # workspace), so under PDL its blocks start as the previous launch's leave their SMs
        self.cooperative = bool(self.plan["consts"].get("COOP", 1))
        self.grid = sms * min(occ, 1)
        ncl = self.plan["consts"].get("NORM_CLUSTER", 1)
        if ncl > 1:  # whole clusters, as many as can be resident at once (NORM_CLUSTER): a cluster's blocks share a GPC
            with cupy.cuda.Device(self.device.index):
                self.grid = ncl * min(self.grid // ncl, _max_active_clusters(
                    self._fns[0][0].ptr, self.grid - self.grid % ncl, self.plan["threads"], self.plan["smem_bytes"]))
            if self.grid < ncl:
                raise RuntimeError(f"{self.name}: NORM_CLUSTER={ncl}: no cluster of {ncl} blocks of "
                                   f"{self.plan['smem_bytes']} B shared memory can be resident on this GPU")
            if self.grid < sms:
                warnings.warn(f"{self.name}: NORM_CLUSTER={ncl}: {self.grid // ncl} clusters of {ncl} resident, "
                              f"{self.grid} of {sms} SMs run the layer", stacklevel=2)
        # programmatic dependent launch for decode where the GPU has it (sm_90+) unless MEGAKERNEL_PDL=0 (measured
        # on the H200: 1B batch 1 50.1 -> 49.2 us a layer); prefill and tensor parallel (launches with all-reduces
        # between) launch without: not measured there
        cc = torch.cuda.get_device_capability(self.device)
        self.pdl = (cc >= (9, 0) and self.mode == "decode" and self.tp == 1
                    and env_flag("MEGAKERNEL_PDL", True))
        if self.pdl:
            self._config = pdl_config(self.grid, self.plan["threads"], self.plan["smem_bytes"],
                                      cooperative=self.cooperative)
        sizes = self.plan.get("sizes", {})
        if 0 < sizes.get("LL_BLOCKS", 0) < self.grid:
            raise LoadError(f"{self.name}: H_LL with DOWN_FLOW needs a gate_up task in every block (the epoch's advance "
                            f"relies on it): {sizes['LL_BLOCKS']} tasks, {self.grid} blocks on this GPU")
        if 0 < sizes.get("TL_BLOCKS", 0) < self.grid:
            raise LoadError(f"{self.name}: a TIMELINE build stamps {sizes['TL_BLOCKS']} blocks and this GPU launches "
                            f"{self.grid}: build it for this GPU's architecture")
        # the launch's argument list, written once from interface.ARGS; x, pos and out are filled in per call
        fixed = {a.name: self.packed.get(a.name) for a in ARGS if a.role == "weight"}
        fixed.update({a.name: self.workspace.data_ptr() + self._buffers[a.name[3:]]["offset"]
                      for a in ARGS if a.role == "workspace"})
        fixed.update(inv_freq=self.inv_freq, k_cache=self.k_cache, v_cache=self.v_cache)
        c = self.plan["consts"]
        if c.get("GEMM_WGMMA"):  # the prefill GEMM's weights by TMA tensor maps: the box is the kernel's chunk
            self.tensor_maps = _tensor_maps(self.name, self.packed, c["GEMM_WM"] * c["GEMM_TM"], c["GEMM_BK"] // 16,
                                            self.device)
            fixed["w_tmaps"] = self.tensor_maps
        if c.get("ATT_TMA"):  # decode attention's K/V tiles by TMA tensor copies (the caches are fixed from here on)
            self.cache_maps = _cache_maps(self.name, self.k_cache, self.v_cache, self.device)
            fixed["kv_tmaps"] = self.cache_maps
        ptr = lambda v: np.uint64(0 if v is None else v if isinstance(v, int) else v.data_ptr())  # noqa: E731
        missing = [a.name for a in ARGS if a.role == "weight" and not a.optional and fixed.get(a.name) is None]
        assert not missing, f"interface.PACKED gives no {missing}"  # a null pointer the kernel would dereference
        ints = {"cache_len": self.cache_len, "tp_rank": self.rank}
        self._argv = [np.int32(ints[a.name]) if a.ctype == "int" else ptr(fixed.get(a.name)) for a in ARGS]
        # tensor parallel: one all-reduce per partial sum (collectives.AllReduce; created in the same order on every
        # rank). Where it has a buffer of its own (symmetric memory), the kernel writes its partial sum there and
        # the all-reduce leaves the sum where the next kernel (h) or the caller (out) reads it.
        self._reducers = {}
        if self.tp > 1 and share_workspace is not None:  # its all-reduce buffers too: the layers run one by one
            self._reducers = share_workspace._reducers
        elif self.tp > 1:
            rows = B * m.hidden
            self._reducers = {"h": AllReduce(group, rows, torch.float32, self.device, allreduce),
                              "out": AllReduce(group, rows, self.dtype, self.device, allreduce)}
        self.allreduce = self._reducers["h"].method if self._reducers else None
        ws_h = next(i for i, a in enumerate(ARGS) if a.name == "ws_h")
        argvs = []
        for _, reduce in self._fns:
            argv = list(self._argv)
            if reduce == "h" and self._reducers["h"].buffer is not None:
                argv[ws_h] = ptr(self._reducers["h"].buffer)
            argvs.append(tuple(argv))
        self._live = [(i, a.name) for i, a in enumerate(ARGS) if a.role in ("input", "output")]
        assert {n for _, n in self._live} == {"x", "pos", "out"}, "interface.ARGS inputs/outputs changed"
        # the driver's kernelParams, built once per kernel: an array of pointers to each argument's value; a call
        # only rewrites x, pos and out (a launch through cupy's Function packs every argument anew: ~25 µs of host
        # time a call measured on the H200's host)
        self._params = []
        for argv in argvs:
            vals = [(ctypes.c_int32 if isinstance(a, np.int32) else ctypes.c_uint64)(int(a)) for a in argv]
            self._params.append((vals, (ctypes.c_void_p * len(vals))(*map(ctypes.addressof, vals))))
        self.id = next(_IDS)
        _LAYERS[self.id] = self

    @property
    def grid(self) -> int:
        """Blocks a launch (one an SM as planned; tests set fewer: the kernel strides over gridDim)."""
        return self._grid

    @grid.setter
    def grid(self, n: int) -> None:
        if not self.cooperative and n > self._resident:  # (a cooperative launch: the driver says it)
            raise LoadError(f"{self.name}: COOP 0: a grid of {n} blocks, {self._resident} can be resident at once on "
                            f"this GPU; its grid barriers need every block resident")
        self._grid = n
        if getattr(self, "pdl", False):  # (the launch's configuration holds the grid)
            self._config = pdl_config(n, self.plan["threads"], self.plan["smem_bytes"], cooperative=self.cooperative)

    @property
    def STAGES(self) -> tuple[str, ...]:
        return tuple(self.plan["steps"])

    def buffer(self, name: str) -> torch.Tensor:
        """A view of workspace buffer `name` (interface.WORKSPACE) with its dtype (T = the variant's dtype, "float"
        fp32, "unsigned" int32) and shape, rows = the launch's token rows (decode: batch; prefill: batch x chunk,
        sequence-major), e.g. "qkv" fp32 [rows, q_dim + 2 kv_dim], "attn" [rows, q_dim], "h" fp32 [rows, hidden],
        "act" [rows, intermediate] ("attn" and "act" of a decode plan with X_FRAG, "xn" of one with GEMM_PROJ,
        "attn" where its o_proj is on the engine (O_GEMM) and "act" where its down_proj is (DOWN_GEMM), and "attn",
        "act", "xn" of an sm_90a prefill plan: a row-major copy of the fragment-ordered or tiled buffer, [rows,
        columns]). Raises ValueError naming the buffers for an unknown name."""
        if name not in self._buffers:
            raise ValueError(f"buffer: no workspace buffer {name!r}; there are {', '.join(self._buffers)}")
        b = self._buffers[name]
        dt = {"T": self.dtype, "float": torch.float32, "unsigned": torch.int32, "long long": torch.int64}[b["ctype"]]
        raw = self.workspace[b["offset"]:b["offset"] + b["bytes"]].view(dt)
        consts = self.plan["consts"]
        if name == "attn" and consts.get("ATT_LL"):
            return from_ll(raw, self.plan["rows"], consts["Q_DIM"])
        if name == "act" and self.mode == "decode" and consts.get("DOWN_FLOW") == 2:
            return from_ll(raw, self.plan["rows"], consts["INTER"])
        if name == "hb" and consts.get("H_LL"):
            return from_ll(raw, self.plan["rows"], consts["HIDDEN"], frag=False)
        if name == "qkv" and self.mode == "decode" and consts.get("QKV_FLOW") == 2:  # (QKV_KSPLIT: splits summed)
            ks, rows = consts.get("QKV_KSPLIT", 1), self.plan["rows"]
            return from_ll(raw, ks * rows, consts["QKV_DIM"], frag=False).view(ks, rows, -1).sum(0)
        # the GEMM engine's inputs (decode GEMM_PROJ: xn holds gate_up's rows last; attn o_proj's where O_GEMM)
        consumer = {"xn": "GU", "attn": "O", "act": "DOWN"}.get(name)  # (the projection that reads it last)
        if self.mode == "decode" and consumer and on_engine(consts, consumer):
            k = {"attn": consts["Q_DIM"], "xn": consts["HIDDEN"], "act": consts["INTER"]}[name]
            return from_tiles(raw, self.plan["rows"], k, consts["GEMM_XROWS"])
        if (name in ("attn", "act") and consts.get("X_FRAG")) or (name == "xn" and consts.get("NORM_GLOBAL")):
            return from_frag(raw, self.plan["rows"], b["shape"][1])
        if name in ("attn", "act", "xn") and self.mode == "prefill" and consts.get("GEMM_WGMMA"):
            k = {"attn": consts["Q_DIM"], "act": consts["INTER"], "xn": consts["HIDDEN"]}[name]
            return from_tiles(raw, self.plan["rows"], k, consts["GEMM_XROWS"])
        return raw.view(b["shape"])

    def stage_us(self) -> dict[str, float]:
        """Time of each step in the last launch in µs (block 0's SM clock, barrier waits included; where per-tile
        counters replace a barrier (decode's QKV_FLOW) the step ends at block 0's own finish and the wait counts in
        the next step (GU_SKIP: block 0 takes no gate_up task, so gate_up reads ~0 and down_proj holds the MLP); with
        tensor parallel, each launch's own steps: the all-reduces between launches are not in it); synchronises. The
        clock's rate is the one measured over the last launch against the global timer (clock_mhz()): under load
        the SM clock runs below the device's nominal ClockRate (~8-10 % on the H200, whose stage times read that
        much too short before)."""
        c = self.buffer("clock").cpu().tolist()
        khz = self.clock_mhz(c) * 1e3
        start = {k["first"]: k.get("start_slot", k["first"]) for k in self.plan["kernels"]}
        out, seen = {}, {}
        for i, s in enumerate(self.STAGES):  # a step that runs twice (prefill's norm) is "norm", then "norm (2)"
            seen[s] = seen.get(s, 0) + 1
            out[s if seen[s] == 1 else f"{s} ({seen[s]})"] = (c[i + 1] - c[start.get(i, i)]) / khz * 1e3
        return out

    def clock_mhz(self, clock: list | None = None) -> float:
        """The SM clock's rate (MHz) over the last launch: its block 0's clock cycles from its first to its last
        stamp over the global timer's nanoseconds between the same points (interface.WORKSPACE "clock"); the
        device's nominal ClockRate where the timer did not advance. Synchronises."""
        import cupy
        c = clock if clock is not None else self.buffer("clock").cpu().tolist()
        if len(c) >= CLOCK_SLOTS + 2:  # (a build from before the timer stamps has none)
            k = self.plan["kernels"][-1]
            cycles = c[k["first"] + len(k["steps"])] - c[k.get("start_slot", k["first"])]
            ns = c[CLOCK_SLOTS + 1] - c[CLOCK_SLOTS]
            if ns > 0 and cycles > 0:
                return cycles / ns * 1e3
        return cupy.cuda.Device(self.device.index).attributes["ClockRate"] / 1e3

    def overflows(self, reset: bool = True) -> int:
        """How many values overflowed the dtype (became inf where the fp32 math was finite: fp16 above 65,504)
        since the last reset; synchronises. A non-zero count means the outputs hold inf."""
        st = self.buffer("status")
        n = int(st[0])
        if reset:
            st.zero_()
        return n

    # -- weights read back in HF layout (for tests) --
    def weights(self) -> dict[str, torch.Tensor]:
        """This GPU's weights (its shard with tensor parallel) in HF layout."""
        return unpack_weights(self.packed, self.shard, weight_format(self.model.dtype).packing)

    @property
    def chunk(self) -> int:
        """New tokens per sequence per launch: 1 for decode, seq_len for prefill."""
        return 1 if self.mode == "decode" else self.variant.seq_len

    def check_inputs(self, x: torch.Tensor, pos: torch.Tensor) -> None:
        """ValueError naming x or pos when a shape, dtype or device is wrong (decode: x [batch, hidden];
        prefill: x [batch, chunk, hidden]; pos int32 [batch], on the layer's GPU or the CPU)."""
        B, H = self.variant.batch, self.model.hidden
        want = (B, H) if self.mode == "decode" else (B, self.chunk, H)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
            raise ValueError(f"x: shape {tuple(getattr(x, 'shape', ()))}, expected {want}")
        if x.dtype != self.dtype:
            raise ValueError(f"x: dtype {x.dtype}, expected {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"x: on {x.device}, expected {self.device}")
        pn = self._pos_name
        if not isinstance(pos, torch.Tensor):
            raise ValueError(f"{pn}: an int32 tensor of shape ({B},), got {type(pos).__name__}")
        if tuple(pos.shape) != (B,):
            raise ValueError(f"{pn}: shape {tuple(pos.shape)}, expected ({B},)")
        if pos.dtype != torch.int32:
            raise ValueError(f"{pn}: dtype {pos.dtype}, expected torch.int32")
        if pos.device.type == "cuda" and pos.device != self.device:
            raise ValueError(f"{pn}: on {pos.device}, expected {self.device} or the CPU")

    @property
    def _pos_name(self) -> str:  # the positions' argument as the caller named it
        return "pos" if self.mode == "decode" else "start_pos"

    def check_positions(self, pos: torch.Tensor) -> None:
        """ValueError unless every sequence's new rows pos[b] .. pos[b] + chunk - 1 lie in the cache."""
        lo, hi = torch.stack(tuple(torch.aminmax(pos))).tolist()  # one read of a GPU tensor
        if lo < 0 or hi + self.chunk > self.cache_len:
            last = self.cache_len - self.chunk
            what = "values" if self.mode == "decode" else f"start positions (+ chunk {self.chunk})"
            raise ValueError(f"{self._pos_name}: {what} must be in [0, {last}] (cache of {self.cache_len} rows), "
                             f"got {lo}..{hi}")

    def _positions(self, pos: torch.Tensor, validate: bool) -> torch.Tensor:
        """pos on the device, checked: a CPU tensor on the host (copied through its own pinned block, which torch's
        caching host allocator keeps until the copy has run, so a later call cannot overwrite it), refused under
        CUDA-graph capture (the graph would replay the value of capture time); a GPU tensor with one device read
        unless validate=False or a graph is being captured (then the kernel's guard turns an out-of-range
        sequence's output into NaN and leaves its cache alone)."""
        if pos.device.type == "cpu":
            if torch.cuda.is_current_stream_capturing():
                raise ValueError(f"{self._pos_name}: a CPU tensor cannot be captured in a CUDA graph (the graph would "
                                 "replay the value it had at capture); pass it as a tensor on the GPU")
            self.check_positions(pos)
            return pos.pin_memory().to(self.device, non_blocking=True)
        if validate and not torch.cuda.is_current_stream_capturing():
            self.check_positions(pos)
        return pos.contiguous()

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """One decode step: x [batch, hidden] (the variant's dtype, on its device), pos int32 [batch] (CPU or GPU,
        see _positions) -> out [batch, hidden]; the caches gain row pos[b] of every sequence b. Raises
        ValueError before anything is launched."""
        if self.mode != "decode":
            raise ValueError(f"{self.name} is a {self.mode} variant: call layer.prefill(x, start_pos)")
        self.check_inputs(x, pos)
        return self._run(x, self._positions(pos, validate))

    def prefill(self, x: torch.Tensor, start_pos: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """One prompt chunk: x [batch, chunk, hidden] (exactly the variant's seq_len tokens a sequence: a shorter
        last chunk is padded or run unfused by the caller, generator.serve), start_pos int32 [batch] on the CPU or
        the layer's GPU -> out [batch, chunk, hidden]; token t of sequence b sits at position start_pos[b] + t,
        attends causally to cache rows 0 .. start_pos[b] + t, and its k, v are written to that cache row. Raises
        ValueError before anything is launched for a wrong shape, dtype or device, or a start position outside
        [0, cache_len - chunk]; with validate=False a GPU start_pos is not read back (no host sync) and a sequence
        out of range gets NaN outputs with its cache untouched (_positions)."""
        if self.mode != "prefill":
            raise ValueError(f"{self.name} is a {self.mode} variant: prefill needs a prefill variant")
        self.check_inputs(x, start_pos)
        pos = self._positions(start_pos, validate)
        B, C, H = x.shape
        return self._run(x.reshape(B * C, H), pos).view(B, C, H)

    def _run(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The launch behind __call__ and prefill: through the torch custom op while torch.compile traces (it
        sees the op and what it mutates), directly otherwise: the custom op's dispatch alone costs ~15-30 µs of
        host time per call, more than a small layer's kernel."""
        # the kernel reads x as dense rows with 16-byte vector loads: a strided view (e.g. a column slice of a wider
        # tensor) or storage at an unaligned offset is copied first (it read the wrong elements, or faulted)
        x = x.contiguous()
        if x.data_ptr() % 16:
            x = x.clone()
        if torch.compiler.is_compiling():
            return torch.ops.megakernel.decoder_layer(x, pos, self.k_cache, self.v_cache, self.workspace, self.id)
        out = torch.empty_like(x)
        self.launch(x, pos, out)
        return out

    def launch(self, x: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        """Launch the kernel(s) on torch's current stream with no checks: x, pos on the device, out [batch, hidden].
        One thread at a time per layer (its caches, workspace and launch arguments are shared), from a thread whose
        current device is the layer's. Raises RuntimeError naming the layer when the driver refuses the launch.
        With tensor parallel, each launch's partial sum (h, then out) is all-reduced over the group
        (generator.collectives) before the next launch: capturable in a CUDA graph like the launches."""
        # torch's current stream, read at every call (a cached stream would break CUDA-graph capture)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for (fn, reduce), (vals, params) in zip(self._fns, self._params):
            red = self._reducers.get(reduce)
            live = {"x": x, "pos": pos,
                    "out": red.buffer if reduce == "out" and red.buffer is not None else out}
            for i, name in self._live:
                vals[i].value = live[name].data_ptr()
            try:
                if self.pdl:
                    launch_pdl(self._config, stream, fn.ptr, ctypes.addressof(params))
                elif self.cooperative:
                    self._driver.launchCooperativeKernel(fn.ptr, self.grid, 1, 1, self.plan["threads"], 1, 1,
                                                        self.plan["smem_bytes"], stream, ctypes.addressof(params))
                else:  # (COOP 0)
                    self._driver.launchKernel(fn.ptr, self.grid, 1, 1, self.plan["threads"], 1, 1,
                                              self.plan["smem_bytes"], stream, ctypes.addressof(params), 0)
            except (self._driver.CUDADriverError, RuntimeError) as exc:
                kind = "cooperative launch" if self.cooperative else "launch (COOP 0)"
                raise RuntimeError(f"{self.name}: {kind} of {self.grid} blocks x {self.plan['threads']} threads, "
                                   f"{self.plan['smem_bytes']} B shared memory failed on {self.device}: {exc}") from exc
            if red is not None:
                red(out if reduce == "out" else self.buffer(reduce))


@torch.library.custom_op("megakernel::decoder_layer", mutates_args=("k_cache", "v_cache", "workspace"))
def _decoder_layer_op(x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      workspace: torch.Tensor, layer_id: int) -> torch.Tensor:
    out = torch.empty_like(x)
    _LAYERS[layer_id].launch(x, pos, out)
    return out


@_decoder_layer_op.register_fake
def _(x, pos, k_cache, v_cache, workspace, layer_id):
    return torch.empty_like(x)


def load(name: str, weights: dict[str, torch.Tensor] | None, *, build_dir: str | Path = "build", device="cuda",
         packed: dict | None = None, caches: tuple | None = None, cache_len: int | None = None,
         group=None, allreduce: str = "auto", share_workspace: FusedDecoderLayer | None = None) -> FusedDecoderLayer:
    """Load variant `name` from a prebuilt build directory with HF-named weights (interface.weight_shapes, already
    on `device`, in the variant's dtype). Raises LoadError (missing, stale, corrupt or other-arch build; no CUDA)
    or ValueError (bad weights).

    packed: another layer's `.packed` (the same weights; then `weights` may be None): one copy serves every
    variant of a layer. caches: (k_cache, v_cache) [>= batch, kv_heads / tp, cache_len, head_dim] to use (the first
    batch sequences) instead of new ones. cache_len: rows per sequence of new caches (prefill variants; a decode
    variant's is its seq_len). group: the torch.distributed process group (NCCL, one process per GPU) of a variant
    built with tp > 1; `weights` are then the whole layer's, and each rank keeps its part (interface.TP_SPLIT).
    allreduce: how its partial sums are summed (generator.collectives: "auto", "symm_mem", "nccl").
    share_workspace: another layer of the same variant whose workspace this one uses: layers launched one after
    another on one stream need one scratch between them (stage_us() and overflows() then read the last launch's)."""
    entry, cubin = find_entry(name, build_dir)
    return FusedDecoderLayer(entry, cubin, weights, device, packed=packed, caches=caches, cache_len=cache_len,
                             group=group, allreduce=allreduce, share_workspace=share_workspace)
