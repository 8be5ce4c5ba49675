"""Decode: one new token for each of `batch` sequences, every stage of the layer in one cooperative launch.

norm + qkv_proj | attention (qk_norm, RoPE, KV append, flash-decoding) | o_proj + residual | norm + gate_up |
down_proj + residual   ("|" = grid-wide barrier)
"""
from __future__ import annotations

import math

from ..plan import THREADS, Mode, Step, align, check_smem, plan_gemv
from ..targets import DTYPES, Arch
from ..variants import Variant

STEPS = (
    Step("qkv_proj", "qkv_proj(x, ln1_w, ln1_b, w_qkv, b_qkv, ws_qkv, smem)"),
    Step("attention", "attention(pos, ws_qkv, q_norm_w, k_norm_w, inv_freq, k_cache, v_cache, ws_part, ws_count, "
                      "ws_attn, smem)"),
    Step("o_proj", "o_proj(ws_attn, w_o, x, ws_h, smem)"),
    Step("gate_up", "gate_up(ws_h, ln2_w, ln2_b, w_gu, ws_act, ws_status, smem)"),
    Step("down_proj", "down_proj(ws_act, w_down, ws_h, out, ws_status, smem)", then="none"),
)


def plan(v: Variant, arch: Arch) -> dict:
    """Every constexpr of the decode kernel for variant `v` on `arch`, the shared-memory layout and the GEMV
    tiling. Raises PlanError when the block's shared memory would exceed the architecture's limit."""
    m = v.model
    esize = DTYPES[m.dtype].bytes
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    sms = arch.sms
    gemv = {"qkv": plan_gemv(q_dim + 2 * kv_dim, m.hidden, sms), "o": plan_gemv(m.hidden, q_dim, sms),
            "gate_up": plan_gemv(2 * m.intermediate, m.hidden, sms), "down": plan_gemv(m.hidden, m.intermediate, sms)}

    # attention: ATT_WARPS warps each walk 16-key tiles through a private ring of ATT_STAGES tiles of K and V in
    # shared memory (rows padded by 16 bytes); a task covers ATT_C rows (whole tiles for every warp), sized so a
    # full cache is one round of tasks: each task pays fixed latencies (queries, the combine), so fewer, longer win.
    # The ring takes two thirds of the block's shared memory at most (150 KB on sm_90), the rest stays L1.
    nw = THREADS // 32
    tile = 16 * (m.head_dim + 8) * esize * 2            # one 16-key tile of K and V
    att_stages = 2
    ring_budget = arch.smem_per_block * 2 // 3
    att_warps = max(1, min(nw, ring_budget // (att_stages * tile)))
    step = 16 * att_warps
    pairs = v.batch * m.kv_heads
    att_c = max(step, math.ceil(v.seq_len / max(1, sms // pairs) / step) * step)
    nsplit = math.ceil(v.seq_len / att_c)

    red_bytes = 2 * nw * 16 * v.batch * 4       # per warp: a 16 x batch tile, double-buffered
    red_bytes = max(red_bytes, nw * 2 * v.batch * 4)  # the norm's scratch shares the region
    xs_ld = m.hidden + 8                          # padded rows: conflict-free B-fragment loads
    smem = {"SMEM_XS": 0, "SMEM_RED": align(v.batch * xs_ld * esize)}
    gemv_bytes = smem["SMEM_RED"] + red_bytes
    smem["SMEM_QS"] = 0
    smem["SMEM_PT"] = align((m.group + 1) * m.head_dim * 4)
    smem["SMEM_WST"] = smem["SMEM_PT"] + align(nw * math.ceil(m.group / 8) * 8 * 24 * esize)
    ring = att_warps * att_stages * tile
    smem["SMEM_FLAG"] = smem["SMEM_WST"] + align(max(ring, att_warps * m.group * (m.head_dim + 2) * 4))
    att_bytes = smem["SMEM_FLAG"] + 16
    smem_bytes = check_smem(v.name, arch, {
        "norm+projection": (gemv_bytes, "the normalised input rows take batch x hidden x 2 B: lower batch"),
        "attention": (att_bytes, "the GQA group's query heads and warp states take (heads/kv_heads) x head_dim x "
                                 "4 B per warp: fewer query heads per KV head or a smaller head_dim"),
    })

    consts = {
        "HIDDEN": m.hidden, "HEADS": m.heads, "KV_HEADS": m.kv_heads, "HEAD_DIM": m.head_dim,
        "INTER": m.intermediate, "BATCH": v.batch, "SEQ_LEN": v.seq_len, "THREADS": THREADS,
        "GROUP": m.group, "Q_DIM": q_dim, "KV_DIM": kv_dim, "QKV_DIM": q_dim + 2 * kv_dim,
        "XS_LD": xs_ld, "ATT_C": att_c, "ATT_WARPS": att_warps, "ATT_STAGES": att_stages, "ATT_NSPLIT": nsplit, **smem,
    }
    for prefix, key in (("QKV", "qkv"), ("O", "o"), ("GU", "gate_up"), ("DOWN", "down")):
        consts.update({f"{prefix}_NWG": gemv[key]["NWG"], f"{prefix}_U": gemv[key]["U"]})
    return {"consts": consts, "rows": v.batch, "gemv": gemv, "threads": THREADS, "smem_bytes": smem_bytes}


MODE = Mode("decode", STEPS, plan, __doc__)
