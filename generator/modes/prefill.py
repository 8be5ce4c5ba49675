"""Prefill: a chunk of `seq_len` new tokens for each of `batch` sequences, each starting at its own position, in one
cooperative launch: the decode layer's stages, with GEMMs over the chunk's token rows in place of GEMVs.

norm | qkv_proj | kv_append (q/k norm, RoPE, cache rows) | attention (causal, over cache + chunk) | o_proj +
residual | norm | gate_up | down_proj + residual   ("|" = grid-wide barrier)
"""
from __future__ import annotations

from ..plan import (MAX_SPLIT, MAX_STAGES, MIN_SPLIT_GAIN, Mode, PlanError, Step, check_knob, check_smem,  # noqa: F401
                    gemm_group, gemm_split_cost, gemm_stages, split_k, wgmma_tile)
from ..targets import DTYPES, Arch
from ..variants import Variant

STEPS = (
    Step("norm", "norm(x, ln1_w, ln1_b, ws_xn)"),
    Step("qkv_proj", "qkv_proj(ws_xn, w_qkv, w_tmaps, b_qkv, ws_qkv, ws_split, ws_count, smem)"),
    Step("kv_append", "kv_append(pos, ws_qkv, q_norm_w, k_norm_w, inv_freq, k_cache, v_cache, cache_len, ws_q, smem)"),
    Step("attention", "attention(pos, ws_q, k_cache, v_cache, cache_len, ws_attn, smem)"),
    Step("o_proj", "o_proj(ws_attn, w_o, w_tmaps, x, ws_h, ws_split, ws_count, smem)"),
    Step("norm", "norm(ws_h, ln2_w, ln2_b, ws_xn)"),
    Step("gate_up", "gate_up(ws_xn, w_gu, w_tmaps, ws_act, ws_status, ws_split, ws_count, smem)"),
    Step("down_proj", "down_proj(ws_act, w_down, w_tmaps, ws_h, out, ws_status, ws_split, ws_count, smem)",
         then="none"),
)

# 12 warps: up to 168 registers a thread (16 warps cap it at 128, where head_dim-128 attention spills: its output
# accumulators alone take 64)
THREADS = 384


# the knobs a plan override (generator.tune) may set: each projection's split-K factor and tiles computed whole
# before the split ones (split_k), the GEMM raster's group, the ring's depth, and whether the attention is inlined
# (0: a call)
PROJECTIONS = (("QKV", "qkv"), ("O", "o"), ("GU", "gate_up"), ("DOWN", "down"))
KNOBS = tuple(f"{p}_{k}" for p, _ in PROJECTIONS for k in ("KSPLIT", "FULL")) + ("GEMM_GM", "GEMM_STAGES",
                                                                                  "ATT_INLINE")
def _check_overrides(name: str, ov: dict, chunks: dict) -> dict:
    """The overrides as ints, or PlanError naming the first bad knob (unknown, not an int, out of range);
    `chunks` {knob: K chunks of that projection}."""
    out = {}
    for k, val in ov.items():
        check_knob(name, k, val, KNOBS)
        hi = chunks.get(k, 1 if k == "ATT_INLINE" else MAX_STAGES if k == "GEMM_STAGES" else 64)
        lo = 0 if k.endswith("_FULL") or k == "ATT_INLINE" else 3 if k == "GEMM_STAGES" else 1
        if not lo <= val <= hi:
            raise PlanError(f"{name}: plan override {k}={val}: must be in {lo}..{hi}" + (
                " (the projection's K chunks)" if k.endswith("_KSPLIT") else
                " (the projection's tiles, less one)" if k.endswith("_FULL") else ""))
        out[k] = val
    return out


def plan(v: Variant, arch: Arch, overrides: dict | None = None) -> dict:
    """Every constexpr of the prefill kernel for `v` (seq_len = the chunk) on `arch`: the GEMM tiles, ring depth and
    split-K per projection, the attention's shared memory. `overrides` {knob: int} (KNOBS; generator.tune) replace
    the planner's split-K factors, raster group, ring depth and the attention's inlining. Raises PlanError over the
    shared-memory limit or on a bad override (one line)."""
    m = v.model
    esize = DTYPES[m.dtype].bytes
    rows = v.batch * v.seq_len
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    # block tiles (weight rows x tokens) and K chunk: a short chunk streams weights (tall tiles over few tokens, long
    # K chunks: fewer barriers per byte, more bytes in flight); a long one is compute-bound (2 x 4 mma tiles a warp:
    # fewer fragment reads per mma; 4 x 4 spills)
    wgmma = arch.sm.startswith("90")  # sm_90 builds as sm_90a (compile.py): Hopper's warpgroup mma
    if wgmma:
        wm, tm, tn, bk = wgmma_tile(rows, THREADS)  # 192 weight rows a block
    elif rows <= 32:
        wm, tm, tn, bk = 6, 2, 2, 128      # 192 x 32
    elif rows <= 96:
        wm, tm, tn, bk = 4, 2, 2, 128      # 128 x 48
    else:
        wm, tm, tn, bk = 4, 2, 4, 64       # 128 x 96
    bm, bn = wm * tm * 16, (THREADS // 32 // wm) * tn * 8
    assert bn % 16 == 0 and bn <= 128, bn  # templates/wgmma.cuh has a wrapper per multiple of 16 up to 128
    gm = gemm_group(arch.sms, bm, bn)
    projs = {"qkv": (q_dim + 2 * kv_dim, m.hidden), "o": (m.hidden, q_dim), "gate_up": (2 * m.intermediate, m.hidden),
             "down": (m.hidden, m.intermediate)}
    def stage_of(bk):
        return (bm * bk + bn * (bk if wgmma else bk + 8)) * esize
    while bk > 64 and 3 * stage_of(bk) + 1024 > arch.smem_per_block:  # 99 KB parts (sm_86/89/120): shorter chunks
        bk //= 2
    stage_bytes = stage_of(bk)
    stages = gemm_stages(arch.smem_per_block, stage_bytes)
    counts = {key: -(-n // bm) * -(-rows // bn) for key, (n, _) in projs.items()}
    ov = _check_overrides(v.name, dict(overrides or {}),
                          {**{f"{p}_KSPLIT": -(-projs[key][1] // bk) for p, key in PROJECTIONS},
                           **{f"{p}_FULL": counts[key] - 1 for p, key in PROJECTIONS}})
    stages = ov.get("GEMM_STAGES", stages)  # a deeper ring than fits is refused by check_smem below
    gemm_bytes = stages * stage_bytes + 1024  # + the ring's alignment to the swizzle atom
    fit = (arch.smem_per_block - 1024) // stage_bytes  # the deepest ring this GPU's shared memory holds
    att_bytes = (2 * 2 * 64 + (THREADS // 32) * 16) * (m.head_dim + 8) * esize   # K/V ring + each warp's queries
    append_bytes = (THREADS // 32) * m.head_dim * 4
    smem_bytes = check_smem(v.name, arch, {
        "projection GEMM": (gemm_bytes, f"{stages} ring stages of a {bm} x {bk} weight and {bn} x {bk} token chunk: "
                                        + (f"at most {fit} fit (GEMM_STAGES)" if fit >= 3 else
                                           "a GPU with more shared memory per block")),
        "attention": (att_bytes, f"64-key K/V tiles and 16 query rows per warp take "
                                 f"{att_bytes // (m.head_dim + 8)} x (head_dim + 8) B: a smaller head_dim, or "
                                 "this model's decode variants only (no prefill variant: prompts take the unfused "
                                 "path)"),
        "kv_append": (append_bytes, "a smaller head_dim, or this model's decode variants only"),
    })
    gm = ov.get("GEMM_GM", gm)
    split_cost = gemm_split_cost(bm, bn, stage_bytes)
    tiles = {}
    for prefix, name in PROJECTIONS:
        n, k = projs[name]
        count, chunks = counts[name], -(-k // bk)
        full, ks = split_k(count, chunks, arch.sms, split_cost)
        loose = split_k(count, chunks, arch.sms, split_cost, waves_gain=MIN_SPLIT_GAIN)  # a tuner candidate
        # a KSPLIT alone splits every tile; a FULL alone splits the rest over one wave where they fit in one
        # (FULL 0 alone: every tile over one wave, or no split where the tiles are more than the SMs)
        if f"{prefix}_KSPLIT" in ov or f"{prefix}_FULL" in ov:
            full = ov.get(f"{prefix}_FULL", 0)
            ks = ov.get(f"{prefix}_KSPLIT", max(1, min(MAX_SPLIT, chunks // 4, arch.sms // (count - full))))
            if full and ks == 1:  # a FULL that plans nothing (every tile whole) is refused, not dropped
                why = "are not split" if f"{prefix}_KSPLIT" in ov else f"fill more than a wave of {arch.sms} SMs"
                raise PlanError(f"{v.name}: plan override {prefix}_FULL={full}: the {count - full} tiles past it "
                                f"{why}: give {prefix}_KSPLIT > 1 (or FULL 0)")
        if ks == 1:
            full = 0
        tiles[name] = {"N": n, "K": k, "tiles": count, "FULL": full, "KSPLIT": ks, "LOOSE": list(loose)}
    xrows = -(-rows // bn) * bn if wgmma else rows  # rows of the GEMMs' inputs: whole token tiles where tiled
    consts = {
        "HIDDEN": m.hidden, "HEADS": m.heads, "KV_HEADS": m.kv_heads, "HEAD_DIM": m.head_dim,
        "INTER": m.intermediate, "BATCH": v.batch, "CHUNK": v.seq_len, "ROWS": rows,
        # a sliding window, if the model has one: the cache's length is given at run time, so it always applies
        "WINDOW": m.sliding_window or 0, "THREADS": THREADS,
        "GROUP": m.group, "Q_DIM": q_dim, "KV_DIM": kv_dim, "QKV_DIM": q_dim + 2 * kv_dim,
        "ATT_NSPLIT": 0, "ATT_INLINE": ov.get("ATT_INLINE", 0),
        "GEMM_WGMMA": int(wgmma), "GEMM_WM": wm, "GEMM_GM": gm, "GEMM_TM": tm, "GEMM_TN": tn,
        "GEMM_BK": bk, "GEMM_STAGES": stages, "GEMM_XROWS": xrows,
        **{f"{p}_{x}": tiles[k][x] for p, k in PROJECTIONS for x in ("KSPLIT", "FULL")},
    }
    flops = 2 * rows * sum(t["N"] * t["K"] for t in tiles.values())
    # the GEMMs' inputs (normed rows, attention output, act) hold whole token tiles on sm_90a (gemm.cuh gemm_x)
    sizes = {"XN_ROWS": xrows, "XF_ROWS": xrows, "Q_ROWS": rows, "COUNTERS": max(t["tiles"] for t in tiles.values()),
             "SPLIT_FLOATS": max((t["tiles"] - t["FULL"]) * t["KSPLIT"] * bm * bn if t["KSPLIT"] > 1 else 0
                                 for t in tiles.values())}
    return {"consts": consts, "rows": rows, "gemm": {"BM": bm, "BN": bn, "BK": bk, **tiles},
            "threads": THREADS, "smem_bytes": smem_bytes, "gemm_flops": flops, "sizes": sizes,
            "overrides": dict(sorted(ov.items()))}


MODE = Mode("prefill", STEPS, plan, __doc__, headers="stages/prefill")
