"""Providers: the ways `megakernel bench` runs one decode step of a stack of N distinct layers, and the registry
(PROVIDERS, a list) the rest of the benchmark iterates over.

A provider says how its layers are built (`make_layer`), how one layer is called (`call`), and how the stack is
run: eagerly, captured in a CUDA graph (`graph`), or through torch.compile of the per-layer step with a given mode
(`compile_mode`) and then captured. A new provider is one class plus one line in PROVIDERS; rows, speedups, the
table and the CSV columns follow the registry.

Layer classes share one interface (bench/baselines.py's TorchLayer): `Cls(weights, m, batch, seq_len, device)`
with HF-named weights (bf16/fp16 tensors on `device`) and a `Model` m, owning `k_cache`/`v_cache`
[batch, kv_heads, seq_len, head_dim]; `layer(x, pos) -> out` with x [batch, hidden] and pos int32 [batch].
Providers with the same `layer_class` share one stack (weights and caches are not duplicated).
"""
from __future__ import annotations

import torch


class Provider:
    """Base class. name: row key (`provider` column, `speedup_vs_<name>`); label: table header; baseline: what the
    fused kernel is compared with; graph: captured in a CUDA graph; compile_mode: torch.compile mode, or None."""
    name = ""
    label = ""
    baseline = True
    graph = False
    compile_mode: str | None = None
    layer_class = None

    def unavailable(self, v) -> str | None:
        """None where this provider can run variant v here, else the reason (one line): it is then skipped, not an
        error."""
        return None

    def load_cache(self, layer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Give `layer` these cache contents ([batch, kv_heads, seq_len, head_dim])."""
        layer.k_cache.copy_(k_cache)
        layer.v_cache.copy_(v_cache)

    def make_layer(self, v, weights: dict[str, torch.Tensor], *, build_dir: str, device):
        """One layer of variant v with these weights; its caches are then overwritten with the shared contents."""
        return self.layer_class(weights, v.model, v.batch, v.seq_len, device)

    def call(self, layer, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode step of one layer: x [batch, hidden] -> [batch, hidden] (same dtype)."""
        return layer(x, pos)

    @property
    def stack_key(self):
        """Providers with equal keys run the same layer objects."""
        return self.layer_class


def _torch_layer():
    from bench.baselines import TorchLayer
    return TorchLayer


class Fused(Provider):
    """N FusedDecoderLayer (one cooperative launch each) from the prebuilt cubin, captured in a CUDA graph."""
    name, label, baseline, graph = "fused", "fused", False, True

    def make_layer(self, v, weights, *, build_dir, device):
        from generator.loader import load
        return load(v.name, weights, build_dir=build_dir, device=device)

    def call(self, layer, x, pos):
        return layer(x, pos, validate=False)  # pos is already checked; a device read would break the capture

    @property
    def stack_key(self):
        return "fused"


class TorchEager(Provider):
    """The plain PyTorch layer (cuBLAS matmuls + SDPA), run eagerly: launch overhead included."""
    name, label = "eager", "eager"

    @property
    def layer_class(self):
        return _torch_layer()


class TorchGraph(TorchEager):
    """The same TorchLayer stack, captured in a CUDA graph."""
    name, label, graph = "torch_graph", "graph", True


class TorchCompileGraph(TorchEager):
    """torch.compile(mode="default", dynamic=False) of the TorchLayer step, compiled once per variant and shared by
    its N layers, then captured in a CUDA graph (only for --compile-subset: compiling is slow)."""
    name, label, graph, compile_mode = "compile", "compile", True, "default"


class ServingCompileGraph(TorchEager):
    """The layer as serving engines write it in PyTorch (bench/serving_layer.py: one GEMM for q/k/v, one for
    gate/up) through torch.compile(mode="max-autotune-no-cudagraphs"), then a CUDA graph (--compile-subset only)."""
    name, label, graph, compile_mode = "serving", "serving", True, "max-autotune-no-cudagraphs"

    @property
    def layer_class(self):
        from bench.serving_layer import ServingLayer
        return ServingLayer


class FlashInfer(TorchEager):
    """The layer as vLLM/SGLang build it from FlashInfer (bench/flashinfer_layer.py: fused add+RMSNorm, RoPE,
    paged KV append, batch decode attention, cuBLAS GEMMs, silu_and_mul), captured in a CUDA graph; skipped with
    the reason where FlashInfer is not installed or has no kernel for the shape."""
    name, label, graph = "flashinfer", "flashinfer", True

    def unavailable(self, v):
        from bench.flashinfer_layer import flashinfer_available
        return flashinfer_available(v.model)

    def load_cache(self, layer, k_cache, v_cache):
        layer.load_kv(k_cache, v_cache)

    @property
    def layer_class(self):
        from bench.flashinfer_layer import FlashInferLayer
        return FlashInferLayer


# The registry: the order here is the order of rows, table columns and CSV speedup columns.
PROVIDERS: list[Provider] = [
    Fused(),
    TorchEager(),
    TorchGraph(),
    TorchCompileGraph(),
    ServingCompileGraph(),
    FlashInfer(),
]

PROVIDER_NAMES: tuple[str, ...] = tuple(p.name for p in PROVIDERS)
BASELINES: tuple[str, ...] = tuple(p.name for p in PROVIDERS if p.baseline)


def by_name(name: str) -> Provider:
    """The registered provider called `name` (KeyError otherwise)."""
    for p in PROVIDERS:
        if p.name == name:
            return p
    raise KeyError(name)


def torch_layer_step(layer, x, pos):
    """What torch.compile compiles: one layer step. The layer object is an argument, so its tensors (weights,
    caches) are graph inputs guarded by shape/dtype only: one compile serves every layer of the stack."""
    return layer(x, pos)


def raise_recompile_limit(n: int) -> None:
    """Head room for N layers should guards ever tell them apart (a recompile each, then still compiled code)."""
    cfg = torch._dynamo.config
    attr = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    if hasattr(cfg, attr) and getattr(cfg, attr) < n:
        setattr(cfg, attr, n)


def compile_layer_step(mode: str | None, n_layers: int, *, backend: str = "inductor", reset: bool = True):
    """torch.compile of torch_layer_step for a stack of n_layers layers: fn(layer, x, pos). `reset` starts dynamo
    afresh (each variant's shape its own compile, never past the recompile limit) and zeroes compiled_graphs();
    `mode` applies to inductor only (another backend, e.g. the CPU tests' "eager", takes none)."""
    if reset:
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
    raise_recompile_limit(n_layers + 4)
    if backend == "inductor":
        return torch.compile(torch_layer_step, mode=mode, dynamic=False)
    return torch.compile(torch_layer_step, backend=backend, dynamic=False)


def compiled_graphs() -> int:
    """Graphs dynamo made since the last reset: more than one for a stack means a graph break or a recompile."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
