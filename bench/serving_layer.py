"""The unfused decode layer as serving engines write it in PyTorch: merged q/k/v and gate/up GEMMs, a precomputed
RoPE table gathered by position, a KV-cache append by index, and attention as vLLM's FlashAttention backend calls it:
FlashAttention-2's varlen forward (torch's own copy, `aten._flash_attention_forward`) with each sequence's used
length (`seqused_k`), in the call form of vLLM's FlashAttention backend (vLLM itself reads a paged cache, FA3 on
Hopper). With GQA, torch 2.11 moves a group's query heads into the query length and splits the cache over blocks
(split-KV) where batch × kv_heads leaves SMs idle; with multi-head attention it does not split (bench/NOTES.md session
46). Where that kernel does not run (the CPU, fp32, a head_dim it lacks, a GPU before sm_80, a torch without
`seqused_k`), SDPA over the whole cache with a length mask.

Written for torch.compile(fullgraph=True) and CUDA-graph capture: no data-dependent Python control flow, no host
syncs (.item(), .tolist()), no allocation that depends on values. `make_serving_step` is the compiled provider.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from generator.host import rope_cos_sin
from generator.variants import Model

COMPILE_MODE = "max-autotune-no-cudagraphs"


def flash_varlen_available(device, dtype, head_dim: int) -> bool:
    """Whether torch's FlashAttention-2 varlen forward with `seqused_k` serves this layer: a CUDA device of sm_80 or
    later with torch's flash kernels built in, fp16/bf16, head_dim a multiple of 8 up to 256 (FlashAttention-2's
    limits), and a torch whose op takes `seqused_k` (2.4 on)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    return ("seqused_k" in schema and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device)[0] >= 8)


class ServingLayer:
    """Decode step of one layer; owns its KV cache.

    weights: HF-named tensors (generator.reference.weight_shapes), all of one dtype (bf16/fp16 on the GPU; fp32
    works too, e.g. on the CPU) that the layer computes in. k_cache, v_cache: [batch, kv_heads, seq_len, head_dim]
    views in that dtype (the fused layer's layout) of caches stored [batch, seq_len, kv_heads, head_dim], the
    layout FlashAttention reads. Call: layer(x [batch, hidden], pos int32 [batch]) -> [batch, hidden]; pos[b] is
    where sequence b's new token goes (0 <= pos < seq_len), and attention reads cache rows 0..pos[b].
    `attention`: "flash_varlen" or "sdpa_mask" (module docstring), chosen at construction.
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
        # RoPE table [seq_len, head_dim/2] in the layer dtype (fp32, as HF computes it)
        cos, sin = rope_cos_sin(m, torch.arange(seq_len, device=device))
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self._k = torch.zeros(batch, seq_len, m.kv_heads, m.head_dim, dtype=dtype, device=device)
        self._v = torch.zeros_like(self._k)
        self.k_cache, self.v_cache = self._k.transpose(1, 2), self._v.transpose(1, 2)
        self.bidx = torch.arange(batch, device=device)
        self.rows = torch.arange(seq_len, device=device)
        self.attention = "flash_varlen" if flash_varlen_available(device, dtype, m.head_dim) else "sdpa_mask"
        self.cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)  # one query token a sequence
        self.cu_k = self.cu_q * seq_len                                        # each sequence's whole cache

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

    def _attend(self, q, pos, p):
        """q [B, heads, head_dim] -> [B, heads, head_dim] over cache rows 0..pos[b] (GQA: kv head = head // group)."""
        m, B, S = self.m, q.shape[0], self.seq_len
        if self.attention == "flash_varlen":  # as vLLM's FlashAttention backend: FA2 varlen, seqused_k
            k, v = self._k.view(B * S, m.kv_heads, m.head_dim), self._v.view(B * S, m.kv_heads, m.head_dim)
            left = None if m.sliding_window is None else m.sliding_window - 1  # (the query's own key aside)
            return torch.ops.aten._flash_attention_forward(
                q, k, v, self.cu_q, self.cu_k, 1, S, 0.0, False, False, seqused_k=(pos + 1).to(torch.int32),
                window_size_left=left, window_size_right=None if left is None else 0)[0]
        # GQA without expanding K/V: the group's query heads are the "query length" of their KV head
        qg = q.view(B, m.kv_heads, m.group, m.head_dim)
        mask = self.rows[None, :] <= p[:, None]
        if m.sliding_window is not None:  # (transformers' sliding_window_causal mask)
            mask = mask & (self.rows[None, :] > p[:, None] - m.sliding_window)
        mask = mask[:, None, None, :]                                                   # [B, 1, 1, seq_len]
        # (the storage's own views: passing k_cache/v_cache, aliases of the written _k/_v, made torch.compile copy
        # the whole caches in and out every step)
        return F.scaled_dot_product_attention(qg, self._k.transpose(1, 2), self._v.transpose(1, 2), attn_mask=mask)

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
        self._k[self.bidx, p] = k                                                    # index_put at (b, pos[b])
        self._v[self.bidx, p] = v
        x = x + F.linear(self._attend(q, pos, p).reshape(B, self.q_size), self.w_o)
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
