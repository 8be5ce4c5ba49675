"""Tuned plans: the candidate plans the tuner times, and tuning/<gpu-slug>.json, the winner per variant on a GPU.

The mode's planner (generator.modes.<mode>.plan) stays the single source of truth: a tuned plan is the default plan
with a few knobs overridden ({"QKV_NWG": 8, "ATT_C": 512, ...}: decode.KNOBS, prefill.KNOBS), and the planner
validates the overrides and derives every dependent constant (ATT_NSPLIT, the shared-memory offsets) from them. A
bad or stale entry in a tuning file is ignored with a one-line warning, never an error.

tuning/<gpu-slug>.json = {variant: {"overrides": {...}, "default_us", "tuned_us", "candidates": n, "failed": n,
                                    "identity": sha256 of the variant's parameters and arch, "gpu", "date",
                                    "knobs": the measured plan's knobs, and where the decode candidates were not
                                    timed at full context alone "positions": "mixed", "row N" or several of
                                    them ("full, row 191": default_us and tuned_us their geometric means, "us_at"
                                    each one's {"default", "tuned"}) (`tune --positions`)}}

This module imports neither torch nor bench: `bench/tune.py` compiles, verifies and times the candidates.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import math
import os
from pathlib import Path

from .manifest import identity
from .modes import decode, prefill
from .plan import PlanError
from .routes import gpu_slug
from .targets import DEFAULT_ARCH, arch as get_arch, gpu_arch
from .variants import Variant

ROOT = Path(__file__).resolve().parent.parent
TUNING_DIR = ROOT / "tuning"


def tuning_dir() -> Path:
    """tuning/ of this source tree, or $MEGAKERNEL_TUNING_DIR."""
    return Path(os.environ.get("MEGAKERNEL_TUNING_DIR") or TUNING_DIR)


def tuning_file(gpu: str, directory: Path | None = None) -> Path:
    """The tuning file of `gpu` (a device name or its slug; a path ending in .json is taken as is)."""
    if gpu.endswith(".json"):
        return Path(gpu)
    return Path(directory or tuning_dir()) / f"{gpu_slug(gpu)}.json"


def default_tuning_file(directory: Path | None = None) -> Path | None:
    """The only tuning file in tuning/, or None when there is none or more than one (then say --tuned-for)."""
    d = Path(directory or tuning_dir())
    files = sorted(d.glob("*.json")) if d.is_dir() else []
    return files[0] if len(files) == 1 else None


def display(path: Path) -> str:
    """`path` relative to the source tree where it lies in it (what the manifest and messages show)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def parse_tuning(path: Path) -> dict | None:
    """The file's {variant: entry}, or None where it is unreadable, not JSON (an empty file included) or not a JSON
    object (tuning_problem says which)."""
    return _load_tuning(path)[0]


def tuning_problem(path: Path, entries: bool = False) -> str | None:
    """Why `path` is not a tuning file, in a few words (the JSON error's line and column), or None where it is.
    entries: also where the object has entries but none holds an "overrides" object (some other JSON file, e.g. a
    checkpoint's config.json)."""
    doc, problem = _load_tuning(path)
    if problem is None and entries and doc and not any(isinstance(e, dict) and isinstance(e.get("overrides"), dict)
                                                       for e in doc.values()):
        keys = "its one key is not" if len(doc) == 1 else f"none of its {len(doc)} keys is"
        return f"{keys} an entry with an \"overrides\" object"
    return problem


def _load_tuning(path: Path) -> tuple[dict | None, str | None]:
    """(the file's object, None) or (None, why it is not a tuning file): one read of the file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror})"
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start})"
    if not text.strip():
        return None, "an empty file"
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return None, (f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})" if hasattr(exc, "lineno")
                      else "not JSON")
    return (doc, None) if isinstance(doc, dict) else (None, "not a JSON object")


def read_tuning(path: Path) -> dict:
    """The file's {variant: entry} ({} where it is missing or unreadable: a warning, not an error, is the caller's
    business)."""
    return parse_tuning(path) or {}


def raw_overrides(path: Path, name: str):
    """What the file holds for variant `name` (its "overrides", or the entry itself when malformed; None where
    absent): the manifest compares this to tell a build whose tuning changed."""
    e = read_tuning(path).get(name)
    return e.get("overrides") if isinstance(e, dict) else e


def tuned_on_other_arch(entry, v: Variant, arch: str) -> str | None:
    """The architecture ("90") of the GPU a tuning entry for `v` was tuned on, where that is not `arch` and the
    entry's identity is `v`'s on it (a valid entry for another architecture's builds); else None."""
    if not isinstance(entry, dict):
        return None
    tuned_on = gpu_arch(str(entry.get("gpu", "")))
    same = tuned_on is None or tuned_on == str(arch).rstrip("a")
    return None if same or entry.get("identity") != identity(v.params(), tuned_on) else tuned_on


def resolve(v: Variant, arch: str, path: Path | None) -> tuple[dict, str, dict | None, str | None]:
    """(overrides, plan_source, tuned figures or None, warning or None) for building `v` with tuning file `path`.

    No file, no entry for `v`, an entry tuned on a GPU of another architecture than `arch`, or one whose overrides
    plan what the default plan now is: the default plan.
    An entry that is malformed, stale (tuned for other parameters), or that the planner refuses: the default plan
    and a one-line warning."""
    from .render import plan  # render imports Jinja: only when resolving
    arch = str(arch).rstrip("a")  # sm_90 builds as sm_90a: one arch for tuning
    if path is None:
        return {}, "default", None, None
    path = Path(path)
    where = display(path)
    if not path.exists():
        return {}, "default", None, None
    doc, problem = _load_tuning(path)
    if doc is None:
        return {}, "default", None, f"warning: {where}: not a tuning file (a JSON object): {problem}; default plans used"
    e = doc.get(v.name)
    if e is None:
        return {}, "default", None, None
    why = None
    if not isinstance(e, dict) or not isinstance(e.get("overrides"), dict):
        why = "malformed entry (no \"overrides\" object)"
    elif e["overrides"].get("TIMELINE"):  # (a build that stamps timers into a workspace: bench/timeline.py's)
        why = "TIMELINE is a measuring build (bench/timeline.py), not a plan to serve: delete it from the overrides"
    elif e.get("knobs") is not None and not isinstance(e["knobs"], dict):
        why = "malformed entry (its \"knobs\", what was measured, is not an object: fix it or delete it)"
    elif e.get("identity") not in (None, identity(v.params(), str(arch))):
        if tuned_on_other_arch(e, v, arch):
            return {}, "default", None, None  # not this build's plan
        why = ("its entry was tuned for other parameters or another arch (a model of the same name and another "
               "shape, or this variant before its declaration changed): not this variant's plan (`megakernel tune` "
               "it, rename the model, or build with --no-tuned)")
    else:
        try:
            p = plan(v, str(arch), overrides=e["overrides"])
            now = knob_dict(p)
            # a knob the overrides set that the record lacks was set by hand after it was measured
            unmeasured = [k for k in e["overrides"] if isinstance(e.get("knobs"), dict) and k not in e["knobs"]]
            if isinstance(e.get("knobs"), dict) and (knobs_differ(e["knobs"], now) or unmeasured):
                rec = {**KNOBS_BEFORE, **e["knobs"]}
                diff = ", ".join([f"{k} {rec.get(k)} -> {now.get(k)}" for k in knobs_differ(e["knobs"], now)]
                                 + [f"{k} (not recorded) -> {now.get(k)}" for k in unmeasured])
                why = (f"the knobs it records (what was measured) differ from what its overrides plan now ({diff}): "
                       "the planner's defaults changed since it was tuned (run `megakernel tune` again) or the "
                       "overrides were edited (delete its \"knobs\" to build them as they are)")
        except PlanError as exc:
            msg = str(exc)  # the line names v once (the planner's message starts with it, or its overrides after)
            why = f"refused by the planner: {msg[len(v.name):].lstrip(': ') if msg.startswith(v.name) else msg}"
    if why:
        return {}, "default", None, f"warning: {where}: {v.name}: {why}; default plan used"
    try:
        default = knob_dict(plan(v, str(arch)))
    except PlanError:  # a plan only the overrides make (tensor parallel's NORM_GLOBAL=1): the tuned one
        default = None
    if default is not None and not knobs_differ(default, now):
        # the planner's default has since become the tuner's pick: the default plan, and the gain measured against
        # the old default is not this build's (`entry["tuning"]` still records the file's overrides)
        return {}, "default", None, None
    figures = {k: e[k] for k in ("default_us", "tuned_us")  # times a hand edit may have broken: not shown
               if isinstance(e.get(k), (int, float)) and not isinstance(e[k], bool)
               and math.isfinite(e[k]) and e[k] > 0}
    return dict(e["overrides"]), f"tuned ({where})", figures or None, None


def _half(n: int) -> int:
    return n // 2


BINARY_KNOBS = ("ATT_COMBINE", "X_FRAG", "GEMV_PF", "QKV_FLOW", "DOWN_FLOW", "ATT_INLINE", "NORM_FOLD", "QKV_PRE",
                "O_PRE", "GU_PRE", "DOWN_PRE", "H_STATS", "ATT_DYN", "RED_DB", "NORM_GLOBAL", "ATT_TMA", "ATT_LL", "H_LL",
                "COOP", "GU_SKIP", "GEMM_PROJ", *(f"{p}_GEMM" for p in decode.GEMM_OPTIONAL), "ATT_ROT",
                "QKV_QFIRST", "ATT_KVLAST")  # on/off knobs: 0 is a setting, not a size


ATT_WALK_KNOBS = ("ATT_WARPS", "ATT_C", "ATT_TMA", "ATT_STAGES")  # candidates kept past the limit (candidates)
ATT_KEEP = 5


def candidates(v: Variant, arch: str = DEFAULT_ARCH, limit: int = 32, positions: str = "full") -> list[dict]:
    """The plans the tuner times for `v`: {} (the default plan) first, then single-knob neighbours of it, each
    accepted by the planner, no two alike (by the knob values they plan), at most `limit` in all: the first ones in
    the order below, except that up to ATT_KEEP of the attention walk's neighbours (ATT_WALK_KNOBS) are kept in place
    of the last others where the limit would cut them.

    Neighbours: per projection U in the fewest steps where the planner took full steps (plan.plan_gemv: the first
    re-plan of a default that spills), GEMM_PROJ flipped (sm_90, one GPU, batch >= 32; where planned, QKV_GEMM,
    O_GEMM and DOWN_GEMM flipped, each GEMM's split-K halved and doubled, GEMM_TOKEN_TILE at the batch where it takes
    several token tiles, up to 128, and no GEMV knob of the projections it moves), split-K (where it has fewer tiles than SMs: plan.gemv_split_k; where a split fills
    the last round of tasks better: plan.gemv_balance_split; qkv's under QKV_FLOW 2 whose words attention sums, last
    of all: level to +3 % a layer at batch 1, bench/NOTES.md session 54, so a limited tune cuts them); X_FRAG
    (o_proj's and down_proj's input in fragment order), QKV_FLOW flipped, DOWN_FLOW 1 where not planned (0 where planned, right after the U above: a spilling
    default's re-plan tries the counters' registers first; 2, act as LL words, after the LL hand-offs where H_LL is
    and the planner did not take it),
    the LL hand-offs (ATT_LL, QKV_FLOW 2, H_LL) together on where the planner has them off (from batch 2 with O_PRE
    off) and off where on (batch <= 8, one GPU; from batch 2 with O_PRE 1 back), the cooperative launch (COOP 1,
    QKV_PRE 0) where the planner launches without it, GU_SKIP flipped under DOWN_FLOW 2 (down_proj's blocks off
    gate_up: -5 % to +19 % a layer at batch 1, bench/NOTES.md session 57), DOWN_SMEM 1 where down_proj's tiles
    are fewer than the SMs and the planner accepts it (down_proj's first task bulk-copied into shared memory: -3.6 ...
    +3.9 % by KV length, session 66; last of all), ATT_COMBINE 1, 2, 3 and 4 where not
    planned (0 never won; 3 and 4 where the planner takes them: no ATT_DYN, one GPU, every attention task in one round), NORM_FOLD 0 and 1 where
    not planned and 3 at batch 1-2 (RMSNorm in bf16 only), GEMV_PF 1 (the next round's weight
    loads early) and 2 (every step's loads a step early), O_PRE and GU_PRE flipped (o_proj's / gate_up's first weights
    loaded before the barrier before their stage: measured +2 % on Llama-3.2-1B b8 and +3.5 % on a hidden-5120 b16
    shape, -0.3 to -2.3 % elsewhere; bench/NOTES.md session 14; QKV_PRE and DOWN_PRE never won by 1 %), H_STATS
    flipped (the second norm's statistics from o_proj: 0 to +1.6 % on 8 of 9 batch 1-4 shapes, -6 % at batch 32),
    RED_DB 1 where the planner took one buffer of partial sums (two were 2 % faster at batch 32 where one only added
    L1 above 60 KB); at batch >= 16 NORM_FOLD 2 where not planned and NORM_CLUSTER 2 (last, so the limit cuts them
    first; these and the NORM_FOLD flips with NORM_GLOBAL 0 where it is planned: they keep the rows in shared
    memory); at batch >= 8 NORM_GLOBAL flipped (last: the norms' rows in global memory, more L1 for one or two grid
    barriers, H_STATS as that plan defaults it; +3 % on the 1B b20 where the planner keeps the rows, session 23);
    per projection NWG halved and doubled (U as planned) and U doubled (halved where that would pass 8) (and from
    batch 16, last of all, its batch slices <P>_BS halved and doubled: slices of one n-tile at least, and with
    NORM_GLOBAL its <P>_TM flipped between 1 and 2); attention:
    ATT_WARPS halved (ATT_C re-derived), ATT_C doubled (half the splits) and halved (twice the splits: a static split,
    so ATT_DYN off where it is the default), ATT_TMA flipped on sm_90+ (the walk's tiles by TMA tensor copies or
    cp.async: -2.4 ... +2.6 % a layer, bench/NOTES.md session 24), ATT_STAGES 3 (a deeper ring; with fewer walker
    warps where 3 stages of all of them do not fit), ATT_DYN 2 (stream-K) where the planner did not take it and its model gains
    STREAM_TRY_GAIN (the static split leaves blocks idle or takes a second round: measured -4.5 ... +7 % a layer
    where one round leaves SMs idle, bench/NOTES.md session 22), and where it took it the split it replaced (ATT_DYN
    0, or 1 from KV 8192). ATT_DYN 1 is tried against a static plan, stream-K's piece charge (ATT_PIECE_TILES
    halved and doubled) where it is planned, and ATT_ROT flipped at batch <= 8 with the static split and QKV_FLOW,
    only where the candidates are not timed at full context (`positions`: what `bench/tune.py --positions` times):
    they matter at mixed or short positions; at batch 1 QKV_QFIRST with ATT_KVLAST flipped (the pair) with QKV_FLOW 2
    and the static split. A candidate whose split count moves the
    planner's ATT_COMBINE default keeps the default plan's, and so does one whose ATT_DYN moves O_PRE's; one that turns
    the planner's LL hand-offs off keeps as many of them as the planner allows with it."""
    from .render import plan
    base = plan(v, arch)
    d = base["consts"]
    tries: list[dict] = []
    if base["mode"] == "prefill":
        tries = _prefill_tries(base, get_arch(arch).sms)
    projections = decode.PROJECTIONS if base["mode"] == "decode" else ()
    for prefix, key in projections:  # U in the fewest steps first where the planner took full steps instead: the
        g = base["gemv"][key]       # re-plan of a default that spills tries it first (its registers moved)
        if "U_fewest_steps" in g and g["U_fewest_steps"] != g["U"]:
            tries.append({f"{prefix}_U": g["U_fewest_steps"]})
    if base["mode"] == "decode" and d["DOWN_FLOW"]:  # (the re-plan of a spilling default: the
        tries.append({"DOWN_FLOW": 0})  # counters' registers first, as the newest default's)
    late: list[dict] = []  # tried after every other candidate (a limited tune, a re-plan's first clean one: not them)
    last: list[dict] = []  # ... and after those (untimed beyond the shapes they were built for)
    # GEMM_PROJ flipped (gate_up, and qkv_proj / o_proj by the planner's rule, on the GEMM engine or the GEMVs; sm_90,
    # one GPU, from batch 32: +3.5 ... +8.7 % a layer there, the default from decode.GEMM_BATCH_MIN), and where planned
    # QKV_GEMM, O_GEMM and DOWN_GEMM flipped, the batch in one token tile and each engine GEMM's split-K halved and
    # doubled; the GEMV knobs of the projections
    # on the engine plan nothing
    gemm_on = base["mode"] == "decode" and d.get("GEMM_PROJ")
    if base["mode"] == "decode" and get_arch(arch).number == 90 and v.tp == 1 and v.batch >= 32:
        tries.append({"GEMM_PROJ": 1 - d["GEMM_PROJ"]})
    if gemm_on:  # (qkv_proj's, o_proj's and down_proj's engine flipped: decode.GEMM_TASKS_MIN_SHARE's rule)
        tries += [{f"{prefix}_GEMM": 1 - d[f"{prefix}_GEMM"]} for prefix in decode.GEMM_OPTIONAL]
        one = -(-v.batch // 16) * 16  # (the batch in one token tile: each weight tile read once; session 71)
        if d["GEMM_TN"] * 8 < v.batch and one <= 128:
            tries.append({"GEMM_TOKEN_TILE": one})
        for prefix in (p for p in decode.GEMM_PROJECTIONS if decode.on_engine(d, p)):
            ks, chunks = d[f"{prefix}_GSPLIT"], -(-base["gemm"][dict(decode.PROJECTIONS)[prefix]]["K"] // d["GEMM_BK"])
            tries += [{f"{prefix}_GSPLIT": s} for s in dict.fromkeys((max(1, ks // 2), ks * 2 if ks > 1 else 2))
                      if s != ks and s <= min(decode.MAX_SPLIT, chunks)]
    if gemm_on:  # (the GEMVs' knobs: down_proj's, and those of qkv_proj and o_proj where they stay GEMVs)
        projections = tuple((p, k) for p, k in projections if not decode.on_engine(d, p))
    for prefix, key in projections:  # split-K first: where it applies, the largest measured effects
        splits = [base["gemv"][key]["split_k"], base["gemv"][key]["split_balance"]]
        # qkv's splits whose words attention sums (QKV_FLOW 2, at most `cap` splits: level to +3 % at batch 1 on an
        # H100, bench/NOTES.md session 54) go last; beyond the cap a split takes the reduction (QKV_FLOW 0), in place
        cap = decode.QKV_WORDS_MAX // decode.qkv_lane_words(d["HEAD_DIM"]) if key == "qkv" and d["QKV_FLOW"] == 2 else 0
        if cap and max(splits) > 1:  # (the most splits whose words attention holds, so the hand-offs stay)
            splits.append(max(s for s in range(1, min(cap, max(splits)) + 1) if d["HIDDEN"] // 16 % s == 0))
        for ks in (ks for ks in dict.fromkeys(splits) if ks > 1):
            (late if ks <= cap else tries).append({f"{prefix}_KSPLIT": ks})
    ll_off = {"ATT_LL": 0, "QKV_FLOW": 1, "H_LL": 0}
    if base["mode"] == "decode" and v.batch <= 8 and v.tp == 1:  # the LL hand-offs together, flipped; turned on at
        # batch >= 2 with O_PRE off (its pre-loaded step held through attention beside ATT_LL's words spilled on 8 of
        # 11 shapes, none without it: bench/NOTES.md session 50)
        on = {"ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1, **({"O_PRE": 0} if v.batch > 1 and d["O_PRE"] else {})}
        # (off from batch 2 with the O_PRE 1 the planner takes without them, where it takes it: O_PRE 0 alone lost; at
        # batch 1 with the O_PRE 1 the planner plans without them: B1_PRE's, past decode.LL_HIDDEN_MAX)
        try:
            off_pre = plan(v, arch, overrides=ll_off)["consts"]["O_PRE"] if d["ATT_LL"] and v.batch == 1 else 0
        except PlanError:
            off_pre = 0
        back = {"O_PRE": 1} if not d["O_PRE"] and (v.batch > 1 and not d["ATT_DYN"] or off_pre) else {}
        tries.append({**ll_off, **back} if d["ATT_LL"] else on)
        # QKV_QFIRST with ATT_KVLAST flipped, the pair (batch 1's decode.kvlast_rule: -0.1 ... -2.7 % where qkv's k and
        # v tasks make a second round of its warp groups, +1.2 ... +2.2 % where one round holds them all; bench/NOTES.md
        # session 68), early: a default tune's limit reaches it
        if v.batch == 1 and d["QKV_FLOW"] == 2 and d["ATT_DYN"] == 0:
            tries.append({"QKV_QFIRST": 1 - d["ATT_KVLAST"], "ATT_KVLAST": 1 - d["ATT_KVLAST"]})
        tries += [{"DOWN_FLOW": 2}] if d["H_LL"] and d["DOWN_FLOW"] != 2 else []  # (act as LL words too)
        tries += [{"COOP": 1, "QKV_PRE": 0}] if not d["COOP"] else []  # (the cooperative launch back, batch 1's rule)
        tries += [{"GU_SKIP": 1 - d["GU_SKIP"]}] if d["DOWN_FLOW"] == 2 else []  # (down_proj's blocks off gate_up)
        # down_proj's first task copied into shared memory from gate_up's start (never planned; H100, session 66:
        # Qwen2.5-0.5B b1 -3.6 ... +3.9 % a layer by KV length), where down_proj's tiles leave SMs idle, the case it
        # was built for; after every other candidate (untimed elsewhere: a limited tune cuts it first)
        last += [{"DOWN_SMEM": 1}] if not d["DOWN_SMEM"] and d["HIDDEN"] // 16 < get_arch(arch).sms else []
    # (NORM_FOLD, NORM_CLUSTER: they keep the rows in shared memory, so where NORM_GLOBAL is planned (from batch 16)
    # they come with NORM_GLOBAL 0, said explicitly: a candidate that moves NORM_GLOBAL unasked is skipped below)
    local = {"NORM_GLOBAL": 0} if d.get("NORM_GLOBAL") else {}
    if base["mode"] == "decode":
        # (QKV_FLOW 1 beside GEMM_PROJ: where qkv_proj and o_proj are GEMVs, asked to stay so: decode.GEMM_OFF)
        flow = {"QKV_GEMM": 0, "O_GEMM": 0} if gemm_on and not (d["QKV_GEMM"] or d["O_GEMM"]) else {}
        tries += [{"X_FRAG": 1 - d["X_FRAG"]}, {"GEMV_PF": 1 if d["GEMV_PF"] != 1 else 0},
                  {"GEMV_PF": 2 if d["GEMV_PF"] != 2 else 0}, {"QKV_FLOW": 1 if d["QKV_FLOW"] != 1 else 0, **flow},
                  *([{"DOWN_FLOW": 1}] if d["DOWN_FLOW"] != 1 else []),
                  *({"ATT_COMBINE": c} for c in (1, 2, 3, 4) if c != d["ATT_COMBINE"]),
                  *({**local, "NORM_FOLD": f} for f in (0, 1) if f != d["NORM_FOLD"]),
                  *([{"NORM_FOLD": 3}] if d["NORM_FOLD"] != 3 and v.batch <= 2 and not d.get("NORM_GLOBAL") else []),
                  # (O_PRE turned on beside the hand-offs from batch 2: with them off, the pair spills)
                  *([] if decode.on_engine(d, "O") else  # (their first weight steps: the GEMVs')
                    [{"O_PRE": 1 - d["O_PRE"], **(ll_off if v.batch > 1 and d["ATT_LL"] and not d["O_PRE"] else {})}]),
                  *([] if gemm_on else [{"GU_PRE": 1 - d["GU_PRE"]}]),
                  {"H_STATS": 1 - d["H_STATS"]}]
        tries += [{"RED_DB": 1}] if d["RED_DB"] == 0 else []
    for prefix, key in projections:
        nwg, u = d[f"{prefix}_NWG"], d[f"{prefix}_U"]
        umax = 8 // d.get(f"{prefix}_TM", 1)  # the planner's own bound: TM tiles' loads a step
        tries += [{f"{prefix}_NWG": _half(nwg)}, {f"{prefix}_NWG": nwg * 2},
                  {f"{prefix}_U": u * 2 if u * 2 <= umax else u // 2}]
        bs = d.get(f"{prefix}_BS", 1)  # (decode from batch 16, after all others: the batch slices halved or doubled)
        if base["mode"] == "decode" and d.get("NORM_GLOBAL"):  # (TM flipped where X comes from L2: the rule
            late += [{f"{prefix}_TM": 1 if d[f"{prefix}_TM"] > 1 else 2}]  # measured 2 ... 7 % either way, session 58)
        nt = -(-v.batch // 8)  # (n-tiles; a slice count that leaves one without any is not tried)
        late += [{f"{prefix}_BS": b} for b in (bs // 2, bs * 2) if b >= 1 and b != bs and (b - 1) * -(-nt // b) < nt] \
            if base["mode"] == "decode" and v.batch >= 16 else []
    w, c = d.get("ATT_WARPS", 0), d.get("ATT_C", 0)  # decode's attention knobs
    if base["mode"] == "decode":
        tries += [{"ATT_WARPS": _half(w)}, {"ATT_C": c * 2}, {"ATT_C": _half(c)}]
        # the walk's copy engine flipped (sm_90+; the planner takes TMA from batch 16: -1.6 ... +0.6 % at batch 8),
        # NORM_GLOBAL kept as planned (its batch rule goes with ATT_TMA)
        tries += [{"ATT_TMA": 1 - d["ATT_TMA"], **({"NORM_GLOBAL": 1} if d["NORM_GLOBAL"] else {})}] \
            if get_arch(arch).number >= 90 else []
        tries += [{"ATT_STAGES": 3, "ATT_WARPS": n} if n != w else {"ATT_STAGES": 3} for n in range(w, 0, -1)]
        kv = d["WINDOW"] or v.seq_len  # the rows attended (a sliding window's)
        if d["ATT_DYN"] == 2:
            tries += [{"ATT_DYN": int(kv >= decode.ATT_DYN_MIN_SEQ)}]
            if positions != "full":
                tries += [{"ATT_PIECE_TILES": t} for t in (d["ATT_PIECE_TILES"] // 2, d["ATT_PIECE_TILES"] * 2)]
        elif 2 <= v.batch <= 32 and v.tp == 1 and decode.stream_gain(
                {**d, "ATT_NSPLIT": decode.stream_room(kv)},
                get_arch(arch).sms, decode.DTYPES[v.model.dtype].bytes) >= decode.STREAM_TRY_GAIN:
            tries += [{"ATT_DYN": 2}]
        if positions != "full" and d["ATT_DYN"] == 0 and 2 <= v.batch <= 32 and v.tp == 1:
            tries += [{"ATT_DYN": 1}]
        # ATT_ROT flipped (batch 1's default; level at full context, -0.6 ... -9.7 % at row 191 on 7 of 9 batch-1
        # shapes, +1.1 ... -1.8 % at Llama-3.2-1B b4: bench/NOTES.md session 67), where positions short of the cache
        # are timed: at full context it times noise
        if positions != "full" and d["ATT_DYN"] == 0 and d["QKV_FLOW"] and v.batch <= 8 and v.tp == 1:
            tries += [{"ATT_ROT": 1 - d["ATT_ROT"]}]
        # at batch >= 16: the gain read from L1 (NORM_FOLD 2; 1B b32 +1.4 % against fold 1) and the norms' rows copied
        # once a cluster of 2 blocks (NORM_CLUSTER 2: +0.9 to +2.8 % on 5 of 6 such shapes, -1 % on one; session 17)
        tries += [{**local, "NORM_FOLD": 2}] if d["NORM_FOLD"] != 2 and v.batch >= 16 else []
        tries += [{**local, "NORM_CLUSTER": 2}] if v.batch >= 16 else []
        tries += [{"NORM_GLOBAL": 1 - d["NORM_GLOBAL"]}] if v.batch >= 8 else []
    tries += late + last
    out, seen, stage3 = [{}], {knob_values(base)}, False
    for ov in tries:  # (every try planned: the limit is applied below)
        if "ATT_STAGES" in ov and stage3:
            continue
        if any(val < 1 for k, val in ov.items() if k not in BINARY_KNOBS):  # their 0 is a choice
            continue
        try:
            p = plan(v, arch, overrides=ov)
            # another split count (or ATT_DYN off) moved the combine's default, ATT_DYN moved O_PRE's, or a projection's
            # NWG / U moved DOWN_FLOW's: keep the default plan's, so the candidate changes one thing (the ATT_COMBINE,
            # O_PRE and DOWN_FLOW candidates time the other; a split gate_up / down_proj takes the barrier, GEMV_PF 1
            # the counters or barrier: not pinned)
            split = any(k.endswith("_KSPLIT") and val > 1 for k, val in ov.items())
            pin = {k: d[k] for k in ("ATT_COMBINE", "O_PRE", "DOWN_FLOW") if k in d and k not in ov
                   and p["consts"].get(k) != d[k] and not (k == "DOWN_FLOW" and (split or ov.get("GEMV_PF") == 1))}
            if pin:
                try:
                    p = plan(v, arch, overrides={**ov, **pin})
                except PlanError:
                    if pin.get("DOWN_FLOW") != 2:
                        raise
                    del pin["DOWN_FLOW"]  # (act as LL words needs H_LL, which this candidate turned off)
                    p = plan(v, arch, overrides={**ov, **pin})
                ov = {**ov, **pin}
            # a knob that turned the planner's LL hand-offs off (split-K, H_STATS, X_FRAG 0): as many of them kept on
            # as the planner allows with it (the largest subset first)
            ll = {k: d[k] for k in ("ATT_LL", "QKV_FLOW", "H_LL") if d.get("ATT_LL") and k not in ov
                  and p["consts"].get(k) != d[k]}
            for keep in (c for n in range(len(ll), 0, -1) for c in itertools.combinations(ll, n)):
                try:
                    p, ov = plan(v, arch, overrides={**ov, **{k: ll[k] for k in keep}}), \
                        {**ov, **{k: ll[k] for k in keep}}
                    break
                except PlanError:
                    continue
        except PlanError:
            continue
        if "NORM_GLOBAL" not in ov and p["consts"].get("NORM_GLOBAL") != d.get("NORM_GLOBAL"):
            continue  # a knob whose rows no longer fit moved them to global memory: two changes, not one
        if "GEMM_PROJ" not in ov and p["consts"].get("GEMM_PROJ") != d.get("GEMM_PROJ"):
            continue  # a knob GEMM_PROJ cannot run with (QKV_FLOW, DOWN_FLOW) turned it off: two changes, not one
        key = knob_values(p)
        if key in seen:
            continue
        seen.add(key)
        out.append(ov)
        stage3 = stage3 or "ATT_STAGES" in ov
    if len(out) > limit:  # the first `limit`, but the attention walk's neighbours kept (up to ATT_KEEP of them): a
        # small model's many split-K and per-projection candidates would otherwise push them all past the limit
        att = [i for i, ov in enumerate(out) if any(k in ATT_WALK_KNOBS for k in ov)][:min(ATT_KEEP, limit // 4)]
        rest = [i for i in range(len(out)) if i not in att][:limit - len(att)]
        out = [out[i] for i in sorted(rest + att)]
    return out


def _prefill_tries(base: dict, sms: int) -> list[dict]:
    """Prefill neighbours of the default plan: per projection every tile split (not at all, half and twice the
    planned ways, the most one wave of tasks allows) or the full waves whole and the rest split over one wave;
    the GEMM raster's group halved and doubled; a ring stage more; the attention inlined (or not)."""
    tries = []
    for prefix, key in prefill.PROJECTIONS:
        g = base["gemm"][key]
        ks, chunks = g["KSPLIT"], -(-g["K"] // base["gemm"]["BK"])
        for k in (1, ks // 2, ks * 2, min(chunks // 4, sms // g["tiles"])):  # every tile split k ways
            if k > prefill.MAX_SPLIT or (k > 1 and g["tiles"] * k > 4 * sms):  # many waves of partials: skip
                continue
            if k >= 1 and (k != ks or g["FULL"]) and {f"{prefix}_KSPLIT": k} not in tries:
                tries.append({f"{prefix}_KSPLIT": k})
        if g["FULL"] == 0 and g["tiles"] > sms and g["tiles"] % sms:  # the full waves whole, the rest split
            tries.append({f"{prefix}_FULL": g["tiles"] // sms * sms})
        full, k = g.get("LOOSE", (g["FULL"], ks))  # the split the planner's 10 % rule would take (split_k)
        if (full, k) != (g["FULL"], ks) and k > 1:  # (a KSPLIT alone splits every tile)
            tries.append({f"{prefix}_KSPLIT": k, **({f"{prefix}_FULL": full} if full else {})})
    gm, stages = base["consts"]["GEMM_GM"], base["consts"]["GEMM_STAGES"]
    return tries + [{"GEMM_GM": max(1, gm // 2)}, {"GEMM_GM": gm * 2}, {"GEMM_STAGES": stages + 1},
                    {"ATT_INLINE": 1 - base["consts"]["ATT_INLINE"]}]


def knob_values(p: dict) -> tuple:
    """The tuned knobs' values in plan `p` (two overrides that plan the same kernel compare equal)."""
    return tuple(p["consts"].get(k) for k in (prefill.KNOBS if p["mode"] == "prefill" else decode.KNOBS))


def knob_dict(p: dict) -> dict:
    """knob_values as {knob: value}: what a tuning entry records of the plan it measured ("knobs"), so that a later
    change of the planner's defaults, which the entry's overrides are relative to, shows as a stale entry."""
    return dict(zip(prefill.KNOBS if p["mode"] == "prefill" else decode.KNOBS, knob_values(p)))


# knobs added after records were made whose default is no longer always the kernel as it was: the value a record
# without them measured (RED_DB: two buffers of partial sums until session 16)
# (ATT_PIECE_TILES: 0 in plans without stream-K; a stream-K record without it ran the bytes model's charge: stale;
# ATT_LL, H_LL: 0 until the LL rule of session 48)
KNOBS_BEFORE = {"RED_DB": 1, "NORM_GLOBAL": 0, "QKV_TM": 1, "O_TM": 1, "GU_TM": 1, "DOWN_TM": 1, "ATT_TMA": 0,
                "ATT_PIECE_TILES": 0, "ATT_LL": 0, "H_LL": 0, "COOP": 1,
                "QKV_BS": 1, "O_BS": 1, "GU_BS": 1, "DOWN_BS": 1,  # (<P>_BS: session 58, from batch 41)
                "GEMM_PROJ": 0, "QKV_GSPLIT": 1, "O_GSPLIT": 1, "GU_GSPLIT": 1,  # (session 62, from batch 64)
                "DOWN_GEMM": 0, "DOWN_GSPLIT": 1}  # (session 71: an override, no default yet)
# knobs the planner no longer has, at the value that built the kernel as it is (L2_PF: the L2 prefetch, measured and
# removed in session 25; records of that session carry it at 0)
KNOBS_RETIRED = {"L2_PF": 0}


def knobs_differ(recorded: dict, now: dict) -> list[str]:
    """The knobs whose value in `recorded` (a tuning entry's or a timing row's) differs from `now` (knob_dict of a
    plan), sorted. A knob the record lacks was added to the planner after it was made: not a difference (a new knob's
    default is the kernel as it was), except those of KNOBS_BEFORE, compared at the value the record measured. A
    knob the planner no longer has is a difference unless the record has it at its KNOBS_RETIRED value."""
    if not recorded:
        return []
    rec = {**{k: val for k, val in KNOBS_BEFORE.items() if k in now}, **recorded}
    for p in ("QKV", "O"):  # (<P>_GEMM: session 64; a record from before ran all three as GEMM_PROJ said)
        if f"{p}_GEMM" in now:
            rec.setdefault(f"{p}_GEMM", rec.get("GEMM_PROJ", 0))
    inert = {"ATT_PIECE_TILES"} if now.get("ATT_DYN") != 2 else set()  # read by stream-K's kernel only
    return sorted(k for k in rec if now.get(k) != rec[k] and k not in inert
                  and not (k not in now and k in KNOBS_RETIRED and KNOBS_RETIRED[k] == rec[k]))


def combine(v: Variant, arch: str, winners: list[dict]) -> dict | None:
    """The union of single-knob winners of different stages (the stages are separated by grid barriers, so their
    knobs act nearly independently), if the planner accepts it and it differs from each of them; else None."""
    from .render import plan
    merged: dict = {}
    for ov in winners:
        if set(ov) & set(merged):
            continue
        merged.update(ov)
    if len(merged) == 0 or any(merged == ov for ov in winners):
        return None
    try:
        plan(v, arch, overrides=merged)
    except PlanError:
        return None
    return merged


@contextlib.contextmanager
def _locked(directory: Path):
    """An exclusive lock on the directory itself (no lock file left in the repository)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def record(path: Path, rows: dict[str, dict]) -> Path:
    """Merge {variant: entry} into the tuning file under a lock (several tuner shards may write one file); through a
    symbolic link, into its target. Raises ValueError where `path` exists and is no regular file (a directory, a
    device: never replaced)."""
    from .compile import atomic_write
    path = Path(os.path.realpath(path))  # through a symbolic link: its target gets the entries, the link stays
    if path.exists() and not path.is_file():
        raise ValueError(f"{path}: not a regular file: tuning entries are not written there")
    with _locked(path.parent):
        doc = read_tuning(path)
        doc.update(rows)
        atomic_write(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path
