"""The decoder layer in plain PyTorch, fp32 math, CPU or GPU: the ground truth the fused kernel is checked against.

One function per kernel stage, with the stage's template name (templates/stages/<name>.cuh.j2). Weight names are
those of HF transformers. The KV caches are the layer's state: they keep the model dtype, as the kernel's do.
"""
from __future__ import annotations

import math

import torch

from .variants import Model

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def weight_shapes(m: Model) -> dict[str, tuple[int, ...]]:
    """Every tensor a layer of this model has, named as in HF transformers."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    shapes = {
        "input_layernorm.weight": (m.hidden,),
        "self_attn.q_proj.weight": (q, m.hidden),
        "self_attn.k_proj.weight": (kv, m.hidden),
        "self_attn.v_proj.weight": (kv, m.hidden),
        "self_attn.o_proj.weight": (m.hidden, q),
        "post_attention_layernorm.weight": (m.hidden,),
        "mlp.gate_proj.weight": (m.intermediate, m.hidden),
        "mlp.up_proj.weight": (m.intermediate, m.hidden),
        "mlp.down_proj.weight": (m.hidden, m.intermediate),
    }
    if m.norm == "layernorm":
        shapes["input_layernorm.bias"] = (m.hidden,)
        shapes["post_attention_layernorm.bias"] = (m.hidden,)
    if m.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if m.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (m.head_dim,), "self_attn.k_norm.weight": (m.head_dim,)})
    return shapes


def random_weights(m: Model, *, seed: int = 0, device="cpu", dtype=None) -> dict[str, torch.Tensor]:
    """Random weights scaled like a trained layer's (unit-variance activations), drawn on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype or TORCH_DTYPES[m.dtype]
    out = {}
    for name, shape in weight_shapes(m).items():
        t = torch.randn(shape, generator=g, device=device)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        else:
            t = t / math.sqrt(shape[1])
        out[name] = t.to(dtype)
    return out


def inv_freq(m: Model, device="cpu") -> torch.Tensor:
    """RoPE inverse frequencies in fp32, computed as HF does (llama3 scaling included)."""
    base = 1.0 / (m.rope_theta ** (torch.arange(0, m.head_dim, 2, dtype=torch.int64).float() / m.head_dim))
    if m.rope_scaling:
        s = dict(m.rope_scaling)
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        base = torch.where(medium, smoothed, scaled)
    return base.to(device)


def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, m: Model) -> torch.Tensor:
    x = x.float()
    if m.norm == "layernorm":
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w.float(), b.float(), m.norm_eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_eps) * w.float()


def qkv_proj(xn: torch.Tensor, W: dict, m: Model):
    def lin(name):
        y = xn @ W[f"self_attn.{name}.weight"].float().T
        return y + W[f"self_attn.{name}.bias"].float() if m.qkv_bias else y
    B = xn.shape[0]
    return (lin("q_proj").view(B, m.heads, m.head_dim), lin("k_proj").view(B, m.kv_heads, m.head_dim),
            lin("v_proj").view(B, m.kv_heads, m.head_dim))


def qk_norm(t: torch.Tensor, w: torch.Tensor | None, m: Model) -> torch.Tensor:
    if not m.qk_norm:
        return t
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.norm_eps) * w.float()


def rope(t: torch.Tensor, pos: torch.Tensor, m: Model) -> torch.Tensor:
    """t [B, heads, head_dim], pos [B]: HF rotate_half convention."""
    freqs = pos.float()[:, None] * inv_freq(m, t.device)[None, :]  # [B, head_dim/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    a, b = t[..., : m.head_dim // 2], t[..., m.head_dim // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
    """Write each sequence's new k, v [B, kv_heads, head_dim] at its own position (in place, cache dtype)."""
    idx = torch.arange(k.shape[0], device=k.device)
    k_cache[idx, :, pos.long()] = k.to(k_cache.dtype)
    v_cache[idx, :, pos.long()] = v.to(v_cache.dtype)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, m: Model):
    """q [B, heads, hd] over cache rows 0..pos[b] of its KV head; softmax in fp32. Returns [B, heads*hd]."""
    out = []
    for b in range(q.shape[0]):
        n = int(pos[b]) + 1
        k = k_cache[b, :, :n].float().repeat_interleave(m.group, dim=0)  # [heads, n, hd]
        v = v_cache[b, :, :n].float().repeat_interleave(m.group, dim=0)
        s = torch.einsum("hd,hnd->hn", q[b], k) / math.sqrt(m.head_dim)
        out.append(torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), v).reshape(-1))
    return torch.stack(out)


def o_proj(attn: torch.Tensor, x: torch.Tensor, W: dict) -> torch.Tensor:
    return x.float() + attn @ W["self_attn.o_proj.weight"].float().T


def gate_up(hn: torch.Tensor, W: dict, m: Model) -> torch.Tensor:
    g = hn @ W["mlp.gate_proj.weight"].float().T
    u = hn @ W["mlp.up_proj.weight"].float().T
    act = torch.nn.functional.silu(g) if m.activation == "silu" else torch.nn.functional.gelu(g)
    return act * u


def down_proj(act: torch.Tensor, h: torch.Tensor, W: dict) -> torch.Tensor:
    return h + act @ W["mlp.down_proj.weight"].float().T


def decoder_layer(x: torch.Tensor, pos: torch.Tensor, W: dict, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  m: Model, *, return_parts: bool = False):
    """One decode step: x [B, hidden], pos [B] -> [B, hidden] fp32; k_cache/v_cache updated in place."""
    xn = norm(x, W["input_layernorm.weight"], W.get("input_layernorm.bias"), m)
    q, k, v = qkv_proj(xn, W, m)
    q = rope(qk_norm(q, W.get("self_attn.q_norm.weight"), m), pos, m)
    k = rope(qk_norm(k, W.get("self_attn.k_norm.weight"), m), pos, m)
    kv_append(k_cache, v_cache, k, v, pos)
    attn = attention(q, k_cache, v_cache, pos, m)
    h = o_proj(attn, x, W)
    hn = norm(h, W["post_attention_layernorm.weight"], W.get("post_attention_layernorm.bias"), m)
    out = down_proj(gate_up(hn, W, m), h, W)
    if return_parts:
        return out, {"q": q, "k": k, "v": v, "attn": attn, "h": h}
    return out
