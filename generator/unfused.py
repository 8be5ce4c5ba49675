"""The decoder layer written plainly in PyTorch, in the model's dtype: the serving model's fallback and prefill path.

Merged q/k/v and gate/up GEMMs (cuBLAS), RoPE from a table gathered by position, the KV-cache append by index, SDPA
over the cache's first kv_len rows with a length mask (GQA without expanding K/V). Same cache layout as the fused
kernel ([batch, kv_heads, cache_len, head_dim]), so one pair of caches serves both paths. No host syncs and no
value-dependent shapes in `decode`: it can be captured in a CUDA graph. Runs on the CPU too (any float dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .host import rope_cos_sin
from .collectives import AllReduce
from .interface import shard_weights, weight_shapes
from .variants import Model, shard_model


class UnfusedLayer:
    """One decoder layer of model `m` on shared KV caches.

    weights: HF-named tensors (generator.interface.weight_shapes(m)), all of one float dtype on one device; the layer
    computes in that dtype (residuals and norms as transformers does: norms in fp32, cast back). They are merged
    (q|k|v, gate|up) into new tensors: the dict may be dropped afterwards. k_cache, v_cache: [max_batch, kv_heads,
    cache_len, head_dim] in the same dtype and device; a call of batch B uses the first B sequences.
    group: a torch.distributed process group of tp processes for tensor parallel (Megatron-LM's split, as serving
    engines run it): `weights` are the whole layer's, this rank keeps its heads and MLP columns
    (interface.TP_SPLIT), the caches hold kv_heads / tp heads, and o_proj's and down_proj's partial products are
    all-reduced (generator.collectives: `allreduce` "auto", "symm_mem" or "nccl"; gloo on the CPU) before their
    residual adds.
    Raises ValueError naming the tensor for a wrong name, shape, dtype or device.
    """

    def __init__(self, weights: dict[str, torch.Tensor], m: Model, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 group=None, allreduce: str = "auto"):
        expected = weight_shapes(m)
        extra = sorted(set(weights) - set(expected))
        if extra:
            raise ValueError(f"weight '{extra[0]}': not a tensor of this layer (expected: {', '.join(expected)})")
        dtype, device = weights["self_attn.q_proj.weight"].dtype, weights["self_attn.q_proj.weight"].device
        for name, shape in expected.items():
            t = weights.get(name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"weight '{name}': missing")
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
                raise ValueError(f"weight '{name}': {t.dtype} {tuple(t.shape)} on {t.device}, expected {dtype} "
                                 f"{shape} on {device}")
        self.group = group
        tp = 1 if group is None else torch.distributed.get_world_size(group)
        if tp > 1:
            weights = shard_weights(weights, tp, torch.distributed.get_rank(group))
            m = shard_model(m, tp)  # ValueError (one line) where tp does not divide the heads or columns
        want = (m.kv_heads, m.head_dim)
        for nm, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(c, torch.Tensor) or c.dim() != 4 or (c.shape[1], c.shape[3]) != want \
                    or c.dtype != dtype or c.device != device:
                raise ValueError(f"{nm}: expected a {dtype} tensor [max_batch, {m.kv_heads}, cache_len, "
                                 f"{m.head_dim}] on {device}, got {getattr(c, 'dtype', type(c).__name__)} "
                                 f"{tuple(getattr(c, 'shape', ()))}")
        self.m, self.dtype, self.device = m, dtype, device
        self._allreduce = None if tp == 1 else AllReduce(group, k_cache.shape[0] * m.hidden, dtype, device, allreduce)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.max_batch, self.cache_len = k_cache.shape[0], k_cache.shape[2]
        W = weights
        self.q_size, self.kv_size = m.heads * m.head_dim, m.kv_heads * m.head_dim
        self.w_qkv = torch.cat([W[f"self_attn.{p}_proj.weight"] for p in "qkv"]).contiguous()
        self.b_qkv = torch.cat([W[f"self_attn.{p}_proj.bias"] for p in "qkv"]).contiguous() if m.qkv_bias else None
        self.w_o = W["self_attn.o_proj.weight"].contiguous()
        self.w_gate_up = torch.cat([W["mlp.gate_proj.weight"], W["mlp.up_proj.weight"]]).contiguous()
        self.w_down = W["mlp.down_proj.weight"].contiguous()
        self.ln1 = (W["input_layernorm.weight"], W.get("input_layernorm.bias"))
        self.ln2 = (W["post_attention_layernorm.weight"], W.get("post_attention_layernorm.bias"))
        self.q_norm, self.k_norm = W.get("self_attn.q_norm.weight"), W.get("self_attn.k_norm.weight")
        # RoPE table [cache_len, head_dim/2]: fp32, cast to the dtype (as transformers does)
        cos, sin = rope_cos_sin(m, torch.arange(self.cache_len, device=device))
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self.rows = torch.arange(self.cache_len, device=device)
        self.bidx = torch.arange(self.max_batch, device=device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of this layer's own (merged) weights."""
        ts = [self.w_qkv, self.b_qkv, self.w_o, self.w_gate_up, self.w_down, *self.ln1, *self.ln2, self.q_norm,
              self.k_norm]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    # -- pieces --
    def _reduce(self, t):
        """The sum of every rank's partial product t (tensor parallel), in place; t itself on one GPU."""
        return t if self._allreduce is None else self._allreduce.reduce_from(t)

    def _norm(self, x, wb):
        w, b = wb
        if self.m.norm == "layernorm":
            return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), self.m.norm_eps).to(x.dtype)
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.m.norm_eps)).to(x.dtype)

    def _head_norm(self, t, w):
        tf = t.float()
        return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + self.m.norm_eps)).to(t.dtype)

    @staticmethod
    def _rope(t, cos, sin):
        a, b = t.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _mlp(self, h):
        gate, up = F.linear(self._norm(h, self.ln2), self.w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) if self.m.activation == "silu" else F.gelu(gate)
        return h + self._reduce(F.linear(act * up, self.w_down))

    def _qkv(self, x, p):
        """x [..., hidden], p [...] long -> q [..., heads, hd], k, v [..., kv_heads, hd] (q, k normed and rotated)."""
        m, lead = self.m, x.shape[:-1]
        qkv = F.linear(self._norm(x, self.ln1), self.w_qkv, self.b_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(*lead, m.heads, m.head_dim), k.view(*lead, m.kv_heads, m.head_dim), \
            v.view(*lead, m.kv_heads, m.head_dim)
        if m.qk_norm:
            q, k = self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)
        cos, sin = self.cos[p].unsqueeze(-2), self.sin[p].unsqueeze(-2)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _mask(self, rows, p):
        """Which cache rows (broadcast against positions p) a query attends to: rows <= p, and with a sliding window
        W rows > p - W (transformers' sliding_window_causal mask)."""
        ok = rows <= p
        return ok if self.m.sliding_window is None else ok & (rows > p - self.m.sliding_window)

    # -- steps --
    def decode(self, x: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """One decode step: x [B, hidden] (B <= max_batch, the layer's dtype and device), pos int32/int64 [B] on the
        device (0 <= pos < kv_len: not checked here, no host sync) -> [B, hidden]; writes cache row pos[b] of
        sequence b and attends to rows 0..pos[b]. kv_len: cache rows attention reads (1..cache_len; default
        cache_len), a bound the host knows from its positions: the step's cost then follows the positions, not the
        cache (serve.kv_bucket rounds it up, a CUDA graph a bucket). CUDA-graph capturable.
        Raises ValueError for a kv_len outside 1..cache_len."""
        m, B = self.m, x.shape[0]
        L = self.cache_len if kv_len is None else int(kv_len)
        if not 1 <= L <= self.cache_len:
            raise ValueError(f"kv_len {kv_len}: must be 1..{self.cache_len} (the cache's rows)")
        p = pos.long()
        q, k, v = self._qkv(x, p)
        kc, vc = self.k_cache[:B], self.v_cache[:B]
        bidx = self.bidx[:B]
        kc[bidx, :, p] = k
        vc[bidx, :, p] = v
        qg = q.view(B, m.kv_heads, m.group, m.head_dim)  # a KV head's query heads are its "query length"
        mask = self._mask(self.rows[None, :L], p[:, None])[:, None, None, :]
        attn = F.scaled_dot_product_attention(qg, kc[:, :, :L], vc[:, :, :L], attn_mask=mask)
        h = x + self._reduce(F.linear(attn.reshape(B, self.q_size), self.w_o))
        return self._mlp(h)

    def prefill(self, x: torch.Tensor, start_pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """One prompt chunk: x [B, C, hidden], start_pos int [B] on the device -> [B, C, hidden]. Token t of sequence
        b is at position start_pos[b] + t: its k, v go to that cache row and it attends causally to rows
        0..start_pos[b] + t. kv_len: cache rows attention reads (>= max(start_pos) + C; default cache_len), a bound
        that saves work for short prefixes. Positions are not checked here (the caller does, on the host).
        Raises ValueError for a kv_len outside C..cache_len."""
        m = self.m
        B, C, _ = x.shape
        L = self.cache_len if kv_len is None else int(kv_len)
        if not C <= L <= self.cache_len:
            raise ValueError(f"kv_len {kv_len}: must be {C}..{self.cache_len} (the chunk's tokens .. the cache's rows)")
        p = start_pos.long()[:, None] + torch.arange(C, device=x.device)[None, :]  # [B, C]
        q, k, v = self._qkv(x, p)  # q [B, C, heads, hd]
        kc, vc = self.k_cache[:B], self.v_cache[:B]
        bidx = self.bidx[:B, None]
        kc[bidx, :, p] = k
        vc[bidx, :, p] = v
        # [B, kv, C * group, hd]: query rows (t, g) of one KV head
        qg = q.view(B, C, m.kv_heads, m.group, m.head_dim).permute(0, 2, 1, 3, 4).reshape(B, m.kv_heads, C * m.group,
                                                                                          m.head_dim)
        if L == C and (m.sliding_window is None or C <= m.sliding_window):
            # every start is 0 (the first chunk of a prompt): causal over the chunk, SDPA's flash kernel
            q4 = q.transpose(1, 2)  # [B, heads, C, hd]
            attn = F.scaled_dot_product_attention(q4, kc[:, :, :C], vc[:, :, :C], is_causal=True, enable_gqa=True)
            attn = attn.transpose(1, 2).reshape(B, C, self.q_size)
            h = x + self._reduce(F.linear(attn, self.w_o))
            return self._mlp(h)
        prow = p.repeat_interleave(m.group, dim=1)  # [B, C * group]
        mask = self._mask(self.rows[None, None, :L], prow[:, :, None])[:, None]  # [B, 1, C * group, L]
        attn = F.scaled_dot_product_attention(qg, kc[:, :, :L], vc[:, :, :L], attn_mask=mask)
        attn = attn.view(B, m.kv_heads, C, m.group, m.head_dim).permute(0, 2, 1, 3, 4).reshape(B, C, self.q_size)
        h = x + self._reduce(F.linear(attn, self.w_o))
        return self._mlp(h)
