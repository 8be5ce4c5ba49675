"""The decoder layer in plain PyTorch, fp32 math, CPU or GPU: the ground truth the fused kernel is checked against.

One function per kernel stage, with the stage's header name (templates/stages/<name>.cuh). Weight names are
those of HF transformers. The KV caches are the layer's state: they keep the model dtype, as the kernel's do.
"""
from __future__ import annotations

import math

import torch

from .host import rope_cos_sin
from .interface import weight_shapes
from .targets import DTYPES, torch_dtype
from .variants import Model

TORCH_DTYPES = {name: torch_dtype(name) for name in DTYPES}


def random_weights(m: Model, *, seed: int = 0, device="cpu", dtype=None) -> dict[str, torch.Tensor]:
    """Random weights scaled like a trained layer's (unit-variance activations), drawn on `device`. Raises
    ValueError (one line) for a CUDA device where torch sees none."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"random_weights(device={str(device)!r}): no CUDA device here (torch.cuda.is_available() is "
                         "False): use device='cpu'")
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
    cos, sin = rope_cos_sin(m, pos, t.device)  # [B, head_dim/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = t[..., : m.head_dim // 2], t[..., m.head_dim // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              seq: torch.Tensor | None = None):
    """Write each token row's new k, v [R, kv_heads, head_dim] at its position pos [R] of its sequence seq [R]
    (default: row r is sequence r), in place, in the cache dtype."""
    seq = torch.arange(k.shape[0], device=k.device) if seq is None else seq.long()
    k_cache[seq, :, pos.long()] = k.to(k_cache.dtype)
    v_cache[seq, :, pos.long()] = v.to(v_cache.dtype)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, m: Model,
              seq: torch.Tensor | None = None):
    """q [R, heads, hd] of token rows at positions pos [R] of sequences seq [R] (default: row r is sequence r):
    each attends to cache rows 0..pos[r] of its sequence's KV head (causal; with m.sliding_window W rows
    pos[r] - W + 1..pos[r], transformers' sliding_window_causal mask); softmax in fp32. Returns [R, heads*hd]."""
    R = q.shape[0]
    seq = torch.arange(R, device=q.device) if seq is None else seq.to(q.device).long()
    pos = pos.to(q.device).long()
    out = torch.empty(R, m.heads * m.head_dim, dtype=torch.float32, device=q.device)
    for b in torch.unique(seq).tolist():  # one sequence at a time, its rows at once under a causal mask
        idx = (seq == b).nonzero().flatten()
        n = int(pos[idx].max()) + 1
        k = k_cache[b, :, :n].float().repeat_interleave(m.group, dim=0)  # [heads, n, hd]
        v = v_cache[b, :, :n].float().repeat_interleave(m.group, dim=0)
        s = torch.einsum("rhd,hnd->rhn", q[idx].float(), k) / math.sqrt(m.head_dim)
        rows, p = torch.arange(n, device=q.device)[None, None, :], pos[idx][:, None, None]
        out_of = rows > p if m.sliding_window is None else (rows > p) | (rows <= p - m.sliding_window)
        s = s.masked_fill(out_of, float("-inf"))
        out[idx] = torch.einsum("rhn,hnd->rhd", torch.softmax(s, dim=-1), v).reshape(len(idx), -1)
    return out


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
                  m: Model, *, return_parts: bool = False, seq: torch.Tensor | None = None):
    """Token rows through the layer: x [R, hidden], pos [R] (each row's position), seq [R] (each row's sequence in
    the caches; default row r is sequence r: one decode step) -> [R, hidden] fp32; k_cache/v_cache [B, kv_heads,
    cache_len, head_dim] gain every row's k, v (all rows are appended before any attends: a prefill chunk sees
    itself causally). As transformers' LlamaDecoderLayer.forward with a static cache.

    return_parts=True also returns each step's result under its stage name, as the kernel's workspace holds it:
    qkv_proj [R, q_dim + 2 kv_dim] (raw, before q/k norm and RoPE), attention [R, q_dim], o_proj [R, hidden] (the
    residual h), gate_up [R, intermediate], down_proj [R, hidden] (the output); plus q, k, v after RoPE."""
    xn = norm(x, W["input_layernorm.weight"], W.get("input_layernorm.bias"), m)
    q, k, v = qkv_proj(xn, W, m)
    R = x.shape[0]
    qkv = torch.cat([q.reshape(R, -1), k.reshape(R, -1), v.reshape(R, -1)], dim=1)
    q = rope(qk_norm(q, W.get("self_attn.q_norm.weight"), m), pos, m)
    k = rope(qk_norm(k, W.get("self_attn.k_norm.weight"), m), pos, m)
    kv_append(k_cache, v_cache, k, v, pos, seq)
    attn = attention(q, k_cache, v_cache, pos, m, seq)
    h = o_proj(attn, x, W)
    hn = norm(h, W["post_attention_layernorm.weight"], W.get("post_attention_layernorm.bias"), m)
    act = gate_up(hn, W, m)
    out = down_proj(act, h, W)
    if return_parts:
        return out, {"q": q, "k": k, "v": v, "qkv_proj": qkv, "attention": attn, "o_proj": h, "gate_up": act,
                     "down_proj": out, "attn": attn, "h": h}
    return out


def prefill_layer(x: torch.Tensor, start_pos: torch.Tensor, W: dict, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  m: Model, *, return_parts: bool = False):
    """A prompt chunk: x [B, C, hidden], start_pos [B] (token t of sequence b at position start_pos[b] + t) ->
    [B, C, hidden] fp32 (parts flattened to [B*C, ...] rows); caches updated in place."""
    B, C, H = x.shape
    dev = x.device
    pos = (start_pos.to(dev).long()[:, None] + torch.arange(C, device=dev)[None, :]).reshape(-1)
    seq = torch.arange(B, device=dev).repeat_interleave(C)
    res = decoder_layer(x.reshape(B * C, H), pos, W, k_cache, v_cache, m, return_parts=return_parts, seq=seq)
    if return_parts:
        return res[0].view(B, C, H), res[1]
    return res.view(B, C, H)
