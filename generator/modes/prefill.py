"""Prefill: a chunk of `seq_len` new tokens for each of `batch` sequences, each starting at its own position, in one
cooperative launch: the decode layer's stages, with GEMMs over the chunk's token rows in place of GEMVs.

norm | qkv_proj | kv_append (q/k norm, RoPE, cache rows) | attention (causal, over cache + chunk) | o_proj +
residual | norm | gate_up | down_proj + residual   ("|" = grid-wide barrier)
"""
from __future__ import annotations

from ..plan import Mode, Step, check_smem
from ..targets import DTYPES, Arch
from ..variants import Variant

STEPS = (
    Step("norm", "norm(x, ln1_w, ln1_b, ws_xn)"),
    Step("qkv_proj", "qkv_proj(ws_xn, w_qkv, b_qkv, ws_qkv, smem)"),
    Step("kv_append", "kv_append(pos, ws_qkv, q_norm_w, k_norm_w, inv_freq, k_cache, v_cache, cache_len, ws_q, smem)"),
    Step("attention", "attention(pos, ws_q, k_cache, v_cache, cache_len, ws_attn, smem)"),
    Step("o_proj", "o_proj(ws_attn, w_o, x, ws_h, smem)"),
    Step("norm", "norm(ws_h, ln2_w, ln2_b, ws_xn)"),
    Step("gate_up", "gate_up(ws_xn, w_gu, ws_act, ws_status, smem)"),
    Step("down_proj", "down_proj(ws_act, w_down, ws_h, out, ws_status, smem)", then="none"),
)

GEMM_BK, GEMM_STAGES = 64, 3
# 12 warps: up to 168 registers a thread (16 warps cap it at 128, where head_dim-128 attention spills: its output
# accumulators alone take 64)
THREADS = 384


def plan(v: Variant, arch: Arch) -> dict:
    """Every constexpr of the prefill kernel for `v` (seq_len = the chunk) on `arch`. The GEMM's block tile is
    (GEMM_WM * 32 weight rows) x ((16 / GEMM_WM) * 16 tokens): tall tiles (more weight-row tasks to spread over the
    SMs) when the chunk is short, square-ish ones when it is long. Raises PlanError over the shared-memory limit."""
    m = v.model
    esize = DTYPES[m.dtype].bytes
    rows = v.batch * v.seq_len
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    wm = 2 if rows <= 64 else 4                     # 64 x 96 tiles for short chunks, 128 x 48 for long ones
    bm, bn = wm * 32, (THREADS // 32 // wm) * 16
    gemm_bytes = GEMM_STAGES * (bm * GEMM_BK + bn * (GEMM_BK + 8)) * esize
    att_bytes = (2 * 2 * 64 + (THREADS // 32) * 16) * (m.head_dim + 8) * esize   # K/V ring + each warp's queries
    append_bytes = (THREADS // 32) * m.head_dim * 4
    smem_bytes = check_smem(v.name, arch, {
        "projection GEMM": (gemm_bytes, "the GEMM ring is fixed by its tile: report this shape"),
        "attention": (att_bytes, "64-key K/V tiles and 16 query rows per warp take 1024 x (head_dim + 8) B: a "
                                 "smaller head_dim"),
        "kv_append": (append_bytes, "a smaller head_dim"),
    })
    consts = {
        "HIDDEN": m.hidden, "HEADS": m.heads, "KV_HEADS": m.kv_heads, "HEAD_DIM": m.head_dim,
        "INTER": m.intermediate, "BATCH": v.batch, "CHUNK": v.seq_len, "ROWS": rows, "THREADS": THREADS,
        "GROUP": m.group, "Q_DIM": q_dim, "KV_DIM": kv_dim, "QKV_DIM": q_dim + 2 * kv_dim, "XN_ROWS": rows,
        "ATT_NSPLIT": 0, "GEMM_WM": wm, "GEMM_BK": GEMM_BK, "GEMM_STAGES": GEMM_STAGES,
    }
    tiles = {name: {"N": n, "K": k, "tasks": -(-n // bm) * -(-rows // bn)} for name, n, k in (
        ("qkv", q_dim + 2 * kv_dim, m.hidden), ("o", m.hidden, q_dim), ("gate_up", 2 * m.intermediate, m.hidden),
        ("down", m.hidden, m.intermediate))}
    flops = 2 * rows * sum(t["N"] * t["K"] for t in tiles.values())
    return {"consts": consts, "rows": rows, "gemm": {"BM": bm, "BN": bn, "BK": GEMM_BK, **tiles},
            "threads": THREADS, "smem_bytes": smem_bytes, "gemm_flops": flops}


MODE = Mode("prefill", STEPS, plan, __doc__, headers="stages/prefill")
