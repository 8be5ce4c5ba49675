"""The unfused layer as a user would write it in PyTorch (bf16 cuBLAS matmuls + SDPA), the baseline every fused
kernel is compared with: eager, captured in a CUDA graph, or torch.compile'd and captured."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from generator.host import rope_cos_sin
from generator.variants import Model


class TorchLayer:
    """Decode step of one layer, written plainly; owns its own KV cache (same layout as the fused layer's)."""

    def __init__(self, weights: dict[str, torch.Tensor], m: Model, batch: int, seq_len: int, device="cuda"):
        self.m, self.W = m, weights
        dtype = weights["self_attn.q_proj.weight"].dtype
        self.k_cache = torch.zeros(batch, m.kv_heads, seq_len, m.head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.arange = torch.arange(seq_len, device=device)
        self.bidx = torch.arange(batch, device=device)
        # RoPE table [seq_len, head_dim] (both halves), built once: a step gathers its rows (no host work in a graph)
        self.cos, self.sin = (torch.cat([t, t], dim=-1).to(dtype) for t in rope_cos_sin(m, self.arange))

    def _norm(self, x, prefix):
        w, b = self.W[f"{prefix}.weight"], self.W.get(f"{prefix}.bias")
        if self.m.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, b, self.m.norm_eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.m.norm_eps)).to(x.dtype) * w

    def _rope(self, t, cos, sin):
        half = t.shape[-1] // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos + rot * sin

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m, W, B = self.m, self.W, x.shape[0]
        h = self._norm(x, "input_layernorm")
        q = F.linear(h, W["self_attn.q_proj.weight"], W.get("self_attn.q_proj.bias")).view(B, m.heads, 1, m.head_dim)
        k = F.linear(h, W["self_attn.k_proj.weight"], W.get("self_attn.k_proj.bias")).view(B, m.kv_heads, 1, m.head_dim)
        v = F.linear(h, W["self_attn.v_proj.weight"], W.get("self_attn.v_proj.bias")).view(B, m.kv_heads, 1, m.head_dim)
        if m.qk_norm:
            q = self._norm(q, "self_attn.q_norm")
            k = self._norm(k, "self_attn.k_norm")
        cos, sin = self.cos[pos.long()][:, None, None, :], self.sin[pos.long()][:, None, None, :]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        self.k_cache[self.bidx, :, pos.long()] = k[:, :, 0]
        self.v_cache[self.bidx, :, pos.long()] = v[:, :, 0]
        mask = self.arange[None, :] <= pos[:, None].long()
        if m.sliding_window is not None:  # (transformers' sliding_window_causal mask)
            mask = mask & (self.arange[None, :] > pos[:, None].long() - m.sliding_window)
        mask = mask[:, None, None, :]
        attn = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + F.linear(attn.reshape(B, m.heads * m.head_dim), W["self_attn.o_proj.weight"])
        h = self._norm(x, "post_attention_layernorm")
        g = F.linear(h, W["mlp.gate_proj.weight"])
        act = F.silu(g) if m.activation == "silu" else F.gelu(g)
        return x + F.linear(act * F.linear(h, W["mlp.up_proj.weight"]), W["mlp.down_proj.weight"])
