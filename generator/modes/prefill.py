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
    Step("qkv_proj", "qkv_proj(ws_xn, w_qkv, b_qkv, ws_qkv, ws_split, ws_count, smem)"),
    Step("kv_append", "kv_append(pos, ws_qkv, q_norm_w, k_norm_w, inv_freq, k_cache, v_cache, cache_len, ws_q, smem)"),
    Step("attention", "attention(pos, ws_q, k_cache, v_cache, cache_len, ws_attn, smem)"),
    Step("o_proj", "o_proj(ws_attn, w_o, x, ws_h, ws_split, ws_count, smem)"),
    Step("norm", "norm(ws_h, ln2_w, ln2_b, ws_xn)"),
    Step("gate_up", "gate_up(ws_xn, w_gu, ws_act, ws_status, ws_split, ws_count, smem)"),
    Step("down_proj", "down_proj(ws_act, w_down, ws_h, out, ws_status, ws_split, ws_count, smem)", then="none"),
)

# cp.async ring depth: up to 7 chunks in flight per SM (mma.sync; wgmma: 6, one stage is still being read by the
# mma in flight) keep HBM busy when a chunk is short (few tasks); the shared memory sets it lower for large tiles
MAX_STAGES = 8
# 12 warps: up to 168 registers a thread (16 warps cap it at 128, where head_dim-128 attention spills: its output
# accumulators alone take 64)
THREADS = 384


def split_k(tiles: int, chunks: int, sms: int) -> int:
    """Split-K factor of a GEMM with `tiles` output tiles of `chunks` K chunks each: about one task per SM where the
    tiles are fewer than the SMs, never a second (partial) wave, >= 4 chunks a task. Measured on the H200 (see
    bench/NOTES.md): finer splits (2 chunks a task, or a second wave to even out the tail) were slower: each split
    pays the ring's fill and the partials' combine; on the wgmma GEMM (64-wide chunks) coarser ones (>= 8 chunks a
    task, or 16 x the token tile's width in K) were slower too (1B 64-token chunk 130 -> 146 µs): one SM streams
    weights at a fraction of HBM's rate, so a short chunk wants every SM on its projection."""
    return max(1, min(chunks // 4, sms // tiles))


def plan(v: Variant, arch: Arch) -> dict:
    """Every constexpr of the prefill kernel for `v` (seq_len = the chunk) on `arch`: the GEMM tiles, ring depth and
    split-K per projection, the attention's shared memory. Raises PlanError over the shared-memory limit."""
    m = v.model
    esize = DTYPES[m.dtype].bytes
    rows = v.batch * v.seq_len
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    # block tiles (weight rows x tokens) and K chunk: a short chunk streams weights (tall tiles over few tokens, long
    # K chunks: fewer barriers per byte, more bytes in flight); a long one is compute-bound (2 x 4 mma tiles a warp:
    # fewer fragment reads per mma; 4 x 4 spills)
    wgmma = arch.sm.startswith("90")  # sm_90 builds as sm_90a (compile.py): Hopper's warpgroup mma
    if wgmma:
        # a warpgroup per 64 weight rows (192 a block), the tokens split into equal tiles of <= 128 (multiples of 16)
        token_tiles = -(-rows // 128)
        wm, tm, tn = THREADS // 32, 1, 2 * -(-rows // token_tiles // 16)
        bk = 64  # one swizzled row; the ring's depth keeps the bytes in flight
    elif rows <= 32:
        wm, tm, tn, bk = 6, 2, 2, 128      # 192 x 32
    elif rows <= 96:
        wm, tm, tn, bk = 4, 2, 2, 128      # 128 x 48
    else:
        wm, tm, tn, bk = 4, 2, 4, 64       # 128 x 96
    bm, bn = wm * tm * 16, (THREADS // 32 // wm) * tn * 8
    assert bn % 16 == 0 and bn <= 128, bn  # templates/wgmma.cuh has a wrapper per multiple of 16 up to 128
    # weight tiles per group of the GEMM's raster (gemm.cuh): the SMs' concurrent tiles then read ~gm weight tiles and
    # ~sms / gm token tiles, least bytes at gm = sqrt(sms x token-tile bytes / weight-tile bytes)
    gm = max(1, round((arch.sms * bn / bm) ** 0.5))
    def stage_of(bk):
        return (bm * bk + bn * (bk if wgmma else bk + 8)) * esize
    while bk > 64 and 3 * stage_of(bk) + 1024 > arch.smem_per_block:  # 99 KB parts (sm_86/89/120): shorter chunks
        bk //= 2
    stage_bytes = stage_of(bk)
    stages = max(3, min(MAX_STAGES, arch.smem_per_block * 3 // 4 // stage_bytes))
    gemm_bytes = stages * stage_bytes + 1024  # + the ring's alignment to the swizzle atom
    att_bytes = (2 * 2 * 64 + (THREADS // 32) * 16) * (m.head_dim + 8) * esize   # K/V ring + each warp's queries
    append_bytes = (THREADS // 32) * m.head_dim * 4
    smem_bytes = check_smem(v.name, arch, {
        "projection GEMM": (gemm_bytes, f"3 ring stages of a {bm} x {bk} weight and {bn} x {bk} token chunk: a GPU "
                                        f"with more shared memory per block (sm_80, sm_90, sm_100)"),
        "attention": (att_bytes, f"64-key K/V tiles and 16 query rows per warp take "
                                 f"{att_bytes // (m.head_dim + 8)} x (head_dim + 8) B: a smaller head_dim"),
        "kv_append": (append_bytes, "a smaller head_dim"),
    })
    tiles = {}
    for name, n, k in (("qkv", q_dim + 2 * kv_dim, m.hidden), ("o", m.hidden, q_dim),
                       ("gate_up", 2 * m.intermediate, m.hidden), ("down", m.hidden, m.intermediate)):
        count = -(-n // bm) * -(-rows // bn)
        tiles[name] = {"N": n, "K": k, "tiles": count, "KSPLIT": split_k(count, -(-k // bk), arch.sms)}
    consts = {
        "HIDDEN": m.hidden, "HEADS": m.heads, "KV_HEADS": m.kv_heads, "HEAD_DIM": m.head_dim,
        "INTER": m.intermediate, "BATCH": v.batch, "CHUNK": v.seq_len, "ROWS": rows, "THREADS": THREADS,
        "GROUP": m.group, "Q_DIM": q_dim, "KV_DIM": kv_dim, "QKV_DIM": q_dim + 2 * kv_dim,
        "ATT_NSPLIT": 0, "GEMM_WGMMA": int(wgmma), "GEMM_WM": wm, "GEMM_GM": gm, "GEMM_TM": tm, "GEMM_TN": tn,
        "GEMM_BK": bk, "GEMM_STAGES": stages,
        **{f"{p}_KSPLIT": tiles[k]["KSPLIT"]
           for p, k in (("QKV", "qkv"), ("O", "o"), ("GU", "gate_up"), ("DOWN", "down"))},
    }
    flops = 2 * rows * sum(t["N"] * t["K"] for t in tiles.values())
    sizes = {"XN_ROWS": rows, "COUNTERS": max(t["tiles"] for t in tiles.values()),
             "SPLIT_FLOATS": max(t["tiles"] * t["KSPLIT"] * bm * bn if t["KSPLIT"] > 1 else 0 for t in tiles.values())}
    return {"consts": consts, "rows": rows, "gemm": {"BM": bm, "BN": bn, "BK": bk, **tiles},
            "threads": THREADS, "smem_bytes": smem_bytes, "gemm_flops": flops, "sizes": sizes}


MODE = Mode("prefill", STEPS, plan, __doc__, headers="stages/prefill")
