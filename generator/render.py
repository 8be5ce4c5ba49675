"""Variant -> plan (every compile-time constant, the shared-memory layout) -> rendered CUDA source.

The plan is the single source of truth for the kernel's layout: the template only prints its numbers, the loader
sizes the workspace from it, and the manifest records it.
"""
from __future__ import annotations

import math
from pathlib import Path

import jinja2

from .variants import Variant

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
THREADS = 512          # one block of 16 warps per SM (cooperative grid of num_sms blocks)
NUM_SMS = 132          # H100/H200 SXM: only used to balance the plan; the kernel strides over gridDim
SMEM_LIMIT = 227 * 1024  # sm_90 opt-in maximum of dynamic shared memory per block
GRID_SYNCS = 4
RING_BUDGET = 150 * 1024  # shared memory for the attention K/V ring (leaves room for L1)
DTYPE_BYTES = {"bf16": 2, "fp16": 2}


class PlanError(ValueError):
    """The variant cannot be generated (e.g. over the shared-memory budget); one line."""


def _align(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def plan_gemv(n: int, k: int, batch: int) -> dict:
    """Warps per task NWG and k-tiles in flight per warp U for one projection (tasks are 16-row tiles)."""
    ktiles = k // 16
    # about four k-tiles per warp per task at least; short rows get small groups, so more tasks run at once
    nwg = max(1, min(16, _pow2_floor(ktiles // 4)))
    groups = NUM_SMS * (THREADS // 32 // nwg)
    tasks = n // 16
    u = max(1, min(8, math.ceil(ktiles / nwg)))  # 16-byte weight loads in flight per lane (registers)
    balance = tasks / (math.ceil(tasks / groups) * groups)
    return {"NWG": nwg, "U": u, "tasks": tasks, "balance": round(balance, 3)}


def plan(v: Variant) -> dict:
    m = v.model
    if v.mode != "decode":
        raise PlanError(f"{v.name}: mode '{v.mode}' has no template yet (decode only)")
    esize = DTYPE_BYTES[m.dtype]
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    qkv = plan_gemv(q_dim + 2 * kv_dim, m.hidden, v.batch)
    o = plan_gemv(m.hidden, q_dim, v.batch)
    gu = plan_gemv(2 * m.intermediate, m.hidden, v.batch)
    down = plan_gemv(m.hidden, m.intermediate, v.batch)

    # attention: ATT_WARPS warps each walk 16-key tiles through a private ring of ATT_STAGES tiles of K and V in
    # shared memory (rows padded by 16 bytes); a task covers ATT_C rows (whole tiles for every warp), sized so a
    # full cache is one round of tasks: each task pays fixed latencies (queries, the combine), so fewer, longer win
    nw = THREADS // 32
    tile = 16 * (m.head_dim + 8) * esize * 2            # one 16-key tile of K and V
    att_stages = 2
    att_warps = max(1, min(nw, RING_BUDGET // (att_stages * tile)))
    step = 16 * att_warps
    pairs = v.batch * m.kv_heads
    att_c = max(step, math.ceil(v.seq_len / max(1, NUM_SMS // pairs) / step) * step)
    nsplit = math.ceil(v.seq_len / att_c)

    red_bytes = 2 * nw * 16 * v.batch * 4       # per warp: a 16 x batch tile, double-buffered
    red_bytes = max(red_bytes, nw * 2 * v.batch * 4)  # the norm's scratch shares the region
    xs_ld = m.hidden + 8                          # padded rows: conflict-free B-fragment loads
    smem = {"SMEM_XS": 0, "SMEM_RED": _align(v.batch * xs_ld * esize)}
    gemv_bytes = smem["SMEM_RED"] + red_bytes
    smem["SMEM_QS"] = 0
    smem["SMEM_PT"] = _align((m.group + 1) * m.head_dim * 4)
    smem["SMEM_WST"] = smem["SMEM_PT"] + _align(nw * math.ceil(m.group / 8) * 8 * 24 * esize)
    ring = att_warps * att_stages * tile
    smem["SMEM_FLAG"] = smem["SMEM_WST"] + _align(max(ring, att_warps * m.group * (m.head_dim + 2) * 4))
    att_bytes = smem["SMEM_FLAG"] + 16
    smem_bytes = max(gemv_bytes, att_bytes)
    if smem_bytes > SMEM_LIMIT:
        stage = "norm+projection" if gemv_bytes >= att_bytes else "attention"
        raise PlanError(f"{v.name}: needs {smem_bytes} B of shared memory per block ({stage} stage), over the "
                        f"sm_90 limit of {SMEM_LIMIT} B (227 KB); lower batch or hidden size")

    consts = {
        "HIDDEN": m.hidden, "HEADS": m.heads, "KV_HEADS": m.kv_heads, "HEAD_DIM": m.head_dim,
        "INTER": m.intermediate, "BATCH": v.batch, "SEQ_LEN": v.seq_len, "THREADS": THREADS,
        "GROUP": m.group, "Q_DIM": q_dim, "KV_DIM": kv_dim, "QKV_DIM": q_dim + 2 * kv_dim,
        "XS_LD": xs_ld, "ATT_C": att_c, "ATT_WARPS": att_warps, "ATT_STAGES": att_stages, "ATT_NSPLIT": nsplit, **smem,
    }
    for prefix, g in (("QKV", qkv), ("O", o), ("GU", gu), ("DOWN", down)):
        consts.update({f"{prefix}_NWG": g["NWG"], f"{prefix}_U": g["U"]})
    return {
        "consts": consts,
        "gemv": {"qkv": qkv, "o": o, "gate_up": gu, "down": down},
        "threads": THREADS,
        "smem_bytes": smem_bytes,
        "grid_syncs": GRID_SYNCS,
        "workspace_floats": {
            "qkv": v.batch * (q_dim + 2 * kv_dim),
            "part": v.batch * m.heads * nsplit * (m.head_dim + 2),
            "h": v.batch * m.hidden,
        },
        "workspace_elems": {"attn": v.batch * q_dim, "act": v.batch * m.intermediate},
        "counters": v.batch * m.kv_heads,
    }


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def render(v: Variant, p: dict | None = None) -> str:
    p = p or plan(v)
    m = v.model
    return _env().get_template("layer.cu.j2").render(
        name=v.name, consts=p["consts"], grid_syncs=p["grid_syncs"],
        norm_eps=f"{m.norm_eps!r}f", score_scale=f"{math.log2(math.e) / math.sqrt(m.head_dim)!r}f",
        norm=m.norm, activation=m.activation, qkv_bias=m.qkv_bias, qk_norm=m.qk_norm, dtype=m.dtype)
