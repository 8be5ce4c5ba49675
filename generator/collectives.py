"""The all-reduce of a tensor-parallel layer's partial sums, written once for the fused and the unfused layers.

Two ways, both from torch.distributed and both capturable in a CUDA graph:
- "symm_mem": torch's symmetric memory (torch.distributed._symmetric_memory) one-shot all-reduce: every GPU reads
  the peers' partial sums straight from their memory over NVLink (P2P loads, no NVLink multicast) after one barrier
  on the allocation's signal pad. The producer writes its partial into `buffer` (the fused kernel does so directly).
- "nccl": dist.all_reduce in place (NCCL on GPUs, gloo on the CPU).
"auto" takes symm_mem where it can be set up (a CUDA group whose GPUs reach each other), NCCL otherwise, and warns
once saying which runs and why. MEGAKERNEL_ALLREDUCE=nccl|symm_mem overrides "auto".
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

METHODS = ("auto", "symm_mem", "nccl")
SYMM_DTYPES = (torch.float32, torch.bfloat16)  # what torch's one_shot_all_reduce kernels take
_warned: set = set()


class AllReduceWarning(UserWarning):
    """Which all-reduce a tensor-parallel layer runs when it is not the one asked for (one line)."""


class AllReduce:
    """Sum over process group `group` of tensors of up to `numel` elements of `dtype` on `device`, every rank the
    same.

    buffer: flat [numel] symmetric-memory tensor ("symm_mem") where the producer may write its partial sum before
    __call__; None for "nccl". reduce(out): the sum of every rank's buffer[:out.numel()] (symm_mem) or of every
    rank's `out` (nccl, in place) into `out`. reduce_from(partial): the sum of every rank's `partial`, in place
    (copied into the buffer first; larger than the buffer: NCCL). Creating one is a collective: every rank creates
    its AllReduces in the same order. Raises ValueError for an unknown method."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device, method: str = "auto"):
        method = (os.environ.get("MEGAKERNEL_ALLREDUCE") or method) if method == "auto" else method  # ("": unset)
        if method not in METHODS:
            raise ValueError(f"allreduce: one of {', '.join(METHODS)}, got {method!r}")
        self.group, self.buffer = group, None
        if method != "nccl" and dtype not in SYMM_DTYPES:
            _warn_once(f"all-reduce: torch's one-shot all-reduce takes {', '.join(map(str, SYMM_DTYPES))}, not "
                       f"{dtype}: NCCL all-reduce instead")
        elif method != "nccl" and torch.device(device).type == "cuda":
            try:
                from torch.distributed import _symmetric_memory as symm_mem
                self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
                symm_mem.rendezvous(self.buffer, group.group_name)
                self.group_name = group.group_name
            except Exception as exc:  # noqa: BLE001 - the reason is reported, NCCL serves instead
                self.buffer = None
                _warn_once(f"all-reduce: torch symmetric memory unavailable here ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}): NCCL all-reduce instead")
        elif method == "symm_mem":
            _warn_once(f"all-reduce: symmetric memory needs CUDA, the layer is on {device}: "
                       f"{dist.get_backend(group)} all-reduce instead")
        if torch.device(device).type == "cuda":  # every rank must take the same way, or each waits on the other
            ok = torch.tensor([int(self.buffer is not None)], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
            if not ok.item() and self.buffer is not None:
                self.buffer = None
                _warn_once("all-reduce: symmetric memory could not be set up on every rank: NCCL all-reduce instead")
        self.method = "symm_mem" if self.buffer is not None else "nccl"

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            dist.all_reduce(out, group=self.group)
        else:
            torch.ops.symm_mem.one_shot_all_reduce_out(self.buffer[:out.numel()], "sum", self.group_name,
                                                       out.view(-1))
        return out

    def reduce_from(self, partial: torch.Tensor) -> torch.Tensor:
        if self.buffer is None or partial.numel() > self.buffer.numel():
            dist.all_reduce(partial, group=self.group)
            return partial
        self.buffer[:partial.numel()].copy_(partial.view(-1))
        return self(partial)


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(AllReduceWarning(msg), stacklevel=3)
