"""Checks of a loaded fused layer against the fp32 reference on fresh random inputs (used by the GPU tests and by
bench/gpu_check.py, so both judge a kernel the same way)."""
from __future__ import annotations

import math

import torch

from . import reference

REL_TOL = {"bf16": 1e-2, "fp16": 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_inputs(layer, seed: int, *, positions: str = "random"):
    """Fresh x, positions and a random (never zero) cache. positions: 'random' (includes 0 and seq_len-1 when
    batch allows), 'full' (all seq_len-1)."""
    g = torch.Generator(device=layer.device).manual_seed(seed)
    B, S = layer.variant.batch, layer.variant.seq_len
    x = torch.randn(B, layer.model.hidden, generator=g, device=layer.device).to(layer.dtype)
    layer.k_cache.copy_(torch.randn(layer.k_cache.shape, generator=g, device=layer.device))
    layer.v_cache.copy_(torch.randn(layer.v_cache.shape, generator=g, device=layer.device))
    if positions == "full":
        pos = torch.full((B,), S - 1, dtype=torch.int32)
    else:
        pos = torch.randint(0, S, (B,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        pos[0] = S - 1
        if B > 1:
            pos[1] = 0
    return x, pos


def check_step(layer, x: torch.Tensor, pos: torch.Tensor) -> dict:
    """One step through the kernel with a NaN-poisoned output vs. the reference on copies of the caches."""
    m = layer.model
    kc, vc = layer.k_cache.clone(), layer.v_cache.clone()
    W = layer.weights()
    out = torch.full_like(x, float("nan"))
    pos_dev = pos.to(layer.device)
    layer.check_positions(pos)
    layer.launch(x, pos_dev, out)
    torch.cuda.synchronize(layer.device)
    ref = reference.decoder_layer(x, pos_dev, W, kc, vc, m)
    idx = torch.arange(x.shape[0], device=layer.device)
    p = pos_dev.long()
    new_k, new_v = layer.k_cache[idx, :, p], layer.v_cache[idx, :, p]
    # every row but the appended ones must be untouched, bit for bit
    mask = torch.ones(layer.k_cache.shape[:3], dtype=torch.bool, device=layer.device)
    mask[idx, :, p] = False
    untouched = bool((layer.k_cache[mask] == kc[mask]).all() and (layer.v_cache[mask] == vc[mask]).all())
    return {
        "rel_err": rel_err(out, ref),
        "unwritten": int(torch.isnan(out).sum()),
        "k_err": rel_err(new_k, kc[idx, :, p]),
        "v_err": rel_err(new_v, vc[idx, :, p]),
        "cache_untouched": untouched,
        "out": out,
    }


def passed(result: dict, dtype: str) -> bool:
    tol = REL_TOL[dtype]
    return (result["rel_err"] <= tol and result["unwritten"] == 0 and result["k_err"] <= tol
            and result["v_err"] <= tol and result["cache_untouched"])
