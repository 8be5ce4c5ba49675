"""The decode layer as vLLM / SGLang build it from FlashInfer (0.7.2): FlashInfer RMSNorm, fused add+RMSNorm,
RoPE from a cos/sin cache, paged KV append (page 16, NHD), BatchDecodeWithPagedKVCacheWrapper in CUDA-graph mode,
silu_and_mul; the GEMMs (merged qkv, o, merged gate/up, down) are cuBLAS through torch.

FlashInfer is optional: it is imported lazily, and `flashinfer_available(m)` says (one line) why it cannot serve a
model. The carried wheel has kernels for bf16, head_dim 64/128 only (RMSNorm, SiLU, no per-head q/k norm).

Positions are fixed at plan time: attention's per-sequence KV lengths (pos + 1) come from
`BatchDecodeWithPagedKVCacheWrapper.plan()`, which runs on the host (it copies the page table into the wrapper's
fixed device buffers and computes the split-KV schedule) and so cannot be captured. The layer plans at construction
for `positions` (default seq_len-1 for every sequence, the benchmark's decode step); `set_positions(pos)` re-plans,
outside any capture. Each call must pass the planned positions as `pos`: RoPE and the KV append read the device
tensor, attention the plan. In CUDA-graph mode FlashInfer keeps the kernels' launch shape across plans for a fixed
batch, so a re-plan between replays is what vLLM does before each replay.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from generator.host import rope_cos_sin
from generator.variants import Model

PAGE_SIZE = 16
HEAD_DIMS = (64, 128)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)


def _import_flashinfer():
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")  # the CuTe-DSL norm kernels need a package not carried
    import flashinfer  # noqa: F401
    import flashinfer.activation
    import flashinfer.decode
    import flashinfer.norm
    import flashinfer.page
    import flashinfer.rope
    return flashinfer


def flashinfer_available(m: Model) -> str | None:
    """None when FlashInferLayer can run model m here, else a one-line reason (shape first, then installation)."""
    why = []
    if m.dtype != "bf16":
        why.append(f"dtype {m.dtype}")
    if m.head_dim not in HEAD_DIMS:
        why.append(f"head_dim {m.head_dim}")
    if m.norm != "rmsnorm":
        why.append(f"norm {m.norm}")
    if m.activation != "silu":
        why.append(f"activation {m.activation}")
    if m.qk_norm:
        why.append("qk_norm")
    if why:
        return f"FlashInfer: not available for this shape ({', '.join(why)})"
    try:
        _import_flashinfer()
    except ImportError as exc:
        if getattr(exc, "name", None) == "flashinfer":
            return "flashinfer not installed"
        return f"flashinfer not importable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - any failure at import is a reason, on one line
        return f"flashinfer not importable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if not torch.cuda.is_available():
        return "FlashInfer: needs a CUDA device"
    return None


def page_table(positions: torch.Tensor, pages_per_seq: int):
    """Host page table for sequences whose new token is at positions [B] (kv length pos + 1), sequence b owning
    pages b*pages_per_seq .. : (indptr int32 [B+1], indices int32 [indptr[-1]], last_page_len int32 [B]), on CPU."""
    kv_len = positions.to("cpu", torch.int64) + 1
    n_pages = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
    indptr = torch.zeros(len(kv_len) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(n_pages, 0)
    indices = torch.cat([b * pages_per_seq + torch.arange(int(n)) for b, n in enumerate(n_pages)])
    last = kv_len - (n_pages - 1) * PAGE_SIZE
    return indptr.int(), indices.int(), last.int()


class FlashInferLayer:
    """Decode step of one layer from FlashInfer kernels; owns a paged KV cache.

    weights: HF-named bf16 tensors. k_pages, v_pages: [batch * pages_per_seq, 16, kv_heads, head_dim] bf16 (NHD),
    sequence b's rows 16*j .. 16*j+15 in page b*pages_per_seq + j; load_kv / dense_kv convert from / to the
    [batch, kv_heads, seq_len, head_dim] layout of the other layers. Call: layer(x [batch, hidden] bf16,
    pos int32 [batch]) -> [batch, hidden] bf16, pos equal to the planned positions (module docstring).
    use_tensor_cores: FlashInfer's prefill-kernel decode; default as SGLang picks for bf16 (query group >= 4; the
    CUDA-core decode kernel has no group 5, 7, ...). share_plan_with: another FlashInferLayer of the same shape
    whose wrapper (one plan per step for all layers, as the engines do) and workspace this layer uses.
    group: a torch.distributed process group for tensor parallel as vLLM runs it: `weights` are the whole
    layer's, this rank keeps its heads and MLP columns (generator.interface.TP_SPLIT), the o_proj and down_proj
    GEMMs write their partial products straight into the all-reduce's buffer (generator.collectives: symmetric
    memory one-shot, else NCCL), rank 0 adding the residual in the down GEMM's epilogue.
    """

    def __init__(self, weights: dict[str, torch.Tensor], m: Model, batch: int, seq_len: int, device="cuda", *,
                 positions: torch.Tensor | None = None, use_tensor_cores: bool | None = None,
                 share_plan_with: FlashInferLayer | None = None, group=None):
        self.tp, self.rank, self._ar = 1, 0, None
        if group is not None and torch.distributed.get_world_size(group) > 1:
            from generator.collectives import AllReduce
            from generator.interface import shard_weights
            from generator.variants import shard_model
            self.tp, self.rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            weights, m = shard_weights(weights, self.tp, self.rank), shard_model(m, self.tp)
            self._ar = AllReduce(group, batch * m.hidden, torch.bfloat16, device)
        reason = flashinfer_available(m)
        if reason:
            raise RuntimeError(reason)
        fi = _import_flashinfer()
        self.fi, self.m, self.batch, self.seq_len = fi, m, batch, seq_len
        W = {k: v.to(device=device, dtype=torch.bfloat16) for k, v in weights.items()}
        self.q_size, self.kv_size = m.heads * m.head_dim, m.kv_heads * m.head_dim
        self.w_qkv = torch.cat([W[f"self_attn.{p}_proj.weight"] for p in "qkv"]).contiguous()
        self.b_qkv = torch.cat([W[f"self_attn.{p}_proj.bias"] for p in "qkv"]) if m.qkv_bias else None
        self.w_o = W["self_attn.o_proj.weight"]
        self.w_gate_up = torch.cat([W["mlp.gate_proj.weight"], W["mlp.up_proj.weight"]]).contiguous()
        self.w_down_t = W["mlp.down_proj.weight"].t()
        self.ln1, self.ln2 = W["input_layernorm.weight"], W["post_attention_layernorm.weight"]
        # vLLM/SGLang layout: fp32 [seq_len, head_dim], cos in the first half, sin in the second
        self.cos_sin_cache = torch.cat(rope_cos_sin(m, torch.arange(seq_len, device=device)), dim=-1).contiguous()
        self.pages_per_seq = -(-seq_len // PAGE_SIZE)
        shape = (batch * self.pages_per_seq, PAGE_SIZE, m.kv_heads, m.head_dim)
        self.k_pages = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v_pages = torch.zeros_like(self.k_pages)
        self.batch_indices = torch.arange(batch, dtype=torch.int32, device=device)
        if share_plan_with is not None:
            s = share_plan_with
            if (s.m, s.batch, s.seq_len) != (m, batch, seq_len):
                raise ValueError("share_plan_with: a layer of another shape")
            self._owner = s._owner
            self.wrapper = s.wrapper
            self.indptr, self.indices, self.last_page_len = s.indptr, s.indices, s.last_page_len
            return
        self._owner = self
        if use_tensor_cores is None:
            use_tensor_cores = m.group >= 4
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(batch * self.pages_per_seq, dtype=torch.int32, device=device)
        self.last_page_len = torch.zeros(batch, dtype=torch.int32, device=device)
        self.wrapper = fi.decode.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len)
        self.set_positions(torch.full((batch,), seq_len - 1, dtype=torch.int32) if positions is None else positions)

    def set_positions(self, positions: torch.Tensor) -> None:
        """Plan attention for new tokens at positions [batch] (kv length pos + 1). Host work and a sync: call it
        before capture / between replays, never inside a capture. Layers sharing the plan see it too."""
        if self._owner is not self:
            return self._owner.set_positions(positions)
        pos = positions.to("cpu", torch.int64)
        if pos.shape != (self.batch,) or int(pos.min()) < 0 or int(pos.max()) >= self.seq_len:
            raise ValueError(f"positions must be [{self.batch}] in [0, {self.seq_len})")
        indptr, indices, last = page_table(pos, self.pages_per_seq)
        m = self.m
        # (a sliding window: its window_left, the keys left of the query's own)
        self.wrapper.plan(indptr, indices, last, m.heads, m.kv_heads, m.head_dim, PAGE_SIZE,
                          pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                          window_left=-1 if m.sliding_window is None else m.sliding_window - 1)
        torch.cuda.current_stream(self.indptr.device).synchronize()  # the plan's copies are non-blocking
        self._positions = pos.int()

    @property
    def positions(self) -> torch.Tensor:
        """The planned positions, int32 [batch] on the CPU."""
        return self._owner._positions

    def load_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Fill the pages from dense caches [batch, kv_heads, seq_len, head_dim] (the other layers' layout)."""
        for pages, dense in ((self.k_pages, k_cache), (self.v_pages, v_cache)):
            view = pages.view(self.batch, self.pages_per_seq * PAGE_SIZE, self.m.kv_heads, self.m.head_dim)
            view[:, :self.seq_len].copy_(dense.transpose(1, 2))

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches as [batch, kv_heads, seq_len, head_dim]."""
        return tuple(p.view(self.batch, -1, self.m.kv_heads, self.m.head_dim)[:, :self.seq_len]
                     .transpose(1, 2).contiguous() for p in (self.k_pages, self.v_pages))

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        fi, m, B = self.fi, self.m, x.shape[0]
        h = fi.norm.rmsnorm(x, self.ln1, m.norm_eps)
        qkv = F.linear(h, self.w_qkv, self.b_qkv)                                  # [B, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)   # strided views of qkv
        fi.rope.apply_rope_with_cos_sin_cache_inplace(pos, q, k, m.head_dim, self.cos_sin_cache, is_neox=True)
        k3, v3 = k.view(B, m.kv_heads, m.head_dim), v.view(B, m.kv_heads, m.head_dim)
        fi.page.append_paged_kv_cache(k3, v3, self.batch_indices, pos, (self.k_pages, self.v_pages),
                                      self.indices, self.indptr, self.last_page_len, kv_layout="NHD")
        attn = self.wrapper.run(q.view(B, m.heads, m.head_dim), (self.k_pages, self.v_pages))  # [B, H, hd]
        if self._ar is not None:
            o = self._reduced_mm(attn.reshape(B, self.q_size), self.w_o.t(), None)
        else:
            o = F.linear(attn.reshape(B, self.q_size), self.w_o)
        residual = x.clone()                            # the caller's x stays as it was (graph replays reuse it)
        fi.norm.fused_add_rmsnorm(o, residual, self.ln2, m.norm_eps)  # residual += o; o = rmsnorm(residual)
        act = fi.activation.silu_and_mul(F.linear(o, self.w_gate_up))             # [B, intermediate]
        # down GEMM with the residual add in cuBLAS's epilogue (the engines defer it to the next layer's
        # fused_add_rmsnorm; this layer's contract returns the full hidden state)
        if self._ar is not None:
            return self._reduced_mm(act, self.w_down_t, residual)
        return torch.addmm(residual, act, self.w_down_t)

    def _reduced_mm(self, a, w_t, residual):
        """Tensor parallel: the sum over ranks of a @ w_t (+ residual, added once by rank 0), the GEMM writing into
        the all-reduce's buffer where it has one."""
        out = torch.empty(a.shape[0], w_t.shape[1], dtype=a.dtype, device=a.device)
        dst = out if self._ar.buffer is None else self._ar.buffer[:out.numel()].view_as(out)
        if residual is not None and self.rank == 0:
            torch.addmm(residual, a, w_t, out=dst)
        else:
            torch.mm(a, w_t, out=dst)
        return self._ar(out)
