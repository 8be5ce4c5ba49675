"""The unfused decode layer as serving engines write it in PyTorch: merged q/k/v and gate/up GEMMs, a precomputed
RoPE table gathered by position, a KV-cache append by index, SDPA over the whole cache with a length mask.

Written for torch.compile(fullgraph=True) and CUDA-graph capture: no data-dependent Python control flow, no host
syncs (.item(), .tolist()), no allocation that depends on values. `make_serving_step` is the compiled provider.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from generator import reference
from generator.variants import Model

COMPILE_MODE = "max-autotune-no-cudagraphs"


class ServingLayer:
    """Decode step of one layer; owns its KV cache.

    weights: HF-named tensors (generator.reference.weight_shapes), all of one dtype (bf16/fp16 on the GPU; fp32
    works too, e.g. on the CPU) that the layer computes in. k_cache, v_cache: [batch, kv_heads, seq_len, head_dim]
    in that dtype, the fused layer's layout. Call: layer(x [batch, hidden], pos int32 [batch]) -> [batch, hidden];
    pos[b] is where sequence b's new token goes (0 <= pos < seq_len), and attention reads cache rows 0..pos[b].
    """

    def __init__(self, weights: dict[str, torch.Tensor], m: Model, batch: int, seq_len: int, device="cuda"):
        self.m, self.batch, self.seq_len = m, batch, seq_len
        W = {k: v.to(device) for k, v in weights.items()}
        dtype = W["self_attn.q_proj.weight"].dtype
        self.q_size, self.kv_size = m.heads * m.head_dim, m.kv_heads * m.head_dim
        # merged once, as the engines load checkpoints: [q + 2 kv, hidden] and [2 intermediate, hidden]
        self.w_qkv = torch.cat([W[f"self_attn.{p}_proj.weight"] for p in "qkv"]).contiguous()
        self.b_qkv = torch.cat([W[f"self_attn.{p}_proj.bias"] for p in "qkv"]) if m.qkv_bias else None
        self.w_o = W["self_attn.o_proj.weight"]
        self.w_gate_up = torch.cat([W["mlp.gate_proj.weight"], W["mlp.up_proj.weight"]]).contiguous()
        self.w_down = W["mlp.down_proj.weight"]
        self.ln1 = (W["input_layernorm.weight"], W.get("input_layernorm.bias"))
        self.ln2 = (W["post_attention_layernorm.weight"], W.get("post_attention_layernorm.bias"))
        self.q_norm, self.k_norm = W.get("self_attn.q_norm.weight"), W.get("self_attn.k_norm.weight")
        # RoPE table [seq_len, head_dim/2] in the layer dtype (fp32 angles, as HF computes them)
        freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * reference.inv_freq(m, device)[None]
        self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        self.k_cache = torch.zeros(batch, m.kv_heads, seq_len, m.head_dim, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.bidx = torch.arange(batch, device=device)
        self.rows = torch.arange(seq_len, device=device)

    def _norm(self, x, wb):
        w, b = wb
        if self.m.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, b, self.m.norm_eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.m.norm_eps)).to(x.dtype) * w

    def _head_norm(self, t, w):
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + self.m.norm_eps)).to(t.dtype) * w

    @staticmethod
    def _rope(t, cos, sin):
        """t [B, heads, hd]; cos, sin [B, 1, hd/2]: rotate-half (NeoX / HF) convention."""
        a, b = t.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m, B = self.m, x.shape[0]
        p = pos.long()
        h = self._norm(x, self.ln1)
        qkv = F.linear(h, self.w_qkv, self.b_qkv)                                   # [B, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(B, m.heads, m.head_dim), k.view(B, m.kv_heads, m.head_dim)
        v = v.view(B, m.kv_heads, m.head_dim)
        if m.qk_norm:
            q, k = self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)
        cos, sin = self.cos[p][:, None], self.sin[p][:, None]                       # [B, 1, hd/2]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        self.k_cache[self.bidx, :, p] = k                                            # index_put at (b, :, pos[b])
        self.v_cache[self.bidx, :, p] = v
        # GQA without expanding K/V: the group's query heads are the "query length" of their KV head
        qg = q.view(B, m.kv_heads, m.group, m.head_dim)
        mask = (self.rows[None, :] <= p[:, None])[:, None, None, :]                   # [B, 1, 1, seq_len]
        attn = F.scaled_dot_product_attention(qg, self.k_cache, self.v_cache, attn_mask=mask)
        x = x + F.linear(attn.reshape(B, self.q_size), self.w_o)
        gate, up = F.linear(self._norm(x, self.ln2), self.w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) if m.activation == "silu" else F.gelu(gate)
        return x + F.linear(act * up, self.w_down)


def _serving_step(layer: ServingLayer, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """What torch.compile compiles: the layer is an argument, so its tensors are graph inputs guarded by
    shape/dtype/stride only, and one compile serves every layer of a stack of the same shape."""
    return layer(x, pos)


@functools.lru_cache(maxsize=None)
def _compiled(backend: str):
    if backend == "inductor":
        return torch.compile(_serving_step, mode=COMPILE_MODE, fullgraph=True, dynamic=False)
    return torch.compile(_serving_step, backend=backend, fullgraph=True, dynamic=False)


def make_serving_step(layer: ServingLayer, *, backend: str = "inductor"):
    """step(x, pos) -> [batch, hidden]: torch.compile(mode="max-autotune-no-cudagraphs", fullgraph=True) of the
    layer's step, compiled at the first call (shared by all layers of one shape). Not graphed: the caller captures
    it in its own CUDA graph after a warm-up call. `backend` other than inductor (e.g. "aot_eager") is for tests."""
    return functools.partial(_compiled(backend), layer)
