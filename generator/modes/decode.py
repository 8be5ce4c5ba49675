"""Decode: one new token for each of `batch` sequences, every stage of the layer in one launch (cooperative unless
COOP 0).

norm + qkv_proj | attention (qk_norm, RoPE, KV append, flash-decoding) | o_proj + residual | norm + gate_up |
down_proj + residual   ("|" = grid-wide barrier). Each norm runs inside its projection's stage, every block
normalising the rows into its own shared memory, except with NORM_GLOBAL (where the rows do not fit, or leave too
little L1): then it is a step of its own, "norm | qkv_proj" and "norm | gate_up".
"""
from __future__ import annotations

import math

from ..plan import (L1_ENOUGH, MAX_SPLIT, THREADS, Mode, PlanError, Step, align, check_knob, check_smem,
                    gemm_group, gemm_split_cost, gemm_stages, gemv_balance_split, gemv_split_k, l1_bytes,
                    open_barriers, plan_gemv, split_k, wgmma_tile)
from ..interface import TIMELINE_ATT, TIMELINE_ATT_PHASES, TIMELINE_SLOTS, on_engine  # noqa: F401  (re-exported)
from ..targets import DTYPES, Arch
from ..variants import Variant, window_at

STEPS = (
    # NORM_GLOBAL: each norm a step of its own, its rows to global memory and a grid barrier; else (NORM_LOCAL) every
    # block normalises the rows into its own shared memory inside the projection's stage: the step is empty
    Step("norm", "norm(x, ln1_w, ln1_b, ws_xn, smem)", flow="NORM_LOCAL",
         pre="const auto qkv_pre = qkv_proj_pre(w_qkv, ln1_w, smem)"),
    Step("qkv_proj", "qkv_proj(x, ln1_w, ln1_b, ws_xn, w_qkv, w_tmaps, b_qkv, ws_qkv, ws_split, ws_count, ws_ready, ws_epoch, "
                     "qkv_pre, smem)",
         flow="QKV_FLOW"),
    Step("attention", "attention(pos, ws_qkv, q_norm_w, k_norm_w, inv_freq, k_cache, v_cache, kv_tmaps, ws_part, "
                      "ws_count, ws_ready, ws_attn, ws_epoch, ws_timeline, smem)",
         flow="ATT_LL"),
    Step("o_proj", "o_proj(ws_attn, w_o, w_tmaps, x, ln2_w, ws_h, ws_hb, ws_xn, ws_hsq, tp_rank, ws_split, ws_count, ws_ready, "
                   "ws_epoch, o_pre, smem)",
         reduce="h", flow="H_LL", pre="const auto o_pre = o_proj_pre(w_o)"),
    # (NORM2_LOCAL: also empty with NORM_GLOBAL and H_STATS, o_proj's epilogue writing the rows and their statistics)
    Step("norm", "norm(norm_src(ws_hb, ws_h), ln2_w, ln2_b, ws_xn, smem, std::bool_constant<!NORM2_LOCAL>{}, "
                 "std::bool_constant<GEMM_PROJ != 0>{})",
         flow="NORM2_LOCAL",
         pre="const auto gu_pre = gate_up_pre(w_gu, ln2_w, smem)"),
    Step("gate_up", "gate_up(ws_h, ws_hb, ws_hsq, ln2_w, ln2_b, ws_xn, w_gu, w_tmaps, w_down, ws_act, ws_status, ws_split, "
                    "ws_count, ws_ready, ws_epoch, gu_pre, smem)",
         flow="DOWN_FLOW"),
    Step("down_proj", "down_proj(ws_act, w_down, w_tmaps, ws_h, out, ws_status, tp_rank, ws_split, ws_count, "
                      "ws_ready, ws_epoch, down_pre, smem)",
         then="none", reduce="out", pre="const auto down_pre = down_proj_pre(w_down)"),
)


# the knobs a plan override (generator.tune) may set: per projection the warps per task NWG, the 16-byte loads
# in flight U and the split-K KSPLIT; the attention's walker warps, cache rows per task (-> ATT_NSPLIT), ring depth
# and how the last split combines (ATT_COMBINE 1: one online pass, one thread's release/acquire; 2: the same release/
# acquire, the splits spread over warps and merged in shared memory; 0: two passes through shared memory after a
# fence by every thread; 3: every split's block combines a slice of the outputs once all splits have counted, one poll
# and one batch of loads after the last partial instead of its whole combine: static split, one GPU, every task in
# one round, refused otherwise; the kernel takes 1's path on a GPU with fewer SMs than planned; 4 (a tuner candidate;
# tuned for Qwen2.5-0.5B b1 KV 4096): 3 with the partials as 64-bit words tagged with the launch's count, polled by
# the combining lanes: no fence, counter or block barrier between the last partial and the combine); X_FRAG:
# attention's output and the MLP's act stored in the tensor cores' B-fragment order for o_proj and down_proj (templates/gemv.cuh x_at); GEMV_PF 1: a projection's next
# round of weight loads issued before this round's reduction and epilogue, 2: every step's loads one step ahead
# (templates/gemv.cuh); QKV_FLOW: per-KV-head counters instead of the grid barrier between qkv_proj and attention
# (2: no counters, qkv's results as 64-bit words carrying the launch's epoch, which attention polls; by default with
# ATT_LL and H_LL under the LL rule, LL_HIDDEN_MAX);
# NORM_FOLD (RMSNorm, bf16): the norms keep the raw rows, qkv_proj and gate_up multiply their B fragments by the gain
# and their sums by each row's 1/rms (no scale pass over the rows in shared memory; templates/stages/norm.cuh), the
# gain kept in shared memory (1) or read from global memory (2); 3: the norm multiplies the raw rows by the gain in its
# sums pass (the gain's copy started before the barrier or launch wait that precedes the norm), the projections scale
# their sums by 1/rms: the gain's first read (HBM) and the scale pass's block barrier off the chain (batch 1);
# DOWN_FLOW: per-chunk counters of act instead of the grid barrier between gate_up and down_proj (a down_proj warp
# waits, before each step's mma, for the gate_up tiles of the act columns that step reads; its weights need nothing;
# 2 (with H_LL, X_FRAG, batch <= 8; by default under the LL rule at batch 1 up to hidden 3072 where the counters
# are not taken): no counters, act written as 32-bit words carrying the launch's epoch, which down_proj's lanes poll
# as o_proj's poll attention's under ATT_LL);
# DOWN_SMEM (an override and a tuner candidate): the block's first down_proj task's weights bulk-copied into shared
# memory from gate_up's start, down_proj reading them there (plan: down_smem); GU_SKIP (an override): down_proj's
# blocks take no gate_up task, so their tiles stream (with DOWN_SMEM: are copied) while the other blocks run gate_up
# (plan: gu_skip);
# <P>_PRE: the projection's first weight step loaded before the barrier that precedes its stage (qkv: before the
# launch's wait for the previous layer, so the launch before must not write the weights; templates/gemv.cuh
# gemv_pre; 2: the rest of the group's first task prefetched into L2 as well); H_STATS (RMSNorm, tp 1, bf16):
# o_proj writes the second norm's input times its gain and each row's sum of squares per tile, so that norm makes no pass (templates/stages/o_proj.cuh); ATT_DYN 1: attention's rows per
# task chosen at run time from the positions (attention_split below; templates/stages/attention.cuh att_schedule),
# 2: stream-K, equal runs of the launch's tiles a block (attention_stream; att_stream_schedule);
# RED_DB: the projections' partial sums double-buffered in shared memory (0: one buffer and a group barrier before
# each round's writes; templates/gemv.cuh); NORM_CLUSTER: the kernel in clusters of that many blocks, the norms' rows
# copied once a cluster (templates/stages/norm.cuh norm_rows_multicast); NORM_GLOBAL: each norm a step of its own
# writing the rows to global memory in fragment order, a grid barrier, the projection reading them from there;
# ATT_TMA (sm_90+): attention's K/V tiles by TMA tensor copies in the 128-byte swizzle, counted on an mbarrier a ring
# stage, instead of cp.async by every lane; ATT_LL (one GPU, X_FRAG, no NORM_GLOBAL, batch <= 8; by default under
# the LL rule, LL_HIDDEN_MAX): no grid barrier
# between attention and o_proj, attention's output written as 32-bit words carrying the launch's epoch, which
# o_proj's lanes poll (NCCL's LL protocol; templates/gemv.cuh ll_store; 2: the same, ~256 ns between polls);
# H_LL (by default under the LL rule, LL_HIDDEN_MAX; one GPU, bf16 with HB_COPY, the second norm in each block (no
# NORM_GLOBAL, H_STATS or NORM_CLUSTER), batch <= 8, o_proj and gate_up unsplit): no grid barrier between o_proj and gate_up,
# o_proj's T copy of h written as such words, which every block's norm polls (2: ~256 ns between polls); DOWN_FLOW's
# counters then count on across launches (no reset); TIMELINE (one GPU, a measuring build): every block's thread 0
# stamps the global timer at its entry, after the launch's wait, at each step's end and after each grid barrier,
# then at attention's phases (ws_timeline; bench/timeline.py); COOP 0: no cooperative launch (below)
assert 2 + 2 * len(STEPS) <= TIMELINE_ATT and TIMELINE_ATT + len(TIMELINE_ATT_PHASES) <= TIMELINE_SLOTS, \
    "TIMELINE: a block's row holds entry, wait, each step's end and barrier, then attention's phases"
PROJECTIONS = (("QKV", "qkv"), ("O", "o"), ("GU", "gate_up"), ("DOWN", "down"))
GEMM_PROJECTIONS = ("QKV", "O", "GU", "DOWN")  # GEMM_PROJ: the projections that can run on the GEMM engine
GEMM_OPTIONAL = ("QKV", "O", "DOWN")  # ... of which these each by a knob of their own (<P>_GEMM 0: a GEMV; gate_up
# always; interface.on_engine reads a plan's)


# GEMM_PROJ: the knobs it cannot run beside (on: refused with it asked for, and it is off by default), and why (QKV_FLOW
# 1: where qkv_proj and o_proj are asked to stay GEMVs, plan)
GEMM_OFF = {"QKV_FLOW": "the GEMM's tiles are not counted or tagged; 1 where QKV_GEMM 0 and O_GEMM 0 are asked",
            "DOWN_FLOW": "the GEMM's tiles are not counted",
            "ATT_LL": "o_proj's GEMM does not poll words", "H_LL": "gate_up's GEMM does not poll words",
            "DOWN_SMEM": "the GEMM's ring holds gate_up's shared memory", "GU_SKIP": "gate_up's GEMM takes every block"}
KNOBS = (tuple(f"{p}_{k}" for p, _ in PROJECTIONS for k in ("NWG", "U", "KSPLIT", "PRE", "TM", "BS"))
         + ("ATT_WARPS", "ATT_C", "ATT_STAGES", "ATT_COMBINE", "X_FRAG", "GEMV_PF", "QKV_FLOW", "NORM_FOLD",
            "H_STATS", "DOWN_FLOW", "ATT_DYN", "RED_DB", "NORM_CLUSTER", "NORM_GLOBAL", "ATT_TMA", "ATT_PIECE_TILES",
            "ATT_LL", "H_LL", "TIMELINE", "COOP", "DOWN_SMEM", "GU_SKIP", "GEMM_PROJ", "QKV_QFIRST", "ATT_ROT",
            "ATT_KVLAST", "GEMM_TOKEN_TILE")
         + tuple(f"{p}_GSPLIT" for p in GEMM_PROJECTIONS) + tuple(f"{p}_GEMM" for p in GEMM_OPTIONAL))
NWG_CHOICES = tuple(n for n in (1, 2, 4, 8, 16) if (THREADS // 32) % n == 0)
U_RANGE = (1, 8)
ATT_STAGES_RANGE = (2, 3)
ATT_WARPS_MAX = 8  # the planner's most attention walker warps (an override may take up to all 16)


# <P>_BS: a projection's warp group in batch slices (templates/gemv.cuh): each slice's warps split K and hold the
# accumulators and B fragments of at most BS_NTILE_MAX n-tiles (32 sequences), the weights kept in L1 for the other
# slices. At batch 64 the 8 n-tiles' left no registers for a step's weight loads in flight (ptxas issued them one at
# a time between the mma). Measured on an H100 (bench/NOTES.md session 58), against BS 1, full context / mix:
# Llama-3.2-1B b64 -3.7 / -5.4 %, b48 -1.1 / -1.7 %, Llama-3-8B b64 -7.7 / -8.9 %; b32 +1.7 / +1.7 % (so from
# BS_BATCH_MIN); with the weights read past L1 by each slice it lost (+3.4 % at b64, +6 % at b48). By default where
# the projection allows it: its X complete at its start (no LL words, counters or staged weights) and its weights
# loaded in the stage (<P>_PRE 0)
BS_BATCH_MIN = 41
BS_NTILE_MAX = 4


def batch_slices(name: str, consts: dict, ov: dict) -> None:
    """Sets <P>_BS in `consts` (the plan's constants so far) for each projection: the override, refused in one line
    (PlanError) where the projection cannot take it, else the default (BS_NTILE_MAX from BS_BATCH_MIN)."""
    ntile = -(-consts["BATCH"] // 8)
    for prefix, _ in PROJECTIONS:
        want = ov.get(f"{prefix}_BS", 1)
        needs = [(consts[f"{prefix}_NWG"] % want == 0 and (want - 1) * -(-ntile // want) < ntile,
                  f"{prefix}_NWG a multiple of it ({consts[f'{prefix}_NWG']}) and an n-tile of 8 sequences for every "
                  f"slice ({ntile} at batch {consts['BATCH']})"),
                 (not consts[f"{prefix}_PRE"], f"{prefix}_PRE 0 (its first weights loaded before the stage)")]
        if prefix == "O":
            needs.append((not consts["ATT_LL"], "ATT_LL 0 (o_proj polls attention's words)"))
        if prefix == "DOWN":
            needs += [(not consts["DOWN_FLOW"], "DOWN_FLOW 0 (down_proj waits on act's counters or words)"),
                      (not consts["DOWN_SMEM"], "DOWN_SMEM 0")]
        if f"{prefix}_BS" in ov:
            if ov[f"{prefix}_BS"] > 1:
                _needs(name, f"{prefix}_BS", ov[f"{prefix}_BS"], needs)
            consts[f"{prefix}_BS"] = ov[f"{prefix}_BS"]
        else:
            bs = 1 << max(0, math.ceil(ntile / BS_NTILE_MAX) - 1).bit_length() \
                if consts["BATCH"] >= BS_BATCH_MIN else 1  # (a power of two)
            while bs > 1 and (bs - 1) * -(-ntile // bs) >= ntile:  # (no slice without an n-tile: batch 65-72's 4
                bs //= 2                                                 # slices of 3 would leave one empty)
            consts[f"{prefix}_BS"] = bs if all(ok for ok, _ in needs[1:]) and consts[f"{prefix}_NWG"] % bs == 0 else 1


def _needs(name: str, knob: str, val: int, needs: list[tuple[bool, str]]) -> None:
    """Refuses the override knob=val in one line naming each requirement (ok, what) that the plan fails, not the
    whole list. Raises PlanError."""
    failed = [what for ok, what in needs if not ok]
    if failed:
        raise PlanError(f"{name}: plan override {knob}={val} needs {'; '.join(failed)}")


def _check_overrides(name: str, ov: dict) -> dict:
    """The overrides as ints, or PlanError naming the first bad knob (unknown, not an int, out of range)."""
    out = {}
    for k, val in ov.items():
        check_knob(name, k, val, KNOBS)
        if k.endswith("_NWG") and val not in NWG_CHOICES:
            raise PlanError(f"{name}: plan override {k}={val}: must be one of {NWG_CHOICES} (divides "
                            f"{THREADS // 32} warps)")
        if k.endswith("_TM") and val not in (1, 2, 4):
            raise PlanError(f"{name}: plan override {k}={val}: must be 1, 2 or 4")
        if k.endswith("_BS") and val not in (1, 2, 4, 8):
            raise PlanError(f"{name}: plan override {k}={val}: must be 1, 2, 4 or 8")
        if k.endswith("_KSPLIT") and not 1 <= val <= 8:
            raise PlanError(f"{name}: plan override {k}={val}: must be in 1..8")
        if k.endswith("_U") and not U_RANGE[0] <= val <= U_RANGE[1]:
            raise PlanError(f"{name}: plan override {k}={val}: must be in {U_RANGE[0]}..{U_RANGE[1]}")
        if k == "ATT_WARPS" and not 1 <= val <= THREADS // 32:
            raise PlanError(f"{name}: plan override {k}={val}: must be in 1..{THREADS // 32}")
        if k == "ATT_STAGES" and not ATT_STAGES_RANGE[0] <= val <= ATT_STAGES_RANGE[1]:
            raise PlanError(f"{name}: plan override {k}={val}: must be in {ATT_STAGES_RANGE[0]}..{ATT_STAGES_RANGE[1]}")
        if k == "GEMV_PF" and val not in (0, 1, 2):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0, 1 or 2")
        on_off = ("X_FRAG", "TIMELINE", "H_STATS", "RED_DB", "NORM_GLOBAL", "ATT_TMA", "COOP", "DOWN_SMEM",
                  "GU_SKIP", *(f"{p}_GEMM" for p in GEMM_OPTIONAL), "QKV_QFIRST", "ATT_ROT", "ATT_KVLAST")
        if k == "NORM_FOLD" and val not in (0, 1, 2, 3):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0, 1, 2 or 3")
        if k == "ATT_DYN" and val not in (0, 1, 2):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0, 1 or 2")
        if k in ("ATT_LL", "QKV_FLOW", "H_LL", "DOWN_FLOW") and val not in (0, 1, 2):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0, 1 or 2")
        if k == "ATT_COMBINE" and val not in (0, 1, 2, 3, 4):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0, 1, 2, 3 or 4")
        if k.endswith("_PRE") and val not in (0, 1, 2):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0, 1 or 2 (2: the rest of the first task "
                            "prefetched into L2 as well)")
        if k in on_off and val not in (0, 1):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0 or 1")
        if k == "NORM_CLUSTER" and val not in (1, 2):
            raise PlanError(f"{name}: plan override {k}={val}: must be 1 or 2" + (
                " (clusters of 4: 30 resident on the H200, 120 of its 132 SMs)" if val == 4 else ""))
        if k == "GEMM_PROJ" and val not in (0, 1):
            raise PlanError(f"{name}: plan override {k}={val}: must be 0 or 1")
        if k == "GEMM_TOKEN_TILE" and (val % 16 or not 16 <= val <= 128):
            raise PlanError(f"{name}: plan override {k}={val}: must be a multiple of 16 in 16..128 (the GEMM engine's "
                            "token tile rows; wgmma's n)")
        if k.endswith("_GSPLIT") and not 1 <= val <= MAX_SPLIT:
            raise PlanError(f"{name}: plan override {k}={val}: must be in 1..{MAX_SPLIT}")
        if k == "ATT_PIECE_TILES" and not 0 <= val <= 1024:
            raise PlanError(f"{name}: plan override {k}={val}: must be in 0..1024 (16-row tiles)")
        if k == "ATT_C" and val < 16:
            raise PlanError(f"{name}: plan override {k}={val}: must be a positive multiple of 16 x ATT_WARPS")
        out[k] = val
    return out


ACT_STRIDE = 32  # DOWN_FLOW: words between two chunks' counters (a 128-byte line each)
# QKV_FLOW 2 with a split qkv: the most 64-bit words of a head a lane of attention holds and polls (head_dim / 32 a
# split); 4 x 7 spilled 176 B at head_dim 128, 4 x 4 compiled clean (bench/NOTES.md session 52)
QKV_WORDS_MAX = 16


def qkv_lane_words(head_dim: int, ksplit: int = 1) -> int:
    """QKV_FLOW 2: the 64-bit words of one head a lane of attention holds and polls (templates/stages/attention.cuh
    QW): head_dim / 32 (rounded up) a split of qkv."""
    return -(-head_dim // 32) * ksplit


DOWN_FLOW_MIN_ROUNDS = 5  # DOWN_FLOW by default from this many rounds of gate_up's tasks (see plan)
FOLD_RANK = {3: 3, 1: 2, 2: 1, 0: 0}  # NORM_FOLD settings in the planner's order where L1_ENOUGH is left (plan)
ATT_DYN_SPLITS = 16   # ATT_DYN: the partials' room, at most this many splits a sequence (or the planned ones)
ATT_DYN_MIN_SEQ = 8192  # ATT_DYN by default from this KV length (see plan)
STREAM_MIN_PAIRS = 64  # ATT_DYN 2 instead of 1 by default from this many (sequence, KV head) pairs (see plan)
STREAM_IDLE_SMS = 0.05  # ... or where ATT_DYN 1's one round at full context leaves this share of the SMs idle (plan)
STREAM_IDLE_MIN_PAIRS = 28  # ... from this many pairs (the fewest measured; at 16 stream-K lost: many pieces a pair)
# GEMM_PROJ by default from this batch (see plan). Measured on an H100 (bench/NOTES.md session 62), the engine against
# the GEMVs, full context / serving mix: batch 64 Llama-3-8B -4.4 / -5.6 %, Qwen2.5-7B-like -4.1 / -4.6, Llama-3.2-3B-like
# -0.3 / -1.0, Llama-3.2-1B -1.3 / -2.4 (gate_up whole); batch 96-128 -16 ... -33 % (Llama-3.2-1B, 3B-like, 8B);
# batch 48 +1.6 % (8B), 0.0 (Mistral-Nemo-like), +7.5 % (1B); batch 32 +3.5 % (8B), +8.7 % (1B); gate_up alone on it
# (qkv_proj and o_proj GEMVs, session 66): batch 48 +1.5 … +7.6 %, batch 32 +2.8 … +9.1 % (1B, 8B, Nemo-like)
GEMM_BATCH_MIN = 64
# ... at a hidden size where it won: batch 64, H100 (session 62), hidden 1536 (Qwen2.5-1.5B-like) -2.8 / -2.9 %, 2048-4096
# above; 896 (Qwen2.5-0.5B-like) +18 / +22 %, 960 (SmolLM-360M-like) +10 / +14 % (qkv's and o_proj's 4-6 tiles)
GEMM_HIDDEN_MIN = 1536
# GEMM_PROJ's split-K: a projection with at least this share of the SMs' worth of 256-row tiles (and at most one a
# block) runs them whole, its blocks streaming faster than split_k's busiest-SM model credits (measured, H100: the
# Llama-3.2-1B b64 gate_up's 64 tiles whole -2.2 / -2.8 % a layer against 2 splits, Llama-3-8B's 112 whole -4.3 / -5.0
# % against 2); fewer take split_k's rule (qkv's and o_proj's 8-24 tiles: 8 splits +0.6 / +1.7 % faster than 4)
GEMM_UNSPLIT_SHARE = 0.45
# GEMM_PROJ: qkv_proj and o_proj on the engine (QKV_GEMM, O_GEMM) where their split gives at least this share of the
# SMs a task (whole tiles + split tiles x split-K; or whole tiles from GEMM_UNSPLIT_SHARE of the SMs), else GEMVs
# (at batch <= GEMM_BN_MAX), which run on every SM: K runs out before the split fills the grid (small hidden sizes;
# split_k keeps >= 4 K chunks a task). Timed on an H100 (bench/NOTES.md session 65), against all three on the
# engine: Llama-3.2-1B b64 (qkv 96 tasks, o_proj 64) -2.4 / -2.6 % a layer as GEMVs, Qwen2.5-1.5B-like b64 (48, 36)
# -4.5 / -5.8 %; o_proj a GEMV at Llama-3.2-3B-like b64 (120 tasks) +1.7 / +2.3 %, at Llama-3-8B b64 (128) +0.9 /
# +1.2 %. (A rule on K chunks a task, 6, was predicted and missed: the 3B's o_proj has 4 a task and wins on the
# engine.) The tuner flips both either way
GEMM_TASKS_MIN_SHARE = 0.8
# DOWN_GEMM (down_proj on the engine, act tiled): past one token tile (GEMM_BN_MAX) the down_proj GEMV runs the batch
# in slices and falls away (H100, session 71: Qwen2.5-7B-like b96 down_proj 109.7 us for 136 MB, 42 % of the copy
# bandwidth, the layer 0.82x FlashInfer's; 1B-shape b128 26.9 us for 33.5 MB), level with the engine at batch 64
# (session 61). Built in session 71 without a GPU run: an override and a tuner candidate (verified per candidate)
# until its GPU test and A/B have run (bench/queue.sh downgemm), then the default past GEMM_BN_MAX
DOWN_GEMM_BY_DEFAULT = False
GEMM_BN_MAX = 64  # GEMM_PROJ's token tiles: at most this many rows (64 x 64 accumulators a warpgroup: 32 registers a
# thread of the 128 that 16 warps leave; 128 rows take 64, yet one tile of 96 or 128 compiled without spills in
# session 71: GEMM_TOKEN_TILE, not yet timed)
NORM_GLOBAL_MIN_BATCH = 16  # NORM_GLOBAL by default from this batch (one GPU of 256 KB L1 + shared memory; see plan)


def attended(lengths: list[int], consts: dict) -> list[int]:
    """The rows each sequence's attention walks: its `lengths` (position + 1), at most WINDOW where the plan has a
    sliding window (templates/stages/attention.cuh att_rows)."""
    w = consts.get("WINDOW", 0)
    return [min(n, w) for n in lengths] if w else list(lengths)


def attention_split(lengths: list[int], consts: dict, grid: int) -> int:
    """The cache rows per attention task C that ATT_DYN's kernel picks for one launch (templates/stages/attention.cuh
    att_schedule does the same integer arithmetic on the device): `lengths` are each sequence's rows (position + 1;
    0 for an empty or refused position), `consts` the plan's constants, `grid` the launch's blocks. A sequence of L
    rows makes ceil(L / C) tasks per KV head (one when empty); C is the smallest multiple of 16 x ATT_WARPS (at most
    ATT_NSPLIT splits a sequence) with every task in one round (at most `grid`), else the one that gives each
    sequence one task; where two first-round candidates are more than 31 steps apart the pick can be a few steps
    above that smallest (kernel and model alike). Candidates: C for 1 .. smax splits of the longest sequence (32
    spread over them), then 32 between the smallest that fits and the next. At full context every declared variant's
    pick is the planner's ATT_C (tests/test_tune.py). Why one round: a second costs every block a task's fixed latency
    again (queries, partial, counter: ~3 us), which lost to the static split at KV 4096 on the H200 (bench/NOTES.md
    session 15)."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)
    lengths = attended(lengths, consts)
    step, nsplit, kvh = 16 * consts["ATT_WARPS"], consts["ATT_NSPLIT"], consts["KV_HEADS"]
    lmax = max(lengths)
    klo = max(1, cdiv(max(1, cdiv(lmax, nsplit)), step))
    khi = max(klo, cdiv(lmax, step))
    smax = max(1, min(nsplit, cdiv(lmax, step)))

    def clamp(s: int) -> int:
        return min(khi, max(klo, cdiv(cdiv(lmax, s), step)))

    def fits(k: int) -> bool:
        return kvh * sum(cdiv(n, k * step) if n > 0 else 1 for n in lengths) <= grid
    k1 = [clamp(1 + lane * (smax - 1) // 31) for lane in range(32)]
    ok = [lane for lane in range(32) if fits(k1[lane])]
    if not ok:
        return khi * step
    j = max(ok)
    kb, ka = k1[j], k1[min(31, j + 1)]
    if ka >= kb - 1:
        return kb * step
    return next(k for k in (ka + lane * (kb - ka) // 31 for lane in range(32)) if fits(k)) * step


def attention_stream(lengths: list[int], consts: dict, grid: int) -> tuple[int, int]:
    """ATT_DYN 2 (stream-K attention): (R, W), the units each block takes and the launch's units in all, as
    templates/stages/attention.cuh att_stream_schedule computes them on the device. `lengths` are each sequence's
    rows (position + 1; 0 for an empty or refused position: one tile, its NaN output), `consts` the plan's
    constants, `grid` the launch's blocks. Every (sequence, KV head) pair spans ATT_PIECE_TILES units (a piece's
    fixed cost, in 16-row tiles) then its tiles, pairs end to end; block i takes units [i R, (i + 1) R) and walks
    the tiles among them: the pieces of a few pairs in turn, fewer where the pairs are short. R is at least
    ceil((Umax - 1) / (ATT_NSPLIT - 1)), so a pair of Umax tiles spans at most ATT_NSPLIT blocks (the partials'
    room). Stream-K: Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix
    Multiplication on the GPU" (PPoPP 2023)."""
    tiles = [max(1, -(-n // 16)) for n in attended(lengths, consts)]
    w = consts["KV_HEADS"] * sum(u + consts["ATT_PIECE_TILES"] for u in tiles)
    return max(-(-w // grid), -(-(max(tiles) - 1) // (consts["ATT_NSPLIT"] - 1))), w


def attention_pieces(lengths: list[int], consts: dict, grid: int) -> list[list[tuple[int, ...]]]:
    """ATT_DYN 2: each block's pieces as (sequence, KV head, first row, end row, split, nsplit), in the order the
    block walks them: the device loop of templates/stages/attention.cuh step by step (the sequence found from the
    units before each, a run that ends inside a pair's fixed cost walks nothing of it; the end row is whole tiles,
    the kernel stops at the position), for tests and the planner's model."""
    r, w = attention_stream(lengths, consts, grid)
    lengths = attended(lengths, consts)
    kvh, pt = consts["KV_HEADS"], consts["ATT_PIECE_TILES"]
    first = [0]
    for n in lengths:
        first.append(first[-1] + max(1, -(-n // 16)) + pt)
    out = []
    for i in range(grid):
        su, su_end, got = i * r, min(w, (i + 1) * r), []
        while su < su_end:
            b = max(j for j in range(len(lengths)) if kvh * first[j] <= su)
            s0, span = kvh * first[b], first[b + 1] - first[b]
            h = (su - s0) // span
            f = s0 + h * span + pt
            ub = span - pt
            end = min(f + ub, su_end)
            if end <= f:
                break
            got.append((b, h, (max(su, f) - f) * 16, (end - f) * 16, i - f // r, (f + ub - 1) // r - f // r + 1))
            su = end
        out.append(got)
    return out


# ATT_DYN 2 by the planner's model of a block's attention time in bytes of cache walked: its rows times the row's
# bytes plus ATT_TASK_BYTES for each task or piece (a task's fixed latency, ~3 us: queries, the walk's first loads,
# the partial and its counter, bench/NOTES.md session 15, at one SM's walk rate, ~32 GB/s: 65 us for 2 MB, session
# 19's batch-24 profile); taken where the static split takes two rounds or more and the full-context model gains at
# least STREAM_MIN_GAIN. Measured on the H200 (bench/NOTES.md session 22), against the static split in a stack of
# layers at full context: two rounds, +1.2 ... +13.9 % on eight shapes (Llama-3.2-1B shape b20 KV 4096 +13 %,
# modelled 0.54; b20 KV 1024 +1.5 %, 0.34; Llama-3-8B shape b20 KV 1024 +1.2 %, 0.45); one round with idle SMs (96
# pairs or fewer) -4.5 ... +7 % across runs, the static split's own time moving by up to 25 % from run to run there
# (the tuner tries it: generator/tune.py); the 1B b28 (two rounds, modelled 0.12: not taken) -0.5 %
ATT_TASK_BYTES = 96 << 10
# ATT_DYN 2's run layout charges each piece PIECE_RUN_TILES 16-row tiles (ATT_PIECE_TILES; the choice of ATT_DYN 2
# above keeps its bytes model): a piece's fixed chain (the ring drained and refilled, queries, the warp states, the
# partial and its counter, the last piece's combine) costs more than ATT_TASK_BYTES of walk, and at a serving mix of
# positions a run over many short pairs held too many pieces. Measured on the H200 (bench/NOTES.md session 32), 48
# tiles against the bytes model's 12 (head_dim 128) or 24 (64), at spread positions: +0.7 ... +8.8 % a layer on seven
# shapes (Llama-3.1-8B-like b12 KV 8192 +4.9, Mistral-Nemo-like b18 +6.6, Mistral-7B-like b20 +8.8, 1B-like b20 +4.4,
# b12 KV 8192 +3.2, hidden-3072 b9 +1.5, Qwen2.5-7B-like b16 KV 32768 +0.7), at full context -0.1 ... +1.4 %; 96
# tiles about the same, 192 worse (-3.4 % on a 1B-like shape). The constant is 0 in plans without ATT_DYN 2 (unused)
PIECE_RUN_TILES = 48
STREAM_MIN_GAIN = 0.25
STREAM_TRY_GAIN = 0.10  # the tuner times ATT_DYN 2 from this modelled gain (generator/tune.py candidates)
# ATT_DYN 2 by default also where the static split is one round that leaves SMs idle and the model gains this much,
# at KV >= 2048 on sm_90, where measured (bench/NOTES.md session 28, head_dim 128, 68-80 pairs at KV 2048-4096,
# modelled 0.53-0.77: +0.2 ... +16.7 % a layer on seven real-model shapes, -0.5 % on one, at full context; session
# 32, with PIECE_RUN_TILES, five shapes of 72-96 pairs at head_dim 64/96/128 modelled 0.27-0.58: -2.1 ... +2.5 % at
# full context, +3.1 ... +9.3 % at a serving mix of positions; at 0.13 (head_dim 64, 96 pairs) -2.9 / -1.0 %; where
# it lowers the threshold, ATT_DYN 2 also turns O_PRE's batch 2-8 default off, as measured). Below ATT_DYN_MIN_SEQ.
STREAM_IDLE_GAIN = 0.25


def static_rounds(consts: dict, grid: int) -> int:
    """Rounds of the static split's tasks over `grid` blocks at full context (ATT_C rows a task)."""
    rows = attended([consts["SEQ_LEN"]], consts)[0]
    return -(-consts["BATCH"] * consts["KV_HEADS"] * -(-rows // consts["ATT_C"]) // grid)


def stream_room(seq_len: int) -> int:
    """ATT_DYN 2: the partials' room, pieces a (sequence, KV head) may span (ATT_NSPLIT): ATT_DYN_SPLITS, fewer where
    the cache has fewer tiles, at least 2."""
    return max(2, min(-(-seq_len // 16), ATT_DYN_SPLITS))


def piece_tiles(head_dim: int, esize: int) -> int:
    """ATT_DYN 2: a piece's fixed cost in 16-row tiles of K and V (ATT_TASK_BYTES over a tile's bytes)."""
    return -(-ATT_TASK_BYTES // (16 * 2 * head_dim * esize))


def stream_gain(consts: dict, grid: int, esize: int) -> float:
    """The modelled gain of ATT_DYN 2 over the static split ATT_C at full context (every sequence at SEQ_LEN rows):
    static time / stream-K time - 1 (bytes model above, its runs laid out with ATT_TASK_BYTES a piece whatever
    ATT_PIECE_TILES the kernel's runs take: STREAM_MIN_GAIN and STREAM_IDLE_GAIN were fitted to measurements in this
    model, the latter with the kernel's 48-tile charge; 0.25 = a quarter faster)."""
    row = 2 * consts["HEAD_DIM"] * esize
    seq, att_c = attended([consts["SEQ_LEN"]], consts)[0], consts["ATT_C"]
    static = static_rounds(consts, grid) * (att_c * row + ATT_TASK_BYTES)
    model = {**consts, "ATT_PIECE_TILES": piece_tiles(consts["HEAD_DIM"], esize)}
    stream = max(sum((e - s) * row + ATT_TASK_BYTES for _, _, s, e, _, _ in blk)
                 for blk in attention_pieces([seq] * consts["BATCH"], model, grid))
    return static / stream - 1


def combine_default(outputs: int, nsplit: int) -> int:
    """ATT_COMBINE by default: 2 (split-parallel) where the one online pass takes >= 3 dependent batches of loads
    (ceil(group x head_dim / THREADS) rounds of ceil(nsplit / 8) batches: its loop keeps 8 splits in flight), else
    1. Measured on the H200 (bench/NOTES.md session 19): 32 splits 1.022-1.075x (Qwen2.5-0.5B b1, Qwen2.5-7B b1,
    a hidden-1536 group-6 b2), 16 splits with 2 rounds 1.009x (Qwen2.5-7B b1), 16 splits in one round 0.998-1.002x
    (Llama-3.2-1B, Llama-3-8B b1), 8 splits 0.972-0.985x (Qwen2.5-0.5B b8, Llama-3.2-1B b1 KV 1024). The planner
    takes it on one GPU without ATT_DYN only: with ATT_DYN (Qwen2.5-7B b4 KV 32768) the whole suite measured the layer
    5 % slower, its attention stage unchanged (the GEMV stages slower: register allocation), and tensor parallel's
    combine has not run on 2 GPUs with it."""
    return 2 if -(-outputs // THREADS) * -(-nsplit // 8) >= 3 else 1


# GEMV_PF 1 and O_PRE 1 by default at batch 1 on one sm_90 GPU, bf16 RMSNorm, where (hidden, KV heads) is one of
# these and the MLP is 3-4x the hidden size. Measured on the H200, both against neither (speedup), at row 191 (a served
# model's short context) / full context (bench/NOTES.md sessions 32-33): hidden 2048 with 8 KV heads (Llama-3.2-1B KV
# 1024 / 4096, Qwen3-1.7B, InternLM2-1.8B-like) +2.4 ... +6.1 %, with 32 (SmolLM2-1.7B) +6.1 / +5.1 %; hidden 4096 with
# 8 KV heads (Llama-3-8B KV 1024 / 4096, Mistral-7B-like KV 8192, Qwen3-8B-like, Granite-3-8B-like) +0.6 ... +2.0 %,
# ten of ten faster. Not taken where it lost or tied: hidden 2048 with 4 KV heads (TinyLlama -1.8 / -2.1 %) or 2
# (Qwen2.5-3B +0.3 / 0.0), hidden 4096 with 4 (Yi-6B +0.2 / -1.65) or 32 (Llama-2-7B -0.1 / -1.2), hidden 3584
# (Qwen2.5-7B -2.3 / -1.6), 896 (Qwen2.5-0.5B), 3072 and 5120 (-1.0 ... +0.8); mixed at 1440 / 2560 (head_dim 80; a
# Qwen3-4B-like shape at 2560 spills 16 B with both). What decides it is not established: the losers differ in KV
# heads and also in the MLP's width (intermediate / hidden 2.7 or 5.3, every winner's 3.0-4.0), so both are required
# (B1_PRE_MLP). Either knob alone gains less (GEMV_PF alone spilled 48 B at hidden 3072); the tuner tries each where off
B1_PRE_SHAPES = ((2048, 8), (2048, 32), (4096, 8))  # (hidden 4096: where the LL hand-offs are off, LL_HIDDEN_MAX)
B1_PRE_MLP = (3.0, 4.0)  # intermediate / hidden of every measured winner
# the LL hand-offs by default (plan: ll_rule) up to this hidden size at batch 1 (batch 2-5: below). Hidden 896-3072,
# batch 1: measured on an H100 (bench/NOTES.md session 48), the rule's plan against the same plan with the barriers
# and counters, full context / row 191: faster in all 20 timings of 10 shapes, by 1.1 ... 6.2 % (the A/B's noise +-0.6 %); repeated on the H200
# (session 50): the barriers +2.9 ... +10.2 % in all 20. Hidden 3584 (session 50, H200): Qwen2.5-7B b1 -1.6 / -1.2 %
# with the three. At hidden 4096 beside B1_PRE's O_PRE 1 and GEMV_PF 1 they lost (Llama-3-8B b1 +0.2 / +0.1 % on the
# H100: at 128 registers the held words spill 72 / 144 B); in their place they win (session 59, H100, full context /
# row 191: Llama-3-8B b1 -1.9 / -1.3 %, held-out Yi-9B-like -1.6 / -1.6, Llama-2-7B-like -2.0 / -1.5; no spill), so
# at batch 1 past LL_HIDDEN_MAX up to LL_HIDDEN_MAX_ANY they come without B1_PRE. At batch 2-5 they win (session
# 50, H200, full context / serving mix: Llama-3.2-1B b4 -3.2 / -2.9 %,
# Qwen2.5-7B b4 -2.0 / -2.2, held-out multi-head b5 -3.3 / -3.1), but beside O_PRE 1 (o_proj's first step held through
# attention) 8 of 11 further batch 2-5 shapes spilled 4-104 B; so from batch 2 they come with O_PRE 0 (plan: O_PRE),
# measured against the default with O_PRE 1 (session 51, H100, bench/queue.sh llb): faster or level on all 9 such
# shapes, none spilling (TinyLlama-like b2 -4.5 / -4.6 %, SmolLM-1.7B-like MHA b3 -2.5 / -2.4, held-out hidden 2560 b3
# -2.4 / -2.0 and 1536 b2 -2.1 / -2.1, Llama-3.2-3B-like b2 -1.5 / -1.1, hidden 960 b2 -0.9 / -0.7; hidden 576 b3,
# head_dim 96 b5 and Llama-3.2-3B-like b5 level, -0.4 ... +0.2), while O_PRE 0 alone lost +0.2 ... +2.0 %. Not with
# q/k norms (Qwen3-1.7B b4 -2.2 / -2.5 % but spills 8 / 4 B). From batch 2 up to hidden 4096 (LL_HIDDEN_MAX_ANY;
# session 51, H100, none spilling): Llama-3-8B b4 KV 1024 -1.3 / -0.8 %, KV 4096 -1.1 / -1.2, held-out group-12 b2
# -1.9 / -2.0. Batch 6-8 is mixed (session 51: Qwen2.5-0.5B b8 +2.1 / +3.2 %, hidden 960 b8 +6.7 / +7.0, hidden 1792
# b8 -0.7 / +8.3; Llama-3-8B b8 -1.6 / -1.0, Llama-3.2-1B b8 -0.7 / -0.3, TinyLlama-like b6 -2.6 / -0.6)
# QKV_QFIRST + ATT_KVLAST by default at batch 1 (kvlast_rule) where qkv's q tasks fit in one round of its warp groups
# and all its tasks in 1 .. KVLAST_ROUNDS rounds. Measured on an H100 (bench/NOTES.md session 68) against the plans
# build gave (ATT_ROT on), full context / row 191 / row 1023: Qwen3-1.7B b1 (256 tasks on 132 groups) -1.7 / -2.7 /
# -1.3 %, Qwen3-0.6B-like b1 (256) -1.2 / -1.9 / -0.5, Llama-3.2-1B b1 KV 4096 (192 with its tuned QKV_NWG 16) -0.3 /
# -0.9 / -0.1; outside it: Llama-3-8B b1 (384 tasks, q alone 256) +0.9 / -0.2 / -0.6, Qwen2.5-0.5B b1 (72: one round)
# +1.2 / +2.2 / +2.0, Llama-3.2-1B b1 KV 1024 (192 on 264 groups) -0.4 / +0.3 / -0.6; ATT_KVLAST alone (k and v
# first) at Llama-3.2-1B KV 4096 -0.5 / +1.0 / +0.8
KVLAST_ROUNDS = 2
# ... and qkv in one 16-warp group a block (QKV_NWG 16, where the planner's 8-warp groups hold it in one round) at
# batch 1 where that makes a second round of tasks at least this share of the SMs, so the pair above applies.
# Measured on an H100 (session 68) against NWG 8, full / 191 / 1023, with the pair (without it): Llama-3.2-1B b1
# (192 tasks: 60 in round two) KV 1024 -3.4 / -3.1 / -3.4 % (-2.6 / -2.5 / -2.3), KV 32768 -1.0 / -3.4 / -2.6 (-0.7 /
# -2.5 / -2.9), and the H200 tuner took NWG 16 at KV 4096 (session 55); with 28 tasks in round two (160: a TinyLlama-like
# b1 KV 4096 -0.4 / +1.0 / +0.2, held-out yarn hidden 2048 b1 KV 8192 -0.4 / -0.5 / -0.9) not taken
NWG16_SECOND_MIN = 0.4
LL_HIDDEN_MAX = 3584  # at batch 1 beside B1_PRE up to this hidden size; past it, up to LL_HIDDEN_MAX_ANY, without
LL_HIDDEN_MAX_ANY = 4096  # the hand-offs at any batch of the rule up to this hidden size (was LL_HIDDEN_MAX_BATCH)
LL_HEAD_DIMS_BATCH = (64, 96, 128)  # from batch 2 (head_dim 80 with 32 KV heads at b3 spills 44 B with them: not timed)
LL_BATCH_MAX = 5
DOWN_WORDS_HIDDEN_MAX = 3072  # DOWN_FLOW 2's default under the LL rule: batch 1 up to this hidden size (plan: words)
# GU_SKIP by default (plan: gu_skip) at batch 1 where down_proj's tiles hold at most this share of the SMs and are at
# least this many k-tiles long. Measured on the H100 (bench/NOTES.md session 57), the layer at full context / row 191:
# Qwen2.5-0.5B (56 of 132 SMs, 304 k-tiles) -5.3 / -4.5 % at KV 4096, -5.5 / -5.5 % at 1024, -5.5 / -6.1 % at 32768;
# a SmolLM-360M-like shape (60, 160) -1.0 / +0.7 %; hidden 1440 (90, 352) +14 / +19 % (gate_up on 42 blocks)
SKIP_SHARE_MAX = 0.45
SKIP_MIN_DOWN_KTILES = 256


def _fmt(ov: dict) -> str:
    return " ".join(f"{k}={val}" for k, val in sorted(ov.items()))


def plan(v: Variant, arch: Arch, overrides: dict | None = None, *, skip_rule_off: bool = False,
         gemm_rule_off: bool = False, kvlast_rule_off: bool = False) -> dict:
    """Every constexpr of the decode kernel for variant `v` on `arch`, the shared-memory layout and the GEMV
    tiling. `overrides` {knob: int} (KNOBS; generator.tune) replace the planner's choice of those knobs before the
    constants that depend on them (ATT_NSPLIT, the shared-memory offsets) are derived. Raises PlanError when the
    block's shared memory would exceed the architecture's limit or an override is bad (naming it)."""
    ov = _check_overrides(v.name, dict(overrides or {}))
    m = v.shard  # one GPU's part of the layer (the layer itself unless tp > 1)
    esize = DTYPES[m.dtype].bytes
    q_dim, kv_dim = m.heads * m.head_dim, m.kv_heads * m.head_dim
    sms = arch.sms
    shapes = {"qkv": (q_dim + 2 * kv_dim, m.hidden), "o": (m.hidden, q_dim), "gate_up": (2 * m.intermediate, m.hidden),
              "down": (m.hidden, m.intermediate)}
    gemv = {}
    if ov.get("ATT_COMBINE", 0) >= 2 and v.tp > 1:
        raise PlanError(f"{v.name}: plan override ATT_COMBINE={ov['ATT_COMBINE']}: not with tensor parallel (the "
                        "split-parallel combines have not run on 2 GPUs)")
    if ov.get("QKV_FLOW") and v.tp > 1:
        raise PlanError(f"{v.name}: plan override QKV_FLOW={ov['QKV_FLOW']}: tensor parallel keeps the qkv -> attention "
                        "grid barrier (the counters have not run on 2 GPUs)")
    if ov.get("QKV_FLOW") == 1 and ov.get("QKV_KSPLIT", 1) > 1:
        raise PlanError(f"{v.name}: plan overrides QKV_FLOW=1 and QKV_KSPLIT={ov['QKV_KSPLIT']}: the counters need qkv "
                        "unsplit (its split-K counters would share ws_count with attention's; QKV_FLOW 2 takes a split)")
    if ov.get("DOWN_FLOW") and v.tp > 1:
        raise PlanError(f"{v.name}: plan override DOWN_FLOW={ov['DOWN_FLOW']}: tensor parallel keeps the gate_up -> "
                        "down_proj grid barrier (the counters have not run on 2 GPUs)")
    if ov.get("DOWN_FLOW") and (ks := [k for k in ("GU_KSPLIT", "DOWN_KSPLIT") if ov.get(k, 1) > 1]):
        raise PlanError(f"{v.name}: plan overrides DOWN_FLOW={ov['DOWN_FLOW']} and {ks[0]}={ov[ks[0]]}: the flow "
                        "needs gate_up and down_proj unsplit (a tile's last split writes it; down_proj's splits would share ws_count)")
    if v.tp > 1 and (pre := [k for k in ov if k.endswith("_PRE") and ov[k]]):
        raise PlanError(f"{v.name}: plan override {pre[0]}=1: not with tensor parallel (weights loaded before the "
                        "wait for the all-reduced input have not run on 2 GPUs)")
    norm_fold = ov.get("NORM_FOLD", 0)  # explicit here; the default is decided with the shared memory, below
    if norm_fold and (m.norm != "rmsnorm" or m.dtype != "bf16"):
        raise PlanError(f"{v.name}: plan override NORM_FOLD={norm_fold}: needs RMSNorm in bf16 (this layer: {m.norm}, "
                        f"{m.dtype}; LayerNorm's mean and fp16's range need the scaled rows)")
    if norm_fold and v.tp > 1:
        raise PlanError(f"{v.name}: plan override NORM_FOLD={norm_fold}: not with tensor parallel (its fp32-source norm has not "
                        "run folded on 2 GPUs)")
    def tm_ok(prefix: str, key: str, tm: int) -> bool:  # TM tiles a task: unsplit, the tiles (qkv: its q tiles,
        return tm == 1 or (ov.get(f"{prefix}_KSPLIT", 1) == 1 and (shapes[key][0] // 16) % tm == 0  # QKV_FLOW's
                           and (prefix != "QKV" or (q_dim // 16) % tm == 0))  # first) in whole groups

    # GU_SKIP's default (SKIP_SHARE_MAX), decided before gate_up is planned for the blocks it leaves: batch 1 on one
    # sm_90 GPU under DOWN_FLOW 2's hidden bound; where the plan then lacks its requirements (overrides took them),
    # planned again without it (skip_rule_off)
    skip_rule = (v.batch == 1 and v.tp == 1 and arch.number == 90 and m.hidden <= DOWN_WORDS_HIDDEN_MAX
                 and m.hidden // 16 <= SKIP_SHARE_MAX * sms and m.intermediate // 16 >= SKIP_MIN_DOWN_KTILES
                 and not skip_rule_off)

    def plan_projection(prefix: str, key: str, tm: int) -> None:  # gemv[key], TM tiles a task
        n, k = shapes[key]
        ks = ov.get(f"{prefix}_KSPLIT", 1)
        if not tm_ok(prefix, key, tm):
            q = f" (and its {q_dim // 16} q tiles)" if prefix == "QKV" else ""
            raise PlanError(f"{v.name}: plan override {prefix}_TM={tm}: needs {prefix}_KSPLIT 1 and {key}'s "
                            f"{n // 16} tiles{q} in whole groups of {tm}")
        # GEMV_PF 2 holds two steps' loads in registers: steps of at most 4 (the same registers as 8 unpipelined)
        # tensor parallel keeps 16-warp groups for long rows: fewest_rounds has not been measured on 2 GPUs
        # full steps (plan_gemv) on one GPU and sm_90, where measured; tensor parallel plans as before
        # (GU_SKIP: gate_up's tasks go round the blocks down_proj's leave it)
        blocks = sms - m.hidden // 16 if key == "gate_up" and ov.get("GU_SKIP", skip_rule) and m.hidden // 16 < sms \
            else sms
        g = gemv[key] = plan_gemv(n, k, blocks, ks, umax=4 if ov.get("GEMV_PF") == 2 else 8, rebalance=v.tp == 1,
                                  tm=tm, full_steps=v.tp == 1 and arch.number == 90)
        g["split_k"] = gemv_split_k(n, k, sms)  # what the tuner tries
        g["split_balance"] = gemv_balance_split(n, k, sms)
        g.update({k: ov[f"{prefix}_{k}"] for k in ("NWG", "U") if f"{prefix}_{k}" in ov})
        set_balance(g, blocks)

    def set_balance(g: dict, blocks: int) -> None:  # g's tasks over its warp groups' rounds (a share of the last)
        groups = blocks * (THREADS // 32 // g["NWG"])
        g["balance"] = round(g["tasks"] / (math.ceil(g["tasks"] / groups) * groups), 3)

    def qkv_two_rounds(nwg: int, second_min: float) -> bool:  # kvlast_rule's shape test at qkv's groups of nwg warps
        # (batch 1, one sm_90 GPU, qkv unsplit): q's tasks in the first round of groups, the k and v tasks' second
        # round more than empty and at least second_min of the groups, nothing past KVLAST_ROUNDS
        g, groups = gemv["qkv"], sms * (THREADS // 32 // nwg)
        second = g["tasks"] / groups - 1
        return (v.batch == 1 and v.tp == 1 and arch.number == 90 and not kvlast_rule_off and g["KSPLIT"] == 1
                and q_dim // 16 // g["TM"] <= groups and 0 < second and second_min <= second
                and g["tasks"] <= KVLAST_ROUNDS * groups)

    for prefix, key in PROJECTIONS:
        n, k = shapes[key]
        ks = ov.get(f"{prefix}_KSPLIT", 1)
        if (k // 16) % ks:
            raise PlanError(f"{v.name}: plan override {prefix}_KSPLIT={ks}: must divide the {k // 16} k-tiles of "
                            f"{key}")
        plan_projection(prefix, key, ov.get(f"{prefix}_TM", 1))
    # qkv in one 16-warp group a block at batch 1 (one sm_90 GPU) where that puts its q tasks in the first round and its
    # k and v tasks in a second at least NWG16_SECOND_MIN full, which kvlast_rule below then takes
    if "QKV_NWG" not in ov and gemv["qkv"]["NWG"] < THREADS // 32 and qkv_two_rounds(THREADS // 32, NWG16_SECOND_MIN):
        gemv["qkv"]["NWG"] = THREADS // 32
        set_balance(gemv["qkv"], sms)

    # attention: ATT_WARPS warps each walk 16-key tiles through a private ring of ATT_STAGES tiles of K and V in
    # shared memory (rows padded by 16 bytes; ATT_TMA: swizzled boxes, below); a task covers ATT_C rows (whole tiles for every warp), sized so a
    # full cache is one round of tasks: each task pays fixed latencies (queries, the combine), so fewer, longer win.
    # The ring takes two thirds of the block's shared memory at most (150 KB on sm_90), the rest stays L1. At most
    # ATT_WARPS_MAX walkers: with 16 (head_dim 64 fits them) a split is >= 256 rows, one tile a warp, and a short
    # cache gets few tasks; 8 measured 0.2-5.4 % faster on 12 of 13 head_dim 64/80/96 shapes (bench/NOTES.md
    # session 11; Qwen2.5-0.5B b1 KV 4096 +1.9 %: its tuned plan keeps 16)
    nw = THREADS // 32
    # ATT_TMA (sm_90+): the ring's tiles by TMA tensor copies, whose 128-byte swizzle keeps ldmatrix conflict-free
    # without padding, a tile of K (or V) one 16-row x 64-dim box per 64 dims. Measured on the H200 (bench/NOTES.md
    # session 24), against cp.async in a stack: +0.5 ... +2.6 % a layer at batch 16-32 (Llama-3-8B b32 +2.6 %, a
    # Qwen2.5-7B-like b24 +1.9 %), -1.4 ... -2.4 % at batch 1 (its entry: mbarriers, fences, one block barrier more),
    # -1.6 ... +0.6 % at batch 8: the default from batch 16 on one GPU (sm_90, where measured; an override may take
    # it on any sm_90+), for head_dim 64 and 128 (a row of whole boxes: at 80 or 96 the second box's zeros take ring
    # bytes, 23-45 % more a tile; not measured there)
    sm = arch.number  # "90a": planned as sm_90
    att_tma = ov.get("ATT_TMA", int(sm == 90 and v.batch >= 16 and v.tp == 1 and m.head_dim % 64 == 0))
    if att_tma and sm < 90:
        raise PlanError(f"{v.name}: plan override ATT_TMA=1: TMA tensor copies need sm_90 or later (this build: "
                        f"sm_{arch.sm})")
    if att_tma and v.tp > 1:
        raise PlanError(f"{v.name}: plan override ATT_TMA=1: not with tensor parallel (the cache maps of a GPU's "
                        "shard have not run on 2 GPUs)")
    half_dims = -(-m.head_dim // 64)                    # ATT_TMA: 64-dim boxes a row
    tile = (2 * half_dims * 16 * 64 * esize if att_tma
            else 16 * (m.head_dim + 8) * esize * 2)     # one 16-key tile of K and V
    att_stages = ov.get("ATT_STAGES", 2)
    ring_budget = arch.smem_per_block * 2 // 3
    att_warps = ov.get("ATT_WARPS", max(1, min(nw, ATT_WARPS_MAX, ring_budget // (att_stages * tile))))
    step = 16 * att_warps
    pairs = v.batch * m.kv_heads
    # the rows a query attends to at most: the cache, or a shorter sliding window (the kernel walks the last WINDOW
    # rows up to the position: its splits and schedules plan for those)
    window = window_at(m.sliding_window, v.seq_len) or 0
    kv = window or v.seq_len
    att_c = max(step, math.ceil(kv / max(1, sms // pairs) / step) * step)
    if "ATT_C" in ov:
        att_c = ov["ATT_C"]
        if att_c % step:
            raise PlanError(f"{v.name}: plan override ATT_C={att_c}: must be a multiple of 16 x ATT_WARPS = {step} "
                            "(whole tiles for every walker warp)")
        if att_c > max(step, align(kv, step)):
            raise PlanError(f"{v.name}: plan override ATT_C={att_c}: over the attended rows {kv} rounded up "
                            f"to {step}")
    nsplit = math.ceil(kv / att_c)
    # ATT_DYN (batch 2-32, one GPU): the rows per task follow the positions, so sequences at mixed positions spread
    # their actual rows over the blocks (attention_split); at full context the same split as ATT_C. The partials
    # then have room for more splits: one round's worth per KV head, at most ATT_DYN_SPLITS or the planned ones
    # (finer splits lost on a 2-KV-head shape: their combine). By default from a KV length of ATT_DYN_MIN_SEQ (no ATT_C
    # override): measured on the H200 (bench/NOTES.md session 15), the schedule costs 1-2.5 us a launch, and at KV 4096
    # it won 2-6 % at random positions but lost 2-4 % at full context; at KV 32768, batch 8, 11-23 % faster at spread
    # positions.
    # (overrides that plan the static split: ATT_C's rows a task, ATT_ROT's and ATT_KVLAST's task placement)
    static_asked = "ATT_C" in ov or any(ov.get(k) for k in ("ATT_ROT", "ATT_KVLAST"))
    att_dyn = ov.get("ATT_DYN", int(2 <= v.batch <= 32 and v.tp == 1 and ATT_DYN_MIN_SEQ <= kv
                                    and v.seq_len < 1 << 24 and not static_asked))
    if att_dyn and (v.batch > 32 or v.tp > 1 or v.seq_len >= 1 << 24):
        raise PlanError(f"{v.name}: plan override ATT_DYN={att_dyn}: needs batch <= 32 (one warp schedules), one "
                        f"GPU and a cache under 2^24 rows (ATT_DYN 1's float division is exact below; this variant: "
                        f"batch {v.batch}, tp {v.tp}, seq_len {v.seq_len})")
    if att_dyn and "ATT_C" in ov:
        raise PlanError(f"{v.name}: plan overrides ATT_DYN={att_dyn} and ATT_C={ov['ATT_C']}: with ATT_DYN the rows "
                        "per task are chosen at run time (leave ATT_C out, or ATT_DYN=0)")
    if att_dyn == 1:
        nsplit = max(nsplit, min(math.ceil(kv / step), math.ceil(sms / m.kv_heads) + 1, ATT_DYN_SPLITS))
    # ATT_DYN 2 (stream-K, attention_stream): by default where the static split takes two rounds and the model above
    # gains STREAM_MIN_GAIN at full context (b20 with 8 KV heads: 160 pairs on 132 SMs), room for ATT_DYN_SPLITS
    # pieces a pair; and on sm_90 (where measured) instead of ATT_DYN 1 from STREAM_MIN_PAIRS (sequence, KV head) pairs
    # up to one a block (more pairs than SMs are the model's above): with every task in one round, ATT_DYN 1's whole
    # tasks a sequence leave the slowest block ~37 % more rows than an even share at a serving mix of positions (8
    # sequences spread over KV 32768), which stream-K splits evenly. Measured on the H200 (bench/NOTES.md session 25),
    # against ATT_DYN 1 at KV 32768: 64 pairs (b8, 8 KV heads) +2.8 ... +7.1 % a layer at mixed positions, 0 ... +0.7 %
    # at full context; 32 pairs -0.2 / -1.0 %, 16 pairs -4.3 % (65 ... 132 pairs: not measured, the same reading);
    # and with fewer pairs where ATT_DYN 1's whole splits a pair leave STREAM_IDLE_SMS of the SMs idle in its one round
    # at full context (56 pairs x 2 splits = 112 tasks on 132 SMs; the 32 and 16 pairs above took 128: 3 % idle) and
    # stream-K's room (ATT_DYN_SPLITS pieces a pair) reaches them (not 6 pairs of 16 splits: 96 either way), from
    # STREAM_IDLE_MIN_PAIRS (fewer pairs take many pieces each, as the 16 above). Measured on an H100 (bench/NOTES.md
    # session 59), ATT_DYN 1 against stream-K, full context / serving mix: 56 pairs (112 tasks, Llama-3.2-3B-like b7
    # KV 16384) +4.1 / +0.5 %, 48 (96, Llama-3-8B b6 KV 16384) +6.4 / -0.6, 48 (96, 24 KV heads b2 KV 8192) +3.6 /
    # +1.3, 40 (120, 8B b5) +1.2 / +0.8, 28 (112, Qwen2.5-7B-like b7 KV 32768) +1.4 / +1.9;
    # and below ATT_DYN_MIN_SEQ where one round of the static split leaves many SMs idle (STREAM_IDLE_GAIN)
    # ATT_DYN 2's run charge for a piece (PIECE_RUN_TILES, or the override); the choice of ATT_DYN 2 below does not
    # read it (stream_gain keeps the bytes model's charge)
    att_piece = ov.get("ATT_PIECE_TILES", PIECE_RUN_TILES)
    if "ATT_DYN" not in ov and not static_asked and 2 <= v.batch <= 32 and v.tp == 1 and v.seq_len < 1 << 24:
        model = {"HEAD_DIM": m.head_dim, "SEQ_LEN": kv, "ATT_C": att_c, "BATCH": v.batch,
                 "KV_HEADS": m.kv_heads, "ATT_NSPLIT": stream_room(kv)}
        rounds, gain = static_rounds(model, sms), stream_gain(model, sms, esize)
        # ATT_DYN 1's tasks at full context, against the blocks stream-K's room for pieces can fill
        dyn = {"ATT_WARPS": att_warps, "ATT_NSPLIT": nsplit, "KV_HEADS": m.kv_heads}
        dyn_tasks = pairs * -(-kv // attention_split([kv] * v.batch, dyn, sms)) if att_dyn == 1 else sms
        idle = dyn_tasks <= (1 - STREAM_IDLE_SMS) * min(sms, pairs * stream_room(kv))
        if rounds >= 2 and gain >= STREAM_MIN_GAIN or att_dyn == 1 and sm == 90 and pairs <= sms \
                and (pairs >= STREAM_MIN_PAIRS or idle and pairs >= STREAM_IDLE_MIN_PAIRS) \
                or not att_dyn and sm == 90 and kv >= 2048 and rounds == 1 \
                and gain >= STREAM_IDLE_GAIN and ov.get("ATT_COMBINE") not in (3, 4):  # (they need the static split)
            att_dyn = 2
    if att_dyn == 2:
        nsplit = max(nsplit, stream_room(kv))
    elif "ATT_PIECE_TILES" in ov:
        raise PlanError(f"{v.name}: plan override ATT_PIECE_TILES={ov['ATT_PIECE_TILES']}: a piece's charge in "
                        f"ATT_DYN 2's runs (this plan: ATT_DYN={att_dyn})")
    sliced = ov.get("ATT_COMBINE") in (3, 4)  # every split's block combines a slice
    if sliced and att_dyn:
        raise PlanError(f"{v.name}: plan override ATT_COMBINE={ov['ATT_COMBINE']}: not with ATT_DYN={att_dyn} (the "
                        "combine spread over the splits' blocks needs every task in one round of the static split: "
                        "ATT_DYN=0)")
    if sliced and nsplit * v.batch * m.kv_heads > sms:
        raise PlanError(f"{v.name}: plan override ATT_COMBINE={ov['ATT_COMBINE']}: {nsplit * v.batch * m.kv_heads} "
                        f"attention tasks on {sms} SMs (every split's block waits for its peers, so every task must "
                        "be in one round: fewer splits, a larger ATT_C)")

    # o_proj and down_proj read X from global memory: in fragment order, one 8-byte load a lane per k-tile and 8
    # rows (padded to 8) instead of two 4-byte loads touching 8 rows each. Measured on the H200: at batch 16-32
    # those loads, not the weights, set the two stages' time; at batch 1-4 it was 7-15 % faster on Qwen2.5-0.5B,
    # Qwen2.5-7B and a hidden-2560 shape, -1.1 ... +2.8 % on every other shape (bench/NOTES.md session 10).
    # Tensor parallel keeps it from batch 8 (small batches with it not yet run on 2 GPUs).
    x_frag = ov.get("X_FRAG", int(v.tp == 1 or v.batch >= 8))
    # gate_up's norm reads h rounded to T (written by o_proj: half the bytes, copied without registers) where h is
    # whole on this GPU (tp = 1) and T has fp32's range (bf16: no overflow to count)
    hb_copy = int(v.tp == 1 and m.dtype == "bf16")
    xs_ld = m.hidden + 8                          # padded rows: conflict-free B-fragment loads

    tm_max = max(g["TM"] for g in gemv.values())  # the partial sums' region holds every projection's

    def o_groups() -> int:  # o_proj's warp groups a block, as planned now (NORM_GLOBAL re-plans the projections)
        return nw // gemv["o"]["NWG"]

    def sq_bytes(batch: int) -> int:  # H_STATS: o_proj's squares, [groups][O_TM][16][batch] fp32 (SMEM_SQ)
        return o_groups() * gemv["o"]["TM"] * 16 * batch * 4

    def gemv_need(batch: int, fold: int, stats: int = 0, db: int = 1, rows: bool = True) -> int:
        # the norm + projection stage's bytes: rows (not with NORM_GLOBAL), reduction tiles (per warp TM 16 x batch
        # tiles, RED_DB: twice; the norm's scratch shares it)
        red = max((1 + db) * nw * tm_max * 16 * batch * 4, nw * 2 * batch * 4)
        need = (align(batch * xs_ld * esize) if rows else 0) + red
        if stats and not rows:  # H_STATS with NORM_GLOBAL: o_proj's squares after the partial sums (else in the rows)
            need = align(need) + sq_bytes(batch)
        # NORM_FOLD: the gain (hidden x T) and each row's 1/rms (batch x fp32) stay for the projection; H_STATS: 1/rms
        if fold in (1, 3):
            return align(need) + align(m.hidden * esize) + batch * 4
        return align(need) + batch * 4 if stats or fold == 2 else need

    def fold_ok(batch: int) -> bool:  # NORM_FOLD possible at this batch (in its measured range, batch 8-32)
        # measured on the H200 (bench/NOTES.md sessions 13, 16): +0.4 to +5.9 % at batch 8-32 where the block keeps
        # >= L1_ENOUGH of L1 (-1.8 % at batch 4); not with q/k norm (Qwen3-1.7B spills 8 B with it)
        return m.norm == "rmsnorm" and m.dtype == "bf16" and v.tp == 1 and not m.qk_norm and 8 <= batch <= 32 \
            and gemv_need(batch, 1, 0, 0) <= arch.smem_per_block

    def gain_rows_ok() -> bool:  # NORM_FOLD 3 by default: where measured (sm_90, one GPU, RMSNorm in bf16, batch 1)
        # measured on the H200 (bench/NOTES.md session 38, 14 batch-1 shapes at full context and row 191): +0.9 %
        # (median; -0.2 ... +4.0 %, 26 of 28 timings faster); batch 2: -0.4 ... +1.4 %, batch 3-8: -0.3 ... -1.5 %
        return m.norm == "rmsnorm" and m.dtype == "bf16" and v.tp == 1 and hb_copy and v.batch == 1 \
            and arch.number == 90 and gemv_need(v.batch, 3, 0, 0) <= arch.smem_per_block

    h_stats = ov.get("H_STATS", 0)  # (the default with NORM_GLOBAL: below)
    # NORM_CLUSTER 2 (a tuner knob, off by default): the kernel in clusters of 2 blocks, each norm's rows bulk-copied
    # once a cluster by multicast (templates/stages/norm.cuh norm_rows_multicast); T rows only. Measured on the H200
    # (bench/NOTES.md session 17): +0.9 to +2.8 % on 6 of 8 batch 8-32 shapes, -1 % on 2: the copy from L2 is not
    # what the norms wait on
    norm_cluster = ov.get("NORM_CLUSTER", 1)
    if norm_cluster > 1 and (not hb_copy or h_stats or arch.sm[:2] not in ("90", "10")):
        raise PlanError(f"{v.name}: plan override NORM_CLUSTER={norm_cluster}: needs bf16 on one GPU, no H_STATS "
                        f"and sm_90/sm_100 (this variant: {m.dtype}, tp {v.tp}, H_STATS {h_stats}, sm_{arch.sm})")
    if h_stats and (m.norm != "rmsnorm" or not hb_copy):
        raise PlanError(f"{v.name}: plan override H_STATS=1: needs RMSNorm, bf16 and one GPU (this layer: {m.norm}, "
                        f"{m.dtype}, tp {v.tp})")
    if h_stats and o_groups() > 15:
        raise PlanError(f"{v.name}: plan override H_STATS=1: needs o_proj in groups of >= 2 warps (O_NWG="
                        f"{gemv['o']['NWG']}: {o_groups()} warp groups a block, at most 15 named barriers)")
    smem = {"SMEM_XS": 0, "SMEM_RED": 0}  # SMEM_RED: after the rows where they are kept (NORM_GLOBAL below)
    # QKV_QFIRST with ATT_KVLAST by default at batch 1 on one sm_90 GPU where qkv's q tasks fit in its first round of
    # warp groups and the k and v tasks make a second (KVLAST_ROUNDS): every attention split then starts after round
    # one (rule and measurements below, at their constants); where the plan then lacks their requirements (other
    # overrides took them), planned again without (kvlast_rule_off)
    kvlast_rule = qkv_two_rounds(gemv["qkv"]["NWG"], 0)
    qfirst = ov.get("QKV_QFIRST", int(kvlast_rule and ov.get("ATT_KVLAST", 1)))  # (the pair, or neither)
    kvlast = ov.get("ATT_KVLAST", int(kvlast_rule and qfirst))  # (its requirements below, with QKV_FLOW)
    def attention_layout(qsmem: int) -> int:  # the attention stage's offsets into smem; its bytes
        smem["SMEM_QS"] = 0  # the queries, the new key (ATT_KVLAST: its value, its scores)
        smem["SMEM_QP"] = align((m.group + 1 + kvlast) * m.head_dim * 4 + kvlast * m.group * 4)
        smem["SMEM_PT"] = smem["SMEM_QP"] + (align(math.ceil(m.group / 8) * m.head_dim * 16) if qsmem else 0)
        # (ATT_TMA: the ring at 1024 bytes, the swizzle's 8-row atom, so its pattern is each row's index mod 8)
        smem["SMEM_WST"] = align(smem["SMEM_PT"] + align(nw * math.ceil(m.group / 8) * 8 * 24 * esize),
                                 1024 if att_tma else 16)
        ring = att_warps * att_stages * tile
        smem["SMEM_FLAG"] = smem["SMEM_WST"] + align(max(ring, (att_warps + kvlast) * m.group * (m.head_dim + 2) * 4))
        # ATT_DYN 1: C, the task count, each sequence's first task, its rows; 2: R, W, the units before each
        # sequence, rows
        smem["SMEM_SCHED"] = smem["SMEM_FLAG"] + 16
        # ATT_TMA: an mbarrier a walker warp's ring stage (8-byte aligned)
        smem["SMEM_MBAR"] = smem["SMEM_SCHED"] + (4 * (2 * v.batch + 3) if att_dyn else 0)
        if att_tma:
            smem["SMEM_MBAR"] = align(smem["SMEM_MBAR"], 8)
        return smem["SMEM_MBAR"] + (8 * att_warps * att_stages if att_tma else 0)

    # ATT_QSMEM: the queries' B fragments (2 x n-tiles x k-steps registers held through the walk) in shared memory
    # where they would take 32 registers or more (n-tiles x k-steps >= 16: a GQA group of more than 8 at head_dim
    # >= 128, more than 16 at 96-112, more than 24 at 64-80; head_dim 256). Measured on the H200 (bench/NOTES.md
    # session 30): spills of 168-676 B gone or cut, +0.9 ... +6.9 % a layer. Not where the packed copy would not fit
    # beside the ring (99 KB GPUs: the shapes that planned before plan as before)
    att_qsmem = int(math.ceil(m.group / 8) * (m.head_dim // 16) >= 16)
    att_bytes = attention_layout(att_qsmem)
    if att_qsmem and att_bytes > arch.smem_per_block:
        att_qsmem = 0
        att_bytes = attention_layout(0)
    combine = m.group * nsplit * 4            # the combine's weights [GROUP][ATT_NSPLIT] reuse the warp states
    if combine > smem["SMEM_FLAG"] - smem["SMEM_WST"]:
        raise PlanError(f"{v.name}: {nsplit} attention splits x {m.group} query heads need {combine} B for the "
                        f"combine, over the {smem['SMEM_FLAG'] - smem['SMEM_WST']} B warp-state region: a larger "
                        "ATT_C")
    # NORM_FOLD 2 (the gain read from L1, not kept in shared memory) only where the gain in shared memory would leave
    # less than L1_ENOUGH and without it the block leaves enough: measured on the H200 (bench/NOTES.md session 17), Qwen2.5-7B-like b24 -2.7 % against no
    # fold, equal at batch 8-20, and where fold 1 leaves enough L1 slower than it (hidden 5120 b16 +12 %)
    # NORM_FOLD and RED_DB by the L1 they leave beside the block's shared memory (plan.l1_bytes): first at least
    # L1_ENOUGH (below it the weight loads slowed 3-11 %, bench/NOTES.md session 16), then the fold, then the
    # partial sums double-buffered (one buffer and L1 from 60 to 92 KB: -1.8 ... +0.6 %), then more L1. Where no plan
    # leaves L1_ENOUGH (the smaller-L1 GPUs, never measured) two buffers come before the fold, as the planner had it;
    # tensor parallel keeps two buffers (one has not run on 2 GPUs)
    # NORM_GLOBAL (one GPU): each norm a step of its own, the rows in global memory in fragment order
    # (templates/stages/norm.cuh), read by qkv_proj and gate_up as o_proj and down_proj read theirs, at the cost of
    # two grid barriers; by default where the rows do not fit in shared memory beside one buffer of partial sums
    # (Llama-3-8B from batch 26, hidden 5120 from 21: refused before), and where no plan with them there leaves
    # L1_ENOUGH of L1. Measured on the H200 (bench/NOTES.md session 23): a Mistral-Nemo-like b18 (28 KB of L1 with its
    # 184 KB of rows) 316 -> 281 us; with 60-124 KB left, -2.2 ... +3 % (the tuner tries it from batch 8)
    folds = [ov["NORM_FOLD"]] if "NORM_FOLD" in ov else [1, 0, 2] if fold_ok(v.batch) else [3, 0] if gain_rows_ok() \
        else [0]
    dbs = [ov["RED_DB"]] if "RED_DB" in ov else [1, 0] if v.tp == 1 else [1]
    local_l1 = max([l1_bytes(arch, max(att_bytes, need)) for f in folds for d in dbs
                    if (need := gemv_need(v.batch, f, h_stats, d)) <= arch.smem_per_block] or [0])
    pinned = bool(ov.get("NORM_FOLD") or norm_cluster > 1)  # overrides that keep the rows local
    # (the L1 rule only where an SM's unified L1 and shared memory is 256 KB, as measured: smaller ones never ran it)
    # (and where it leaves L1_ENOUGH itself: its partial sums, at two tiles a task, may take as much at small hidden)
    # TM 2 with NORM_GLOBAL where two tiles' accumulators (TM x NTILE x 4 a lane) fit in registers: 2 x NTILE <= 16,
    # batch <= 64 (Llama-3-8B b96 at TM 2 spilled 368 B, b64 4 B, b128 at TM 1 none)
    global_tm = 2 if 2 * math.ceil(v.batch / 8) <= 16 else 1
    global_l1 = l1_bytes(arch, max(att_bytes, nw * global_tm * 16 * v.batch * 4))
    # (and, with ATT_TMA, from batch NORM_GLOBAL_MIN_BATCH on such a GPU wherever it leaves L1_ENOUGH: measured on
    # the H200 (bench/NOTES.md session 24) +0.6 ... +4.2 % on four batch 16-32 shapes whose rows fit with 60-92 KB of
    # L1; without ATT_TMA, session 23: -0.7 ... +2.8 %)
    # (and wherever GEMM_PROJ is asked for, or the engine's own knobs, which bring it: its GEMMs read the rows from
    # global memory)
    engine_asked = [k for k in ov if k.endswith("_GSPLIT") or k == "GEMM_TOKEN_TILE"
                    or k in (f"{p}_GEMM" for p in GEMM_OPTIONAL) and ov[k]]
    norm_global = ov.get("NORM_GLOBAL", int(ov.get("GEMM_PROJ", 1 if engine_asked else 0) == 1 or v.tp == 1 and not pinned and (local_l1 == 0 or (
        arch.unified_kb >= 256 and global_l1 >= L1_ENOUGH and (
            local_l1 < L1_ENOUGH or (att_tma and v.batch >= NORM_GLOBAL_MIN_BATCH))))))
    if norm_global:  # (the rows normalised in global memory)
        # (tensor parallel: override only, the norm step reading the all-reduced fp32 h; verified on one GPU in
        # session 45 with its ranks as threads, tests/test_tp.py; not yet timed on 2 GPUs)
        _needs(v.name, "NORM_GLOBAL", norm_global, [
            (not ov.get("NORM_FOLD"), f"no NORM_FOLD (this plan: {ov.get('NORM_FOLD')})"),
            (norm_cluster == 1, f"NORM_CLUSTER 1 (this plan: {norm_cluster})")])
    smem["SMEM_RED"] = 0 if norm_global else align(v.batch * xs_ld * esize)
    if norm_global:
        folds = [0]
        # every projection's X from global memory: two tiles a task (<P>_TM 2) load each B fragment once for both,
        # halving the X reads from L2 (at batch 32, 2x the weight bytes a 16-row tile). Measured on the H200
        # (bench/NOTES.md session 23): Llama-3-8B b32 +6 %, Nemo-like b18 +5 %, 70B-like b16 +3 %, hidden-5120 b16
        # +2.8 % against the rows in shared memory; o_proj/down_proj at TM 2 beside the rows in shared memory lost
        # (its partial sums take twice the shared memory: -6 ... -12 %)
        # (global_tm: up to batch 64). Only where the projection has a tile an SM: at two a task fewer than half the
        # SMs would stream (measured on an H100, bench/NOTES.md session 58: o_proj and down_proj's 128 tiles at TM 1,
        # Llama-3.2-1B b20 / b32 / b48 / b64 -2.2 / -4.1 / -6.3 / -7.1 % at full context, -4.5 ... -8.6 % at the
        # serving mix, TinyLlama b24 -3.8 %; Llama-3-8B b28's 256 tiles +0.9 %, b64 +5.4 %)
        for prefix, key in PROJECTIONS:
            if f"{prefix}_TM" not in ov and global_tm > 1 and tm_ok(prefix, key, global_tm) \
                    and shapes[key][0] // 16 >= sms:
                plan_projection(prefix, key, global_tm)
        tm_max = max(g["TM"] for g in gemv.values())
        # H_STATS with NORM_GLOBAL: o_proj's epilogue writes the second norm's rows (times its gain) and their sums of
        # squares, so that norm is no step: one grid barrier and a pass over the rows less. Measured on the H200
        # (bench/NOTES.md session 25, against NORM_GLOBAL's norm step): +0.2 ... +2.5 % on eight batch 16-32 shapes
        # (Llama-3.2-1B b32 +2.5 %). By default where RMSNorm in bf16, o_proj's groups fit the named barriers, the
        # squares and 1/rms fit beside one buffer of partial sums, on a GPU of 256 KB L1 + shared memory (as measured)
        if "H_STATS" not in ov:
            h_stats = int(m.norm == "rmsnorm" and hb_copy and o_groups() <= 15 and arch.unified_kb >= 256
                          and gemv_need(v.batch, 0, 1, min(dbs), False) <= arch.smem_per_block)
    if h_stats and not norm_global and sq_bytes(v.batch) > v.batch * xs_ld * esize:
        raise PlanError(f"{v.name}: plan override H_STATS=1: o_proj's {o_groups()} warp groups' squares "
                        f"({sq_bytes(v.batch)} B) exceed the rows' region ({v.batch * xs_ld * esize} B): a larger "
                        "O_NWG or O_TM 1")

    # GEMM_PROJ (sm_90, one GPU, NORM_GLOBAL): gate_up, and qkv_proj and o_proj where QKV_GEMM / O_GEMM (see
    # GEMM_TASKS_MIN_SHARE), on the wgmma GEMM engine that prefill's projections run on (templates/gemm.cuh: the
    # batch's rows tiled in shared memory by bulk copies, read once a 256-row tile instead of once a 16-row GEMV task
    # from L2), the inputs of those (the first norm's rows, attention's output, o_proj's H_STATS rows or the second
    # norm's) written in its tiled layout (gemv.cuh gemm_x, xg_at); down_proj past one token tile (DOWN_GEMM: level
    # with its GEMV at batch 64, session 61), act then tiled too. By default from GEMM_BATCH_MIN and GEMM_HIDDEN_MIN
    # (measured there) at a head_dim a multiple of 32 (head_dim 80 spills 224-252 B with it at batch 64-128, 0-100 B
    # without: not timed)
    wgmma = arch.sm.startswith("90")  # (sm_90 builds as sm_90a, compile.py)
    # (a projection's GEMV knobs, overridden: a plan of its GEMV; gate_up's: of the GEMVs)
    gemv_knobs = {g: [k for k in ov if k in (f"{g}_{x}" for x in ("NWG", "U", "KSPLIT", "PRE", "TM", "BS"))]
                  for g in GEMM_PROJECTIONS}
    # (engine_asked, the engine's own knobs, a projection on it or a split of its: GEMM_PROJ 1 unless asked off)
    # QKV_FLOW's counters (1) beside it where qkv_proj and o_proj are both asked to stay GEMVs (o_proj's GEMV resets them)
    flow_ok = all(ov.get(f"{p}_GEMM") == 0 for p in ("QKV", "O")) and ov.get("QKV_FLOW", 0) <= 1
    gemm_off = {k: why for k, why in GEMM_OFF.items() if k != "QKV_FLOW" or not flow_ok}
    gemm_proj = ov.get("GEMM_PROJ", 1 if engine_asked else int(not gemm_rule_off and wgmma and v.tp == 1 and norm_global
                                        and v.batch >= GEMM_BATCH_MIN
                                        and m.head_dim % 32 == 0 and m.hidden >= GEMM_HIDDEN_MIN
                                        and not any(ov.get(k) for k in gemm_off)
                                        and not gemv_knobs["GU"]))
    if gemm_proj:
        _needs(v.name, "GEMM_PROJ", gemm_proj, [
            (wgmma, f"sm_90 (wgmma; this build: sm_{arch.sm})"), (v.tp == 1, f"one GPU (tp {v.tp})"),
            (norm_global, "NORM_GLOBAL 1 (the GEMM reads its rows from global memory)"),
            *((not ov.get(k), f"{k} 0 ({why})") for k, why in gemm_off.items()),
            (not gemv_knobs["GU"], f"no GEMV knob of gate_up ({', '.join(gemv_knobs['GU'])}: it runs on the GEMM "
                                   "engine; GU_GSPLIT sets its split-K)")])
    elif engine_asked:
        raise PlanError(f"{v.name}: plan override {engine_asked[0]}={ov[engine_asked[0]]}: a knob of the GEMM engine, "
                        "which needs GEMM_PROJ 1 (asked: 0)")
    # its tiling: 4 warpgroups of 64 weight rows (256 a tile), the batch in token tiles of <= GEMM_BN_MAX; where off,
    # the same numbers stand in (GEMM_WGMMA 0: the constants are declared, no GEMM is compiled)
    # (GEMM_TOKEN_TILE, an override and a tuner candidate: token tiles of up to 128 rows, one tile for a batch of up
    # to 128, so that each weight tile is read once, not once a token tile; 96 and 128 compile without spills at 512
    # threads, session 71, not yet timed)
    bn_max = ov.get("GEMM_TOKEN_TILE", GEMM_BN_MAX)
    g_wm, g_tm, g_tn, g_bk = wgmma_tile(v.batch, THREADS, bn_max)
    g_bm, g_bn = g_wm * 16, g_tn * 8
    g_stage = (g_bm + g_bn) * g_bk * esize
    # (the ring, then with H_STATS gate_up's 1/rms of each row; 1 KB left for the static shared memory, padded to
    # ATT_TMA's 1024-byte alignment)
    rs_bytes = v.batch * 4 if h_stats else 0
    g_stages = min(gemm_stages(arch.smem_per_block, g_stage), (arch.smem_per_block - 2048 - rs_bytes) // g_stage)
    g_ring = g_stages * g_stage + 1024  # (+ the ring's alignment to the swizzle atom)
    gemm_tiles = {}  # {prefix: its GEMM's N, K, tiles, FULL, KSPLIT} (a projection off the engine: unsplit)
    on_gemm = {"GU": gemm_proj}  # {prefix: whether it runs on the engine}
    for prefix in GEMM_PROJECTIONS:
        key = dict(PROJECTIONS)[prefix]
        n, k = shapes[key]
        tiles, chunks = -(-n // g_bm) * -(-v.batch // g_bn), -(-k // g_bk)
        # (from GEMM_UNSPLIT_SHARE of the SMs' worth of tiles up to one a block, whole tiles: see GEMM_UNSPLIT_SHARE)
        full, ks = (0, 1) if not gemm_proj or GEMM_UNSPLIT_SHARE * sms <= tiles <= sms else \
            split_k(tiles, chunks, sms, gemm_split_cost(g_bm, g_bn, g_stage))
        if f"{prefix}_GSPLIT" in ov:  # every tile split that many ways
            full, ks = 0, ov[f"{prefix}_GSPLIT"]
            if ks > chunks:
                raise PlanError(f"{v.name}: plan override {prefix}_GSPLIT={ks}: over {key}'s {chunks} K chunks")
        if prefix in GEMM_OPTIONAL:
            # qkv_proj and o_proj stay GEMVs where one token tile holds the batch (past it the GEMVs run it in batch
            # slices and fall away) and their split leaves SMs without a task (GEMM_TASKS_MIN_SHARE);
            # qkv_proj on the engine wherever hidden is not whole 64-column blocks: as a GEMV the first norm's
            # fragment-ordered rows would land in the tiled layout's padding columns, which gate_up's GEMM reads from
            # the shared xn (times zero weights: a NaN of one sequence would cross to the others)
            whole = prefix != "QKV" or m.hidden % 64 == 0
            auto = (DOWN_GEMM_BY_DEFAULT and v.batch > GEMM_BN_MAX if prefix == "DOWN" else
                    v.batch > GEMM_BN_MAX or tiles >= GEMM_UNSPLIT_SHARE * sms
                    or full + (tiles - full) * ks >= GEMM_TASKS_MIN_SHARE * sms)
            on = ov.get(f"{prefix}_GEMM", int(gemm_proj and (not whole or not gemv_knobs[prefix] and (
                f"{prefix}_GSPLIT" in ov or auto))))
            if on:
                _needs(v.name, f"{prefix}_GEMM", on, [
                    (not gemv_knobs[prefix], f"no GEMV knob of {key} ({', '.join(gemv_knobs[prefix])}: it runs on the "
                                             f"GEMM engine; {prefix}_GSPLIT sets its split-K)"
                                             + ("" if whole else f"; hidden {m.hidden} is not a multiple of 64"))])
            elif gemm_proj and not whole:
                raise PlanError(f"{v.name}: plan override QKV_GEMM=0 beside GEMM_PROJ 1 needs hidden a multiple of 64 "
                                f"({m.hidden}: the first norm's rows would fill gate_up's padding columns)")
            elif f"{prefix}_GSPLIT" in ov:
                raise PlanError(f"{v.name}: plan override {prefix}_GSPLIT={ov[f'{prefix}_GSPLIT']}: the GEMM engine's "
                                f"split-K of {key}, with {prefix}_GEMM 1 only (this plan: 0, a GEMV)")
            on_gemm[prefix] = on
        if not on_gemm[prefix]:
            full, ks = 0, 1
        gemm_tiles[prefix] = {"N": n, "K": k, "tiles": tiles, "FULL": full if ks > 1 else 0, "KSPLIT": ks}

    def pick(c: tuple[int, int]) -> tuple:
        need = gemv_need(v.batch, c[0], h_stats, c[1], not norm_global)
        l1 = l1_bytes(arch, max(att_bytes, need))
        return (need <= arch.smem_per_block, min(l1, L1_ENOUGH), FOLD_RANK[c[0]] if l1 >= L1_ENOUGH else 0, c[1],
                int(c[0] == 1), l1)
    norm_fold, red_db = max(((f, d) for f in folds for d in dbs), key=pick)
    smem["SMEM_GS"] = align(gemv_need(v.batch, 0, 0, red_db)) if norm_fold in (1, 3) else 0
    # H_STATS: o_proj's squares in the rows' region (idle in its stage), with NORM_GLOBAL after the partial sums
    smem["SMEM_SQ"] = align(gemv_need(v.batch, 0, 0, red_db, False)) if h_stats and norm_global else 0
    smem["SMEM_RS"] = (align(g_ring) if gemm_proj and h_stats  # (gate_up's, past the GEMM's ring)
                       else smem["SMEM_GS"] + align(m.hidden * esize) if norm_fold in (1, 3)
                       else smem["SMEM_SQ"] + align(sq_bytes(v.batch)) if h_stats and norm_global
                       else align(gemv_need(v.batch, 0, 0, red_db)) if h_stats or norm_fold == 2 else 0)
    gemv_bytes = gemv_need(v.batch, norm_fold, h_stats, red_db, not norm_global)

    def rows_advice() -> str:  # why the norm + projection stage does not fit (only computed for a refusal)
        if norm_fold and gemv_need(v.batch, 0, h_stats, red_db) <= arch.smem_per_block:
            kept = "the gain and each row's 1/rms" if norm_fold in (1, 3) else "each row's 1/rms"
            return (f"NORM_FOLD={norm_fold} keeps {kept} beside the rows: "
                    f"{gemv_bytes - gemv_need(v.batch, 0, h_stats, red_db)} B more; without it the stage fits")
        if h_stats and gemv_need(v.batch, 0, 0, red_db) <= arch.smem_per_block:
            return (f"H_STATS=1 keeps each row's 1/rms beside the rows: "
                    f"{gemv_bytes - gemv_need(v.batch, 0, 0, red_db)} B more; without it the stage fits")
        one = gemv_need(v.batch, norm_fold, h_stats, 0, not norm_global)
        if red_db and one <= arch.smem_per_block:
            tp = (" (tensor parallel plans two: one has not run on 2 GPUs; a tuning entry's overrides "
                  "{\"RED_DB\": 0} build it with one)") if v.tp > 1 and "RED_DB" not in ov else ""
            return (f"RED_DB=1 keeps two buffers of partial sums: {gemv_bytes - one} B more; with one the stage "
                    f"fits{tp}")
        if norm_global:  # no rows in shared memory: the partial sums (and H_STATS's squares) alone are over
            most = arch.smem_per_block // (nw * tm_max * 16 * 4)  # one buffer (RED_DB=0)
            stats = (f"; H_STATS=1 adds o_proj's squares and 1/rms ({gemv_bytes - gemv_need(v.batch, 0, 0, red_db, False)}"
                     " B), H_STATS=0 leaves them out") if h_stats else ""
            return (f"with NORM_GLOBAL the projections' partial sums still take {nw} warps x {tm_max * 16} x batch x "
                    f"4 B (twice with RED_DB=1): a batch of at most {most} fits{stats}")
        fits = 0  # the largest batch that fits, planned as that batch would be (the need grows with the batch)
        while fits < v.batch and gemv_need(fits + 1, ov.get("NORM_FOLD", 0), h_stats, min(dbs)) \
                <= arch.smem_per_block:
            fits += 1
        glob = ""  # what would keep the rows in global memory instead
        if not norm_global and gemv_need(v.batch, 0, 0, min(dbs), False) <= arch.smem_per_block:
            glob = ("; NORM_GLOBAL=1 keeps them in global memory (with tensor parallel an override only, not yet "
                    "timed on 2 GPUs: an entry {\"" + v.name + "\": {\"overrides\": {\"NORM_GLOBAL\": 1}}} in the "
                    "one file in tuning/, which build reads, or in a file given to every build's --tuned-for)"
                    if v.tp > 1 else
                    f"; NORM_GLOBAL=1 keeps them in global memory, without the overrides {_fmt(ov)}" if pinned else
                    "; NORM_GLOBAL=1 (the default where they do not fit) keeps them in global memory")
        return (f"the normalised input rows take batch x hidden x {esize} B: at hidden {m.hidden} a batch of at "
                f"most {fits} fits{glob}" if fits else "lower hidden")
    # DOWN_SMEM (an override and a tuner candidate; Qwen2.5-0.5B b1 on an H100 -3.6 ... +3.9 % a layer by KV length,
    # session 66; not yet timed on an H200): the block's first down_proj task's weights (its first DW_KT k-tiles, as
    # many as fit past the norm + projection stage's bytes) copied into shared memory by the TMA unit from gate_up's
    # start, counted on an mbarrier, so down_proj reads them
    # there: down_proj's tiles fill few SMs at small hidden sizes (Qwen2.5-0.5B: 56 of 132), which streamed their
    # 155 KB each only once act was in (bench/NOTES.md session 56); one bulk copy brings them while gate_up streams
    # its own, no registers held
    down_smem = ov.get("DOWN_SMEM", 0)
    dn = gemv["down"]
    # (1 KB left for the kernel's static shared memory: split-K's, DOWN_FLOW's words)
    dw_kt = min(m.intermediate // 16, (arch.smem_per_block - 1024 - align(gemv_bytes, 128) - 16) // 512) \
        if down_smem else 0
    if down_smem:
        _needs(v.name, "DOWN_SMEM", down_smem, [
            (arch.number >= 90, f"sm_90+ (TMA bulk copies; sm_{arch.sm})"), (v.tp == 1, f"one GPU (tp {v.tp})"),
            (dn["NWG"] == nw, f"down_proj in one group a block (DOWN_NWG {nw}; this plan: {dn['NWG']})"),
            (dn["KSPLIT"] == 1 and dn["TM"] == 1, "DOWN_KSPLIT 1 and DOWN_TM 1"),
            (not ov.get("DOWN_PRE"), "DOWN_PRE 0 (its first step comes from shared memory)"),
            (dw_kt >= 1, "a k-tile's 512 B of shared memory past the norm + projection stage's")])
    smem["SMEM_DW"] = align(gemv_bytes, 128) if down_smem else 0  # the staged weights, then their mbarrier
    smem["SMEM_DWBAR"] = smem["SMEM_DW"] + dw_kt * 512 if down_smem else 0
    if kvlast and "ATT_KVLAST" not in ov and att_bytes > arch.smem_per_block:  # (kvlast_rule's row and state)
        return plan(v, arch, overrides, skip_rule_off=skip_rule_off, gemm_rule_off=gemm_rule_off,
                    kvlast_rule_off=True)
    smem_bytes = check_smem(v.name + (f" (plan overrides {_fmt(ov)})" if ov else ""), arch, {
        "down_proj's staged weights": (smem["SMEM_DWBAR"] + 8 if down_smem else 0, ""),
        "norm+projection": (gemv_bytes, rows_advice() if gemv_bytes > arch.smem_per_block else ""),
        "projection GEMM": ((align(g_ring) + rs_bytes) if gemm_proj else 0,
                            f"{g_stages} ring stages of a {g_bm} x {g_bk} weight and {g_bn} x {g_bk} token chunk "
                            "(GEMM_PROJ 0: the GEMVs)"),
        "attention": (att_bytes, "the GQA group's query heads and warp states take (heads/kv_heads) x head_dim x "
                                 "4 B per warp: fewer query heads per KV head or a smaller head_dim"),
    })
    # gate_up -> down_proj without a grid barrier: act counted in chunks of one down_proj step's k-tiles (NWG x U: a
    # warp's step reads k-tiles of one chunk), each chunk's counter on a 128-byte line of its own (ACT_STRIDE words:
    # one L2 slice does not take every block's polls) past the KV heads' in ws_ready
    # By default (sm_90, one GPU, batch <= 8) where gate_up takes DOWN_FLOW_MIN_ROUNDS rounds or more of tasks and
    # down_proj one 16-warp group a block: measured on the H200 (bench/NOTES.md session 37) +0.4 ... +3.5 % a layer
    # (row 191 / full context) on the 8 such shapes timed (Llama-3.2-1B b1/b8, Llama-3-8B b1/b4/b8, Qwen3-1.7B b1, hidden 1536 b2, Qwen3-8B
    # b2; then on 7 held-out shapes it picked: Mistral-7B b2/b6, Qwen2.5-1.5B b1, SmolLM2-1.7B b4, InternLM2-1.8B b8
    # +0.4 ... +2.7 %), and -5 ... +1 % where gate_up is under a round (Qwen2.5-0.5B, hidden 576: the chunks complete
    # together, and the counters cost what the barrier did), down_proj runs 8-warp groups (small chunks: hidden 2560
    # -4 %, Qwen2.5-7B 0 %, Llama-3.2-3B and Phi-3-mini b1 +1 %) or the batch is 16-32 (-0.3 ... -2.6 %); and on the
    # four shapes whose last chunk is partial (down_proj's k-tiles no multiple of NWG x U: intermediate 4864 and
    # 11008, Yi-6B and Qwen2.5-3B b1 -3.8 / -4.2 % at full context): the cause is not established, so those keep the
    # barrier. Under the LL rule, where DOWN_FLOW 2's words are not planned (batch 2-5, or hidden > 3072), 8-warp
    # groups take the counters too: there the barrier it removes is the last one of a batch-1 layer (COOP 0 follows);
    # measured on the H100 (bench/NOTES.md session 52) the barrier +0.4 ... +2.3 % on 14 of 16 timings of 8 such
    # shapes (Qwen2.5-7B b1 / b4, held out: head_dim 96 b5, hidden 2560-3584 at b1-5), -1.6 % on one (hidden 2560,
    # intermediate 9728, b2 KV 1024)
    gu, dn = gemv["gate_up"], gemv["down"]
    gu_rounds = 2 * m.intermediate // 16 // gu["TM"] / (sms * (THREADS // 32 // gu["NWG"]))
    down_kt, down_step = m.intermediate // 16, dn["NWG"] * dn["U"]  # down_proj's k-tiles; a chunk's (one step's)
    # batch 1 at the (hidden, KV heads) of B1_PRE_SHAPES and an MLP of B1_PRE_MLP: the next round's weights before
    # each round's reduction (GEMV_PF 1) and o_proj's first step before attention's barrier (O_PRE 1), together
    b1_pre = (v.batch == 1 and v.tp == 1 and sm == 90 and m.dtype == "bf16" and m.norm == "rmsnorm"
              and (m.hidden, m.kv_heads) in B1_PRE_SHAPES
              and B1_PRE_MLP[0] <= m.intermediate / m.hidden <= B1_PRE_MLP[1])
    # the LL hand-offs (ATT_LL 1, QKV_FLOW 2, H_LL 1: no grid barrier and no counter between qkv -> attention ->
    # o_proj -> the second norm) by default at batch 1, and at batch 2 .. LL_BATCH_MAX with O_PRE 0 (below), on
    # one sm_90 GPU in bf16 where each is allowed and the layer is small (LL_HIDDEN_MAX_ANY: where measured; at
    # batch 1 past LL_HIDDEN_MAX without B1_PRE's O_PRE 1 and GEMV_PF 1)
    # (a split qkv keeps them: under QKV_FLOW 2 attention sums its splits' words, templates/stages/qkv_proj.cuh, up to
    # QKV_WORDS_MAX words a lane)
    qkv_words = qkv_lane_words(m.head_dim, gemv["qkv"]["KSPLIT"])
    unsplit = (all(g["KSPLIT"] == 1 for key, g in gemv.items() if key != "qkv")
               and (gemv["qkv"]["KSPLIT"] == 1 or qkv_words <= QKV_WORDS_MAX))
    ll_rule = (v.tp == 1 and sm == 90 and hb_copy and x_frag and not norm_global and not h_stats
               and norm_cluster == 1 and unsplit
               and (v.batch == 1 and m.hidden <= LL_HIDDEN_MAX_ANY
                    or 2 <= v.batch <= LL_BATCH_MAX and m.hidden <= LL_HIDDEN_MAX_ANY and not m.qk_norm
                    and m.head_dim in LL_HEAD_DIMS_BATCH))
    gu_tasks = 2 * m.intermediate // 16 // gemv["gate_up"]["TM"]
    # (an override DOWN_FLOW=1 with a split gate_up or down_proj was refused above: splits come from overrides only)
    flow_ok = (sm == 90 and v.tp == 1 and v.batch <= 8 and gu["KSPLIT"] == 1 and dn["KSPLIT"] == 1 and not gemm_proj
               and not (att_tma and smem_bytes > arch.smem_per_block - 1024))
    words = (flow_ok and ll_rule and v.batch == 1 and m.hidden <= DOWN_WORDS_HIDDEN_MAX and gu_tasks >= sms
             and ov.get("H_LL", 1) != 0
             and ov.get("GEMV_PF", int(b1_pre)) != 1)
    counters = (flow_ok and gu_rounds >= DOWN_FLOW_MIN_ROUNDS and down_kt % down_step == 0
                and (dn["NWG"] == THREADS // 32 or ll_rule and not words))
    # DOWN_FLOW 2 (act as LL words) by default under the LL rule where the counters are not taken and gate_up has a
    # task in every block (H_LL's epoch): measured on an H100 (bench/NOTES.md session 49) -0.9 ... -5.8 % a layer on
    # all 12 timings of 6 such shapes (Qwen2.5-0.5B KV 1024 / 4096 / 32768; held out: hidden 960, 1440 / head_dim 80,
    # 2560 MHA, 3072); where the counters are taken (Llama-3.2-1B, Qwen3-1.7B) it needs DOWN_U 4 against spills and
    # ties (-0.5 ... +0.8 %), so they keep them; not with GEMV_PF 1 (its early loads beside the held words spill 76 B
    # at Llama-3.2-1B b1 with GU_NWG 8, where the counters give way); batch 1 up to hidden 3072 (where measured)
    down_flow = ov.get("DOWN_FLOW", 1 if counters else 2 if words else 0)
    act_chunks = -(-down_kt // down_step) if down_flow == 1 else 0
    h_ll = ov.get("H_LL", int(ll_rule and not (down_flow and gu_tasks < sms)))
    # (o_proj and gate_up unsplit: their split-K counters would share ws_count, which the barrier kept apart)
    if h_ll:
        _needs(v.name, "H_LL", h_ll, [
            (v.tp == 1, f"one GPU (tp {v.tp})"), (hb_copy, "bf16's HB_COPY 1 (this plan: 0)"),
            (not norm_global, "NORM_GLOBAL 0 (the second norm in each block)"), (not h_stats, "H_STATS 0"),
            (norm_cluster == 1, f"NORM_CLUSTER 1 (this plan: {norm_cluster})"),
            (v.batch <= 8, f"batch <= 8 ({v.batch})"),
            (gemv["o"]["KSPLIT"] == 1, f"O_KSPLIT 1 (this plan: {gemv['o']['KSPLIT']})"),
            (gemv["gate_up"]["KSPLIT"] == 1, f"GU_KSPLIT 1 (this plan: {gemv['gate_up']['KSPLIT']})")])
    if down_flow == 2:
        # DOWN_FLOW 2: no counters, act as LL words down_proj's lanes poll; the epoch advances at down_proj's end
        # (H_LL), where block 0's down_proj task has seen every gate_up tile's words (each task reads all of act)
        _needs(v.name, "DOWN_FLOW", down_flow, [
            (bool(h_ll), "H_LL (the epoch's advance at down_proj's end)"), (x_frag, "X_FRAG 1"),
            (v.batch <= 8, f"batch <= 8 ({v.batch})")])
    if h_ll and down_flow and gu_tasks < sms:
        raise PlanError(f"{v.name}: plan override H_LL={h_ll} with DOWN_FLOW: needs a gate_up task in every block (the "
                        f"epoch's advance at block 0's down_proj end relies on every block's count): {gu_tasks} tasks "
                        f"(GU_TM {gemv['gate_up']['TM']}) on {sms} SMs; DOWN_FLOW=0 keeps gate_up's barrier")
    coop = ov.get("COOP", 1)
    if not coop:
        # COOP 0: launched without the cooperative attribute, so under PDL this launch's blocks take SMs as the
        # previous launch's blocks leave them (a cooperative grid starts only once every SM is free) and run their
        # pre-wait work (QKV_PRE's weights) early; its grid barriers count in ws_gridbar (templates/common.cuh
        # grid_barrier), which needs every block resident: one block an SM, the grid at most the SMs, and nothing
        # else on the GPU holding SMs for good
        _needs(v.name, "COOP", coop, [
            (v.tp == 1, f"one GPU (tp {v.tp}: a launch a reduction)"),
            (norm_cluster == 1, f"NORM_CLUSTER 1 (this plan: {norm_cluster}, a cluster launch)")])
    if ov.get("TIMELINE") and v.tp > 1:
        raise PlanError(f"{v.name}: plan override TIMELINE=1: one GPU only (a launch's stamps; tensor parallel runs "
                        "several launches a layer)")
    att_ll = ov.get("ATT_LL", int(ll_rule))
    # past LL_HIDDEN_MAX at batch 1 the hand-offs replace B1_PRE's early loads (beside them the held words spill)
    b1_pre = b1_pre and not (att_ll and m.hidden > LL_HIDDEN_MAX)
    # (o_proj unsplit: its split-K counters share ws_count with attention's, which the barrier kept apart)
    if att_ll:
        _needs(v.name, "ATT_LL", att_ll, [
            (v.tp == 1, f"one GPU (tp {v.tp})"), (x_frag, "X_FRAG 1"), (not norm_global, "NORM_GLOBAL 0"),
            (v.batch <= 8, f"batch <= 8 ({v.batch})"),
            (gemv["o"]["KSPLIT"] == 1, f"O_KSPLIT 1 (this plan: {gemv['o']['KSPLIT']})")])
    # ATT_TMA aligns the dynamic shared memory at 1024 B (the swizzle's atom), so the static shared memory that split-K,
    # NORM_CLUSTER and DOWN_FLOW declare (a few bytes) is padded to 1 KB ahead of it: both must fit in the block's limit
    # GEMM_PROJ: the GEMMs' static shared memory (their mbarriers; with ATT_TMA padded to 1 KB) beside the dynamic: where
    # they would not fit, planned without it (asked for: refused)
    if gemm_proj and smem_bytes > arch.smem_per_block - 1024:
        if "GEMM_PROJ" not in ov and not engine_asked:  # (an engine knob asked brings it: refused, not re-planned)
            return plan(v, arch, overrides, skip_rule_off=skip_rule_off, gemm_rule_off=True,
                        kvlast_rule_off=kvlast_rule_off)
        asked = "GEMM_PROJ" if "GEMM_PROJ" in ov else engine_asked[0]
        raise PlanError(f"{v.name}: plan override {asked}={ov[asked]}: needs {smem_bytes} B of shared memory per "
                        f"block and 1 KB more for the GEMMs' static shared memory: over sm_{arch.sm}'s "
                        f"{arch.smem_per_block} B (GEMM_PROJ=0 plans the GEMVs)")
    if att_tma and (norm_cluster > 1 or down_flow or any(g["KSPLIT"] > 1 for g in gemv.values())) \
            and smem_bytes > arch.smem_per_block - 1024:
        raise PlanError(f"{v.name}: needs {smem_bytes} B of shared memory per block and, with ATT_TMA 1 and split-K, "
                        f"NORM_CLUSTER or DOWN_FLOW, 1 KB more for the static shared memory padded to the swizzle's "
                        f"1024-byte alignment: over sm_{arch.sm}'s {arch.smem_per_block} B (ATT_TMA=0 leaves it out)")

    # GU_SKIP (an override): the HIDDEN / 16 blocks of down_proj's tasks take no gate_up task (gate_up's go round the
    # others), so down_proj's tiles stream while gate_up runs instead of after it: at Qwen2.5-0.5B b1 down_proj's 56
    # blocks ended 4.6 us after gate_up's (session 55's H200 timeline); with DOWN_SMEM their copy has the SMs to itself
    gu_skip = ov.get("GU_SKIP", int(skip_rule))
    go = gemv["o"]
    skip_needs = [
        (h_ll == 1 or h_ll == 2, "H_LL (o_proj's h words order the skipped blocks' epoch)"),
        (down_flow == 2, f"DOWN_FLOW 2 (act's words; this plan: {down_flow})"),
        (dn["NWG"] == nw and dn["KSPLIT"] == 1 and dn["TM"] == 1,
         "down_proj in one unsplit group a block (DOWN_NWG 16, DOWN_KSPLIT 1, DOWN_TM 1)"),
        (go["KSPLIT"] == 1 and go["TM"] == 1, "O_KSPLIT 1 and O_TM 1 (an o_proj tile on each skipped block)"),
        (m.hidden // 16 < sms, f"blocks left for gate_up (hidden / 16 = {m.hidden // 16} of {sms} SMs)")]
    if skip_rule and "GU_SKIP" not in ov and not all(ok for ok, _ in skip_needs):
        return plan(v, arch, overrides, skip_rule_off=True,  # (the rule's requirements went with other overrides)
                    gemm_rule_off=gemm_rule_off, kvlast_rule_off=kvlast_rule_off)
    if gu_skip:
        _needs(v.name, "GU_SKIP", gu_skip, skip_needs)
    consts = {
        "HIDDEN": m.hidden, "HEADS": m.heads, "KV_HEADS": m.kv_heads, "HEAD_DIM": m.head_dim,
        "INTER": m.intermediate, "TP": v.tp, "BATCH": v.batch, "SEQ_LEN": v.seq_len, "WINDOW": window,
        "THREADS": THREADS,
        "GROUP": m.group, "Q_DIM": q_dim, "KV_DIM": kv_dim, "QKV_DIM": q_dim + 2 * kv_dim,
        "XS_LD": xs_ld, "ATT_C": att_c, "ATT_WARPS": att_warps, "ATT_STAGES": att_stages, "ATT_NSPLIT": nsplit,
        "ATT_COMBINE": ov.get("ATT_COMBINE", combine_default(m.group * m.head_dim, nsplit)
                              if not att_dyn and v.tp == 1 else 1), "ATT_DYN": att_dyn,
        "ATT_PIECE_TILES": att_piece if att_dyn == 2 else 0, "ATT_TMA": att_tma, "ATT_QSMEM": att_qsmem,
        "X_FRAG": x_frag, "HB_COPY": hb_copy,
        "GEMV_PF": ov.get("GEMV_PF", int(b1_pre)), "NORM_FOLD": norm_fold, "RED_DB": red_db,
        "NORM_CLUSTER": norm_cluster,
        # qkv -> attention without a grid barrier: each attention task waits on its KV head's qkv tiles (counted
        # per head); only with qkv unsplit (its split-K counters share ws_count with attention's). Measured on the
        # H200 (bench/NOTES.md session 11): 1-3 % faster on 1B b1/b8, 0.5B b1, 8B b1. Tensor parallel keeps the
        # barrier until it runs on 2 GPUs.
        "QKV_FLOW": ov.get("QKV_FLOW", 2 if ll_rule else int(v.tp == 1 and gemv["qkv"]["KSPLIT"] == 1
                                                              and not gemm_proj)),
        "DOWN_FLOW": down_flow, "ACT_CHUNKS": act_chunks, "ACT_STRIDE": ACT_STRIDE,
        "NORM_GLOBAL": norm_global, "NORM_LOCAL": 1 - norm_global, "NORM2_LOCAL": int(not norm_global or h_stats),
        "ATT_LL": att_ll, "H_LL": h_ll, "TIMELINE": ov.get("TIMELINE", 0), "COOP": coop,
        "DOWN_SMEM": down_smem, "DW_KT": dw_kt, "GU_SKIP": gu_skip,
        # GEMM_PROJ's engine (templates/gemm.cuh; GEMM_WGMMA 0: declared, not compiled)
        "GEMM_PROJ": gemm_proj, **{f"{p}_GEMM": on_gemm[p] for p in GEMM_OPTIONAL},
        "GEMM_WGMMA": gemm_proj, "GEMM_WM": g_wm, "GEMM_TM": g_tm, "GEMM_TN": g_tn,
        "GEMM_BK": g_bk, "GEMM_STAGES": g_stages, "GEMM_XROWS": -(-v.batch // g_bn) * g_bn,
        "GEMM_TOKEN_TILE": bn_max,
        "GEMM_GM": gemm_group(sms, g_bm, g_bn),
        **{f"{p}_{x}": g[y] for p, g in gemm_tiles.items() for x, y in (("GSPLIT", "KSPLIT"), ("GFULL", "FULL"))},
        **smem,
    }
    for prefix, key in PROJECTIONS:
        consts.update({f"{prefix}_{k}": gemv[key][k] for k in ("NWG", "U", "KSPLIT", "TM")})
        consts[f"{prefix}_PRE"] = ov.get(f"{prefix}_PRE", 0)
    if consts["QKV_FLOW"] == 2 and gemv["qkv"]["KSPLIT"] > 1 and qkv_words > QKV_WORDS_MAX:
        raise PlanError(f"{v.name}: plan overrides QKV_KSPLIT={gemv['qkv']['KSPLIT']} and QKV_FLOW=2: attention would "
                        f"hold {qkv_words} words a lane (head_dim {m.head_dim}: {qkv_lane_words(m.head_dim)} a "
                        f"split), at most {QKV_WORDS_MAX}: fewer splits, or QKV_FLOW=0 (the split-K reduction)")
    # o_proj's first weight step before attention's grid barrier by default at batch 2-8 (one GPU, the static split,
    # sm_90): measured on the H200 (bench/NOTES.md session 27) -0.02 ... +4.1 % a layer on 15 such shapes at KV 4096
    # (Llama-3-8B and Qwen2.5-7B 0.0 ... +0.4 %, the smaller and held-out ones +0.6 ... +4.1 % but for a Qwen3-8B-like
    # b2's 0.0); at batch 1 -0.6 ... +3.6 % alone, so only with GEMV_PF at B1_PRE_SHAPES (sessions 32-33);
    # with ATT_DYN (KV >= 8192) not timed; not beside the LL hand-offs from batch 2 (LL_BATCH_MAX: the pair spills)
    if "O_PRE" not in ov:
        consts["O_PRE"] = int((2 <= v.batch <= 8 and not att_dyn and not (ll_rule and att_ll) or b1_pre)
                              and v.tp == 1 and sm == 90 and not on_gemm["O"])
    # COOP 0 with QKV_PRE 1 by default at batch 1 on one sm_90 GPU where the plan has no grid barrier left (the LL
    # hand-offs with DOWN_FLOW: COOP 0's workspace barrier never runs): the next layer's blocks enter as this one's
    # leave and load their first qkv step before the launch's wait. Measured on an H100 (bench/NOTES.md session 51),
    # against the cooperative launch, full context / row 191: -0.8 ... -2.9 % on 9 of 10 timings of 5 shapes
    # (Llama-3.2-1B KV 4096 -0.9 / 0.0, KV 1024 -1.0 / -0.8, Qwen2.5-0.5B -0.8 / -0.9, Qwen3-1.7B -1.3 / -1.9, held-out
    # SmolLM-360M-like -1.9 / -2.9); COOP 0 alone 0.0 ... +1.3 %; level at batch 4 (Llama-3.2-1B b4 0.0 / 0.0)
    if v.batch == 1 and v.tp == 1 and sm == 90 and norm_cluster == 1 and not open_barriers(STEPS, consts):
        consts["COOP"] = ov.get("COOP", 0)
        consts["QKV_PRE"] = ov.get("QKV_PRE", int(not consts["COOP"]))  # (an override COOP 0 plans the default)
    # QKV_QFIRST: under QKV_FLOW qkv's q tiles first (the k and v tiles first otherwise: whole heads after the first
    # round of tiles), so that every attention split but the one holding the new row (the only one that reads k and
    # v) waits for the first round only; alone level to -0.7 % beside ATT_ROT on an H100 (bench/NOTES.md session 67),
    # a default only with ATT_KVLAST (kvlast_rule). ATT_ROT: attention's static tasks start on the blocks with one qkv task fewer than
    # the rest (templates/stages/attention.cuh: task t on block (t + qkv's tasks mod grid) mod grid), where they would
    # otherwise start a qkv task late (1.7 us at Llama-3.2-1B b1 KV 4096 with QKV_NWG 16, session 66's timeline). By
    # default at batch 1 on one GPU with the static split and QKV_FLOW. Measured on an H100 (session 67) against the
    # plans build gives, full context / row 191 / row 1023, over 9 batch-1 shapes: +0.03 ... +0.23 % on 5 of 27
    # timings, the rest -0.04 ... -9.7 % (Qwen3-0.6B-like -9.7 % at row 191; Llama-3.2-1B KV 4096 -0.2 / -2.2 / -1.7,
    # Llama-3-8B 0.0 / -1.7 / +0.1, Qwen2.5-0.5B KV 4096 -1.7 / -0.6 / +0.1; and session 66's run, Llama-3.2-1B KV 1024
    # full / 191 -0.8 / +0.4): the appending split, alone at a short context, no longer waits behind a qkv tile. Not
    # from batch 2: Llama-3.2-1B b4 +1.1 / +0.7 / -1.8 %
    consts["QKV_QFIRST"] = qfirst
    # ATT_KVLAST: the appending split walks its cached rows without waiting for the new k and v, which two warps that
    # do not walk poll, append and fold in as one more warp state; beside QKV_QFIRST (q in qkv's first round of tiles,
    # k and v after) every split then starts after qkv's first round. It plans the static split, as ATT_ROT does. By
    # default with QKV_QFIRST (kvlast_rule, KVLAST_ROUNDS)
    consts["ATT_KVLAST"] = kvlast
    kvlast_needs = [(consts["QKV_FLOW"] == 2, "QKV_FLOW 2 (the head's words: with the counters "
                                               "attention waits for the k and v tiles anyway)"),
                    (not att_dyn, f"ATT_DYN 0 (the static split; asked: {att_dyn})"),
                    (att_warps <= nw - 2 and m.group <= nw - 2,
                     f"two warps besides the {att_warps} walkers and {m.group} query heads (of {nw})")]
    if kvlast and "ATT_KVLAST" not in ov and not all(ok for ok, _ in kvlast_needs):
        return plan(v, arch, overrides, skip_rule_off=skip_rule_off, gemm_rule_off=gemm_rule_off,
                    kvlast_rule_off=True)
    if kvlast:
        _needs(v.name, "ATT_KVLAST", 1, kvlast_needs)
    consts["ATT_ROT"] = ov.get("ATT_ROT", int(v.batch == 1 and v.tp == 1 and not att_dyn and consts["QKV_FLOW"] != 0))
    if consts["QKV_QFIRST"]:
        _needs(v.name, "QKV_QFIRST", 1, [(consts["QKV_FLOW"] != 0, "QKV_FLOW 1 or 2 (qkv -> attention by counters "
                                                                   "or words: without it no task order matters)")])
    if consts["ATT_ROT"]:
        _needs(v.name, "ATT_ROT", 1, [(not att_dyn, f"ATT_DYN 0 (the static split; asked: {att_dyn})"),
                                      (consts["QKV_FLOW"] != 0, "QKV_FLOW 1 or 2 (attention starts as its block "
                                                                "leaves qkv, not at a grid barrier)")])
    consts["H_STATS"] = h_stats
    batch_slices(v.name, consts, ov)
    if gemm_proj and (planned := [k for k in gemm_off if consts[k]]):  # (what the planner took beside it)
        raise PlanError(f"{v.name}: plan override GEMM_PROJ=1 needs {', '.join(f'{k} 0' for k in planned)} (this plan: "
                        f"{', '.join(f'{k} {consts[k]}' for k in planned)}; {GEMM_OFF[planned[0]]})")
    # the split GEMVs that reduce through ws_split and ws_count (not qkv under QKV_FLOW 2: attention sums its splits)
    reduced = {k: g for k, g in gemv.items() if g["KSPLIT"] > 1 and not (k == "qkv" and consts["QKV_FLOW"] == 2)}
    split_gemms = [g for g in gemm_tiles.values() if g["KSPLIT"] > 1]
    return {"consts": consts, "rows": v.batch, "gemv": gemv, "threads": THREADS, "smem_bytes": smem_bytes,
            **({"gemm": {"BM": g_bm, "BN": g_bn, "BK": g_bk, "STAGES": g_stages,
                         **{dict(PROJECTIONS)[p]: g for p, g in gemm_tiles.items()}}} if gemm_proj else {}),
            # the attention's counters, the split GEMVs' and GEMMs' are used in turn (each resets its own)
            "sizes": {"COUNTERS": max([v.batch * m.kv_heads] + [shapes[k][0] // 16 for k in reduced]
                                      + [g["tiles"] for g in split_gemms]),
                      # fragment order, or GEMM_PROJ's tiled layout (whole token tiles)
                      "XN_ROWS": consts["GEMM_XROWS"] if gemm_proj else math.ceil(v.batch / 8) * 8 if norm_global
                      else 0,
                      "XF_ROWS": math.ceil(v.batch / 8) * 8 if x_frag else v.batch,
                      "HB_ROWS": v.batch if hb_copy else 0,
                      "HSQ_TILES": m.hidden // 16 if h_stats else 0,
                      "TL_BLOCKS": sms if ov.get("TIMELINE") else 0,  # (the most blocks a launch has)
                      # H_LL with DOWN_FLOW: the most blocks the epoch's argument allows (one gate_up task each)
                      "LL_BLOCKS": gu_tasks if h_ll and down_flow else 0,
                      "SPLIT_FLOATS": max([0] + [g["KSPLIT"] * shapes[k][0] * v.batch for k, g in reduced.items()]
                                          + [(g["tiles"] - g["FULL"]) * g["KSPLIT"] * g_bm * g_bn
                                             for g in split_gemms])},
            "overrides": dict(sorted(ov.items()))}


MODE = Mode("decode", STEPS, plan, __doc__)
