"""Planning pieces every mode shares: the Mode/Step declaration, the GEMV tiling rule, the shared-memory check.

A mode (generator/modes/<mode>.py) declares its stages in order, the barrier after each, and a plan function that
turns a Variant into every compile-time constant of the kernel. Nothing here knows a particular mode.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import Callable

from .interface import CLOCK_SLOTS
from .targets import Arch

THREADS = 512  # one block of 16 warps per SM (cooperative grid of one block per SM)


class PlanError(ValueError):
    """The variant cannot be generated for its target (e.g. over the shared-memory budget); one line."""


def check_knob(name: str, knob: str, val, knobs: tuple) -> None:
    """A plan override's knob is one of the mode's `knobs` and its value an int, else PlanError (one line naming
    variant `name`); the mode checks the value's range."""
    if knob not in knobs:  # (a near miss named, the whole list otherwise)
        near = difflib.get_close_matches(str(knob), knobs, n=1)
        raise PlanError(f"{name}: plan override {knob}: unknown knob ("
                        + (f"did you mean {near[0]}?" if near else f"one of {', '.join(knobs)}") + ")")
    if isinstance(val, bool) or not isinstance(val, int):
        raise PlanError(f"{name}: plan override {knob}={json.dumps(val)}: must be an integer")


@dataclasses.dataclass(frozen=True)
class Step:
    """One top-level stage of a mode: `stage` names templates/<mode.headers>/<stage>.cuh and
    generator.reference.<stage>;
    `call` is its C call in the kernel body (arguments named as in generator.interface.ARGS, plus `smem`);
    `then` is what separates it from the next step: "grid" (a grid-wide barrier) or "none".
    `reduce` names what holds this step's partial sum when the layer is split over tp > 1 GPUs (a workspace buffer
    or the output): the kernel ends after this step and the runtime all-reduces it before the next launch.
    `flow` names a plan constant that, where it is non-zero, drops the step's grid barrier: the next step waits on
    per-tile counters for the parts it reads (decode's QKV_FLOW), polls the words it reads until they carry the
    launch's epoch (decode's ATT_LL), or needs nothing from other blocks (NORM_LOCAL: the norm
    step is empty, each block normalising its own copy inside the projection's stage).
    `pre` is a C statement run before the barrier that precedes the step (before the launch's wait for the previous
    launch where the step comes first): work that does not depend on the previous step (loading its first weights)."""
    stage: str
    call: str
    then: str = "grid"
    reduce: str = ""
    flow: str = ""
    pre: str = ""


@dataclasses.dataclass(frozen=True)
class Mode:
    """A kernel mode (decode, prefill, ...): its steps in order and its planner (Variant, Arch) -> plan dict."""
    name: str
    steps: tuple[Step, ...]
    plan: Callable
    doc: str
    headers: str = "stages"   # where its steps' headers live under templates/

    def __post_init__(self):
        assert len(self.steps) < CLOCK_SLOTS, f"interface.WORKSPACE's clock buffer holds {CLOCK_SLOTS} stamps"

    @property
    def grid_syncs(self) -> int:
        return sum(s.then == "grid" for s in self.steps)


def open_barriers(steps, consts: dict) -> int:
    """The grid barriers left inside one kernel of `steps` (Step, in order) under a plan's constants: each step but
    the last whose `then` is "grid" and whose `flow` constant is 0 (a barrier at a kernel's end is the launch
    boundary itself)."""
    return sum(s.then == "grid" and not consts.get(s.flow) for s in steps[:-1])


def kernels(mode: Mode, tp: int) -> list[dict]:
    """The launches of one layer step: one kernel "decoder_layer" with every step when tp = 1; with tensor
    parallel a kernel ends at each step that leaves a partial sum (Step.reduce), so the runtime can all-reduce
    it between launches. Each: {"name", "first" (index of its first step), "steps", "reduce" (or None)}."""
    out, cur = [], []
    for i, s in enumerate(mode.steps):
        cur.append(i)
        if (tp > 1 and s.reduce) or i == len(mode.steps) - 1:
            out.append({"first": cur[0], "steps": [mode.steps[j].stage for j in cur],
                        "reduce": s.reduce if tp > 1 and s.reduce else None})
            cur = []
    for k, d in enumerate(out):
        d["name"] = "decoder_layer" if len(out) == 1 else f"decoder_layer_{k}"
        # block 0's clock at the kernel's start: a later kernel's block 0 may sit on another SM (clocks differ), so
        # it stamps a slot of its own at the end of the clock buffer, not the previous kernel's last stamp
        d["start_slot"] = d["first"] if k == 0 else CLOCK_SLOTS - k
    assert len(mode.steps) < CLOCK_SLOTS - (len(out) - 1), \
        f"interface.WORKSPACE's clock buffer holds {CLOCK_SLOTS} stamps"
    return out


def align(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


def pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def gemv_split_k(n: int, k: int, sms: int) -> int:
    """The split-K a [n, k] projection with fewer 16-row tiles than `sms` would take: the largest divisor s <= 8 of
    its k-tiles with >= 16 k-tiles a task and every task on its own SM; 1 where the tiles fill the SMs. Measured
    on the H200 (bench/NOTES.md): neutral on Qwen2.5-0.5B, so it is a tuner candidate, not the default."""
    ktiles, tiles = k // 16, n // 16
    return max(s for s in range(1, 9) if s == 1 or (ktiles % s == 0 and ktiles // s >= 16 and tiles * s <= sms))


def gemv_balance_split(n: int, k: int, sms: int) -> int:
    """The split-K that best fills the last round of a [n, k] projection's tasks (plan_gemv's balance: a round of
    232 tasks on 132 SMs leaves 32 idle for the whole second task): the divisor s <= 8 of its k-tiles with >= 16
    k-tiles a task whose balance is highest, where it beats the unsplit plan's by >= 0.05; else 1. A tuner
    candidate (generator.tune)."""
    ktiles = k // 16
    # balance of whole-block (16-warp) groups: fewest_rounds' smaller groups fill one round by other means
    best, split = plan_gemv(n, k, sms, rebalance=False)["balance"] + 0.05, 1
    for s in range(2, 9):
        if (ktiles % s == 0 and ktiles // s >= 16
                and (b := plan_gemv(n, k, sms, s, rebalance=False)["balance"]) >= best):
            best, split = b + 1e-9, s
    return split


REBALANCE_BELOW = 0.9  # a plan whose rounds are filled less than this is re-planned with smaller groups
MIN_WARPS = THREADS // 32 * 64  # warps that must stream weights at once for the loads in flight (64 SMs' worth)


def fewest_rounds(tasks: int, nwg: int, sms: int) -> int:
    """Warps per task for `tasks` GEMV tasks planned with `nwg` warps each: where the last round of tasks leaves
    many groups idle (filled < REBALANCE_BELOW: 320 tiles on 132 SMs of 16-warp groups run 3 rounds, the last with
    56 busy SMs), the largest smaller power of two, >= 2, whose groups take every task in one round with >= MIN_WARPS
    warps streaming weights; else `nwg`. Each round ends in a block barrier and the next one's loads start cold, and
    a thin last round has too few loads in flight for the bandwidth. Measured on the H200 (bench/NOTES.md session
    13): hidden 5120 batch 16, o_proj and down_proj (320 tiles) 16 -> 4 warps in one round: +4.7 % and +5.1 % of the
    layer; hidden 2560 down_proj (160 tiles) and hidden 3072 o/down (192) 16 -> 8: +1.5 to +3 %; plans filled >= 0.94
    (128, 256, 1024, 1792 tiles) lost 1 to 7 % with smaller groups, and 1-2-warp groups on gate_up (1376-1728 tiles,
    filled 0.935-0.948) up to 4 %: one round, and never single warps, is what was measured to win."""
    per_sm = THREADS // 32
    rounds = math.ceil(tasks / (sms * (per_sm // nwg)))
    if rounds == 1 or tasks / (rounds * sms * (per_sm // nwg)) >= REBALANCE_BELOW:
        return nwg  # one round already (nothing to save), or full enough
    n = nwg // 2
    while n >= 2:
        if tasks <= sms * (per_sm // n):  # one round; the largest such group is the first found
            return n if tasks * n >= MIN_WARPS else nwg
        n //= 2
    return nwg


U_EVEN_MIN = 4  # plan_gemv: the fewest 16-byte loads in flight a warp that it takes for full steps


def plan_gemv(n: int, k: int, sms: int, ksplit: int = 1, umax: int = 8, rebalance: bool = True, tm: int = 1,
              full_steps: bool = False) -> dict:
    """Split-K KSPLIT (given: 1 unless a plan override sets it, a divisor of k/16), warps per task NWG and k-tiles
    a step per warp U (<= umax / TM: the TM tiles of a task each take U loads) for one [n, k] projection (tasks are
    TM 16-row tiles (given), or a KSPLIT-th of one's K range), balanced for `sms` blocks of THREADS threads;
    `rebalance`: smaller groups where that saves rounds (fewest_rounds); `full_steps`: U in full steps (below).
    Also returns U_fewest_steps: U as the fewest steps would take it."""
    ktiles, tiles = k // 16, n // 16
    ktiles //= ksplit
    tasks = tiles * ksplit // tm
    umax = max(1, umax // tm)
    # about four k-tiles per warp per task at least; short rows get small groups, so more tasks run at once
    nwg = max(1, min(16, pow2_floor(ktiles // 4)))
    if rebalance:
        nwg = fewest_rounds(tasks, nwg, sms)
    groups = sms * (THREADS // 32 // nwg)
    # 16-byte weight loads in flight per lane (registers): at most umax, in equal steps over the warp's k-tiles (a
    # partial last step holds registers for loads it predicates off)
    per_warp = math.ceil(ktiles / nwg)
    u = math.ceil(per_warp / math.ceil(per_warp / umax))
    # every step full where the warps' k-tiles allow it: the largest divisor of per_warp from U_EVEN_MIN below u
    # (more, smaller steps) instead of a partial last step (registers held for loads it predicates off). Measured on
    # the H200 (bench/NOTES.md session 27): 20 k-tiles a warp in steps of 5 instead of 7, 7, 6 +6.2 % a layer
    # (head_dim-80 MHA b1's o_proj) and +7 % (hidden-2560 b3's qkv and o_proj), 0.0 ... +0.8 % on hidden-5120 shapes'
    # gate_up and qkv; down_proj at 148 k-tiles a warp (Qwen2.5-7B) U 8 -> 4 +0.1 ... +1.7 % a layer at batch 1-8 (the
    # tuner's pick on 5 of 7 variants), at 76 +2.1 ... +2.4 %; where U already divides the warp's k-tiles, smaller
    # full steps changed nothing or lost (-0.7 ... +0.1 % on six shapes)
    fewest = u  # (the tuner's first candidate where the rule below moved U, and a spilling plan's first re-plan)
    if full_steps and ktiles % nwg == 0 and per_warp % u:
        u = next((d for d in range(u - 1, U_EVEN_MIN - 1, -1) if per_warp % d == 0), u)
    balance = tasks / (math.ceil(tasks / groups) * groups)
    return {"KSPLIT": ksplit, "NWG": nwg, "U": u, "U_fewest_steps": fewest, "TM": tm, "tasks": tasks,
            "balance": round(balance, 3)}


# ---- the GEMM engine (templates/gemm.cuh): prefill's projections, decode's GEMM_PROJ ----

# the GEMM ring's depth (cp.async; sm_90a: TMA tensor and bulk copies): up to 7 chunks in flight per SM (mma.sync;
# wgmma: 6, one stage is still being read by the mma in flight) keep HBM busy when a chunk is short (few tasks); the
# shared memory sets it lower for large tiles (GEMM_STAGES overrides it)
MAX_STAGES = 8
MAX_SPLIT = 16
MIN_SPLIT_GAIN = 0.1  # a split plan must cut the busiest SM's work by this fraction (its partials cost L2 traffic)
# ... and this much where every tile of more than a wave is split (FULL 0, tiles > SMs: every tile's partials go
# through L2): the model's 10.2 % for 8B down_proj at 2,048 token rows (352 tiles of 224 chunks, split 3) measured
# x1.056-1.067 slower than no split (bench/results/tune-prefill-h200-2026-12-02-2.txt, 8B 1 x 2048 and 4 x 512); the
# tuner still times that split (the plan's LOOSE)
MIN_SPLIT_GAIN_WAVES = 0.15
WAVES_MIN_CHUNKS = 32  # a split into more tasks than SMs keeps >= this many chunks a task


def split_k(tiles: int, chunks: int, sms: int, split_cost: float = 2.0,
            waves_gain: float = MIN_SPLIT_GAIN_WAVES) -> tuple[int, int]:
    """(FULL, KSPLIT) of a GEMM with `tiles` output tiles of `chunks` K chunks each on `sms` SMs: FULL tiles
    computed whole, the rest split KSPLIT ways. Minimises the busiest SM's work, rounds of tasks x chunks a task
    (+ `split_cost` chunks where split: storing the partial tile, summing a share of the splits', the counter),
    with >= 4 chunks a task, and splits only where that beats no split by MIN_SPLIT_GAIN (by `waves_gain` where
    every tile of more than a wave would be split); the fewest splits within 5 % of the least. Plans: every tile
    split into one wave of tasks (fewer tiles than SMs); the full waves whole and the tiles past them split over
    one wave (a partial last wave: 150 tiles on 132 SMs take 64 + 10 chunk-times instead of 2 x 64); every tile
    split into several waves only with >= WAVES_MIN_CHUNKS chunks a task (the last split to finish then sums the
    whole tile alone). Measured on the H200 (bench/NOTES.md, session 6): more waves of long tasks won (8B
    down_proj at 512 tokens, 88 tiles of 224 chunks, split 3: 231 -> 168 µs), of short ones lost or won by turns
    (8B gate_up, 150 tiles of 64 chunks, split 5: 100 -> 83 µs at 16 tokens, 161 -> 182 at 128); `megakernel tune`
    tries the others per variant."""
    def cost(full, k):
        rest = tiles - full
        return full // sms * chunks + -(-rest * k // sms) * -(-chunks // k) + (split_cost if k > 1 else 0)
    plans = [(0, k) for k in range(1, max(1, min(MAX_SPLIT, chunks // 4)) + 1)
             if k == 1 or tiles * k <= sms or -(-chunks // k) >= WAVES_MIN_CHUNKS]
    full = tiles // sms * sms
    if 0 < full < tiles:
        plans.append((full, max(1, min(MAX_SPLIT, chunks // 4, sms // (tiles - full)))))
    least = min(cost(*pl) for pl in plans)
    # the fewest partial tiles within 5 % of the least (whole waves first)
    best = min((pl for pl in plans if cost(*pl) <= 1.05 * least), key=lambda pl: ((tiles - pl[0]) * pl[1], pl[1]))
    need = waves_gain if best[0] == 0 and tiles > sms else MIN_SPLIT_GAIN
    if best[1] == 1 or cost(*best) > (1 - need) * cost(0, 1):
        return 0, 1
    return best


def wgmma_tile(rows: int, threads: int, bn_max: int = 128) -> tuple[int, int, int, int]:
    """The wgmma GEMM engine's tiling (templates/gemm.cuh, GEMM_WGMMA) for `rows` token rows and `threads` threads a
    block: (GEMM_WM, GEMM_TM, GEMM_TN, GEMM_BK). A warpgroup per 64 weight rows (threads / 128 of them: GEMM_BM =
    threads / 2), the tokens split into equal tiles of at most `bn_max` (multiples of 16, templates/wgmma.cuh has a
    wrapper for each up to 128), K in chunks of 64 (one 128-byte swizzled row; the ring's depth keeps the bytes in
    flight)."""
    token_tiles = -(-rows // bn_max)
    return threads // 32, 1, 2 * -(-rows // token_tiles // 16), 64


def gemm_group(sms: int, bm: int, bn: int) -> int:
    """GEMM_GM, the weight tiles per group of the GEMM's raster (gemm.cuh): the SMs' concurrent tiles then read ~gm
    weight tiles and ~sms / gm token tiles, least bytes at gm = sqrt(sms x token-tile bytes / weight-tile bytes)."""
    return max(1, round((sms * bn / bm) ** 0.5))


def gemm_stages(smem_per_block: int, stage_bytes: int) -> int:
    """GEMM_STAGES, the ring's depth: as many chunks as three quarters of the block's shared memory hold (the rest
    stays L1), MAX_STAGES at most, 3 at least."""
    return max(3, min(MAX_STAGES, smem_per_block * 3 // 4 // stage_bytes))


def gemm_split_cost(bm: int, bn: int, stage_bytes: int) -> float:
    """split_k's cost of a split, in chunks: the partial tile stored and read back through L2 (~half HBM's cost a
    byte), plus ~a chunk of synchronisation."""
    return 1 + bm * bn * 4 / stage_bytes


SMEM_RESERVED = 1024  # bytes of shared memory the system reserves per block (sm_80 and later)
L1_ENOUGH = 60 * 1024  # bytes of L1 the decode planner keeps beside the block's shared memory where it can (l1_bytes)


def l1_bytes(arch: Arch, smem_bytes: int, blocks: int = 1) -> int:
    """Bytes of L1 an SM keeps beside `blocks` resident blocks of `smem_bytes` shared memory each (the decode
    kernel: one): the driver configures the smallest carveout (Arch.carveouts_kb) that holds them and SMEM_RESERVED
    each, and the rest of the unified storage is L1. Measured on the H200 (bench/NOTES.md session 16): the GEMV's
    weight loads (ld.global, staged in L1) stream 3-6 % slower with 28 KB of L1 than with 60 KB (5-11 % on batch
    20-24 shapes), 0.4-2.7 % slower with 60 KB than with >= 92 KB."""
    need = max(1, blocks) * (smem_bytes + SMEM_RESERVED)
    steps = [c * 1024 for c in arch.carveouts_kb if c * 1024 >= need]
    return arch.unified_kb * 1024 - (steps[0] if steps else need)


def check_smem(name: str, arch: Arch, parts: dict[str, tuple[int, str]]) -> int:
    """The block's shared memory: the largest of the stages' needs `parts` {stage: (bytes, advice)}. Raises
    PlanError naming the stage, the target and what would lower that stage's need."""
    stage, (need, advice) = max(parts.items(), key=lambda kv: kv[1][0])
    if need > arch.smem_per_block:
        raise PlanError(f"{name}: needs {need} B of shared memory per block ({stage} stage), over sm_{arch.sm}'s "
                        f"limit of {arch.smem_per_block} B ({arch.smem_per_block // 1024} KB); {advice}")
    return need
