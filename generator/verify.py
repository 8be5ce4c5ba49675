"""Checks of a loaded fused layer against the fp32 reference on fresh random inputs (used by the GPU tests and by
bench/gpu_check.py, so both judge a kernel the same way)."""
from __future__ import annotations

import math

import torch

from . import reference
from .targets import DTYPES

REL_TOL = {name: d.rel_tol for name, d in DTYPES.items()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def random_inputs(layer, seed: int, *, positions: str = "random"):
    """Fresh x (rows of different scales and means), positions and a random (never zero) cache. positions: 'random'
    (includes 0 and the last possible position when batch allows), 'full' (all at the last possible position).
    Decode: x [batch, hidden], pos [batch]; prefill: x [batch, chunk, hidden], start positions [batch] (the last: a
    chunk ending at the last cache row)."""
    g = torch.Generator(device=layer.device).manual_seed(seed)
    B, C, S = layer.variant.batch, layer.chunk, layer.cache_len
    shape = (B, layer.model.hidden) if layer.mode == "decode" else (B, C, layer.model.hidden)
    # each token row at its own scale (log-uniform in [1/4, 4]) and offset: a norm that drops 1/rms or the mean,
    # or takes another row's, cannot pass (standard-normal rows all have rms ~1)
    x = torch.randn(shape, generator=g, device=layer.device)
    stat = (*shape[:-1], 1)
    x = x * torch.exp2(torch.rand(stat, generator=g, device=layer.device) * 4 - 2) \
        + torch.randn(stat, generator=g, device=layer.device) * 0.5
    x = x.to(layer.dtype)
    layer.k_cache.copy_(torch.randn(layer.k_cache.shape, generator=g, device=layer.device))
    layer.v_cache.copy_(torch.randn(layer.v_cache.shape, generator=g, device=layer.device))
    last = S - C
    if positions == "full":
        pos = torch.full((B,), last, dtype=torch.int32)
    else:
        pos = torch.randint(0, last + 1, (B,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        pos[0] = last
        if B > 1:
            pos[1] = 0
    return x, pos


# the workspace buffer where the kernel leaves each step's result (the last step's is the output)
STEP_BUFFERS = {"qkv_proj": "qkv", "attention": "attn", "o_proj": "h", "gate_up": "act"}


def _gather_heads(c: torch.Tensor, layer) -> torch.Tensor:
    """The whole KV cache [B, kv_heads, S, hd] from every tensor-parallel rank's [B, kv_heads / tp, S, hd]."""
    parts = [torch.empty_like(c) for _ in range(layer.tp)]
    torch.distributed.all_gather(parts, c.contiguous(), group=layer.group)
    return torch.cat(parts, dim=1)


def _rank_part(stage: str, t: torch.Tensor, layer) -> torch.Tensor:
    """The part of the whole layer's step result `t` that this tensor-parallel rank computes (its heads / MLP
    columns); h (after the all-reduce) is whole on every rank."""
    tp, r, m = layer.tp, layer.rank, layer.model
    if tp == 1 or stage == "o_proj":
        return t
    if stage == "qkv_proj":
        q, k, v = t.split([m.heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim], dim=-1)
        return torch.cat([q.chunk(tp, -1)[r], k.chunk(tp, -1)[r], v.chunk(tp, -1)[r]], dim=-1)
    return t.chunk(tp, -1)[r]  # attention: this rank's heads; gate_up: its MLP columns


def check_step(layer, x: torch.Tensor, pos: torch.Tensor, weights: dict | None = None) -> dict:
    """One launch (a decode step, or a prefill chunk) with a NaN-poisoned output vs. the reference on copies of the
    caches.

    Returns rel_err (output), unwritten (NaN count), k_err/v_err (the appended cache rows against the reference's),
    cache_untouched (every other row bit-exact), stage_err {step: rel_err of its workspace result}, first_bad_stage
    (the first step out of tolerance, where the fault is; None when all pass), overflows (values the dtype could
    not hold), out. weights: the HF-named weights the layer was loaded with (default: read back from its packed
    copy). A tensor-parallel layer (every rank calls this with the same x, pos and whole-layer weights) is judged
    against the whole layer's reference: its output whole, its cache rows and step results as its rank's part."""
    m = layer.model
    if layer.tp > 1:
        if weights is None:
            raise ValueError("weights: a tensor-parallel layer is checked against the whole layer's weights")
        kc, vc = _gather_heads(layer.k_cache, layer), _gather_heads(layer.v_cache, layer)
    else:
        kc, vc = layer.k_cache.clone(), layer.v_cache.clone()
    W = weights if weights is not None else layer.weights()
    out = torch.full_like(x, float("nan"))
    pos_dev = pos.to(layer.device)
    layer.check_positions(pos)
    layer.overflows()  # reset the counter
    H = m.hidden
    layer.launch(x.reshape(-1, H), pos_dev, out.view(-1, H))
    torch.cuda.synchronize(layer.device)
    if layer.mode == "decode":
        ref, parts = reference.decoder_layer(x, pos_dev, W, kc, vc, m, return_parts=True)
    else:
        ref, parts = reference.prefill_layer(x, pos_dev, W, kc, vc, m, return_parts=True)
    if layer.tp > 1:  # this rank's KV heads of the reference's caches
        kc, vc = kc.chunk(layer.tp, 1)[layer.rank].contiguous(), vc.chunk(layer.tp, 1)[layer.rank].contiguous()
    # the rows this launch appends: pos[b] .. pos[b] + chunk - 1 of every sequence b
    B, KV, S = layer.k_cache.shape[:3]
    rows = torch.arange(S, device=layer.device)[None, :]
    new = (rows >= pos_dev.long()[:, None]) & (rows < pos_dev.long()[:, None] + layer.chunk)  # [B, S]
    new = new[:, None, :].expand(B, KV, S)
    # every other row must be untouched, bit for bit (kc, vc: the reference appended the same rows)
    untouched = bool((layer.k_cache[~new] == kc[~new]).all() and (layer.v_cache[~new] == vc[~new]).all())
    stage_err = {s: rel_err(layer.buffer(b), _rank_part(s, parts[s], layer)) for s, b in STEP_BUFFERS.items()}
    stage_err["kv_append"] = max(rel_err(layer.k_cache[new], kc[new]), rel_err(layer.v_cache[new], vc[new]))
    stage_err["down_proj"] = rel_err(out, ref)
    tol = REL_TOL[m.dtype]
    order = list(layer.STAGES)
    if "kv_append" not in order:  # decode appends inside its attention step
        order.insert(order.index("attention"), "kv_append")
    return {
        "rel_err": stage_err["down_proj"],
        "unwritten": int(torch.isnan(out).sum()),
        "k_err": rel_err(layer.k_cache[new], kc[new]),
        "v_err": rel_err(layer.v_cache[new], vc[new]),
        "cache_untouched": untouched,
        "stage_err": stage_err,
        "first_bad_stage": next((s for s in order if stage_err.get(s, 0.0) > tol), None),
        "overflows": layer.overflows(),
        "out": out,
    }


def passed(result: dict, dtype: str) -> bool:
    tol = REL_TOL[dtype]
    return (result["rel_err"] <= tol and result["unwritten"] == 0 and result["k_err"] <= tol
            and result["v_err"] <= tol and result["cache_untouched"])
