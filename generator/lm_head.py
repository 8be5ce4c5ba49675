"""The served model's head as one kernel (templates/lm_head.cu): final RMSNorm -> LM head -> greedy next token.

At batch 1 the LM head is a read of its [vocab, hidden] weight (525 MB for Llama-3's 128,256 x 2,048 in
bf16): cuBLAS's GEMV streams it at ~3.5 TB/s on the H200 (150 µs, bench/NOTES.md session 7), a streaming GEMV near
the copy bandwidth. The norm and the argmax come with it, so a decode step's head is one launch instead of the
norm's elementwise kernels, a GEMM, a cast and an argmax. Compiled ahead of its first use into the build directory's
object cache (generator.compile), one object per (hidden, rows, dtype).
"""
from __future__ import annotations

import ctypes
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from .targets import DTYPES

# Rows of x a launch serves: 1 (FMAs) or 2..MAX_BATCH (the tensor cores, one n-tile of 8). Measured on the H200
# (bench/NOTES.md session 18; hidden 896-5120, vocab 128-152 K): 3.5-4.3 TB/s, 1.09-1.37x torch's norm + GEMM +
# argmax at one row, 1.00-1.41x at 2-8; above 8 rows the head is a GEMM (torch's).
MAX_BATCH = 8
WARPS = 8  # templates/lm_head.cu: WARPS
ROWS_PER_WARP = {1: 2, MAX_BATCH: 16}  # rows of W a warp takes at a time, by kernel_rows (LMH_R; the mma tile)


class Advance(NamedTuple):
    """The served decode step's advance, done by the head's last block after the greedy choice (generator.serve:
    a step then ends in this launch): hist[step][b] = next[b], pos[b] += 1, x_next[b] = embed[next[b]], then
    step += 1. hist [>= steps, B] int64 (the generation's tokens, a row a step: the host copies row i on another
    stream while later steps run, and nothing writes it again), step [1] int64 (the row this step writes), pos [B]
    int32 (the step's positions), embed [vocab, hidden] and x_next [B, hidden] (the next step's input: not the
    head's x) in the model's dtype, all contiguous on the head's device. The head does not check step against
    hist's rows: the caller sizes hist."""
    hist: torch.Tensor
    step: torch.Tensor
    pos: torch.Tensor
    embed: torch.Tensor
    x_next: torch.Tensor


def kernel_rows(batch: int) -> int:
    """The MAXB of the kernel that serves `batch` rows: 1 (its own FMA loop) or MAX_BATCH (1..8 rows)."""
    return 1 if batch == 1 else MAX_BATCH


def source(hidden: int, maxb: int, dtype: str) -> str:
    """The kernel's whole CUDA source for `hidden` (a multiple of 8) and up to `maxb` (1..MAX_BATCH) rows of
    `dtype`."""
    from .render import TEMPLATES, _inline  # the renderer and compiler only where a head is built
    dt = DTYPES[dtype]
    cfg = (f"#define MEGAKERNEL_CONFIG 1\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
           f"constexpr int HIDDEN = {hidden};\nconstexpr int MAXB = {maxb};\n"
           f"typedef {dt.ctype} T;\ntypedef {dt.ctype2} T2;\nconstexpr float T_MAX = {dt.max_finite!r}f;\n"
           f"#define DTYPE_BF16 {1 if dtype == 'bf16' else 0}\n#define MMA_AB \"{dt.mma}\"\n")
    return _inline(cfg + (TEMPLATES / "lm_head.cu").read_text(), TEMPLATES, set())


def supported(batch: int, hidden: int, norm: str, dtype: torch.dtype) -> str | None:
    """None where LMHead serves this head, else why not (one line: the served model then runs torch's)."""
    if norm != "rmsnorm":
        return f"the fused head does RMSNorm only ({norm}: torch)"
    if not 1 <= batch <= MAX_BATCH:
        return f"batch {batch} > {MAX_BATCH}: a GEMM (torch's)"
    if hidden % 8:
        return f"hidden {hidden} is not a multiple of 8"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (bf16/fp16 only)"
    return None


class LMHead:
    """logits, next = norm(x) @ weight.T and its argmax, for x of 1..maxb rows (maxb = kernel_rows(batch): 1, or
    MAX_BATCH for any batch of 2..MAX_BATCH), in one launch.

    gain: [hidden] the final RMSNorm's weight; weight: [vocab, hidden] the LM head (tied or not), both the model's
    dtype (bf16/fp16) on one CUDA device; eps: the norm's epsilon. The norm rounds as transformers' LlamaRMSNorm:
    h = gain * T(x * rsqrt(mean(x^2) + eps)); logits are h @ weight.T summed in fp32 and rounded to T (as
    transformers' lm_head in T returns them), stored as float32; next is the first index of each row's largest
    logit (torch.argmax). Compiled for the weight's GPU (its compute capability) at construction: needs nvcc and
    the templates, as `megakernel build` does.
    Raises ValueError (shapes, dtypes, devices; supported() says why a head is not served) and CompileError.
    Its resources (registers, spills) are in `meta`; spills warn. One launch at a time (its argmax scratch is
    shared).
    """

    def __init__(self, gain: torch.Tensor, weight: torch.Tensor, eps: float, batch: int, *,
                 build_dir: str | Path = "build", arch: str | None = None):
        V, H = weight.shape
        why = supported(batch, H, "rmsnorm", weight.dtype)
        if why:
            raise ValueError(f"LMHead: {why}")
        if gain.shape != (H,) or gain.dtype != weight.dtype or gain.device != weight.device or \
                weight.device.type != "cuda":
            raise ValueError(f"LMHead: gain [{H}] and weight [vocab, {H}] of one dtype on one CUDA device, got "
                             f"{tuple(gain.shape)} {gain.dtype} {gain.device} and {tuple(weight.shape)} "
                             f"{weight.dtype} {weight.device}")
        if not weight.is_contiguous() or not gain.is_contiguous() or weight.data_ptr() % 16 or gain.data_ptr() % 16:
            raise ValueError("LMHead: gain and weight must be contiguous and 16-byte aligned (the kernel's loads)")
        import cupy
        from cupy_backends.cuda.api import driver

        from . import compile as gcompile
        arch = arch or "%d%d" % torch.cuda.get_device_capability(weight.device)
        self.maxb = kernel_rows(batch)
        self.gain, self.weight, self.eps, self.vocab, self.hidden = gain, weight, eps, V, H
        self.device = weight.device
        dtype = next(n for n, d in DTYPES.items() if getattr(torch, d.torch) == weight.dtype)
        src = source(H, self.maxb, dtype)
        key = gcompile.cache_key(src, arch)
        self.meta, _ = gcompile.compiled_object(src, key, arch, Path(build_dir))
        if self.meta["spill_stores"] or self.meta["spill_loads"]:
            warnings.warn(f"LMHead (hidden {H}, up to {self.maxb} rows): the kernel spills "
                          f"{self.meta['spill_stores']} B of stores, {self.meta['spill_loads']} B of loads",
                          stacklevel=2)
        self.pitch = (H + 8) * weight.element_size()  # a row of x in shared memory (templates/lm_head.cu: HP)
        self.smem = self.maxb * self.pitch  # at most; a launch asks for its rows' share
        with cupy.cuda.Device(self.device.index):
            self._module = cupy.RawModule(path=str(Path(build_dir) / "objects" / key / "kernel.cubin"))
            fn = self._module.get_function("lm_head")
            fn.max_dynamic_shared_size_bytes = self.smem
            self._fn = fn.kernel
            occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(self._fn.ptr, WARPS * 32, self.smem)
            sms = cupy.cuda.Device(self.device.index).attributes["MultiProcessorCount"]
        if occ < 1:
            raise ValueError(f"LMHead: {self.maxb} x hidden {H} rows ({self.smem} B of shared memory) do not fit "
                             "an SM")
        self._driver = driver
        self.grid = max(1, min(sms * occ, -(-V // (WARPS * ROWS_PER_WARP[self.maxb]))))
        self.part = torch.empty(self.grid * self.maxb, dtype=torch.int64, device=self.device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # the kernel leaves it at 0
        # the driver's kernelParams, built once (x, logits, next, rows and the advance's pointers filled in per call)
        vals = [ctypes.c_uint64(0), ctypes.c_uint64(gain.data_ptr()), ctypes.c_uint64(weight.data_ptr()),
                ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(self.part.data_ptr()),
                ctypes.c_uint64(self.counter.data_ptr()), ctypes.c_int32(V), ctypes.c_int32(1), ctypes.c_float(eps),
                *(ctypes.c_uint64(0) for _ in Advance._fields)]
        self._vals = vals
        self._params = (ctypes.c_void_p * len(vals))(*map(ctypes.addressof, vals))
        # programmatic dependent launch on sm_90+ (unless MEGAKERNEL_PDL=0): a decode step's head is scheduled while
        # its last layer runs. Safe after any launch (tensor parallel's all-reduce too): the kernel's first
        # instruction waits for the previous launch to finish and its writes to be visible
        from .loader import env_flag, pdl_config
        self.pdl = torch.cuda.get_device_capability(self.device) >= (9, 0) and env_flag("MEGAKERNEL_PDL", True)
        self._config = pdl_config(self.grid, WARPS * 32, 0, cooperative=False) if self.pdl else None

    def __call__(self, x: torch.Tensor, logits: torch.Tensor | None = None,
                 next_tokens: torch.Tensor | None = None, advance: Advance | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, hidden], 1 <= B <= maxb (the last layer's output, the model's dtype) -> (logits [B, vocab]
        float32, next [B] int64), written into the given tensors where given; with `advance`, also the served decode
        step's advance (Advance). On torch's current stream; capturable in a CUDA graph. Raises ValueError on a
        wrong shape, dtype or device."""
        B, V = x.shape[0] if x.dim() == 2 else -1, self.vocab
        if not 1 <= B <= self.maxb or x.shape[1] != self.hidden or x.dtype != self.weight.dtype or \
                x.device != self.device or not x.is_contiguous() or x.data_ptr() % 16:
            raise ValueError(f"LMHead: x must be contiguous [1..{self.maxb}, {self.hidden}] {self.weight.dtype} "
                             f"on {self.device} (16-byte aligned: the kernel's loads), got {tuple(x.shape)} {x.dtype} "
                             f"{x.device}")
        logits = torch.empty(B, V, dtype=torch.float32, device=self.device) if logits is None else logits
        next_tokens = torch.empty(B, dtype=torch.int64, device=self.device) if next_tokens is None else next_tokens
        if logits.shape != (B, V) or logits.dtype != torch.float32 or not logits.is_contiguous() or \
                next_tokens.shape != (B,) or next_tokens.dtype != torch.int64 or \
                logits.device != self.device or next_tokens.device != self.device:
            raise ValueError(f"LMHead: logits [{B}, {V}] float32 and next [{B}] int64 on {self.device}")
        if advance is not None:
            hist, step, pos, embed, x_next = advance
            if hist.dim() != 2 or hist.shape[1] != B or hist.dtype != torch.int64 or step.shape != (1,) or \
                    step.dtype != torch.int64 or pos.shape != (B,) or pos.dtype != torch.int32 or \
                    embed.dim() != 2 or embed.shape[0] < V or embed.shape[1] != self.hidden or \
                    embed.dtype != x.dtype or x_next.shape != x.shape or x_next.dtype != x.dtype or \
                    not all(t.is_contiguous() and t.device == self.device for t in advance) or \
                    embed.data_ptr() % 16 or x_next.data_ptr() % 16 or x_next.data_ptr() == x.data_ptr():
                raise ValueError(f"LMHead: advance (hist [steps, {B}] int64, step [1] int64, pos [{B}] int32, embed "
                                 f"[>= {V}, {self.hidden}] and x_next [{B}, {self.hidden}] of x's dtype, not x, "
                                 f"16-byte aligned) contiguous on {self.device}")
        self.launch(x, logits, next_tokens, advance)
        return logits, next_tokens

    def launch(self, x: torch.Tensor, logits: torch.Tensor, next_tokens: torch.Tensor,
               advance: Advance | None = None) -> None:
        """As __call__ with no checks."""
        nb = x.shape[0]
        self._vals[0].value, self._vals[3].value, self._vals[4].value = \
            x.data_ptr(), logits.data_ptr(), next_tokens.data_ptr()
        self._vals[8].value = nb
        for v, t in zip(self._vals[10:], advance or (None,) * len(Advance._fields)):
            v.value = 0 if t is None else t.data_ptr()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with torch.cuda.device(self.device):  # the module's context: the weight's device, whichever is current
            if self._config is not None:
                from .loader import launch_pdl
                self._config.sharedMemBytes = nb * self.pitch
                launch_pdl(self._config, stream, self._fn.ptr, ctypes.addressof(self._params))
            else:
                self._driver.launchKernel(self._fn.ptr, self.grid, 1, 1, WARPS * 32, 1, 1,
                                          nb * self.pitch, stream, ctypes.addressof(self._params), 0)
