"""The facts about targets, each kind in one table: GPU architectures, activation dtypes, weight formats.

Everything that differs between sm_80 and sm_90, or between bf16 and fp16, is read from here (planner, renderer,
build, report, loader); nothing else hard-codes a shared-memory size, an SM count or a C type name.
"""
from __future__ import annotations

import dataclasses


class TargetError(ValueError):
    """An architecture, dtype or weight format this generator cannot target; one line."""


@dataclasses.dataclass(frozen=True)
class Arch:
    """One GPU architecture (compute capability `sm`), from NVIDIA's CUDA C++ Programming Guide, table
    "Technical Specifications per Compute Capability"."""
    sm: str                 # nvcc's digits: "90" = sm_90
    smem_per_block: int     # bytes of dynamic shared memory one block may opt in to
    smem_per_sm: int        # bytes of shared memory per SM (blocks per SM)
    regs_per_sm: int
    threads_per_sm: int
    sms: int                # SM count of the flagship part; the planner balances tasks for it (the kernel
    example: str            # strides over gridDim, so any SM count is correct)
    mem_bytes: int = 0      # device memory of the largest part (a layer that needs more cannot run on any)
    # the SM's unified L1 / shared-memory storage (KB) and the shared-memory sizes (carveouts, KB) it can be split at
    # (the CUDA C++ Programming Guide's compute-capability sections, "Shared Memory"); the rest is L1
    unified_kb: int = 0
    carveouts_kb: tuple[int, ...] = ()

    @property
    def number(self) -> int:
        """The compute capability as a number, 90 for sm_90 and for its arch-specific target "90a"."""
        return int(self.sm.rstrip("a"))


_CARVE_86 = (0, 8, 16, 32, 64, 100)
_CARVE_80 = _CARVE_86 + (132, 164)
_CARVE_90 = _CARVE_80 + (196, 228)
# the kernel needs mma.sync m16n8k16 with bf16/fp16 inputs, cp.async and ldmatrix: sm_80 and later
ARCHS: dict[str, Arch] = {a.sm: a for a in (
    Arch("80", 163 * 1024, 164 * 1024, 65536, 2048, 108, "A100", 80 * 10**9, 192, _CARVE_80),
    Arch("86", 99 * 1024, 100 * 1024, 65536, 1536, 84, "RTX 3090", 48 * 10**9, 128, _CARVE_86),
    Arch("89", 99 * 1024, 100 * 1024, 65536, 1536, 128, "RTX 4090 / L40S", 48 * 10**9, 128, _CARVE_86),
    Arch("90", 227 * 1024, 228 * 1024, 65536, 2048, 132, "H100 / H200", 141 * 10**9, 256, _CARVE_90),
    Arch("100", 227 * 1024, 228 * 1024, 65536, 2048, 148, "B200", 192 * 10**9, 256, _CARVE_90),
    Arch("120", 99 * 1024, 100 * 1024, 65536, 1536, 188, "RTX 5090", 32 * 10**9, 128, _CARVE_86),
)}
DEFAULT_ARCH = "90"


def arch(sm: str) -> Arch:
    """The Arch for nvcc digits `sm` ("90", or "90a" for the arch-specific features, planned as sm_90); TargetError
    naming the supported ones otherwise."""
    sm = str(sm)
    base = sm[:-1] if sm.endswith("a") else sm
    if base in ARCHS and sm != base and int(base) < 90:  # (nvcc: compute_80a and the like do not exist)
        raise TargetError(f"--arch {sm}: sm_{base} has no arch-specific ('a') target; those start at sm_90 "
                          f"({', '.join(a + 'a' for a in ARCHS if int(a) >= 90)}); give --arch {base}")
    if base in ARCHS:
        return dataclasses.replace(ARCHS[base], sm=sm)
    if base.isdigit() and int(base) < 80:
        raise TargetError(f"--arch {sm}: sm_{sm} has no bf16/fp16 mma.sync m16n8k16 and cp.async, which the kernel "
                          f"needs (sm_80 or later: {', '.join(ARCHS)})")
    raise TargetError(f"--arch '{sm}': not a known architecture (one of {', '.join(ARCHS)}; from 90 optionally with 'a')")


def gpu_arch(gpu_name: str) -> str | None:
    """The architecture of a GPU by the name torch reports ("NVIDIA H200" -> "90"), from the Arch examples; None
    where no example names it."""
    import re
    for a in ARCHS.values():  # "A100" is not "RTX A1000": no digit may follow the example's name
        if any(part.strip() and re.search(re.escape(part.strip()) + r"(?![0-9])", gpu_name)
               for part in a.example.split("/")):
            return a.sm
    return None


def runs_on(build_sm: str, major: int, minor: int) -> bool:
    """Whether a cubin for sm_<build_sm> loads on a device of compute capability major.minor (cubins run on the
    same major version with an equal or later minor version)."""
    b = int(build_sm.rstrip("a"))
    if build_sm.endswith("a"):  # arch-specific features: that exact architecture only
        return b == major * 10 + minor
    return b // 10 == major and b % 10 <= minor


@dataclasses.dataclass(frozen=True)
class DType:
    """An activation dtype: what the kernel computes in and what the KV cache stores."""
    name: str          # variants.yaml spelling
    ctype: str         # CUDA C++ type of one element
    ctype2: str        # CUDA C++ type of a pair (packed math, 4-byte loads)
    torch: str         # attribute of the torch module
    bytes: int
    max_finite: float  # largest finite value: an intermediate above it overflows to inf
    mma: str           # the PTX type in mma.sync.m16n8k16 ...f32.<mma>.<mma>.f32
    rel_tol: float     # verification tolerance against the fp32 reference (relative L2 error)


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("bf16", "__nv_bfloat16", "__nv_bfloat162", "bfloat16", 2, 3.3895313892515355e38, "bf16", 1e-2),
    DType("fp16", "__half", "__half2", "float16", 2, 65504.0, "f16", 1e-2),
)}


def torch_dtype(name: str):
    """The torch dtype of activation dtype `name` (imports torch: runtime and tests only)."""
    import torch
    return getattr(torch, DTYPES[name].torch)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How a projection's weights are stored for the kernel, separate from the activation dtype. Today the one
    format is "same as the activations, in mma fragment order"; a quantised format (fp8, int4 + scales) adds an
    entry here, its packing in generator/interface.py and its GEMV inner loop in templates/gemv.cuh."""
    name: str
    bits: int
    packing: str       # name of the packing function in generator.interface.PACKINGS
    needs_dtype: str | None = None   # the activation dtype it requires (None: any)


WEIGHT_FORMATS: dict[str, WeightFormat] = {w.name: w for w in (
    WeightFormat("bf16", 16, "fragments", "bf16"),
    WeightFormat("fp16", 16, "fragments", "fp16"),
)}


def weight_format(dtype: str, requested: str | None = None) -> WeightFormat:
    """The weight format of a variant: `requested` (variants.yaml `weights:`) or the activation dtype's."""
    name = requested or dtype
    if name not in WEIGHT_FORMATS:
        raise TargetError(f"weight format '{name}' is not implemented (one of {', '.join(WEIGHT_FORMATS)})")
    wf = WEIGHT_FORMATS[name]
    if wf.needs_dtype and wf.needs_dtype != dtype:
        raise TargetError(f"weight format '{name}' needs dtype {wf.needs_dtype}, the variant is {dtype}")
    return wf
