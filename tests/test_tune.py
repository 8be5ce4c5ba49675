"""The tuner's CPU side (candidates, plan overrides, tuning files, build/report picking up tuned plans) and, marked
gpu, `megakernel tune` on one small variant."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from generator import manifest as gmanifest, render, report as greport, tune as gtune, variants as gvariants
from generator.manifest import identity
from generator.modes import decode
from generator.modes.decode import KNOBS
from generator.plan import PlanError

from conftest import ROOT, TINY_NAMES, run_cli, steps_track_the_reference

TINY = TINY_NAMES[0]  # tiny-a_decode_b1_s64_bf16
LL_OFF = {"ATT_LL": 0, "QKV_FLOW": 1, "H_LL": 0}  # the barriers and counters of a plan outside decode's LL rule


def declared():
    vs = gvariants.load(ROOT / "variants.yaml") + gvariants.load(ROOT / "bench" / "heldout.yaml")
    return [v for v in vs if v.mode == "decode"]  # the tuner sweeps the decode planner's knobs


def tiny(tiny_variants_file, name=TINY):
    return next(v for v in gvariants.load(tiny_variants_file) if v.name == name)


@pytest.mark.parametrize("v", declared(), ids=lambda v: v.name)
def test_candidates_default_first_all_plan_no_duplicates(v):
    cands = gtune.candidates(v)
    assert cands[0] == {}
    assert 9 <= len(cands) <= 32
    if v.mode == "decode":  # the attention's neighbours still fit in the limit
        assert any("ATT_C" in ov for ov in cands) and any("ATT_STAGES" in ov for ov in cands), cands
    seen = set()
    for ov in cands:
        p = render.plan(v, overrides=ov)  # within budget (else PlanError)
        assert p["smem_bytes"] <= 227 * 1024
        key = gtune.knob_values(p)
        assert key not in seen
        seen.add(key)
        assert p["overrides"] == dict(sorted(ov.items()))


def test_override_changes_source_and_dependent_constants():
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b4_s32768_bf16")
    d = render.plan(v)
    c = d["consts"]
    p = render.plan(v, overrides={"ATT_C": c["ATT_C"] * 2, "O_NWG": c["O_NWG"] // 2})
    assert p["consts"]["ATT_C"] == c["ATT_C"] * 2 and p["consts"]["O_NWG"] == c["O_NWG"] // 2
    assert p["consts"]["ATT_NSPLIT"] == -(-v.seq_len // (c["ATT_C"] * 2)) != c["ATT_NSPLIT"]
    assert p["workspace"]["bytes"] != d["workspace"]["bytes"]  # partial results scale with the splits
    s3 = render.plan(v, overrides={"ATT_STAGES": 3})
    assert s3["consts"]["SMEM_FLAG"] > c["SMEM_FLAG"] and s3["smem_bytes"] > d["smem_bytes"]
    w = render.plan(v, overrides={"ATT_WARPS": c["ATT_WARPS"] // 2})  # ATT_C re-derived for the new step
    assert w["consts"]["ATT_C"] % (16 * w["consts"]["ATT_WARPS"]) == 0
    src, src2 = render.render(v, d), render.render(v, p)
    assert src != src2 and f"ATT_NSPLIT = {p['consts']['ATT_NSPLIT']};" in src2


def test_split_k_where_a_projection_has_fewer_tiles_than_sms():
    """Qwen2.5-0.5B: o_proj and down_proj have 56 tiles for 132 SMs: the tuner tries K split in two (measured
    neutral on the H200, so not the default); the override sizes the partials' buffer and the tiles' counters; a
    projection with enough tiles has no split to try."""
    v = next(v for v in declared() if v.name == "qwen2.5-0.5b_decode_b8_s4096_bf16")
    d = render.plan(v)
    assert all(d["consts"][f"{k}_KSPLIT"] == 1 for k in ("QKV", "O", "GU", "DOWN"))
    assert d["sizes"]["SPLIT_FLOATS"] == 0
    assert [d["gemv"][k]["split_k"] for k in ("qkv", "o", "gate_up", "down")] == [1, 2, 1, 2]
    cands = gtune.candidates(v)
    assert {"O_KSPLIT": 2} in cands and {"DOWN_KSPLIT": 2} in cands
    p = render.plan(v, overrides={"DOWN_KSPLIT": 2})
    assert p["consts"]["DOWN_KSPLIT"] == 2 and p["gemv"]["down"]["tasks"] == 2 * 896 // 16 <= 132
    assert p["sizes"]["SPLIT_FLOATS"] == 2 * 896 * 8 and p["sizes"]["COUNTERS"] >= 896 // 16
    assert "DOWN_KSPLIT = 2;" in render.render(v, p)
    big = next(v for v in declared() if v.name == "llama3-8b_decode_b1_s4096_bf16")
    assert not any("KSPLIT" in k for ov in gtune.candidates(big) for k in ov)


def test_balance_split_fills_the_last_round_of_tasks():
    """plan.gemv_balance_split: Qwen2.5-7B's down_proj (224 tasks for 132 SMs, balance 0.85) splits K 4 ways
    (896 tasks, 0.97), a projection whose tasks fill their rounds is not split, nor one whose k-tiles have no divisor
    that helps; the tuner tries it first, next to the fewer-tiles-than-SMs split."""
    from generator.plan import gemv_balance_split, plan_gemv
    assert gemv_balance_split(3584, 18944, 132) == 4
    assert (plan_gemv(3584, 18944, 132, 4, rebalance=False)["balance"]
            > plan_gemv(3584, 18944, 132, rebalance=False)["balance"] + 0.05)
    assert gemv_balance_split(4096, 14336, 132) == 1  # Llama-3-8B down_proj: 256 tasks, balance 0.97
    assert gemv_balance_split(16 * 200, 16 * 17, 132) == 1  # 17 k-tiles: no split keeps >= 16 a task
    v = next(v for v in declared() if v.name == "qwen2.5-7b_decode_b4_s4096_bf16")
    cands = gtune.candidates(v)
    # (each with the LL hand-offs the planner keeps beside it: split-K and X_FRAG 0 turn some of them off)
    assert any(c.get("DOWN_KSPLIT") == 4 for c in cands[:7]) and any(c.get("X_FRAG") == 0 for c in cands[:10])


def test_ll_hand_offs_by_default_at_batch_1_on_small_layers():
    """decode's LL rule: ATT_LL 1, QKV_FLOW 2 and H_LL 1 by default at batch 1, and at batch 2 .. LL_BATCH_MAX with
    O_PRE 0 (beside O_PRE 1 they spill) without q/k norms at head_dim 64 / 96 / 128 (LL_HEAD_DIMS_BATCH), on one
    sm_90 GPU in bf16 up to hidden LL_HIDDEN_MAX_ANY (at batch 1 past LL_HIDDEN_MAX without B1_PRE; measured,
    bench/NOTES.md sessions 48, 50, 51 and 59): no grid barrier between qkv_proj and gate_up (with DOWN_FLOW
    none at all); O_PRE 1 again where they are turned off; not past LL_BATCH_MAX, with q/k norms from batch 2, above
    the hidden size, with tensor parallel, in fp16 (no HB_COPY) or on another arch; DOWN_FLOW 2's words only at batch 1
    up to hidden 3072; an override of one knob leaves the others' defaults; where the norm's rows go to global memory
    or H_STATS is asked for, the rule gives way (no refusal); the tuner tries the three off together (and with O_PRE
    1 from batch 2)."""
    from generator.modes.decode import LL_BATCH_MAX
    from generator.modes.decode import LL_HIDDEN_MAX
    from generator.modes.decode import LL_HIDDEN_MAX_ANY
    named = {v.name: v for v in declared()}
    ll = {"ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1}
    for name in ("llama3.2-1b_decode_b1_s4096_bf16", "qwen2.5-0.5b_decode_b1_s1024_bf16",
                 "qwen3-1.7b_decode_b1_s32768_bf16", "qwen2.5-7b_decode_b1_s4096_bf16",
                 "llama3.2-1b_decode_b4_s32768_bf16", "qwen2.5-0.5b_decode_b4_s32768_bf16",
                 "llama3.2-1b_decode_b4_s4096_bf16", "qwen2.5-7b_decode_b4_s1024_bf16",
                 "llama3-8b_decode_b4_s1024_bf16", "llama3-8b_decode_b1_s4096_bf16"):
        p = render.plan(named[name])
        assert {k: p["consts"][k] for k in ll} == ll, name
        off = ({**LL_OFF, "O_PRE": 1} if named[name].batch > 1 and not p["consts"]["ATT_DYN"]
               or named[name].model.hidden > LL_HIDDEN_MAX else LL_OFF)  # (B1_PRE's O_PRE 1 back at hidden 4096)
        assert off in gtune.candidates(named[name]), name
    assert render.plan(named["llama3.2-1b_decode_b1_s4096_bf16"])["grid_syncs"] == 0  # (DOWN_FLOW there too)
    assert render.plan(named["qwen2.5-7b_decode_b1_s4096_bf16"])["consts"]["DOWN_FLOW"] != 2  # (hidden 3584)
    assert render.plan(named["qwen2.5-0.5b_decode_b4_s32768_bf16"])["consts"]["DOWN_FLOW"] != 2  # (batch 1's)
    for name in ("llama3.2-1b_decode_b4_s32768_bf16", "llama3.2-1b_decode_b4_s4096_bf16"):
        assert render.plan(named[name])["consts"]["O_PRE"] == 0, name
    b4 = named["llama3.2-1b_decode_b4_s4096_bf16"]  # (the hand-offs off: O_PRE 1 again, the old default)
    assert render.plan(b4, overrides={"ATT_LL": 0})["consts"]["O_PRE"] == 1
    # at batch 1 past LL_HIDDEN_MAX (hidden 4096) in place of B1_PRE's O_PRE 1 and GEMV_PF 1, which come back where
    # the hand-offs are off (the tuner's candidate: the plan before)
    b1 = named["llama3-8b_decode_b1_s4096_bf16"]
    c = render.plan(b1)["consts"]
    assert (c["O_PRE"], c["GEMV_PF"]) == (0, 0) and LL_HIDDEN_MAX < b1.model.hidden <= LL_HIDDEN_MAX_ANY
    c = render.plan(b1, overrides=LL_OFF)["consts"]
    assert (c["O_PRE"], c["GEMV_PF"]) == (1, 1)
    v = named["llama3.2-1b_decode_b1_s4096_bf16"]
    big = dataclasses.replace(v, model=dataclasses.replace(v.model, hidden=LL_HIDDEN_MAX_ANY + 1024,
                                                           intermediate=4 * (LL_HIDDEN_MAX_ANY + 1024)))
    fp16 = dataclasses.replace(v, model=dataclasses.replace(v.model, dtype="fp16"))
    long4 = named["llama3.2-1b_decode_b4_s32768_bf16"]
    b4 = named["llama3-8b_decode_b4_s1024_bf16"]  # (hidden 4096: LL_HIDDEN_MAX_ANY)
    big4 = dataclasses.replace(b4, model=dataclasses.replace(b4.model, hidden=LL_HIDDEN_MAX_ANY + 1024,
                                                             heads=40))
    c5 = render.plan(dataclasses.replace(long4, batch=LL_BATCH_MAX))["consts"]
    assert {k: c5[k] for k in ll} == ll and c5["O_PRE"] == 0
    for off, arch in ((named["qwen3-1.7b_decode_b4_s4096_bf16"], "90"),
                      (named["qwen3-1.7b_decode_b4_s32768_bf16"], "90"),
                      (named["llama3.2-1b_decode_b8_s32768_bf16"], "90"),
                      (dataclasses.replace(long4, batch=LL_BATCH_MAX + 1), "90"),
                      (big4, "90"), (big, "90"),
                      (dataclasses.replace(b4, batch=3, model=dataclasses.replace(b4.model, head_dim=80)), "90"), (fp16, "90"), (dataclasses.replace(v, tp=2), "90"), (v, "80")):
        c = render.plan(off, arch)["consts"]
        assert (c["ATT_LL"], c["H_LL"]) == (0, 0) and c["QKV_FLOW"] in (0, 1), (off.name, off.model.hidden, arch)
    b8 = named["llama3.2-1b_decode_b8_s4096_bf16"]  # (from batch 2 with O_PRE off: its held step spills beside them)
    assert render.plan(b8)["consts"]["O_PRE"] == 1
    assert {"ATT_LL": 1, "QKV_FLOW": 2, "H_LL": 1, "O_PRE": 0} in gtune.candidates(b8)
    one = render.plan(v, overrides={"H_LL": 0})["consts"]
    assert (one["ATT_LL"], one["QKV_FLOW"], one["H_LL"]) == (1, 2, 0)
    for ov in ({"H_STATS": 1}, {"NORM_GLOBAL": 1}, {"O_KSPLIT": 2}):  # (a split qkv keeps them: its words)
        c = render.plan(v, overrides=ov)["consts"]
        assert (c["ATT_LL"], c["H_LL"]) == (0, 0) and c["QKV_FLOW"] in (0, 1), ov


def test_next_rounds_weight_loads_early_is_a_tuner_knob():
    """GEMV_PF 1: the projections' next round of weight loads issued before this round's reduction; 2: every step's
    loads one step ahead, in steps of at most 4 loads (two register sets) (templates/gemv.cuh PF); off by default
    (each wins on some shapes and loses on others, bench/NOTES.md), tuner candidates; but 1 (with O_PRE 1) at batch 1
    for bf16 RMSNorm shapes of the measured (hidden, KV heads) (decode.B1_PRE_SHAPES: Llama-3.2-1B, Qwen3-1.7B,
    SmolLM2-1.7B, Llama-3-8B; not TinyLlama's 4 KV heads at hidden 2048 or Llama-2-7B's 32 at 4096)."""
    from generator.modes.decode import LL_HIDDEN_MAX
    by = {v.name: v for v in declared()}
    for name, on in (("llama3.2-1b_decode_b1_s4096_bf16", 1), ("qwen3-1.7b_decode_b1_s32768_bf16", 1),
                     ("llama3-8b_decode_b1_s4096_bf16", 0), ("llama3-8b_decode_b1_s32768_bf16", 0),  # (LL)
                     ("qwen2.5-7b_decode_b1_s4096_bf16", 0), ("qwen2.5-0.5b_decode_b1_s4096_bf16", 0),
                     ("ho-hd80-mha_decode_b1_s4096_bf16", 0), ("ho-h3072-g3_decode_b1_s4096_bf16", 0)):
        c = render.plan(by[name])["consts"]
        assert c["GEMV_PF"] == on and c["O_PRE"] == on, name
    # the measured (hidden, KV heads) pairs with an MLP 3-4x the hidden size (decode.B1_PRE_MLP), on one GPU
    for name, kv_heads, inter, tp, on in (("llama3.2-1b_decode_b1_s4096_bf16", 32, 8192, 1, 1),
                                          ("llama3.2-1b_decode_b1_s4096_bf16", 4, 8192, 1, 0),
                                          ("llama3.2-1b_decode_b1_s4096_bf16", 8, 5632, 1, 0),    # TinyLlama's MLP
                                          ("llama3-8b_decode_b1_s4096_bf16", 32, 14336, 1, 0),
                                          ("llama3-8b_decode_b1_s4096_bf16", 4, 14336, 1, 0),
                                          ("llama3-8b_decode_b1_s4096_bf16", 8, 11008, 1, 0),    # Yi / Llama-2's MLP
                                          ("llama3-8b_decode_b1_s4096_bf16", 8, 12288, 1, 1),    # Qwen3-8B's
                                          ("llama3-8b_decode_b1_s4096_bf16", 16, 28672, 2, 0)):  # shard (4096, 8, 14336)
        v = by[name]
        w = dataclasses.replace(v, tp=tp, model=dataclasses.replace(v.model, kv_heads=kv_heads, intermediate=inter))
        # (at hidden 4096 where the LL hand-offs are off: with them the early loads give way, LL_HIDDEN_MAX)
        ov = LL_OFF if w.model.hidden > LL_HIDDEN_MAX and tp == 1 else None
        assert render.plan(w, overrides=ov)["consts"]["GEMV_PF"] == on, (name, kv_heads, inter, tp)
    assert render.plan(by["llama3.2-1b_decode_b4_s4096_bf16"])["consts"]["GEMV_PF"] == 0  # (O_PRE 1: batch 2-8)
    fp16 = dataclasses.replace(by["llama3.2-1b_decode_b1_s4096_bf16"],
                               model=dataclasses.replace(by["llama3.2-1b_decode_b1_s4096_bf16"].model, dtype="fp16"))
    assert render.plan(fp16)["consts"]["GEMV_PF"] == 0
    v = by["qwen2.5-7b_decode_b1_s4096_bf16"]
    assert render.plan(v)["consts"]["GEMV_PF"] == 0
    assert {"GEMV_PF": 1} in gtune.candidates(v) and {"GEMV_PF": 2} in gtune.candidates(v)
    src = render.render(v, render.plan(v, overrides={"GEMV_PF": 1}))
    calls = re.findall(r"gemv<[^>]*>\(", src)  # every projection passes it (qkv's call in two branches)
    assert "GEMV_PF = 1;" in src and len(calls) == 5 and all("GEMV_PF" in c for c in calls)
    p2 = render.plan(v, overrides={"GEMV_PF": 2})
    assert p2["consts"]["GEMV_PF"] == 2 and max(p2["consts"][f"{k}_U"] for k in ("QKV", "O", "GU", "DOWN")) <= 4
    assert max(render.plan(v)["consts"][f"{k}_U"] for k in ("QKV", "O", "GU", "DOWN")) == 8
    with pytest.raises(PlanError, match="GEMV_PF=3"):
        render.plan(v, overrides={"GEMV_PF": 3})


def test_qkv_flow_replaces_one_barrier():
    """QKV_FLOW (the default on one GPU where qkv is unsplit; a tuner knob): the qkv -> attention grid barrier is
    compiled out, every KV head counts (GROUP + 2) x head_dim / 16 tiles (the C mapping templates/stages/qkv_proj.cuh
    qkv_tile_head, mirrored here); a split qkv plans the barrier, and asking for both is refused; tensor parallel
    keeps the barrier. (At batch 8: batch 1-5's default hands qkv over as words, decode.LL_BATCH_MAX.)"""
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b8_s4096_bf16")
    on, off = render.plan(v), render.plan(v, overrides={"QKV_FLOW": 0})
    assert off["consts"]["QKV_FLOW"] == 0 and on["consts"]["QKV_FLOW"] == 1
    assert on["grid_syncs"] == off["grid_syncs"] - 1
    assert "constexpr int QKV_FLOW = 1;" in render.render(v, on) and "constexpr int QKV_FLOW = 0;" in \
        render.render(v, off)
    c = on["consts"]
    heads = []
    for tile in range(c["QKV_DIM"] // 16):
        r = tile * 16
        q = r < c["Q_DIM"]
        heads.append(r // (c["GROUP"] * c["HEAD_DIM"]) if q else ((r - c["Q_DIM"]) % c["KV_DIM"]) // c["HEAD_DIM"])
    assert [heads.count(h) for h in range(c["KV_HEADS"])] == [(c["GROUP"] + 2) * c["HEAD_DIM"] // 16] * c["KV_HEADS"]
    assert render.plan(v, overrides={"QKV_KSPLIT": 2})["consts"]["QKV_FLOW"] == 0
    with pytest.raises(PlanError, match="QKV_FLOW=1 and QKV_KSPLIT=2"):
        render.plan(v, overrides={"QKV_FLOW": 1, "QKV_KSPLIT": 2})
    assert {"QKV_FLOW": 0} in gtune.candidates(v)
    tp = dataclasses.replace(v, tp=2)
    assert render.plan(tp)["consts"]["QKV_FLOW"] == 0
    with pytest.raises(PlanError, match="QKV_FLOW=1: tensor parallel keeps"):
        render.plan(tp, overrides={"QKV_FLOW": 1})


def test_coop_0_counts_its_grid_barriers_in_the_workspace():
    """COOP 0: the decode kernel is launched without the cooperative attribute (loader: cooperative False), its grid
    barriers are templates/common.cuh grid_barrier over a 4-byte workspace word instead of cooperative groups'
    grid.sync; the default keeps grid.sync and no such buffer; tensor parallel and a cluster launch are refused in
    one line naming what fails."""
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    off, on = render.plan(v, overrides=LL_OFF), render.plan(v, overrides={**LL_OFF, "COOP": 0})  # (with barriers)
    assert off["consts"]["COOP"] == 1 and on["consts"]["COOP"] == 0 and on["grid_syncs"] == off["grid_syncs"]
    src_on, src_off = render.render(v, on), render.render(v, off)
    assert src_on.count("grid_barrier(ws_gridbar);") == src_off.count("grid.sync();") == 6
    assert "grid.sync();" not in src_on and "grid_barrier(ws_gridbar);" not in src_off
    assert on["workspace"]["buffers"]["gridbar"]["bytes"] == 4 and off["workspace"]["buffers"]["gridbar"]["bytes"] == 0
    for layer, ov, want in ((dataclasses.replace(v, tp=2), {"COOP": 0}, r"COOP=0 needs one GPU \(tp 2"),
                            (v, {"COOP": 0, "NORM_CLUSTER": 2},
                             r"COOP=0 needs NORM_CLUSTER 1 \(this plan: 2, a cluster launch\)$"),
                            (v, {"COOP": 2}, "COOP=2: must be 0 or 1")):
        with pytest.raises(PlanError, match=want):
            render.plan(layer, overrides=ov)
    # the launch configuration: programmatic serialisation only, or with the cooperative attribute as well
    from generator.loader import _ATTR_COOPERATIVE, _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, pdl_config
    for coop, want in ((False, [_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION]),
                       (True, [_ATTR_COOPERATIVE, _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION])):
        cfg = pdl_config(132, 512, 1024, cooperative=coop)
        assert [cfg.attrs[i].id for i in range(cfg.numAttrs)] == want and cfg.gridDimX == 132


def test_coop_0_with_qkv_pre_by_default_where_no_grid_barrier_is_left():
    """decode: COOP 0 and QKV_PRE 1 by default at batch 1 on one sm_90 GPU where the plan has no grid barrier (the LL
    hand-offs with DOWN_FLOW; measured, bench/NOTES.md session 51); the cooperative launch where a barrier is left
    (Llama-3-8B b1 with the hand-offs off), from batch 2, with tensor parallel or on another arch; an override COOP 1
    leaves QKV_PRE at 0 unless asked, COOP 0 plans the default; the tuner tries the cooperative launch back."""
    named = {v.name: v for v in declared()}
    for name in ("llama3.2-1b_decode_b1_s4096_bf16", "qwen2.5-0.5b_decode_b1_s1024_bf16",
                 "qwen3-1.7b_decode_b1_s32768_bf16", "llama3-8b_decode_b1_s4096_bf16"):
        p = render.plan(named[name])
        assert p["grid_syncs"] == 0 and (p["consts"]["COOP"], p["consts"]["QKV_PRE"]) == (0, 1), name
        assert {"COOP": 1, "QKV_PRE": 0} in gtune.candidates(named[name]), name
    v = named["llama3.2-1b_decode_b1_s4096_bf16"]
    for layer, ov, arch in ((named["llama3-8b_decode_b1_s4096_bf16"], LL_OFF, "90"),
                            (named["llama3.2-1b_decode_b4_s4096_bf16"], {}, "90"), (v, LL_OFF, "90"),
                            (dataclasses.replace(v, tp=2), {}, "90"), (v, {}, "80"), (v, {"COOP": 1}, "90")):
        c = render.plan(layer, arch, overrides=ov)["consts"]
        assert (c["COOP"], c["QKV_PRE"]) == (1, 0), (layer.name, ov, arch)
    c = render.plan(v, overrides={"QKV_PRE": 0})["consts"]
    assert (c["COOP"], c["QKV_PRE"]) == (0, 0)
    assert gtune.knob_dict(render.plan(v, overrides={"COOP": 0})) == gtune.knob_dict(render.plan(v))


def test_h_ll_drops_o_projs_barrier():
    """H_LL (by default under the LL rule, decode.LL_HIDDEN_MAX): the o_proj -> gate_up grid barrier compiled out (with ATT_LL,
    QKV_FLOW 2 and DOWN_FLOW none is left), o_proj's T copy of h as words (twice the buffer) that decode as the kernel
    writes them (interface.from_ll, frag False, a 16-bit dtype); refused in one line where the second norm is not
    each block's own or would not read that copy, with tensor parallel, above batch 8 and with a split o_proj or
    gate_up."""
    import torch

    from generator.interface import from_ll
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    off, on = render.plan(v, overrides=LL_OFF), render.plan(v, overrides={**LL_OFF, "H_LL": 1})
    assert on["consts"]["H_LL"] == 1 and on["grid_syncs"] == off["grid_syncs"] - 1
    assert render.plan(v, overrides={"H_LL": 1, "ATT_LL": 1, "QKV_FLOW": 2})["grid_syncs"] == 0
    assert "if constexpr (!H_LL) grid.sync();" in render.render(v, on)
    assert on["workspace"]["buffers"]["hb"]["bytes"] == 2 * off["workspace"]["buffers"]["hb"]["bytes"]
    for ov, why in [({"H_STATS": 1}, "H_STATS 0"), ({"NORM_CLUSTER": 2}, r"NORM_CLUSTER 1 \(this plan: 2\)"),
                    ({"NORM_GLOBAL": 1}, r"NORM_GLOBAL 0 \(the second norm in each block\); H_STATS 0"),
                    ({"O_KSPLIT": 2}, r"O_KSPLIT 1 \(this plan: 2\)"),
                    ({"GU_KSPLIT": 2}, r"GU_KSPLIT 1 \(this plan: 2\)")]:
        with pytest.raises(PlanError, match=f"H_LL=1 needs {why}$"):  # (only what fails is named)
            render.plan(v, overrides={"H_LL": 1, **ov})
    with pytest.raises(PlanError, match=r"H_LL=1 needs one GPU \(tp 2\)"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"H_LL": 1})
    with pytest.raises(PlanError, match=r"H_LL=1 needs batch <= 8 \(16\)$"):
        render.plan(dataclasses.replace(v, batch=16), overrides={"H_LL": 1, "NORM_GLOBAL": 0})
    fp16 = dataclasses.replace(v, model=dataclasses.replace(v.model, dtype="fp16"))
    # (fp16: the norm reads fp32 h, which may exceed fp16's range)
    with pytest.raises(PlanError, match="HB_COPY 1 .this plan: 0"):
        render.plan(fp16, overrides={"H_LL": 1})
    small = _decode_layer("hll", 1, 256, "hidden: 1024, heads: 16, kv_heads: 4, head_dim: 64, intermediate: 3072")
    with pytest.raises(PlanError, match="H_LL=1 with DOWN_FLOW: needs a gate_up task in every block.*96 tasks"):
        render.plan(small, overrides={"H_LL": 1, "DOWN_FLOW": 1, "GU_TM": 4})
    assert render.plan(small, overrides={"H_LL": 1, "DOWN_FLOW": 0, "GU_TM": 4})["consts"]["H_LL"] == 1
    vals = torch.randn(3, 24).to(torch.bfloat16)
    words = (vals.view(torch.int16).to(torch.int32) & 0xFFFF) | (0x1234 << 16)
    assert torch.equal(from_ll(words.view(-1).view(torch.bfloat16), 3, 24, frag=False), vals)


def test_qkv_flow_2_hands_qkv_over_as_words():
    """QKV_FLOW 2 (by default under the LL rule, decode.LL_HIDDEN_MAX): no barrier and no counters between qkv_proj and attention,
    qkv's results as 64-bit words carrying the launch's epoch (twice the buffer; the epoch word as ATT_LL's), which
    decode as the kernel lays them out (interface.from_ll, frag False: row-major, the value's float bits in each word's
    low half); refused with tensor parallel and past 2 (a split qkv: test_qkv_splits_keep_the_ll_hand_off)."""
    import torch

    from generator.interface import from_ll
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    one, two = render.plan(v, overrides=LL_OFF), render.plan(v, overrides={**LL_OFF, "QKV_FLOW": 2})
    assert two["consts"]["QKV_FLOW"] == 2 and two["grid_syncs"] == one["grid_syncs"]
    assert "constexpr int QKV_FLOW = 2;" in render.render(v, two)
    w1, w2 = one["workspace"]["buffers"], two["workspace"]["buffers"]
    assert w2["qkv"]["bytes"] == 2 * w1["qkv"]["bytes"] and w2["epoch"]["bytes"] == 4
    with pytest.raises(PlanError, match="QKV_FLOW=2: tensor parallel keeps"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"QKV_FLOW": 2})
    assert render.plan(v, overrides={"QKV_FLOW": 2, "QKV_KSPLIT": 2})["consts"]["QKV_FLOW"] == 2  # (its splits'
    # words summed by attention: test_qkv_splits_keep_the_ll_hand_off)
    with pytest.raises(PlanError, match="QKV_FLOW=3: must be 0, 1 or 2"):
        render.plan(v, overrides={"QKV_FLOW": 3})
    rows, k = 3, 40
    vals = torch.randn(rows, k)
    words = (vals.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (0x7A5 << 48)  # (epoch << 16 in the high half)
    assert torch.equal(from_ll(words.view(-1).view(torch.float32), rows, k, frag=False), vals)


def test_down_flow_2_hands_act_over_as_words():
    """DOWN_FLOW 2: no counters between gate_up and down_proj, act written as 32-bit words carrying the launch's
    epoch (twice the buffer, no counters in ready), which down_proj polls as o_proj polls attention's (gemv XF 2);
    with the LL rule's three a Llama-3.2-1B b1 layer has no grid barrier; refused in one line without H_LL (the
    epoch's advance at down_proj's end), without X_FRAG and with tensor parallel; the words decode as the kernel lays
    them out (buffer "act": interface.from_ll). By default under the LL rule where DOWN_FLOW 1's counters are not
    taken and gate_up has a task in every block (measured, bench/NOTES.md session 49: Qwen2.5-0.5B b1, held-out
    hidden 960 / 1440 / 2560 / 3072); not where H_LL is overridden off, with GEMV_PF 1, or where the counters are
    taken (Llama-3.2-1B b1);
    the tuner then tries DOWN_FLOW 0 and 1, and its LL-off candidate drops the words with H_LL."""
    named = {v.name: v for v in declared()}
    half = named["qwen2.5-0.5b_decode_b1_s1024_bf16"]
    p = render.plan(half)
    assert p["consts"]["DOWN_FLOW"] == 2 and p["grid_syncs"] == 0 and p["consts"]["ACT_CHUNKS"] == 0
    assert render.plan(half, overrides={"H_LL": 0})["consts"]["DOWN_FLOW"] == 0
    assert render.plan(half, overrides={"X_FRAG": 0})["consts"]["DOWN_FLOW"] == 0
    assert render.plan(half, overrides={"GEMV_PF": 1})["consts"]["DOWN_FLOW"] == 0  # (with the held words it spills)
    assert render.plan(dataclasses.replace(half, batch=2))["consts"]["DOWN_FLOW"] == 0
    cands = gtune.candidates(half)
    assert {"DOWN_FLOW": 0} in cands and {"DOWN_FLOW": 1} in cands and {"DOWN_FLOW": 2} not in cands
    assert LL_OFF in cands and render.plan(half, overrides=LL_OFF)["consts"]["DOWN_FLOW"] == 0
    v = named["llama3.2-1b_decode_b1_s4096_bf16"]
    one, two = render.plan(v), render.plan(v, overrides={"DOWN_FLOW": 2, "DOWN_U": 4})
    assert one["consts"]["DOWN_FLOW"] == 1 and two["consts"]["DOWN_FLOW"] == 2 and two["grid_syncs"] == 0
    assert two["consts"]["ACT_CHUNKS"] == 0 < one["consts"]["ACT_CHUNKS"]
    w1, w2 = one["workspace"]["buffers"], render.plan(v, overrides={"DOWN_U": 4})["workspace"]["buffers"]
    assert two["workspace"]["buffers"]["act"]["bytes"] == 2 * w2["act"]["bytes"] == 2 * w1["act"]["bytes"]
    src = render.render(v, render.plan(v, overrides={"DOWN_FLOW": 2, "DOWN_U": 4, "COOP": 1}))  # (grid.sync's text)
    assert "constexpr int DOWN_FLOW = 2;" in src and "if constexpr (!DOWN_FLOW) grid.sync();" in src
    for ov, why in [({"DOWN_FLOW": 2, "H_LL": 0}, r"DOWN_FLOW=2 needs H_LL \(the epoch's advance at down_proj's end\)$"),
                    ({"DOWN_FLOW": 2, "X_FRAG": 0}, "DOWN_FLOW=2 needs H_LL .*; X_FRAG 1$"),
                    ({"DOWN_FLOW": 3}, "DOWN_FLOW=3: must be 0, 1 or 2")]:
        with pytest.raises(PlanError, match=why):
            render.plan(v, overrides=ov)
    with pytest.raises(PlanError, match="DOWN_FLOW=2: tensor parallel keeps"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"DOWN_FLOW": 2})
    assert {"DOWN_FLOW": 2} in gtune.candidates(v)  # (Llama-3.2-1B b1: the counters by default)
    assert not any(ov.get("DOWN_FLOW") == 2 for ov in gtune.candidates(named["llama3.2-1b_decode_b8_s4096_bf16"]))


def test_down_weights_staged_in_shared_memory_is_an_override():
    """DOWN_SMEM 1 (session 56; an override, and a tuner candidate since session 66): the block's first down_proj
    task's first DW_KT k-tiles copied into shared memory from gate_up's start, after the norm + projection stage's
    bytes (128-byte aligned), then an mbarrier: all of Qwen2.5-0.5B's 304 (155 KB), part of Llama-3.2-1B's 512 (the
    block's limit less 1 KB for static shared memory); off by default (the same kernel as before it existed); refused
    in one line where down_proj is not one unsplit group a block, with DOWN_PRE, with tensor parallel or before
    sm_90."""
    from generator.render import plan
    named = {v.name: v for v in declared()}
    half = named["qwen2.5-0.5b_decode_b1_s4096_bf16"]
    p = render.plan(half, overrides={"DOWN_SMEM": 1})
    c = p["consts"]
    assert (c["DOWN_SMEM"], c["DW_KT"]) == (1, 4864 // 16) and c["SMEM_DW"] % 128 == 0 and c["SMEM_DW"] > 0
    assert c["SMEM_DWBAR"] == c["SMEM_DW"] + 304 * 512 and p["smem_bytes"] == c["SMEM_DWBAR"] + 8
    src = render.render(half, p)
    assert "constexpr int DOWN_SMEM = 1;" in src and "down_weights_to_smem(w_down, smem);" in src
    one = render.plan(named["llama3.2-1b_decode_b1_s4096_bf16"], overrides={"DOWN_SMEM": 1})
    assert 0 < one["consts"]["DW_KT"] < 8192 // 16 and one["smem_bytes"] <= 227 * 1024 - 1024 + 8
    d = render.plan(half)["consts"]
    assert (d["DOWN_SMEM"], d["DW_KT"], d["SMEM_DW"]) == (0, 0, 0)
    for ov, why in [({"DOWN_NWG": 8}, r"down_proj in one group a block \(DOWN_NWG 16; this plan: 8\)$"),
                    ({"DOWN_KSPLIT": 2}, "DOWN_KSPLIT 1 and DOWN_TM 1$"),
                    ({"DOWN_PRE": 1}, r"DOWN_PRE 0 \(its first step comes from shared memory\)$")]:
        with pytest.raises(PlanError, match="DOWN_SMEM=1 needs " + why):
            render.plan(half, overrides={"DOWN_SMEM": 1, **ov})
    with pytest.raises(PlanError, match=r"DOWN_SMEM=1 needs .*one GPU \(tp 2\)"):
        render.plan(dataclasses.replace(named["llama3.2-1b_decode_b1_s4096_bf16"], tp=2), overrides={"DOWN_SMEM": 1})
    with pytest.raises(PlanError, match=r"DOWN_SMEM=1 needs sm_90\+"):
        plan(half, "86", overrides={"DOWN_SMEM": 1})
    with pytest.raises(PlanError, match="DOWN_SMEM=2: must be 0 or 1"):
        render.plan(half, overrides={"DOWN_SMEM": 2})


def test_qkv_splits_keep_the_ll_hand_off():
    """QKV_KSPLIT > 1 with QKV_FLOW 2: qkv's splits are not reduced (gemv's RawSplits: no part buffer, no counter) but
    written as words of their own, one set a split (the workspace's qkv grows by the splits), and summed by attention;
    so a split qkv keeps the LL rule's hand-offs (before: split-K turned them off) up to decode.QKV_WORDS_MAX words a
    lane (more: the reduction, the rule off, as before); QKV_FLOW 1 with a split, and QKV_FLOW 2 with more words, are
    refused in one line; the tuner's split candidates keep them (capped to QKV_WORDS_MAX where its balance split
    passes it)."""
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    one, two = render.plan(v), render.plan(v, overrides={"QKV_KSPLIT": 2})
    for k in ("QKV_FLOW", "ATT_LL", "H_LL", "COOP"):
        assert two["consts"][k] == one["consts"][k], k
    assert two["consts"]["QKV_FLOW"] == 2 and two["consts"]["QKV_KSPLIT"] == 2 and two["grid_syncs"] == 0
    q1, q2 = one["workspace"]["buffers"]["qkv"], two["workspace"]["buffers"]["qkv"]
    assert q2["bytes"] == 2 * q1["bytes"] and q2["shape"] == [2, 2 * 3072]
    src = render.render(v, two)
    # (the splits take gemv's RawSplits, selected in the stage by QKV_FLOW 2: both constants as planned)
    assert "constexpr int QKV_KSPLIT = 2;" in src and "constexpr int QKV_FLOW = 2;" in src
    with pytest.raises(PlanError, match="QKV_FLOW=1 and QKV_KSPLIT=2: the counters need qkv unsplit"):
        render.plan(v, overrides={"QKV_FLOW": 1, "QKV_KSPLIT": 2})
    q7 = next(v for v in declared() if v.name == "qwen2.5-7b_decode_b1_s4096_bf16")  # (head_dim 128: 4 words a split)
    assert render.plan(q7, overrides={"QKV_KSPLIT": 4})["consts"]["QKV_FLOW"] == 2
    c = render.plan(q7, overrides={"QKV_KSPLIT": 7})["consts"]  # (28 words a lane spill: the reduction, no LL rule)
    assert (c["QKV_FLOW"], c["ATT_LL"], c["H_LL"]) == (0, 0, 0)
    with pytest.raises(PlanError, match=r"QKV_KSPLIT=7 and QKV_FLOW=2: attention would hold 28 words a lane .* at "
                                        r"most 16: fewer splits, or QKV_FLOW=0"):
        render.plan(q7, overrides={"QKV_KSPLIT": 7, "QKV_FLOW": 2})
    # (q7: the balance split 7, capped to keep the words; DOWN_SMEM 1 comes after them, tune's `last`)
    for w, want in ((q7, {"QKV_KSPLIT": 4}), (v, {"QKV_KSPLIT": 2})):
        full = [c for c in gtune.candidates(w, limit=99) if c != {"DOWN_SMEM": 1}]
        assert full[-1] == want, full  # last of the rest (level to +3 %, session 54; q7's 7, the reduction, in place)
    assert any(c.get("QKV_KSPLIT") == 7 for c in gtune.candidates(q7, limit=99)[:-1])


def test_down_flow_replaces_one_barrier():
    """DOWN_FLOW (a tuner knob; by default where gate_up takes >= 5 rounds and down_proj one 16-warp group a block, or
    under the LL rule where DOWN_FLOW 2 is not planned: Qwen2.5-7B b1 / b4's 8-warp down_proj groups, not at b8):
    the gate_up -> down_proj grid barrier is compiled out; act is counted
    in ACT_CHUNKS chunks of one down_proj step's k-tiles (NWG x U), each on a 128-byte line of its own in the ready
    buffer past the KV heads' counters; every gate_up tile counts in exactly one chunk and each chunk's count is
    what its waiters need (the C mapping of templates/stages/gate_up.cuh ActReady and down_proj.cuh ActWait,
    mirrored here); split gate_up or down_proj and tensor parallel are refused in one line."""
    from generator.interface import WORKSPACE
    v = next(v for v in declared() if v.name == "qwen2.5-7b_decode_b1_s4096_bf16")
    off, on = render.plan(v, overrides={"DOWN_FLOW": 0}), render.plan(v)
    assert off["consts"]["DOWN_FLOW"] == 0 and off["consts"]["ACT_CHUNKS"] == 0 and on["consts"]["DOWN_FLOW"] == 1
    assert render.plan(next(v for v in declared() if v.name == "qwen2.5-7b_decode_b8_s4096_bf16"))["consts"][
        "DOWN_FLOW"] == 0  # (batch 8: outside the LL rule, 8-warp groups keep the barrier)
    assert on["grid_syncs"] == off["grid_syncs"] - 1
    assert "constexpr int DOWN_FLOW = 1;" in render.render(v, on)
    c = on["consts"]
    kt, step = c["INTER"] // 16, c["DOWN_NWG"] * c["DOWN_U"]
    assert c["ACT_CHUNKS"] == -(-kt // step) > 32  # (Qwen2.5-7B b1: more chunks than one poll's 32 lanes)
    counts = [0] * c["ACT_CHUNKS"]
    for tile in range(2 * c["INTER"] // 16):  # gate_up tile t writes act columns 8t .. 8t + 7: k-tile t // 2
        counts[tile // (2 * step)] += 1
    assert counts == [2 * min(step, kt - ch * step) for ch in range(c["ACT_CHUNKS"])]
    ready = next(b for b in WORKSPACE if b.name == "ready")
    assert ready.shape({**c, "ROWS": 1}) == (c["KV_HEADS"] + c["ACT_CHUNKS"] * c["ACT_STRIDE"],)
    assert ready.shape({**off["consts"], "ROWS": 1}) == (c["KV_HEADS"],)
    with pytest.raises(PlanError, match="DOWN_FLOW=1 and DOWN_KSPLIT=2: the flow needs"):
        render.plan(v, overrides={"DOWN_FLOW": 1, "DOWN_KSPLIT": 2})
    with pytest.raises(PlanError, match="DOWN_FLOW=1 and GU_KSPLIT=2"):
        render.plan(v, overrides={"DOWN_FLOW": 1, "GU_KSPLIT": 2})
    with pytest.raises(PlanError, match="DOWN_FLOW=1: tensor parallel keeps"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"DOWN_FLOW": 1})
    with pytest.raises(PlanError, match=r"DOWN_FLOW=2 needs H_LL \(the epoch's advance"):  # (2: act as LL words)
        render.plan(v, overrides={"DOWN_FLOW": 2, "H_LL": 0})
    assert {"DOWN_FLOW": 0} in gtune.candidates(v)
    # where the default takes it (Llama-3.2-1B b1), a candidate whose NWG would move the rule's choice keeps it
    one = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    cands = gtune.candidates(one)
    assert render.plan(one)["consts"]["DOWN_FLOW"] == 1 and cands[1] == {"DOWN_FLOW": 0}
    assert {"GU_NWG": 8, "DOWN_FLOW": 1} in cands and {"GU_NWG": 8} not in cands


def test_att_ll_drops_attentions_barrier(tmp_path):
    """ATT_LL (by default under the LL rule, decode.LL_HIDDEN_MAX): the attention -> o_proj grid barrier is compiled out, attention's
    output takes 32-bit words (twice the buffer) and an epoch word exists; refused in one line with tensor parallel,
    without X_FRAG, with NORM_GLOBAL and above batch 8; the words decode as the kernel lays them out (interface.from_ll
    against templates/gemv.cuh x_at and ll_store, mirrored here); Llama-3.2-1B b1 compiles without spills."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile
    from generator.interface import from_ll
    named = {v.name: v for v in declared()}
    v = named["llama3.2-1b_decode_b1_s4096_bf16"]
    off, on = render.plan(v, overrides=LL_OFF), render.plan(v, overrides={**LL_OFF, "ATT_LL": 1})
    assert off["consts"]["ATT_LL"] == 0 and on["consts"]["ATT_LL"] == 1
    assert on["grid_syncs"] == off["grid_syncs"] - 1
    src = render.render(v, on)
    assert "constexpr int ATT_LL = 1;" in src and "if constexpr (!ATT_LL) grid.sync();" in src
    ws_on, ws_off = on["workspace"]["buffers"], off["workspace"]["buffers"]
    assert ws_on["attn"]["bytes"] == 2 * ws_off["attn"]["bytes"] and ws_on["epoch"]["bytes"] == 4
    with pytest.raises(PlanError, match=r"ATT_LL=1 needs one GPU \(tp 2\)"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"ATT_LL": 1})
    with pytest.raises(PlanError, match="ATT_LL=1 needs X_FRAG 1$"):
        render.plan(v, overrides={"ATT_LL": 1, "X_FRAG": 0})
    with pytest.raises(PlanError, match=r"ATT_LL=1 needs NORM_GLOBAL 0; batch <= 8 \(16\)$"):
        render.plan(dataclasses.replace(v, batch=16), overrides={"ATT_LL": 1})
    # (its split-K counters would share ws_count with attention's)
    with pytest.raises(PlanError, match=r"ATT_LL=1 needs O_KSPLIT 1 \(this plan: 2\)$"):
        render.plan(v, overrides={"ATT_LL": 1, "O_KSPLIT": 2})
    with pytest.raises(PlanError, match="ATT_LL=3: must be 0, 1 or 2"):
        render.plan(v, overrides={"ATT_LL": 3})
    # the words: value bits in the low half, epoch in the high, at x_at<true>(b, k) of a [k/16][ntile][32][4] layout
    rows, k, epoch = 5, 64, 0xBEEF
    vals = torch.randn(rows, k).to(torch.bfloat16)
    words = torch.zeros(k // 16 * 32 * 4, dtype=torch.int64)
    for b in range(rows):
        for c in range(k):
            at = ((((c >> 4) * 1 + (b >> 3)) * 32 + (b & 7) * 4 + ((c & 7) >> 1)) << 2) + ((c >> 3) & 1) * 2 + (c & 1)
            words[at] = (int(vals[b, c].view(torch.int16)) & 0xFFFF) | (epoch << 16)
    raw = words.to(torch.int64).apply_(lambda w: w - (1 << 32) if w >= 1 << 31 else w).to(torch.int32)
    assert torch.equal(from_ll(raw.view(torch.bfloat16), rows, k), vals)
    c = renamed(v, "ll")
    res = gcompile.build([c], tmp_path, overrides={c.name: {"ATT_LL": 1}}, replan_spills=False)
    e, = res["entries"]
    r = e["resources"]
    assert e["status"] == "ok" and r["spill_stores"] == r["spill_loads"] == 0, e


def test_stream_attention_covers_every_tile_once():
    """ATT_DYN 2 (stream-K attention, decode.attention_stream / attention_pieces, the model of templates/stages/
    attention.cuh att_stream_schedule): at full context and at random positions every 16-row tile of every
    (sequence, KV head) is walked by exactly one block, pieces are contiguous and whole tiles, a pair spans at most
    ATT_NSPLIT blocks, no block walks more than R tiles, each pair charged ATT_PIECE_TILES units (spread positions:
    a block holds few short pairs); the planner takes it by default where the static split
    takes two rounds and its model gains STREAM_MIN_GAIN (the held-out Llama-3.2-1B shape at batch 20: 160 pairs),
    and instead of ATT_DYN 1 (from KV 8192) at STREAM_MIN_PAIRS to SMs pairs (b8 with 8 KV heads: a serving mix's
    even split) or with fewer (from STREAM_IDLE_MIN_PAIRS) where ATT_DYN 1's one round leaves STREAM_IDLE_SMS of
    the SMs idle, and where one round of the static split leaves SMs idle with a modelled gain of STREAM_IDLE_GAIN
    (Llama-3-8B- and 1B-shaped b9: 72 pairs, the held-out Qwen2.5-7B-like b24: 96; not with an ATT_COMBINE 3
    override) but not at a smaller gain (the held-out SmolLM-like b3: 9 pairs, 99 tasks), nor with fewer pairs at KV
    32768; an override of 2 is taken, 3 refused."""
    import random
    from generator.modes.decode import STREAM_MIN_GAIN, attention_pieces, attention_stream, static_rounds, stream_gain
    rng = random.Random(22)
    by_name = {v.name: v for v in declared()}
    v = by_name["ho-l1b-b20_decode_b20_s4096_bf16"]
    c = render.plan(v, "90")["consts"]
    assert c["ATT_DYN"] == 2 and c["ATT_NSPLIT"] == 16 and c["ATT_COMBINE"] == 1
    assert static_rounds(c, 132) == 2 and stream_gain(c, 132, 2) >= STREAM_MIN_GAIN
    for name in ("llama3-8b_decode_b8_s4096_bf16", "ho-h576-g3_decode_b3_s4096_bf16",
                 "ho-l1b-b32_decode_b32_s4096_bf16", "llama3-8b_decode_b4_s32768_bf16",
                 "qwen2.5-7b_decode_b8_s32768_bf16", "qwen2.5-0.5b_decode_b8_s32768_bf16"):
        assert render.plan(by_name[name], "90")["consts"]["ATT_DYN"] != 2, name
    assert render.plan(by_name["ho-h3584-b24_decode_b24_s4096_bf16"], "90")["consts"]["ATT_DYN"] == 2
    from generator.modes.decode import STREAM_IDLE_GAIN
    for model, idle in (("llama3-8b", True), ("llama3.2-1b", True)):  # 72 pairs: 9 x 8 KV heads, KV 4096
        u = dataclasses.replace(by_name[f"{model}_decode_b8_s4096_bf16"], batch=9)
        cu = render.plan(u, "90", overrides={"ATT_DYN": 2})["consts"]  # (the static split's ATT_C, stream-K's room)
        assert static_rounds(cu, 132) == 1 and stream_gain(cu, 132, 2) >= STREAM_IDLE_GAIN, model
        assert (render.plan(u, "90")["consts"]["ATT_DYN"] == 2) == idle, model
        # ATT_COMBINE 3, 4 (the static split's combines) as overrides keep the static split
        for comb in (3, 4):
            assert render.plan(u, "90", overrides={"ATT_COMBINE": comb})["consts"]["ATT_DYN"] == 0, model
    # fewer pairs where ATT_DYN 1's whole splits leave STREAM_IDLE_SMS of the SMs idle at full context: the held-out
    # Llama-3.2-3B-like b7 at KV 16384 (56 pairs x 2 splits = 112 tasks on 132) and the 8B shape b6 (48 x 2 = 96) and
    # b5 (40 x 3 = 120: 9 % idle), not the declared b4 (32 x 4 = 128)
    assert render.plan(by_name["ho-l3b-b7_decode_b7_s16384_bf16"], "90")["consts"]["ATT_DYN"] == 2
    for batch, dyn in ((6, 2), (5, 2), (4, 1)):
        u = dataclasses.replace(by_name["llama3-8b_decode_b4_s32768_bf16"], batch=batch, seq_len=16384)
        assert render.plan(u, "90")["consts"]["ATT_DYN"] == dyn, batch
    # (Qwen2.5-0.5B's 2 KV heads at b3: 6 pairs x 16 splits = 96 tasks, all that stream-K's room of 16 pieces a pair
    # would fill too)
    u = dataclasses.replace(by_name["qwen2.5-0.5b_decode_b4_s32768_bf16"], batch=3)
    assert render.plan(u, "90")["consts"]["ATT_DYN"] == 1
    for name in ("llama3.2-1b_decode_b8_s32768_bf16", "llama3-8b_decode_b8_s32768_bf16"):  # 64 pairs from KV 8192
        c8 = render.plan(by_name[name], "90")["consts"]
        assert c8["ATT_DYN"] == 2 and c8["ATT_NSPLIT"] >= 2, name
        assert render.plan(by_name[name], "90", overrides={"ATT_DYN": 1})["consts"]["ATT_DYN"] == 1
    for u, grid in ((v, 132), (by_name["llama3.2-1b_decode_b4_s4096_bf16"], 132),
                    (by_name["ho-h3584-b24_decode_b24_s4096_bf16"], 100)):
        cu = render.plan(u, "90", overrides={"ATT_DYN": 2})["consts"]
        assert cu["ATT_DYN"] == 2 and cu["ATT_NSPLIT"] >= 2
        for trial in range(30):
            lengths = ([u.seq_len] * u.batch if trial == 0 else
                       [rng.choice([0, 1, 17, u.seq_len, rng.randint(1, u.seq_len)]) for _ in range(u.batch)])
            r, w = attention_stream(lengths, cu, grid)
            seen: dict = {}
            for blk in attention_pieces(lengths, cu, grid):
                assert sum(-(-(e - s) // 16) for _, _, s, e, _, _ in blk) <= r
                for b, h, s, e, split, nsplit in blk:
                    assert s < e <= max(16, -(-lengths[b] // 16) * 16)
                    seen.setdefault((b, h), []).append((s, e, split, nsplit))
            assert len(seen) == u.batch * cu["KV_HEADS"], (u.name, lengths)
            for (b, h), runs in seen.items():
                runs.sort()
                assert runs[0][0] == 0 and runs[-1][1] == max(16, -(-lengths[b] // 16) * 16), (u.name, lengths, b)
                assert all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1)), (u.name, lengths, b)
                # the counter's view: splits 0 .. nsplit - 1 in row order, every piece the same nsplit, the last
                # (it appends and combines) holding the position's row
                assert [x[2] for x in runs] == list(range(len(runs))), (u.name, lengths, b, runs)
                assert {x[3] for x in runs} == {len(runs)} and len(runs) <= cu["ATT_NSPLIT"], (u.name, lengths, b)
                assert lengths[b] == 0 or runs[-1][0] <= lengths[b] - 1 < runs[-1][1], (u.name, lengths, b)
    # positions spread evenly over the cache: no block walks the pieces of more than 4 pairs (unweighted: 12; the
    # bytes model's charge of 24 tiles: 5); the runs charge PIECE_RUN_TILES a piece (or the override), while the choice
    # of ATT_DYN 2 keeps its bytes model: an override of the charge changes no other knob
    from generator.modes.decode import PIECE_RUN_TILES
    spread = [(b + 1) * v.seq_len // v.batch for b in range(v.batch)]
    assert c["ATT_PIECE_TILES"] == PIECE_RUN_TILES and max(len(blk) for blk in attention_pieces(spread, c, 132)) <= 4
    assert max(len(blk) for blk in attention_pieces(spread, {**c, "ATT_PIECE_TILES": 24}, 132)) == 5
    u = dataclasses.replace(by_name["llama3-8b_decode_b8_s4096_bf16"], batch=9)  # ATT_DYN 2 by its idle-SM rule
    for ov in ({"ATT_PIECE_TILES": 1}, {"ATT_PIECE_TILES": 400}):
        a, b = render.plan(u, "90")["consts"], render.plan(u, "90", overrides=ov)["consts"]
        assert {k for k in a if a[k] != b[k]} == {"ATT_PIECE_TILES"} and b["ATT_PIECE_TILES"] == ov["ATT_PIECE_TILES"]
    with pytest.raises(PlanError, match="ATT_PIECE_TILES=48: a piece's charge in ATT_DYN 2's runs"):
        render.plan(by_name["llama3-8b_decode_b8_s4096_bf16"], overrides={"ATT_PIECE_TILES": 48})
    assert render.plan(by_name["llama3-8b_decode_b8_s4096_bf16"])["consts"]["ATT_PIECE_TILES"] == 0  # unused there
    # any charge still covers every tile once (0: no fixed cost; 1024: a run of one pair a block where it can)
    for charge in (0, 1024):
        cc = {**c, "ATT_PIECE_TILES": charge}
        for lengths in ([v.seq_len] * v.batch, spread):
            got = sorted((b, h, s) for blk in attention_pieces(lengths, cc, 132) for b, h, s, e, _, _ in blk
                         for s in range(s, e, 16))
            assert got == sorted((b, h, r) for b in range(v.batch) for h in range(cc["KV_HEADS"])
                                 for r in range(0, max(16, -(-lengths[b] // 16) * 16), 16)), (charge, lengths)
    # the tuner times the charge (halved, doubled) and ATT_DYN 1 against a static plan only off full context
    from generator import tune as gt
    for name, knob in (("ho-l1b-b20_decode_b20_s4096_bf16", "ATT_PIECE_TILES"),
                       ("llama3-8b_decode_b8_s4096_bf16", "ATT_DYN")):
        full, mixed = gt.candidates(by_name[name], "90", 64), gt.candidates(by_name[name], "90", 64, "mixed")
        assert not any(knob in ov and ov[knob] != 2 for ov in full), name
        assert any(knob in ov and ov[knob] != 2 for ov in mixed), name
    with pytest.raises(PlanError, match="ATT_DYN=3: must be 0, 1 or 2"):
        render.plan(v, overrides={"ATT_DYN": 3})
    with pytest.raises(PlanError, match="ATT_DYN=2: needs batch <= 32"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"ATT_DYN": 2})


def test_attention_tiles_by_tma_on_sm90(tmp_path):
    """ATT_TMA (attention's K/V tiles by TMA tensor copies in the 128-byte swizzle) is the default for the decode
    variants of batch >= 16 on one GPU on sm_90 with head_dim 64 or 128 (whole boxes), off below, at head_dim 80/96
    (box bytes past the row: not measured) and on sm_80 (refused there as an override, in one line);
    its ring sits at 1024 bytes (the swizzle's atom), a tile of K and V is one 2 KB box a 64-dim part (head_dim 80:
    two, the second part zeros past the row), and each walker warp's stage has an 8-byte mbarrier beside the
    schedule."""
    vs = declared()
    on = set()
    for v in vs:
        c = render.plan(v, "90")["consts"]
        if v.mode == "decode":
            assert c["ATT_TMA"] == int(v.batch >= 16 and v.tp == 1 and v.model.head_dim % 64 == 0), v.name
            on |= {v.name} if c["ATT_TMA"] else set()
            assert c["SMEM_WST"] % (1024 if c["ATT_TMA"] else 16) == 0, v.name
            assert c["SMEM_MBAR"] % (8 if c["ATT_TMA"] else 4) == 0 and c["SMEM_MBAR"] >= c["SMEM_SCHED"], v.name
            assert render.plan(v, "80")["consts"]["ATT_TMA"] == 0, v.name
    assert len(on) >= 6, on
    hd96 = dataclasses.replace(next(v for v in vs if v.model.head_dim == 96 and v.mode == "decode"), batch=16)
    assert render.plan(hd96, "90")["consts"]["ATT_TMA"] == 0
    v = next(v for v in vs if v.name == "llama3-8b_decode_b1_s4096_bf16")
    with pytest.raises(PlanError) as ei:
        render.plan(v, "80", overrides={"ATT_TMA": 1})
    assert "\n" not in str(ei.value) and "sm_90" in str(ei.value)
    tp = next(v for v in vs if v.tp > 1 and v.mode == "decode")
    with pytest.raises(PlanError, match="ATT_TMA=1: not with tensor parallel"):
        render.plan(tp, "90", overrides={"ATT_TMA": 1})
    # sm_90a (what sm_90 builds as) plans as sm_90: the same default, an override taken, the tuner's flip listed
    b16 = next(v for v in vs if v.name == "ho-h5120-g5_decode_b16_s4096_bf16")
    assert render.plan(b16, "90a")["consts"]["ATT_TMA"] == 1 == render.plan(v, "90a", overrides={"ATT_TMA": 1})[
        "consts"]["ATT_TMA"]
    assert {"ATT_TMA": 1} in gtune.candidates(v, "90a")
    # NORM_GLOBAL's batch rule goes with ATT_TMA (measured together): without it the rows stay where they fit
    assert render.plan(b16, "90", overrides={"ATT_TMA": 0})["consts"]["NORM_GLOBAL"] == 0
    hd80 = next(v for v in vs if v.name.startswith("ho-hd80") and v.mode == "decode")
    on, off = (render.plan(hd80, "90", overrides={"ATT_TMA": t})["consts"] for t in (1, 0))
    ring = lambda c: c["SMEM_FLAG"] - c["SMEM_WST"]  # noqa: E731
    assert ring(on) >= on["ATT_WARPS"] * on["ATT_STAGES"] * 2 * 2 * 16 * 64 * 2  # two boxes a row of 80 dims
    assert ring(off) >= off["ATT_WARPS"] * off["ATT_STAGES"] * 2 * 16 * 88 * 2
    # the TMA walk compiles for sm_90 (mbarriers, tensor copies, the swizzled ldmatrix addresses) without spills: a
    # 1B-shaped layer at batch 16 and the head_dim-80 shape forced on (with o_proj in steps of 7, 7, 6: in the full
    # steps of 5 its planner now takes, this plan spills 128 B, a tuner candidate discarded as such)
    from generator import compile as gcompile
    from bench.tune import renamed
    l1b16 = dataclasses.replace(next(v for v in vs if v.name == "llama3.2-1b_decode_b8_s4096_bf16"), batch=16)
    c80 = renamed(hd80, "tma80")
    res = gcompile.build([l1b16, c80], tmp_path, overrides={c80.name: {"ATT_TMA": 1, "O_U": 7}})
    for e in res["entries"]:
        r = e["resources"]
        assert e["status"] == "ok" and r["spill_stores"] + r["spill_loads"] == 0, (e["name"], e.get("error"), r)


def test_norm_global_where_the_rows_do_not_fit_or_leave_too_little_l1():
    """NORM_GLOBAL is the default where the normalised rows and one buffer of partial sums would not fit in the
    block's shared memory (Llama-3-8B from batch 26: refused before) and, on a GPU of 256 KB of L1 and shared memory,
    where no plan with the rows there leaves L1_ENOUGH of L1 (Llama-3-8B b22-25, the Mistral-Nemo-like b18: 28 KB)
    or, with ATT_TMA, from batch 16 (NORM_GLOBAL_MIN_BATCH, where it leaves L1_ENOUGH itself); then the norms are steps of their own
    with a grid barrier each, the rows' buffer (xn) sized in whole n-tiles, no rows in shared memory and two tiles a
    GEMV task (TM), and H_STATS (the second norm from o_proj's epilogue: no step, no barrier; H_STATS=0 gives it back).
    Off on every other declared and held-out variant, on sm_80 below that batch, and with tensor parallel (there an
    override only); refused with NORM_FOLD / NORM_CLUSTER, and NORM_GLOBAL=0 where the rows do not fit names the
    largest batch that does and NORM_GLOBAL in its refusal."""
    from generator.plan import L1_ENOUGH, l1_bytes
    from generator.targets import arch as get_arch
    by = {v.name: v for v in declared()}
    on = {v.name for v in declared() if v.tp == 1 and render.plan(v, "90")["consts"]["NORM_GLOBAL"]}
    assert on == {v.name for v in declared() if v.mode == "decode" and v.tp == 1 and v.batch >= 16}
    assert len(on) >= 8
    l8b = by["llama3-8b_decode_b8_s4096_bf16"]
    for b, want in ((8, 0), (15, 0), (16, 1), (20, 1), (21, 1), (22, 1), (25, 1), (26, 1), (32, 1)):
        p = render.plan(dataclasses.replace(l8b, batch=b), "90")
        c = p["consts"]
        assert c["NORM_GLOBAL"] == want and c["NORM_LOCAL"] == 1 - want and c["H_STATS"] == want, b
        assert c["NORM2_LOCAL"] == 1 and (c["SMEM_SQ"] > 0) == bool(want), b
        assert p["grid_syncs"] == 3 + want - c["DOWN_FLOW"] and p["sizes"]["XN_ROWS"] == (-(-b // 8) * 8 if want else 0), b
        if want:  # without H_STATS the second norm is a step of its own again
            p0 = render.plan(dataclasses.replace(l8b, batch=b), "90", overrides={"H_STATS": 0})
            assert p0["grid_syncs"] == 5 and p0["consts"]["NORM2_LOCAL"] == 0 and p0["consts"]["SMEM_SQ"] == 0, b
        if want:
            assert c["SMEM_RED"] == 0 and c["NORM_FOLD"] == 0 and p["smem_bytes"] < 160 * 1024
            if 22 <= b < 26:  # the rows would fit, leaving too little L1
                local = render.plan(dataclasses.replace(l8b, batch=b), "90", overrides={"NORM_GLOBAL": 0})
                assert l1_bytes(get_arch("90"), local["smem_bytes"]) < L1_ENOUGH
    # below the batch rule the rows stay where they leave L1_ENOUGH; sm_80 (164 KB) never measured the L1 rules
    assert render.plan(dataclasses.replace(l8b, batch=16), "80")["consts"]["NORM_GLOBAL"] == 0
    b32 = dataclasses.replace(l8b, batch=32)
    assert tuple(render.plan(b32, "90")["workspace"]["buffers"]["xn"]["shape"]) == (32, 4096)
    with pytest.raises(PlanError, match="at most 25 fits; NORM_GLOBAL=1 .the default where they do not fit."):
        render.plan(b32, "90", overrides={"NORM_GLOBAL": 0})
    with pytest.raises(PlanError, match="a batch of at most 22 fits; NORM_GLOBAL=1 keeps them in global memory "
                                        ".with tensor parallel an override only, not yet timed on 2 GPUs: an entry"):
        render.plan(dataclasses.replace(b32, tp=2), "90")
    with pytest.raises(PlanError, match="at most 24 fits; NORM_GLOBAL=1 keeps them in global memory, without the "
                                        "overrides NORM_FOLD=1$"):  # an override that pins the rows: drop it
        render.plan(b32, "90", overrides={"NORM_FOLD": 1})
    for b, tm in ((64, 2), (72, 1), (128, 1)):  # two tiles' accumulators in registers: 2 x NTILE <= 16
        c = render.plan(dataclasses.replace(l8b, batch=b), "90")["consts"]
        assert c["NORM_GLOBAL"] == 1 and c["GU_TM"] == c["O_TM"] == tm, b
    with pytest.raises(PlanError, match="16 warps x 16 x batch x 4 B .twice with RED_DB=1.: a batch of at most 227"):
        render.plan(dataclasses.replace(l8b, batch=240), "90")
    for ov, why in (({"NORM_FOLD": 1}, r"no NORM_FOLD \(this plan: 1\)"),
                    ({"NORM_CLUSTER": 2}, r"NORM_CLUSTER 1 \(this plan: 2\)")):
        with pytest.raises(PlanError, match=f"NORM_GLOBAL=1 needs {why}$"):
            render.plan(l8b, "90", overrides={"NORM_GLOBAL": 1, **ov})
    # tensor parallel: an override (session 45; the norm step reads the all-reduced fp32 h, no H_STATS)
    c = render.plan(dataclasses.replace(l8b, tp=2), "90", overrides={"NORM_GLOBAL": 1})["consts"]
    assert c["NORM_GLOBAL"] == 1 and c["H_STATS"] == 0 and c["NORM2_LOCAL"] == 0 and c["TP"] == 2
    src = render.render(b32, render.plan(b32, "90"))
    assert src.count("if constexpr (!NORM_LOCAL) grid.sync();") == 1
    assert src.count("if constexpr (!NORM2_LOCAL) grid.sync();") == 1
    # with the rows in global memory every projection takes two tiles a task (<P>_TM 2: each B fragment loaded once
    # for both), its loads a step halved (the same registers); beside rows in shared memory one
    c = render.plan(b32, "90")["consts"]
    assert all(c[f"{p}_TM"] == 2 and c[f"{p}_U"] <= 4 for p in ("QKV", "O", "GU", "DOWN"))
    assert all(render.plan(l8b, "90")["consts"][f"{p}_TM"] == 1 for p in ("QKV", "O", "GU", "DOWN"))
    one = render.plan(b32, "90", overrides={"GU_TM": 1})["consts"]
    assert one["GU_TM"] == 1 and one["GU_U"] == 8 and one["O_TM"] == 2
    for ov, words in (({"O_TM": 3}, "must be 1, 2 or 4"), ({"O_TM": 2, "O_KSPLIT": 2}, "O_TM=2: needs O_KSPLIT 1")):
        with pytest.raises(PlanError, match=re.escape(words)):
            render.plan(l8b, "90", overrides=ov)
    # H_STATS beside the rows: o_proj's squares, a region per group and tile of a task, in the rows' region
    assert render.plan(l8b, "90", overrides={"H_STATS": 1, "O_TM": 2})["consts"]["O_TM"] == 2
    with pytest.raises(PlanError, match=re.escape("8 warp groups' squares (16384 B) exceed the rows' region (14464 B)")):
        render.plan(by["qwen2.5-0.5b_decode_b8_s4096_bf16"], "90", overrides={"H_STATS": 1, "O_TM": 4, "O_NWG": 2})
    odd = dataclasses.replace(l8b, model=dataclasses.replace(l8b.model, hidden=4112, intermediate=14352))
    with pytest.raises(PlanError, match="in whole groups of 4"):
        render.plan(odd, "90", overrides={"DOWN_TM": 4})


def test_dynamic_attention_split_is_the_planned_one_at_full_context(tmp_path):
    """ATT_DYN (default at batch 2-32 from KV 8192 on one GPU, 2 from 64 pairs, off with an ATT_C override): at full context the
    split the kernel picks (decode.attention_split, the model of templates/stages/attention.cuh att_schedule) is the
    planner's ATT_C for every declared and held-out variant, as built (tuned plans included) with ATT_DYN on; at
    mixed positions it is never more rows than that, keeps every sequence within ATT_NSPLIT splits and is whole tiles
    for every walker warp; batch 1, batch > 32 and tensor parallel keep the static split (asking for it there is
    refused)."""
    import random
    from generator.modes.decode import attention_split
    rng = random.Random(5)
    n_dyn = 0
    for v in declared():
        c = render.plan(v, "90", overrides=gtune.resolve(v, "90", gtune.default_tuning_file())[0])["consts"]
        if v.batch == 1 or v.batch > 32 or v.tp > 1:
            assert c["ATT_DYN"] == 0, v.name
            continue
        rows = min(v.seq_len, v.model.sliding_window or v.seq_len)  # the rows attended (a sliding window's)
        assert c["ATT_DYN"] in (2, int(rows >= 8192)), v.name  # 2: stream-K (test_stream_attention_...)
        c = render.plan(v, "90", overrides={**gtune.resolve(v, "90", gtune.default_tuning_file())[0],
                                            "ATT_DYN": 1})["consts"]
        n_dyn += 1
        assert attention_split([rows] * v.batch, c, 132) == c["ATT_C"], v.name
        for _ in range(20):
            lengths = [rng.choice([0, 1, rows, rng.randint(1, rows)]) for _ in range(v.batch)]
            split = attention_split(lengths, c, 132)
            assert split % (16 * c["ATT_WARPS"]) == 0 and split <= max(c["ATT_C"], 16 * c["ATT_WARPS"]), (v, lengths)
            assert max(-(-n // split) for n in lengths) <= c["ATT_NSPLIT"], (v.name, lengths, split)
            if v.batch * c["KV_HEADS"] <= 132:  # one round
                assert c["KV_HEADS"] * sum(max(1, -(-n // split)) for n in lengths) <= 132, (v.name, lengths)
    assert n_dyn >= 20
    # spread 4,096 ... 32,768 rows: the smallest split with one task a block (by hand: 1+1+1+2+2+2+3+3 = 15 splits
    # x 8 KV heads = 120 tasks; 12,160 rows would make 17 x 8 = 136)
    v = next(v for v in declared() if v.name == "llama3-8b_decode_b8_s32768_bf16")
    assert attention_split([(b + 1) * 4096 for b in range(8)], render.plan(v, overrides={"ATT_DYN": 1})["consts"],
                           132) == 12288
    assert render.plan(v, overrides={"ATT_C": 8192})["consts"]["ATT_DYN"] == 0
    for bad in (dataclasses.replace(v, tp=2), dataclasses.replace(v, batch=1)):
        assert render.plan(bad)["consts"]["ATT_DYN"] == 0
    with pytest.raises(PlanError, match="ATT_DYN=1: needs batch <= 32"):
        render.plan(dataclasses.replace(v, tp=2), overrides={"ATT_DYN": 1})
    with pytest.raises(PlanError, match="ATT_DYN=1 and ATT_C=8192"):
        render.plan(v, overrides={"ATT_DYN": 1, "ATT_C": 8192})
    # the schedule's one-warp limit holds only where it is compiled in: a batch-33 layer builds
    from generator import compile as gcompile
    b33 = gvariants.parse("""
matrix: {mode: [decode], batch: [33], seq_len: [128]}
models:
  hw: {hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 512, layers: 2, norm: rmsnorm,
       norm_eps: 1.0e-6, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "b33.yaml")
    res = gcompile.build(b33, tmp_path)
    assert not res["errors"], res["errors"][0]["error"][:300]


def test_fragment_ordered_activations_on_one_gpu():
    """X_FRAG (o_proj's and down_proj's X in B-fragment order) is the default on one GPU, from 8 sequences on with
    tensor parallel: the buffers hold whole n-tiles of 8 rows, the knob turns it off; the second norm's T copy of h
    exists only without TP and in bf16 (fp16 could overflow)."""
    b8 = next(v for v in declared() if v.name == "ho-h5120-g5_decode_b16_s4096_bf16")
    b1 = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    b3 = next(v for v in declared() if v.name == "ho-h2560-g5_decode_b3_s4096_bf16")
    p = render.plan(b8)
    assert p["consts"]["X_FRAG"] == 1 and render.plan(b1)["consts"]["X_FRAG"] == 1
    assert render.plan(b3)["sizes"]["XF_ROWS"] == 8  # 3 rows padded to an n-tile
    assert render.plan(b3, overrides={"X_FRAG": 0})["sizes"]["XF_ROWS"] == 3
    bufs = p["workspace"]["buffers"]
    assert bufs["attn"]["shape"] == [16, 5120] and bufs["act"]["shape"] == [16, 13824]
    assert bufs["hb"]["shape"] == [16, 5120]
    off = render.plan(b8, overrides={"X_FRAG": 0})
    assert off["consts"]["X_FRAG"] == 0 and "X_FRAG = 0;" in render.render(b8, off)
    tp = next(v for v in declared() if v.tp > 1 and v.batch < 8)
    assert render.plan(tp)["workspace"]["buffers"]["hb"]["bytes"] == 0 and render.plan(tp)["consts"]["HB_COPY"] == 0
    assert render.plan(tp)["consts"]["X_FRAG"] == 0
    assert p["consts"]["HB_COPY"] == 1
    with pytest.raises(PlanError, match="X_FRAG=2"):
        render.plan(b8, overrides={"X_FRAG": 2})


def test_batch_slices_by_default_past_32_sequences():
    """<P>_BS (a projection's warp group in batch slices of at most 4 n-tiles): 2 from batch 41 (uneven slices at 41:
    3 + 3 n-tiles, the last partial), 4 from 73 (at 65-72 four slices of 3 would leave one empty: 2), 1 up to 40 (up
    to 32 the kernel as before: no BS constant moves a plan); an override where the projection cannot take it is one
    line naming the requirement."""
    l1b = "hidden: 2048, heads: 32, kv_heads: 8, head_dim: 64, intermediate: 8192"
    for batch, bs in ((1, 1), (8, 1), (32, 1), (33, 1), (40, 1), (41, 2), (64, 2), (65, 2), (72, 2), (73, 4), (96, 4), (128, 4), (136, 4)):
        c = render.plan(_decode_layer("bsd", batch, 1024, l1b))["consts"]
        assert [c[f"{p}_BS"] for p in ("QKV", "O", "GU", "DOWN")] == [bs] * 4, (batch, c)
    b64 = _decode_layer("bsd", 64, 1024, l1b)
    assert render.plan(b64, overrides={"O_PRE": 1})["consts"]["O_BS"] == 1  # (an override's requirement: the default
    for ov, words in (({"O_BS": 2, "O_PRE": 1}, ["O_BS=2", "O_PRE 0"]),      # yields to it)
                      ({"GU_BS": 4, "GU_NWG": 2}, ["GU_BS=4", "GU_NWG a multiple"]),
                      ({"DOWN_BS": 3}, ["DOWN_BS=3", "must be 1, 2, 4 or 8"])):
        with pytest.raises(PlanError) as ei:
            render.plan(b64, overrides=ov)
        assert "\n" not in str(ei.value) and all(w in str(ei.value) for w in words), str(ei.value)
    with pytest.raises(PlanError, match=r"GU_BS=8 needs .*an n-tile of 8 sequences for every slice \(6 at batch 48\)"):
        render.plan(_decode_layer("bsd", 48, 1024, l1b), overrides={"GU_BS": 8})  # (8 slices of 6 n-tiles)
    b8 = next(v for v in declared() if v.name == "llama3.2-1b_decode_b8_s4096_bf16")
    with pytest.raises(PlanError, match="DOWN_BS=2 needs .*DOWN_FLOW 0"):
        render.plan(b8, overrides={"DOWN_BS": 2, "DOWN_FLOW": 1})


def test_gemm_projections_from_batch_64_on_sm_90(monkeypatch):
    """GEMM_PROJ (qkv_proj, o_proj and gate_up on the wgmma GEMM engine): by default from GEMM_BATCH_MIN on one sm_90
    GPU where the norms' rows are in global memory, with QKV_FLOW 0 (the engine's tiles are not counted); its tiling is
    256 weight rows x token tiles of at most 64 (batch 100: two of 64, padded to 128 rows), split-K from the planner's
    rule but for a projection with GEMM_UNSPLIT_SHARE of the SMs' worth of tiles or more (up to one a block: whole); the workspace holds the split tiles' partials, a counter a tile and the tiled inputs; where it cannot be
    taken an override is one line naming what is missing."""
    from generator import interface
    from generator.modes import decode
    l1b = "hidden: 2048, heads: 32, kv_heads: 8, head_dim: 64, intermediate: 8192"
    # qkv_proj and o_proj on the engine where their split gives GEMM_TASKS_MIN_SHARE of the SMs a task: Llama-3.2-3B-
    # like b64 (120 and 120 on 132 SMs) and Llama-3-8B b64 (120, 128) all three; Qwen2.5-1.5B-like b64 (48, 36)
    # GEMVs beside gate_up's GEMM
    for shape, want in (("hidden: 3072, heads: 24, kv_heads: 8, head_dim: 128, intermediate: 8192", (1, 1, 6, 10)),
                        ("hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128, intermediate: 14336", (1, 1, 5, 8)),
                        ("hidden: 1536, heads: 12, kv_heads: 2, head_dim: 128, intermediate: 8960", (0, 0, 1, 1))):
        c = render.plan(_decode_layer("gpd", 64, 1024, shape))["consts"]
        assert (c["GEMM_PROJ"], c["QKV_GEMM"], c["O_GEMM"], c["QKV_GSPLIT"], c["O_GSPLIT"]) == (1, *want), shape
    monkeypatch.setattr(decode, "GEMM_TASKS_MIN_SHARE", 0)  # (the rule off: all three on the engine)
    c = render.plan(_decode_layer("gpd", 64, 1024, l1b))["consts"]
    assert (c["GEMM_PROJ"], c["QKV_GEMM"], c["O_GEMM"], c["QKV_GSPLIT"], c["O_GSPLIT"]) == (1, 1, 1, 8, 8)
    monkeypatch.undo()
    for batch, on in ((1, 0), (8, 0), (32, 0), (48, 0), (63, 0), (64, 1), (100, 1), (128, 1)):
        p = render.plan(_decode_layer("gpd", batch, 1024, l1b))
        c = p["consts"]
        assert (c["GEMM_PROJ"], c["GEMM_WGMMA"]) == (on, on), (batch, c)
        if not on:
            assert "gemm" not in p and c["QKV_GSPLIT"] == 1
            continue
        assert c["NORM_GLOBAL"] == 1 and c["QKV_FLOW"] == 0 and c["GEMM_WM"] * 16 == 256
        bn = c["GEMM_TN"] * 8
        assert bn <= 64 and bn % 16 == 0 and c["GEMM_XROWS"] % bn == 0 and c["GEMM_XROWS"] >= batch
        g = p["gemm"]
        # qkv_proj and o_proj: GEMVs at batch 64 (their 12 and 8 tiles split 8 ways: 96 and 64 tasks, under
        # GEMM_TASKS_MIN_SHARE of 132 SMs), on the engine past one token tile (batch 100, 128: o_proj's 16 tiles
        # split 8 ways)
        engine = int(batch > 64)
        assert (c["QKV_GEMM"], c["O_GEMM"]) == (engine, engine), (batch, c)
        assert g["gate_up"]["KSPLIT"] == 1 and g["o"]["KSPLIT"] == (8 if engine else 1)
        for key, pre in (("qkv", "QKV"), ("o", "O"), ("gate_up", "GU")):
            assert (c[f"{pre}_GSPLIT"], c[f"{pre}_GFULL"]) == (g[key]["KSPLIT"], g[key]["FULL"])
            if g[key]["KSPLIT"] > 1:
                assert p["sizes"]["SPLIT_FLOATS"] >= (g[key]["tiles"] - g[key]["FULL"]) * g[key]["KSPLIT"] * 256 * bn
                assert p["sizes"]["COUNTERS"] >= g[key]["tiles"]
        # gate_up's 1/rms of each row past the ring (H_STATS), both within the block's shared memory
        assert c["SMEM_RS"] >= c["GEMM_STAGES"] * (256 + bn) * 64 * 2 + 1024
        assert c["SMEM_RS"] + 4 * batch <= p["smem_bytes"]
        buf = interface.workspace_layout({**c, "ROWS": batch, **p["sizes"]})["buffers"]
        assert buf["xn"]["shape"] == [c["GEMM_XROWS"], 2048]
        assert buf["attn"]["shape"] == [c["GEMM_XROWS"] if engine else -(-batch // 8) * 8, 2048]
        assert buf["act"]["shape"][1] == 8192  # (down_proj's GEMV input: fragment order, not tiled)
    assert render.plan(_decode_layer("gpd", 64, 1024, l1b), arch="80")["consts"]["GEMM_PROJ"] == 0
    b32, b64 = (_decode_layer("gpd", b, 1024, l1b) for b in (32, 64))
    c = render.plan(b32, overrides={"GEMM_PROJ": 1})["consts"]  # (asked for: the norms' rows in global memory)
    assert c["GEMM_PROJ"] == 1 and c["NORM_GLOBAL"] == 1
    for ov in ({"QKV_FLOW": 1}, {"GU_NWG": 8}):  # (an override of the GEMVs' plan: GEMM_PROJ 0)
        assert render.plan(b64, overrides=ov)["consts"]["GEMM_PROJ"] == 0, ov
    # per projection: a GEMV knob of qkv_proj or o_proj keeps it a GEMV (the engine takes the others), a split of
    # the engine's puts it there; QKV_FLOW's counters beside the engine where both are asked to stay GEMVs
    b100 = _decode_layer("gpd", 100, 1024, l1b)
    for v, ov, want in ((b100, {"O_PRE": 1}, (1, 1, 0)), (b100, {"QKV_NWG": 8}, (1, 0, 1)),
                        (b64, {"O_GSPLIT": 4}, (1, 0, 1)), (b64, {"QKV_GEMM": 1, "O_GEMM": 1}, (1, 1, 1)),
                        (b64, {"QKV_GEMM": 0, "O_GEMM": 0, "QKV_FLOW": 1}, (1, 0, 0))):
        c = render.plan(v, overrides=ov)["consts"]
        assert (c["GEMM_PROJ"], c["QKV_GEMM"], c["O_GEMM"]) == want and all(c[k] == x for k, x in ov.items()), ov
    c = render.plan(b32, overrides={"GU_GSPLIT": 2})["consts"]  # (the engine's knob asked: GEMM_PROJ with it)
    assert (c["GEMM_PROJ"], c["NORM_GLOBAL"], c["GU_GSPLIT"]) == (1, 1, 2)
    c = render.plan(b64, overrides={"O_GEMM": 1})["consts"]
    assert (c["O_GSPLIT"], c["QKV_GSPLIT"]) == (8, 1)  # (the planner's split for the one asked onto the engine)
    # qkv_proj on the engine where hidden is not whole 64-column blocks (its GEMV's rows would fill gate_up's padding
    # columns of the shared xn); o_proj's first weight step not pre-loaded where it runs on the engine (batch 2-8)
    hd80 = _decode_layer("gpd", 64, 1024, "hidden: 1440, heads: 18, kv_heads: 6, head_dim: 80, intermediate: 3840")
    assert render.plan(hd80, overrides={"GEMM_PROJ": 1})["consts"]["QKV_GEMM"] == 1
    c = render.plan(_decode_layer("gpd", 8, 1024, l1b), overrides={"O_GEMM": 1})["consts"]
    assert (c["GEMM_PROJ"], c["O_GEMM"], c["O_PRE"]) == (1, 1, 0)
    # asked for at batch 8 (one token tile of 16): the counters and LL words the planner takes there give way to it
    c = render.plan(_decode_layer("gpd", 8, 1024, l1b), overrides={"GEMM_PROJ": 1})["consts"]
    assert (c["GEMM_PROJ"], c["DOWN_FLOW"], c["ATT_LL"], c["H_LL"], c["QKV_FLOW"]) == (1, 0, 0, 0, 0)
    hd80 = _decode_layer("gpd", 64, 1024, "hidden: 1440, heads: 18, kv_heads: 6, head_dim: 80, intermediate: 3840")
    assert render.plan(hd80)["consts"]["GEMM_PROJ"] == 0  # (head_dim 80 spills with it: not by default)
    # down_proj on the engine (DOWN_GEMM; an override until its GPU test runs: decode.DOWN_GEMM_BY_DEFAULT): asked, it
    # brings GEMM_PROJ and tiles act; its split from the planner's rule, or DOWN_GSPLIT; a GEMV knob of down_proj
    # beside it is one line
    for v in (b64, b100):
        assert render.plan(v)["consts"]["DOWN_GEMM"] == 0
        p = render.plan(v, overrides={"DOWN_GEMM": 1})
        c = p["consts"]
        assert (c["GEMM_PROJ"], c["DOWN_GEMM"]) == (1, 1) and interface.on_engine(c, "DOWN")
        # 8 weight tiles of 256 rows x the token tiles (1 at b64, 2 at b100), split 16 / 8 ways: 128 tasks either way
        tiles = 8 * -(-v.batch // 64)
        assert p["gemm"]["down"]["tiles"] == tiles and (c["DOWN_GSPLIT"], c["DOWN_GFULL"]) == (128 // tiles, 0)
        assert p["sizes"]["COUNTERS"] >= p["gemm"]["down"]["tiles"]
        assert p["sizes"]["SPLIT_FLOATS"] >= 128 * 256 * c["GEMM_TN"] * 8
        buf = interface.workspace_layout({**c, "ROWS": v.batch, **p["sizes"]})["buffers"]
        assert buf["act"]["shape"] == [c["GEMM_XROWS"], 8192]
        assert "gate_up, down_proj on the wgmma GEMM engine" in render.render(v, p)
    assert render.plan(b100, overrides={"DOWN_GSPLIT": 2})["consts"]["DOWN_GEMM"] == 1
    with pytest.raises(PlanError, match="DOWN_GEMM") as exc:
        render.plan(b100, overrides={"DOWN_GEMM": 1, "DOWN_U": 4})
    assert "\n" not in str(exc.value) and "DOWN_U" in str(exc.value)
    with pytest.raises(PlanError, match="DOWN_GEMM=2: must be 0 or 1"):
        render.plan(b100, overrides={"DOWN_GEMM": 2})
    # the token tile (GEMM_TOKEN_TILE): batch 100 in one tile of 112 rows (12 padding), not two of 64; it brings the
    # engine; a size wgmma has no n for is one line
    p = render.plan(b100, overrides={"GEMM_TOKEN_TILE": 112})
    c = p["consts"]
    assert (c["GEMM_PROJ"], c["GEMM_TN"] * 8, c["GEMM_XROWS"], c["GEMM_TOKEN_TILE"]) == (1, 112, 112, 112)
    assert p["gemm"]["gate_up"]["tiles"] == 8192 * 2 // 256 and render.plan(b100)["gemm"]["gate_up"]["tiles"] == 128
    assert "TOKEN_TILE=112" in greport.path_cell(c)
    assert "TOKEN_TILE" not in greport.path_cell(render.plan(b100)["consts"])
    assert render.plan(b32, overrides={"GEMM_TOKEN_TILE": 32})["consts"]["GEMM_PROJ"] == 1
    for bad in (100, 8, 144):
        with pytest.raises(PlanError, match=f"GEMM_TOKEN_TILE={bad}: must be a multiple of 16 in 16..128"):
            render.plan(b100, overrides={"GEMM_TOKEN_TILE": bad})
    # every projection on the engine: the plan column names them all (no GEMV left to take TM or BS from)
    c = render.plan(b100, overrides={"DOWN_GEMM": 1})["consts"]
    assert greport.path_cell(c).startswith("NORM_GLOBAL H_STATS GEMM_PROJ=qkv+o+gu+down")
    assert "GEMM_PROJ=gu+down" in greport.path_cell(render.plan(b64, overrides={"DOWN_GEMM": 1})["consts"])
    # the tuner flips it where GEMM_PROJ is on (either way: 0 is a setting), tries the batch in one token tile, and a
    # record from before the knob ran down_proj as a GEMV
    assert {"DOWN_GEMM": 1} in gtune.candidates(b100, limit=200) and {"GEMM_TOKEN_TILE": 112} in gtune.candidates(
        b100, limit=200) and {"GEMM_TOKEN_TILE": 64} not in gtune.candidates(b64, limit=200)
    now = gtune.knob_dict(render.plan(b100, overrides={"DOWN_GEMM": 1}))
    before = {k: x for k, x in gtune.knob_dict(render.plan(b100)).items() if k not in ("DOWN_GEMM", "DOWN_GSPLIT")}
    assert gtune.knobs_differ(before, gtune.knob_dict(render.plan(b100))) == []
    assert "DOWN_GEMM" in gtune.knobs_differ(before, now)
    monkeypatch.setattr(decode, "DOWN_GEMM_BY_DEFAULT", True)  # (the rule as it will be: past one token tile)
    assert [render.plan(v)["consts"]["DOWN_GEMM"] for v in (b64, b100)] == [0, 1]
    assert {"DOWN_GEMM": 0} in gtune.candidates(b100, limit=200)
    monkeypatch.undo()
    # its static shared memory counted: Llama-3-8B b227 (the GEMVs' 227 KB exactly) planned without it, asked: refused
    b227 = _decode_layer("gpd", 227, 1024, "hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128, intermediate: 14336")
    p = render.plan(b227)
    assert p["consts"]["GEMM_PROJ"] == 0 and p["overrides"] == {} and p["smem_bytes"] == 232448
    assert render.plan(_decode_layer("gpd", 226, 1024, "hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128, "
                                     "intermediate: 14336"))["consts"]["GEMM_PROJ"] == 1
    with pytest.raises(PlanError, match=r"GEMM_PROJ=1: needs 232448 B .* 1 KB more for the GEMMs' static"):
        render.plan(b227, overrides={"GEMM_PROJ": 1})
    for knob in ("DOWN_GEMM", "QKV_GEMM"):  # (an engine knob asked brings the engine: refused, not re-planned)
        with pytest.raises(PlanError, match=rf"{knob}=1: needs 232448 B .* 1 KB more for the GEMMs' static"):
            render.plan(b227, overrides={knob: 1})
    small = _decode_layer("gpd", 128, 1024, "hidden: 896, heads: 14, kv_heads: 2, head_dim: 64, intermediate: 4864")
    assert render.plan(small)["consts"]["GEMM_PROJ"] == 0  # (hidden under GEMM_HIDDEN_MIN: lost there)
    assert render.plan(small, overrides={"GEMM_PROJ": 1})["consts"]["GEMM_PROJ"] == 1
    for v, arch, ov, words in ((b64, "80", {"GEMM_PROJ": 1}, "needs sm_90"),
                               (b64, "90", {"GEMM_PROJ": 1, "NORM_GLOBAL": 0}, "needs NORM_GLOBAL 1"),
                               (b64, "90", {"GEMM_PROJ": 1, "QKV_FLOW": 1}, "needs QKV_FLOW 0"),
                               (b32, "90", {"GEMM_PROJ": 0, "GU_GSPLIT": 2}, "GU_GSPLIT=2: a knob of the GEMM engine, which needs GEMM_PROJ 1"),
                               (b64, "90", {"GEMM_PROJ": 1, "DOWN_SMEM": 1}, "needs DOWN_SMEM 0"),
                               (b64, "90", {"GEMM_PROJ": 1, "QKV_NWG": 8, "GU_U": 2}, "GU_U: it runs on"),
                               (b64, "90", {"QKV_GEMM": 1, "QKV_NWG": 8}, "no GEMV knob of qkv (QKV_NWG: it runs on"),
                               (b64, "90", {"QKV_GEMM": 0, "QKV_GSPLIT": 2}, "QKV_GSPLIT=2: the GEMM engine's split-K of"),
                               (b64, "90", {"GEMM_PROJ": 0, "O_GEMM": 1}, "O_GEMM=1: a knob of the GEMM engine, which needs GEMM_PROJ 1 (asked: 0)"),
                               (b64, "90", {"GEMM_PROJ": 1, "QKV_GEMM": 0, "QKV_FLOW": 1}, "needs QKV_FLOW 0"),
                               (b64, "90", {"QKV_GEMM": 2}, "must be 0 or 1"),
                               (b64, "90", {"QKV_GEMM": 1, "GU_NWG": 8}, "no GEMV knob of gate_up (GU_NWG: it runs"),
                               (b64, "90", {"GEMM_PROJ": 1, "QKV_GEMM": 0, "O_GEMM": 0, "QKV_FLOW": 2}, "needs QKV_FLOW 0"),
                               (_decode_layer("gpd", 64, 1024, "hidden: 1440, heads: 18, kv_heads: 6, head_dim: 80, "
                                              "intermediate: 3840"), "90", {"GEMM_PROJ": 1, "QKV_GEMM": 0},
                                "QKV_GEMM=0 beside GEMM_PROJ 1 needs hidden a multiple of 64"),
                               (b64, "90", {"O_GSPLIT": 40}, "must be in 1..16"),
                               (_decode_layer("gpd", 64, 1024, "hidden: 512, heads: 8, kv_heads: 8, head_dim: 64, "
                                              "intermediate: 1024"), "90", {"GEMM_PROJ": 1, "QKV_GSPLIT": 16}, "over qkv's 8 K chunks")):
        with pytest.raises(PlanError) as ei:
            render.plan(v, arch=arch, overrides=ov)
        assert "\n" not in str(ei.value) and words in str(ei.value), str(ei.value)


def test_from_frag_is_the_mma_b_fragment_layout():
    """generator.interface.from_frag against element positions worked out by hand from the PTX ISA's m16n8k16 B
    fragment (lane = 4 x group + thread-in-group; b0 holds k = 2t, 2t + 1 of column group, b1 k = 2t + 8, 2t + 9)."""
    import torch
    from generator.interface import from_frag
    rows, k = 12, 32  # two n-tiles (rows 8..11 of the second are real, 12..15 padding), two k-tiles
    raw = torch.zeros(16 * k)
    # (row 9, col 19): k-tile 1, n-tile 1, lane 4 x 1 + (19 % 8) // 2 = 5, b0's second element -> ((1 x 2 + 1) x 32
    # + 5) x 4 + 1 = 405; (row 0, col 10): k-tile 0, n-tile 0, lane 1, b1's first element -> 1 x 4 + 2 = 6
    raw[405], raw[6] = 7.0, 3.0
    x = from_frag(raw, rows, k)
    assert x.shape == (rows, k) and x[9, 19] == 7.0 and x[0, 10] == 3.0 and x.sum() == 10.0


@pytest.mark.parametrize("ov,words", [
    ({"FOO": 1}, ["FOO", "unknown knob (one of QKV_NWG,"]),
    ({"QKV_GEM": 1}, ["QKV_GEM", "unknown knob (did you mean QKV_GEMM?)"]),
    ({"DOWN_KSPLIT": 3}, ["DOWN_KSPLIT=3", "must divide"]),
    ({"O_KSPLIT": 9}, ["O_KSPLIT=9", "1..8"]),
    ({"QKV_NWG": 3}, ["QKV_NWG=3", "divides"]),
    ({"O_U": 9}, ["O_U=9", "1..8"]),
    ({"ATT_STAGES": 4}, ["ATT_STAGES=4"]),
    ({"GU_NWG": "8"}, ["GU_NWG", "integer"]),
    ({"ATT_WARPS": 8, "ATT_C": 200}, ["ATT_C=200", "multiple of 16 x ATT_WARPS = 128"]),
    ({"ATT_WARPS": 16, "ATT_STAGES": 3}, ["plan overrides", "shared memory"]),
])
def test_bad_override_is_one_line_plan_error(ov, words):
    v = next(v for v in declared() if v.name == "llama3-8b_decode_b1_s4096_bf16")
    with pytest.raises(PlanError) as ei:
        render.plan(v, overrides=ov)
    msg = str(ei.value)
    assert "\n" not in msg and v.name in msg
    for w in words:
        assert w in msg


def test_knobs_are_the_planned_constants():
    v = declared()[0]
    assert set(KNOBS) <= set(render.plan(v)["consts"])


def test_resolve_falls_back_with_one_line_warning(tmp_path, tiny_variants_file):
    v = tiny(tiny_variants_file)
    f = tmp_path / "gpu.json"
    good = {"overrides": {"QKV_NWG": 2}, "default_us": 10.0, "tuned_us": 8.0, "identity": identity(v.params(), "90")}
    f.write_text(json.dumps({v.name: good}))
    ov, src, fig, warn = gtune.resolve(v, "90", f)
    assert ov == {"QKV_NWG": 2} and src.startswith("tuned (") and fig == {"default_us": 10.0, "tuned_us": 8.0}
    assert warn is None
    for bad, why in [({**good, "overrides": {"QKV_NWG": 3}}, "refused by the planner"),
                     ({**good, "identity": "0" * 64}, "other parameters"),
                     ({"overrides": 5}, "malformed"), ("junk", "malformed"),
                     ({**good, "knobs": "x"}, "its \"knobs\", what was measured, is not an object")]:
        f.write_text(json.dumps({v.name: bad}))
        ov, src, fig, warn = gtune.resolve(v, "90", f)
        assert (ov, src, fig) == ({}, "default", None)
        assert warn.startswith("warning: ") and why in warn and "\n" not in warn
    # an entry tuned on an H200 is not this sm_86 build's plan: the default, with nothing to warn about
    f.write_text(json.dumps({v.name: {**good, "gpu": "NVIDIA H200"}}))
    assert gtune.resolve(v, "86", f) == ({}, "default", None, None)
    f.write_text(json.dumps({v.name: {**good, "gpu": "NVIDIA H200", "identity": "0" * 64}}))
    assert "other parameters" in gtune.resolve(v, "86", f)[3]  # stale for every arch: still said
    # an entry that records the knobs it measured: kept while the planner plans the same; stale once a default
    # changed under its overrides (they are relative to the defaults)
    knobs = gtune.knob_dict(render.plan(v, "90", overrides={"QKV_NWG": 2}))
    f.write_text(json.dumps({v.name: {**good, "knobs": knobs}}))
    assert gtune.resolve(v, "90", f)[0] == {"QKV_NWG": 2}
    f.write_text(json.dumps({v.name: {**good, "knobs": {**knobs, "X_FRAG": 1 - knobs["X_FRAG"]}}}))
    ov, src, fig, warn = gtune.resolve(v, "90", f)
    assert (ov, src) == ({}, "default") and "defaults changed since it was tuned" in warn and "X_FRAG" in warn
    assert 'delete its "knobs"' in warn and "\n" not in warn  # a hand edit of the overrides reads the same
    # a knob the record lacks (added to the planner after tuning) is no difference
    f.write_text(json.dumps({v.name: {**good, "knobs": {k: x for k, x in knobs.items() if k != "X_FRAG"}}}))
    assert gtune.resolve(v, "90", f)[0] == {"QKV_NWG": 2}
    # ... unless the overrides set it: a knob added to an entry by hand after it was measured
    f.write_text(json.dumps({v.name: {**good, "overrides": {"QKV_NWG": 2, "X_FRAG": 1 - knobs["X_FRAG"]},
                                      "knobs": {k: x for k, x in knobs.items() if k != "X_FRAG"}}}))
    ov, src, fig, warn = gtune.resolve(v, "90", f)
    assert (ov, src) == ({}, "default") and "X_FRAG (not recorded)" in warn
    f.write_text("{not json")
    assert gtune.resolve(v, "90", f)[1] == "default" and "not a tuning file" in gtune.resolve(v, "90", f)[3]
    assert "line 1 column 2" in gtune.resolve(v, "90", f)[3]  # where the JSON breaks, for a hand edit
    f.write_text("")  # an empty file is not a tuning file either; an empty object is one, with no entries
    assert "not a tuning file" in gtune.resolve(v, "90", f)[3] and "an empty file" in gtune.resolve(v, "90", f)[3]
    f.write_text("{}")
    assert gtune.resolve(v, "90", f) == ({}, "default", None, None)
    assert gtune.resolve(v, "90", tmp_path / "absent.json")[:3] == ({}, "default", None)


def test_the_shipped_tuning_files_resolve_without_warnings():
    """Every entry of tuning/*.json whose variant variants.yaml declares is used (none stale, refused or malformed): a
    planner change that makes them stale must re-tune or rebase them in the same change. One whose overrides plan
    what the default plan now is builds as the default, without the tuner's gain (measured against an older
    default); the others as tuned, with it where the entry holds a timing."""
    declared_now = {v.name: v for v in declared()}
    n_default = 0
    for f in sorted((ROOT / "tuning").glob("*.json")):
        for name, e in json.loads(f.read_text()).items():
            if name in declared_now:
                v = declared_now[name]
                ov, src, fig, warn = gtune.resolve(v, "90", f)
                same = not gtune.knobs_differ(gtune.knob_dict(render.plan(v, "90")),
                                              gtune.knob_dict(render.plan(v, "90", overrides=e["overrides"])))
                assert warn is None, (f.name, name, warn)
                if same:
                    n_default += 1
                    assert (ov, src, fig) == ({}, "default", None), (f.name, name)
                else:
                    # (the tuned gain shown where the entry holds one: an entry rebased onto a changed default
                    # without a new timing keeps none, and the report says "not timed")
                    assert src.startswith("tuned") and ov == e["overrides"] and bool(fig) == ("tuned_us" in e), \
                        (f.name, name)
    assert n_default  # (llama3.2-1b b8: the tuner's O_PRE 1 is the planner's default since session 27)


def test_a_tuning_entry_for_a_plan_only_its_overrides_make_is_tuned(tmp_path):
    """A variant whose default plan is refused (Llama-3-70B tp2 b16: the rows do not fit) built from a tuning entry
    whose overrides make it (NORM_GLOBAL=1, as the refusal advises): the tuned plan, not a PlanError from comparing
    it with the default (a review found that regression)."""
    v70 = next(v for v in declared() if v.tp == 2)
    v = dataclasses.replace(v70, batch=16)
    f = tmp_path / "t.json"
    f.write_text(json.dumps({v.name: {"overrides": {"NORM_GLOBAL": 1}}}))
    ov, src, fig, warn = gtune.resolve(v, "90", f)
    assert ov == {"NORM_GLOBAL": 1} and src.startswith("tuned") and warn is None and fig is None


def test_a_tuning_entry_with_timeline_is_refused_as_no_plan_to_serve(tmp_path):
    """TIMELINE=1 (a build that stamps timers: bench/timeline.py) in a tuning entry is not built as a production
    plan: the default, with a one-line warning."""
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    f = tmp_path / "t.json"
    f.write_text(json.dumps({v.name: {"overrides": {"TIMELINE": 1}}}))
    ov, src, _, warn = gtune.resolve(v, "90", f)
    assert (ov, src) == ({}, "default") and "TIMELINE is a measuring build" in warn and "\n" not in warn


def test_record_merges(tmp_path):
    f = tmp_path / "t" / "x.json"
    gtune.record(f, {"a": {"overrides": {}}})
    gtune.record(f, {"b": {"overrides": {"O_U": 2}}})
    assert set(json.loads(f.read_text())) == {"a", "b"}
    assert list(f.parent.iterdir()) == [f]


def test_build_uses_tuning_file_and_no_tuned_ignores_it(tmp_path, tiny_variants_file):
    tdir = tmp_path / "tuning"
    tdir.mkdir()
    v = tiny(tiny_variants_file)
    (tdir / "nvidia-h200.json").write_text(json.dumps({v.name: {
        "overrides": {"QKV_NWG": 2, "DOWN_U": 2}, "default_us": 12.0, "tuned_us": 10.0,
        "identity": identity(v.params(), "90")}}))
    env_dir = {"MEGAKERNEL_TUNING_DIR": str(tdir)}
    b = tmp_path / "build"

    def build(*extra):
        import subprocess
        import sys
        from conftest import cli_env
        r = subprocess.run([sys.executable, "-m", "generator.cli", "build", "--variants", tiny_variants_file,
                            "--build-dir", b, "--only", v.name, "-j", "2", *extra], cwd=tmp_path,
                           env={**cli_env(), **env_dir}, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r, gmanifest.read_manifest(b)["variants"][v.name]

    r, e = build()  # the only file in tuning/: used by default
    assert e["plan_source"] == "tuned (" + str((tdir / "nvidia-h200.json").resolve()) + ")"
    assert e["plan"]["consts"]["QKV_NWG"] == 2 and e["plan"]["overrides"] == {"DOWN_U": 2, "QKV_NWG": 2}
    assert "constexpr int QKV_NWG = 2;" in (b / v.name / "kernel.cu").read_text()
    assert gmanifest.status(e, v, gmanifest.kernel_sources_digest()) == "built"
    tuned_key = e["key"]
    rep = run_cli(["report", "--variants", tiny_variants_file, "--build-dir", b, "--no-gpu", "--wide"], cwd=tmp_path)
    assert "tuned ×1.20" in rep.stdout
    row = json.loads((b / "report.json").read_text())["rows"][0]
    assert row["plan"].startswith("tuned") and row["tuned_gain"] == 1.2
    assert row["overrides"] == {"DOWN_U": 2, "QKV_NWG": 2}  # what was built, in report.json and the plan cell
    from generator.report import _plan_cell
    assert _plan_cell(row, "plan") == "tuned ×1.20 (DOWN_U=2 QKV_NWG=2) [LL]"  # (the LL rule's hand-offs)
    # an entry written by hand (no tuner times): built, said not timed
    assert _plan_cell({"plan": "tuned (x.json)", "overrides": {"H_STATS": 1}}, "plan") == "override, not timed (H_STATS=1)"

    # the tuning entry changes: the build is stale until rebuilt
    (tdir / "nvidia-h200.json").write_text(json.dumps({v.name: {"overrides": {"QKV_NWG": 4},
                                                               "identity": identity(v.params(), "90")}}))
    assert gmanifest.status(e, v, gmanifest.kernel_sources_digest()) == "stale (tuning)"
    with pytest.raises(gmanifest.LoadError, match="stale") as err:
        gmanifest.find_entry(v.name, b, v)
    # the advice rebuilds from the same inputs: this variants file and this tuning file (outside tuning/)
    assert f"--variants {Path(tiny_variants_file).resolve()}" in str(err.value)
    assert f"--tuned-for {(tdir / 'nvidia-h200.json').resolve()}`" in str(err.value)

    # a bad entry: one warning line, the default plan
    (tdir / "nvidia-h200.json").write_text(json.dumps({v.name: {"overrides": {"QKV_NWG": 5}}}))
    r, e = build("--tuned-for", "nvidia-h200")
    warns = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:") and v.name in ln]
    assert len(warns) == 1 and "QKV_NWG=5" in warns[0]
    assert e["plan_source"] == "default" and e["plan"]["overrides"] == {} and e["key"] != tuned_key

    r, e = build("--no-tuned")
    assert e["plan_source"] == "default" and e["tuning"] is None
    rep = run_cli(["report", "--variants", tiny_variants_file, "--build-dir", b, "--no-gpu", "--wide"], cwd=tmp_path)
    assert "default" in rep.stdout


def test_tune_positions_are_checked_before_the_gpu(tmp_path, cli):
    """`tune --positions` (where decode candidates are timed: full, mixed or a row) is checked on any machine: a bad
    value or a row past a selected variant's cache is one line; a good one gets as far as the GPU."""
    base = ["tune", "--variants", ROOT / "variants.yaml", "--only", "llama3.2-1b_decode_b1_s1024*"]
    for val, want in (("bogus", "--positions bogus: full, mixed or a row number"),
                      ("1024", "--positions 1024: past the cache of llama3.2-1b_decode_b1_s1024_bf16 (seq_len 1024"),
                      ("full,bogus", "--positions full,bogus: full, mixed or a row number (0 or more), or several "
                                     "comma-separated; not 'bogus'"),
                      ("full,", "--positions full,: full, mixed or a row number (0 or more), or several "
                                "comma-separated; not ''"),
                      ("191,full,0191", "--positions 191,full,0191: row 191 named twice"),
                      ("full,\u00b2", "--positions full,\u00b2: full, mixed or a row number"),  # (str.isdigit's)
                      ("full,191,1024", "--positions full,191,1024: row 1024 is past the cache of "
                                        "llama3.2-1b_decode_b1_s1024_bf16")):
        r = cli(base + ["--positions", val], cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith(f"error: {want}") and r.stderr.count("\n") == 1, r.stderr
    # prefill candidates are timed on their whole chunk: --positions alone on them is refused, in a mix a warning
    for val in ("mixed", "5"):
        r = cli(["tune", "--only", "llama3.2-1b_prefill_b1_s16*", "--positions", val], cwd=ROOT)
        assert r.returncode == 2 and r.stderr.startswith(f"error: --positions {val}: decode variants only") \
            and "--only selects 1 prefill variant and no decode one" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    pre = tmp_path / "prefill.yaml"  # no --only: the file's variants are named
    pre.write_text("models:\n  p:\n    {hidden: 2048, heads: 32, kv_heads: 8, head_dim: 64, intermediate: 8192, layers: 2, "
                   "norm: rmsnorm, norm_eps: 1.0e-5, rope_theta: 500000.0, activation: silu, qkv_bias: false, "
                   "qk_norm: false, dtype: bf16, matrix: [{mode: [prefill], batch: [1], seq_len: [64]}]}\n")
    r = cli(["tune", "--variants", pre, "--positions", "mixed"], cwd=tmp_path)
    assert r.returncode == 2 and f"{pre} holds" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    if not _cuda():
        r = cli(["tune", "--only", "llama3.2-1b_*_b1_s1024*", "--only", "llama3.2-1b_prefill_b1_s16*",
                 "--positions", "mixed"], cwd=ROOT)
        assert r.stderr.startswith("warning: --positions mixed: decode variants only; prefill variants (1 selected) "
                                   "are timed"), r.stderr
        assert r.returncode == 2 and "no CUDA GPU visible" in r.stderr, r.stderr
        for val in ("mixed", "191", "full", "full,191", "191, mixed"):
            r = cli(base + ["--positions", val], cwd=tmp_path)
            assert r.returncode == 2 and "no CUDA GPU visible" in r.stderr and "warning" not in r.stderr, r.stderr
        for val, same in (("full,mixed", "full and mixed"), ("1023,full", "row 1023 and full")):  # (batch 1, s1024)
            r = cli(base + ["--positions", val], cwd=tmp_path)
            assert r.stderr.startswith(f"warning: --positions {val}: {same} are the same positions for "
                                       "llama3.2-1b_decode_b1_s1024_bf16") and "no CUDA GPU visible" in r.stderr, r.stderr


def test_tune_out_build_dir_and_shard_are_checked_before_the_gpu(tmp_path, cli):
    """Where `tune` writes and builds are checked before any timing (the winners were lost, or a file replaced, after
    the whole sweep): --out a directory, a device, an empty path, a file that is no tuning file, under a file;
    --build-dir a file. Each one `error:` line, exit 2, nothing written; a new file (its folders made when written)
    and a tuning file get as far as the GPU; a shard that selects nothing is a note and exit 0; record() writes
    through a symbolic link into its target."""
    from generator import tune as gtune
    base = ["tune", "--variants", ROOT / "variants.yaml", "--only", "llama3.2-1b_decode_b1_s1024*"]
    notjson = tmp_path / "config.json"
    notjson.write_text('{"hidden_size": 2048}')
    cases = [(["--out", tmp_path], "not a regular file"), (["--out", "/dev/null"], "not a regular file"),
             (["--out", ""], "--out: an empty path"), (["--out", ROOT / "variants.yaml"], "not a tuning file"),
             (["--out", notjson], "not a tuning file"),
             (["--out", ROOT / "README.md" / "t.json"], "README.md is not a writable folder"),
             (["--build-dir", ROOT / "README.md"], "exists and is not a directory"),
             (["--build-dir", ""], "--build-dir: empty")]
    for extra, want in cases:
        r = cli(base + extra, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and want in r.stderr \
            and r.stderr.count("\n") == 1, (extra, r.stderr)
    assert notjson.read_text() == '{"hidden_size": 2048}' and Path("/dev/null").is_char_device()
    # a launcher's shard past the selection: a note, nothing to do, exit 0
    r = cli(base + ["--shard", "1/2"], cwd=tmp_path)
    assert r.returncode == 0 and r.stderr.startswith("note: --shard 1/2: selects none of the 1 variant"), r.stderr
    with pytest.raises(ValueError, match="not a regular file"):
        gtune.record(tmp_path, {})
    target, link = tmp_path / "target.json", tmp_path / "link.json"  # through a link: the target gets the entries
    target.write_text("{}")
    link.symlink_to(target)
    gtune.record(link, {"x": {"overrides": {}}})
    assert link.is_symlink() and json.loads(target.read_text()) == {"x": {"overrides": {}}}
    if not _cuda():  # a new file (in folders made when it is written), a tuning file: as far as the GPU
        for out in (tmp_path / "new" / "t.json", ROOT / "tuning" / "nvidia-h200.json"):
            r = cli(base + ["--out", out], cwd=tmp_path)
            assert r.returncode == 2 and "no CUDA GPU visible" in r.stderr, r.stderr
        assert not (tmp_path / "new").exists()


def test_tuned_for_missing_file_is_one_line(tmp_path, tiny_variants_file, cli):
    r = cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--tuned-for", "no-such-gpu"],
            cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --tuned-for no-such-gpu") and not (tmp_path / "b").exists()


# ---- GPU: the tuner end to end on one small variant -----------------------------------------------------------

def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,positions", [("qwen2.5-0.5b_decode_b1_s1024_bf16", "full"),
                                            ("llama3.2-1b_prefill_b1_s16_bf16", "full"),
                                            ("qwen2.5-0.5b_decode_b4_s1024_bf16", "mixed"),
                                            ("qwen2.5-0.5b_decode_b1_s1024_bf16", "full,191")])
def test_tune_one_small_variant(tmp_path, name, positions):
    from conftest import cli_env
    import subprocess
    import sys
    out = tmp_path / "tuning" / "gpu.json"
    r = subprocess.run([sys.executable, "-m", "generator.cli", "tune", "--only", name, "--out", out, "--limit", "6",
                        "--build-dir", tmp_path / "cands", "--positions", positions], cwd=ROOT, env=cli_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    e = json.loads(out.read_text())[name]
    want = {"full": None, "mixed": "mixed", "full,191": "full, row 191"}[positions]
    assert e.get("positions") == want  # where it was timed, recorded
    assert e["tuned_us"] <= e["default_us"] * 1.03
    if "," in positions:  # each set's default and tuned timings; the winner loses at none of them beyond the margin
        assert list(e["us_at"]) == ["full", "row 191"], e
        assert all(t["tuned"] <= t["default"] * 1.0101 for t in e["us_at"].values()), e
        assert e["us_at"]["row 191"]["default"] < e["us_at"]["full"]["default"], e  # a short context is cheaper
    v = next(v for v in declared() + prefill_declared() if v.name == name)
    ov, src, _, warn = gtune.resolve(v, "90", out)
    # (where the default plan won, or the winner plans what the default does, the build takes the default plan)
    default = gtune.knob_dict(render.plan(v, "90")) == gtune.knob_dict(render.plan(v, "90", overrides=e["overrides"]))
    assert warn is None and (src == "default" if default else src.startswith("tuned"))
    assert ov == ({} if default else e["overrides"])
    # the winner, built by `megakernel build --tuned-for FILE`, passes verification
    b = tmp_path / "build"
    r = subprocess.run([sys.executable, "-m", "generator.cli", "build", "--only", name, "--build-dir", b,
                        "--tuned-for", out], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    import torch
    from generator import reference, verify
    from generator.loader import load
    W = reference.random_weights(v.model, seed=3, device="cuda")
    layer = load(name, W, build_dir=b, cache_len=4096 if v.mode == "prefill" else None)
    assert layer.plan["overrides"] == ov
    x, pos = verify.random_inputs(layer, 3)
    assert verify.passed(verify.check_step(layer, x, pos, weights=W), v.model.dtype)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_split_k_on_every_projection_matches_the_reference_twice(tmp_path):
    """Every projection split in two (qkv with several rounds, gate_up with several groups a block, two splits of
    a tile in one block), built through the tuner's overrides: two decode steps in a row against the fp32 reference
    (the second finds the per-tile counters reset by the first)."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference, verify
    from generator.loader import load
    v = next(v for v in declared() if v.name == "qwen2.5-0.5b_decode_b8_s1024_bf16")
    ov = {"QKV_KSPLIT": 2, "O_KSPLIT": 2, "GU_KSPLIT": 2, "DOWN_KSPLIT": 2}
    c = renamed(v, "ksplit")
    res = gcompile.build([c], tmp_path, overrides={c.name: ov})
    assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
    W = reference.random_weights(v.model, seed=5, device="cuda")
    layer = load(c.name, W, build_dir=tmp_path)
    assert layer.plan["consts"]["GU_KSPLIT"] == 2 and layer.plan["sizes"]["SPLIT_FLOATS"] > 0
    for seed in (5, 6):
        x, pos = verify.random_inputs(layer, seed)
        assert verify.passed(verify.check_step(layer, x, pos, weights=W), v.model.dtype)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pf", [1, 2])
def test_early_weight_loads_match_the_reference(tmp_path, pf):
    """GEMV_PF 1 (the next round's first step early) and 2 (the software pipeline: two register sets alternating,
    the next round's first step in the last step's place): Qwen2.5-7B b4 (k-tiles a warp 14 (qkv, o_proj, gate_up)
    and 74 (down_proj): partial last steps, several rounds) and Llama-3.2-1B b1 (8 a warp: two steps or one),
    against the fp32 reference twice in a row."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference, verify
    from generator.loader import load
    for name in ("qwen2.5-7b_decode_b4_s4096_bf16", "llama3.2-1b_decode_b1_s4096_bf16"):
        v = next(v for v in declared() if v.name == name)
        c = renamed(v, f"pf{pf}")
        res = gcompile.build([c], tmp_path, overrides={c.name: {"GEMV_PF": pf}})
        assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
        W = reference.random_weights(v.model, seed=7, device="cuda")
        layer = load(c.name, W, build_dir=tmp_path)
        assert layer.plan["consts"]["GEMV_PF"] == pf
        for seed in (7, 8):
            x, pos = verify.random_inputs(layer, seed)
            assert verify.passed(verify.check_step(layer, x, pos, weights=W), v.model.dtype), (name, seed)
        del layer
        torch.cuda.synchronize()


def _overrides_match_the_reference(tmp_path, cases, tag: str, seed: int, expect: dict, repeat: bool = False) -> None:
    """Each (variant, overrides) of `cases`, renamed `tag`<i>, built with those overrides (all ok), loaded with random
    weights (`seed`) and checked against the fp32 reference at two seeds (verify.random_inputs: rows of different
    scales); its plan holds `expect` ({knob: value}) and the overrides; repeat: a second launch on the same inputs and caches is
    bit-equal to the first."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference, verify
    from generator.loader import load
    for i, (v, ov) in enumerate(cases):
        c = renamed(v, f"{tag}{i}")
        res = gcompile.build([c], tmp_path, overrides={c.name: ov})
        assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
        W = reference.random_weights(v.model, seed=seed, device="cuda")
        layer = load(c.name, W, build_dir=tmp_path)
        assert all(layer.plan["consts"][k] == val for k, val in {**expect, **ov}.items()), (c.name, ov)
        for s in (seed, seed + 1):
            x, pos = verify.random_inputs(layer, s)
            caches = (layer.k_cache.clone(), layer.v_cache.clone()) if repeat else None
            res = verify.check_step(layer, x, pos, weights=W)
            assert verify.passed(res, v.model.dtype), (c.name, ov, s, res["rel_err"], res["first_bad_stage"])
            if repeat:
                layer.k_cache.copy_(caches[0])
                layer.v_cache.copy_(caches[1])
                again = verify.check_step(layer, x, pos, weights=W)
                assert torch.equal(again["out"], res["out"]), (c.name, s)
        del layer
        torch.cuda.synchronize()


def _decode_layer(name: str, batch: int, seq_len: int, fields: str):
    """One decode variant of a 2-layer test model `name`: an RMSNorm bf16 SiLU layer (eps 1e-5, RoPE theta 1e4, no
    bias, no q/k norm) with `fields` (YAML "key: value, ...") given or overriding those."""
    base = {"layers": "2", "norm": "rmsnorm", "norm_eps": "1.0e-5", "rope_theta": "10000.0", "activation": "silu",
            "qkv_bias": "false", "qk_norm": "false", "dtype": "bf16"}
    base.update(dict(kv.split(": ") for kv in fields.split(", ")))
    return gvariants.parse(f"matrix: {{mode: [decode], batch: [{batch}], seq_len: [{seq_len}]}}\nmodels:\n  {name}: "
                           f"{{{', '.join(f'{k}: {v}' for k, v in base.items())}}}\n", f"{name}.yaml")[0]


def _qwen15_like(name: str, batches: list[int], seq_len: int = 512) -> list:
    """Decode variants of a Qwen2.5-1.5B-like test layer (hidden 1536, 12/2 heads of 128, qkv bias) named `name`,
    one per batch: the plan-override GPU tests' small shape with a partial n-tile (batch 5) and several rounds."""
    from generator.variants import parse
    return parse(f"""
matrix: {{mode: [decode], batch: {batches}, seq_len: [{seq_len}]}}
models:
  {name}: {{hidden: 1536, heads: 12, kv_heads: 2, head_dim: 128, intermediate: 4096, layers: 2, norm: rmsnorm,
       norm_eps: 1.0e-6, rope_theta: 1000000.0, activation: silu, qkv_bias: true, qk_norm: false, dtype: bf16}}
""", f"{name}.yaml")


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_norm_fold_matches_the_reference(tmp_path):
    """NORM_FOLD (the norms' gain in qkv_proj's and gate_up's B fragments, 1/rms in their epilogues; 3: the gain
    applied to the rows by the norm, cases below): Llama-3.2-1B b1
    and b8; a held-out-like shape at batch 16 with split-K gate_up (the fold's epilogue through the split partials)
    and the qkv grid barrier (QKV_FLOW 0), at batch 32 with split-K qkv and GEMV_PF 1, and at batch 5 (a partial
    n-tile) with GEMV_PF 2; NORM_FOLD 2 (the gain read from global memory) at batch 32 and 5, and at batch 16 with
    H_STATS (the second norm's gain from o_proj); against the fp32 reference on rows of different scales
    (verify.random_inputs)."""
    b5, b16, b32 = _qwen15_like("nf", [5, 16, 32])
    cases = [(next(v for v in declared() if v.name == n), {}) for n in ("llama3.2-1b_decode_b1_s4096_bf16",
                                                                          "llama3.2-1b_decode_b8_s4096_bf16")]
    cases += [(b16, {"GU_KSPLIT": 2, "QKV_FLOW": 0}), (b32, {"QKV_KSPLIT": 2, "QKV_FLOW": 0, "GEMV_PF": 1}),
              (b5, {"GEMV_PF": 2})]
    cases = [(v, {"NORM_FOLD": 1, **ov}) for v, ov in cases]
    cases += [(b32, {"NORM_FOLD": 2}), (b5, {"NORM_FOLD": 2, "GEMV_PF": 2}),  # the gain read from global memory
              (b16, {"NORM_FOLD": 2, "H_STATS": 1})]
    # NORM_FOLD 3 (the gain applied to the rows in the norm's sums pass): batch 1 (its default: each thread reads the
    # gain chunks it copied) with H_STATS, batch 5 (rows of several warps: other threads' chunks) with split-K gate_up,
    # batch 16 with the rows multicast over a cluster (NORM_CLUSTER 2)
    b1 = next(v for v in declared() if v.name == "qwen3-1.7b_decode_b1_s4096_bf16")  # (q/k norm)
    cases += [(b1, {}), (b1, {"H_STATS": 1}), (b5, {"NORM_FOLD": 3, "GU_KSPLIT": 2}),
              (b16, {"NORM_FOLD": 3, "NORM_CLUSTER": 2, "NORM_GLOBAL": 0})]
    _overrides_match_the_reference(tmp_path, cases, "nf", 9, {})


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_batch_slices_match_the_reference(tmp_path):
    """<P>_BS: each projection's warps in batch slices (each summing its own sequences' partial sums, Tile's BS):
    the Llama-3.2-1B shape at batch 64 (its default: 2 slices of 4 n-tiles, X from global memory in fragment order)
    and with 4 slices; batch 40 (slices of 3 and 2 n-tiles); with split-K qkv and o_proj (the splits' partial sums
    through ws_split); batch 20 with the rows in shared memory (NORM_GLOBAL 0, slices of 2 and 1 n-tiles, NORM_FOLD's
    gain on the B fragments); fp16 at batch 48: against the fp32 reference at two seeds, a second launch bit-equal."""
    l1b = "hidden: 2048, heads: 32, kv_heads: 8, head_dim: 64, intermediate: 8192"
    b64, b40 = (_decode_layer("bs", b, 512, l1b) for b in (64, 40))
    b20, = _qwen15_like("bsq", [20])
    half = _decode_layer("bsh", 48, 512, "hidden: 1024, heads: 16, kv_heads: 4, head_dim: 64, intermediate: 2816, "
                         "dtype: fp16")
    all_bs = lambda n: {f"{p}_BS": n for p in ("QKV", "O", "GU", "DOWN")}  # noqa: E731
    cases = [(b64, {}), (b64, all_bs(4)), (b40, all_bs(2)), (b64, {"QKV_KSPLIT": 2, "O_KSPLIT": 2, "QKV_FLOW": 0}),
             (b20, {**all_bs(2), "NORM_GLOBAL": 0, "NORM_FOLD": 1}), (half, {})]
    _overrides_match_the_reference(tmp_path, cases, "bs", 23, {}, repeat=True)
    assert all(render.plan(v, overrides=ov)["consts"]["GU_BS"] > 1 for v, ov in cases)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gemm_projections_match_the_reference(tmp_path):
    """GEMM_PROJ (qkv_proj, o_proj and gate_up on the wgmma GEMM engine, their inputs in its tiled layout): the
    Llama-3.2-1B shape at batch 64 with all three on it (qkv and o_proj split-K, H_STATS's sums of squares over quads
    of lanes, gate_up's tiles whole: the staged epilogue), with gate_up alone on it (its default: qkv_proj and o_proj
    GEMVs, o_proj's H_STATS epilogue writing gate_up's rows tiled), with o_proj alone beside gate_up, split 3 ways
    (shares of the split tiles in whole quads) and gate_up split 2, and with QKV_FLOW's counters beside the GEMVs; batch 100
    (two token tiles, 28 padding rows; and with qkv_proj and o_proj GEMVs: xn's fragment-ordered rows under gate_up's
    tiled ones); all three on the engine at: a Qwen2.5-1.5B-like batch 48 (qkv bias, token tiles of 48); hidden 1440
    with head_dim 80 (K and q dim not multiples of 64: zero columns of the tiled inputs and weight k-tiles past K);
    LayerNorm (no H_STATS: the second norm a step of its own, o_proj writing h's T copy) and fp16 (its norm from fp32
    h; and with gate_up alone on it: the second norm's step writing its tiled rows); down_proj on the engine too
    (DOWN_GEMM, act tiled; an override until this test has run): batch 100 (split-K), whole (DOWN_GSPLIT 1: the staged
    epilogue), batch 64, hidden 1440 (a partial 256-row tile) and fp16; batch 100 in one token tile of 112 rows
    (GEMM_TOKEN_TILE), with and without DOWN_GEMM; intermediate 3872 (act's zero columns past K meet the weights'
    zero k-tiles) and batch 100 split 16 ways (256 tasks on 132 SMs: the last split to finish sums the tile): against
    the fp32 reference at two seeds, a second launch bit-equal; then three launches back to back against the reference
    step by step."""
    from bench.tune import renamed
    from generator import reference
    from generator.loader import load
    l1b = "hidden: 2048, heads: 32, kv_heads: 8, head_dim: 64, intermediate: 8192"
    b64, b100 = (_decode_layer("gp", b, 512, l1b) for b in (64, 100))
    b48, = _qwen15_like("gpq", [48])
    hd80 = _decode_layer("gph", 48, 512, "hidden: 1440, heads: 18, kv_heads: 6, head_dim: 80, intermediate: 3840")
    hd80k = _decode_layer("gpk", 48, 512, "hidden: 1440, heads: 18, kv_heads: 6, head_dim: 80, intermediate: 3872")
    ln = _decode_layer("gpl", 48, 512, f"{l1b}, norm: layernorm")
    half = _decode_layer("gpf", 48, 512, "hidden: 1024, heads: 16, kv_heads: 4, head_dim: 64, intermediate: 2816, "
                         "dtype: fp16")
    every = {"QKV_GEMM": 1, "O_GEMM": 1}  # (all three on the engine: asked, it brings GEMM_PROJ)
    cases = [(b64, every), (b64, {}), (b48, every),
             (b64, {"QKV_GEMM": 0, "O_GSPLIT": 3, "GU_GSPLIT": 2}), (b64, {"QKV_GEMM": 0, "O_GEMM": 0, "QKV_FLOW": 1}),
             (b100, {}),
             (b100, {"QKV_GEMM": 0, "O_GEMM": 0}), (hd80, every), (ln, every), (half, every), (half, {"GEMM_PROJ": 1}),
             (b100, {"DOWN_GEMM": 1}), (b100, {"DOWN_GSPLIT": 1}), (b64, {"DOWN_GEMM": 1}),
             (hd80, {**every, "DOWN_GEMM": 1}), (half, {**every, "DOWN_GEMM": 1}),
             (b100, {"GEMM_TOKEN_TILE": 112}), (b100, {"GEMM_TOKEN_TILE": 112, "DOWN_GEMM": 1}),
             (hd80k, {**every, "DOWN_GEMM": 1}), (b100, {"DOWN_GSPLIT": 16})]
    _overrides_match_the_reference(tmp_path, cases, "gp", 41, {"GEMM_PROJ": 1, "QKV_FLOW": 0}, repeat=True)
    c = render.plan(b64)["consts"]
    assert (c["GEMM_PROJ"], c["QKV_GEMM"], c["O_GEMM"], c["DOWN_GEMM"]) == (1, 0, 0, 0)
    c = render.plan(b100, overrides={"DOWN_GEMM": 1})["consts"]
    assert (c["DOWN_GEMM"], c["GEMM_PROJ"]) == (1, 1) and c["DOWN_GSPLIT"] > 1
    assert render.plan(b64, overrides=every)["consts"]["O_GSPLIT"] > 1
    for i in (0, 1, 2, 11):  # (11: down_proj on the engine too)
        v = cases[i][0]
        W = reference.random_weights(v.model, seed=42, device="cuda")
        steps_track_the_reference(load(renamed(v, f"gp{i}").name, W, build_dir=tmp_path), W, v, 43)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_qkv_splits_summed_by_attention_match_the_reference(tmp_path):
    """QKV_KSPLIT > 1 under QKV_FLOW 2 (each split's partial sums as words of their own, attention summing them as it
    polls; templates/stages/qkv_proj.cuh): Llama-3.2-1B b1 under the LL rule (2 and 4 splits, 16- and 4-warp groups),
    Qwen2.5-7B b1 (qkv bias: split 0's words take it; head_dim 128), Qwen3-1.7B b1 (q/k norms after the sum), a
    batch-5 Qwen2.5-1.5B-like (the rule from batch 2, a partial n-tile), the held-out head_dim 80 b1 and 96 b5 with
    the 3 splits the tuner offers them (3 words a lane each) and an fp16 layer outside the rule: against
    the fp32 reference at two seeds (the workspace's qkv, summed over the splits, checked as the qkv step), a second
    launch bit-equal; then three launches back to back (no host work between) against the reference step by step."""
    from bench.tune import renamed
    from generator import reference
    from generator.loader import load
    named = {v.name: v for v in declared()}
    b5, = _qwen15_like("qs", [5])
    half = _decode_layer("qsh", 3, 1024, "hidden: 1024, heads: 16, kv_heads: 4, head_dim: 64, intermediate: 2816, "
                         "dtype: fp16")
    l1 = named["llama3.2-1b_decode_b1_s4096_bf16"]
    cases = [(l1, {"QKV_KSPLIT": 2}), (l1, {"QKV_KSPLIT": 4, "QKV_NWG": 4}),
             (named["qwen2.5-7b_decode_b1_s4096_bf16"], {"QKV_KSPLIT": 2}),
             (named["qwen3-1.7b_decode_b1_s4096_bf16"], {"QKV_KSPLIT": 2}), (b5, {"QKV_KSPLIT": 2}),
             (named["ho-h1440-hd80_decode_b1_s4096_bf16"], {"QKV_KSPLIT": 3}),
             (named["ho-hd96-g4_decode_b5_s4096_bf16"], {"QKV_KSPLIT": 3}), (half, {"QKV_KSPLIT": 2, "QKV_FLOW": 2})]
    _overrides_match_the_reference(tmp_path, cases, "qs", 29, {"QKV_FLOW": 2}, repeat=True)
    for i, (v, _) in enumerate(cases):
        W = reference.random_weights(v.model, seed=30, device="cuda")
        steps_track_the_reference(load(renamed(v, f"qs{i}").name, W, build_dir=tmp_path), W, v, 31)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_down_flow_matches_the_reference(tmp_path):
    """DOWN_FLOW (per-chunk counters of act instead of the gate_up -> down_proj grid barrier): Llama-3.2-1B b1
    (GEMV_PF 1: each round released at once, 4 chunks), Qwen2.5-7B b1 (GEMV_PF 0: each round's release deferred past
    the next round's loads; 37 chunks: more than one poll's 32, 8-warp down_proj groups), a batch-5 shape with
    GEMV_PF 2 (the pipelined loop's two calls a step) and two gate_up groups a block, against the fp32 reference at
    two seeds, a second launch bit-equal to the first; then
    three launches back to back (no host work between: each may overlap the previous one's tail) against the
    reference step by step, each chunk's counter then holding the last launch's whole count (o_proj zeroes them at
    a launch's start; with H_LL they count on: the three launches' counts)."""
    import torch

    from bench.tune import renamed
    from generator import reference
    from generator.loader import load
    named = {v.name: v for v in declared()}
    b5, = _qwen15_like("df", [5])
    cases = [(named["llama3.2-1b_decode_b1_s4096_bf16"], {"DOWN_FLOW": 1, **LL_OFF}),  # (H_LL: counts on)
             (named["qwen2.5-7b_decode_b1_s4096_bf16"], {"DOWN_FLOW": 1}),
             (b5, {"DOWN_FLOW": 1, "GEMV_PF": 2, "GU_NWG": 8})]
    _overrides_match_the_reference(tmp_path, cases, "df", 11, {}, repeat=True)
    for i, (v, _) in enumerate(cases):
        c = renamed(v, f"df{i}")  # built above
        W = reference.random_weights(v.model, seed=12, device="cuda")
        layer = load(c.name, W, build_dir=tmp_path)
        steps_track_the_reference(layer, W, v, 12)
        ready = layer.buffer("ready")
        kvh = layer.plan["consts"]["KV_HEADS"]
        # the chunks' counters (every ACT_STRIDE-th word past the KV heads'): o_proj zeroed them at the last launch's
        # start, so they hold that launch's counts; with H_LL (the default plan of Qwen2.5-7B b1) nothing zeroes them
        # and they count on over the loaded layer's 3 launches (down_proj waits for its launch's multiple)
        launches = 3 if layer.plan["consts"]["H_LL"] else 1
        assert int(ready[kvh::layer.plan["consts"]["ACT_STRIDE"]].sum()) == launches * 2 * v.model.intermediate // 16
        del layer
        torch.cuda.synchronize()


_LL_KNOBS = ("ATT_LL", "QKV_FLOW", "H_LL", "COOP", "QKV_PRE", "ACT_CHUNKS")  # (the twin plan: the barriers,
_AS_TWIN = {("ATT_COMBINE", 4): 3, ("DOWN_FLOW", 2): 1}                       # ATT_COMBINE 4 as 3, DOWN_FLOW 2 as 1)


def _ll_twin_of(ov: dict) -> dict:
    """The LL hand-offs' barrier twin of overrides or a plan's constants `ov`: the hand-offs off, the rest as it is."""
    return {**{k: _AS_TWIN.get((k, x), x) for k, x in ov.items() if k not in _LL_KNOBS}, **LL_OFF}


def _ll_cases():
    """test_ll_hand_offs_match_the_reference's cases [(variant, overrides)] and the plans it builds [(renamed variant,
    overrides)]: each case as ll<i>, its barrier twin as lld<i>."""
    from bench.tune import renamed
    named = {v.name: v for v in declared()}
    b5, = _qwen15_like("ll", [5])
    half = _decode_layer("llh", 3, 1024, "hidden: 1024, heads: 16, kv_heads: 4, head_dim: 64, intermediate: 2816, "
                         "dtype: fp16")
    l1 = named["llama3.2-1b_decode_b1_s4096_bf16"]
    cases = [(l1, {"ATT_LL": 1}), (l1, {"ATT_LL": 2}), (l1, {"ATT_LL": 1, "ATT_COMBINE": 3}),
             (l1, {"ATT_LL": 1, "ATT_COMBINE": 0}), (l1, {"ATT_LL": 1, "ATT_TMA": 1}),
             (l1, {"ATT_LL": 1, "H_STATS": 1, "O_NWG": 8}), (l1, {"ATT_LL": 1, "O_TM": 2}),
             (named["llama3.2-1b_decode_b4_s32768_bf16"], {"ATT_LL": 1}),
             (named["llama3.2-1b_decode_b8_s32768_bf16"], {"ATT_LL": 1}),
             (named["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"ATT_LL": 1}),
             (named["ho-g12-hd128_decode_b2_s4096_bf16"], {"ATT_LL": 2}),
             (b5, {"ATT_LL": 1, "GEMV_PF": 2}), (half, {"ATT_LL": 1}),
             (l1, {"QKV_FLOW": 2}), (l1, {"QKV_FLOW": 2, "ATT_LL": 1}),
             (named["llama3.2-1b_decode_b8_s4096_bf16"], {"QKV_FLOW": 2, "ATT_LL": 2}),
             (named["llama3.2-1b_decode_b8_s32768_bf16"], {"QKV_FLOW": 2}),
             (named["ho-hd80-mha_decode_b1_s4096_bf16"], {"QKV_FLOW": 2}),
             (named["qwen2.5-7b_decode_b1_s4096_bf16"], {"QKV_FLOW": 2, "ATT_LL": 1}),
             (b5, {"QKV_FLOW": 2}), (half, {"QKV_FLOW": 2, "ATT_LL": 1}),
             (l1, {"H_LL": 1}), (l1, {"H_LL": 1, "DOWN_FLOW": 0}), (l1, {"H_LL": 1, "ATT_LL": 1, "QKV_FLOW": 2}),
             (l1, {"H_LL": 1, "ATT_LL": 1}),
             (named["llama3.2-1b_decode_b8_s4096_bf16"], {"H_LL": 1, "ATT_LL": 2, "QKV_FLOW": 2}),
             (named["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"H_LL": 1, "DOWN_FLOW": 0}),  # (2 by default with it)
             (b5, {"H_LL": 1, "GEMV_PF": 2}),
             (named["llama3-8b_decode_b1_s4096_bf16"], {"H_LL": 1, "ATT_LL": 1, "QKV_FLOW": 2}),
             (named["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"H_LL": 1, "DOWN_FLOW": 1}),  # (a partial last chunk)
             (l1, {"H_LL": 1, "GU_TM": 2, "GU_NWG": 8}), (l1, {"H_LL": 2, "ATT_LL": 2, "QKV_FLOW": 2}),
             # COOP 0: no cooperative launch, the grid barriers counted in the workspace (alone, with QKV_PRE's
             # weights before the wait, with stream-K's and ATT_DYN's schedules, beside the hand-offs)
             (l1, {"COOP": 0}), (l1, {"COOP": 0, "QKV_PRE": 1}), (l1, {"COOP": 0, "QKV_PRE": 2}),
             (named["llama3-8b_decode_b1_s4096_bf16"], {"COOP": 0, "QKV_PRE": 1}),
             (named["llama3.2-1b_decode_b8_s32768_bf16"], {"COOP": 0}),
             (named["llama3.2-1b_decode_b4_s32768_bf16"], {"COOP": 0, "ATT_LL": 1}), (b5, {"COOP": 0}),
             (half, {"COOP": 0, "QKV_FLOW": 2}),
             # ATT_COMBINE 4: ATT_COMBINE 3's combine from partials as tagged words (its twin: 3); 16 splits of a
             # group of 4, 32 of 7 (bias, head_dim 128 and 64), 8 at head_dim 80 and batch 3, beside the hand-offs
             (l1, {"ATT_COMBINE": 4}), (named["qwen2.5-7b_decode_b1_s4096_bf16"], {"ATT_COMBINE": 4}),
             (named["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"ATT_COMBINE": 4, "ATT_C": 128}),
             (_decode_layer("llc4", 3, 3000, "hidden: 960, heads: 12, kv_heads: 4, head_dim: 80, intermediate: 2048"),
              {"ATT_COMBINE": 4}),
             (l1, {"ATT_COMBINE": 4, "ATT_LL": 1, "QKV_FLOW": 2}), (l1, {"ATT_COMBINE": 4, "H_LL": 1}),
             (l1, {"ATT_COMBINE": 4, "COOP": 0})]
    # (over the barrier plan: the LL rule would otherwise add the hand-offs a case does not name; the rule's own
    # Llama-3.2-1B b1 plan is the case with all three); then Qwen2.5-0.5B b1's tuned plan as it is (the rule,
    # DOWN_FLOW 2 by default there, said so the twin takes 1, and ATT_COMBINE 4)
    # DOWN_FLOW 2 (act as LL words down_proj polls; its twin: DOWN_FLOW 1's counters): with all three (DOWN_U 4: 8
    # spills 140 B at 1B), with H_LL alone, and at Qwen2.5-0.5B b1 (gate_up in under a round; its default there),
    # with H_LL 2's spaced polls and without the cooperative launch (COOP 0)
    # (GU_SKIP off throughout: the barrier twin cannot take it, and its own test compares it with the plan without it)
    # (ATT_KVLAST 0 throughout: the twin cannot take it, and its row folded in last sums attention in another order)
    cases = [(v, {"GU_SKIP": 0, "ATT_KVLAST": 0, **LL_OFF, **ov}) for v, ov in cases] + [
        (v, {"GU_SKIP": 0, "ATT_KVLAST": 0, **ov}) for v, ov in [
        (named["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"ATT_COMBINE": 4, "DOWN_FLOW": 2}),
        (l1, {"DOWN_FLOW": 2, "DOWN_U": 4}), (l1, {**LL_OFF, "H_LL": 1, "DOWN_FLOW": 2, "DOWN_U": 4}),
        (named["qwen2.5-0.5b_decode_b1_s1024_bf16"], {"DOWN_FLOW": 2}),
        (named["qwen2.5-0.5b_decode_b1_s1024_bf16"], {"DOWN_FLOW": 2, "H_LL": 2}),
        (named["qwen2.5-0.5b_decode_b1_s1024_bf16"], {"DOWN_FLOW": 2, "COOP": 0})]]
    # every plan and its barrier twin compiled at once (in parallel: one at a time would take minutes of the GPU)
    # (the twin keeps the case's O_PRE and GEMV_PF: from batch 2 the hand-offs plan O_PRE 0, the barriers 1; at batch
    # 1 past LL_HIDDEN_MAX, Llama-3-8B's, the hand-offs take the place of B1_PRE's O_PRE 1 and GEMV_PF 1)
    o_pre = [{k: render.plan(v, overrides=ov)["consts"][k] for k in ("O_PRE", "GEMV_PF")} for v, ov in cases]
    pairs = [p for i, (v, ov) in enumerate(cases)
             for p in ((renamed(v, f"ll{i}"), ov), (renamed(v, f"lld{i}"), {**_ll_twin_of(ov), **o_pre[i]}))]
    return cases, pairs


def test_ll_hand_off_twins_differ_only_in_the_hand_offs():
    """The GPU test's premise, checked where CI runs: each case's plan and its barrier twin's differ only in the
    hand-offs (a planner default that moves with the LL rule, e.g. B1_PRE's at Llama-3-8B b1, goes to the twin)."""
    cases, pairs = _ll_cases()
    for (c, ov), (d, dov) in zip(pairs[::2], pairs[1::2]):
        a, b = (_ll_twin_of(render.plan(x, overrides=o)["consts"]) for x, o in ((c, ov), (d, dov)))
        assert a == b, (c.name, ov, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_ll_hand_offs_match_the_reference(tmp_path):
    """ATT_LL (attention's output as epoch-carrying words o_proj polls, no grid barrier between them), 1 (a tight
    poll) and 2 (~256 ns between polls), QKV_FLOW 2 (qkv's results as such words, attention polling them; alone and
    with ATT_LL, at head_dim 64, 80 and 128, with a qkv bias, in fp16) and H_LL (o_proj's h to the second norm as such
    words; NORM_FOLD 0, 1 and 3, with and without DOWN_FLOW's counters, which then count on across launches; all three
    together: no grid barrier at all), DOWN_FLOW 2 (act as such words, down_proj polling them; its twin takes DOWN_FLOW
    1's counters), on Llama-3.2-1B b1 (O_PRE, DOWN_FLOW; with ATT_COMBINE 3, 0, ATT_TMA, H_STATS,
    O_TM 2), b4 at KV 32768 (ATT_DYN 1) and b8 at KV 32768 (stream-K), Qwen2.5-0.5B b1 (ATT_COMBINE 2), a group-12
    head_dim-128 b2 (its o_proj spills), a batch-5 Qwen2.5-1.5B-like (qkv bias, a partial n-tile, GEMV_PF 2) and an
    fp16 layer: against the fp32 reference at two seeds, a second launch bit-equal; three launches back to back (the
    epoch advancing with no host work between) track the reference; then six launches each bit-equal to the barrier
    plan's (the same plan with ATT_LL 0, QKV_FLOW 1 and H_LL 0: each case's overrides apply over it, so a case names
    the hand-offs it runs; the LL rule's default plans are cases of their own) on the same inputs and caches, one with a
    refused position (its row NaN in both: no launch waits for a word nobody writes), one on a third of the grid (attention tasks in several rounds;
    ATT_COMBINE 3 takes 1's path), and two layers sharing one workspace launched in turn; 300 graph replays before a
    last checked step. (A word never written would trap after 2^24 polls, not hang.) COOP 0 (a launch without the
    cooperative attribute, its grid barriers counted in the workspace) goes through the same trials against the
    cooperative plan, and ATT_COMBINE 4 (the split partials as tagged words) against ATT_COMBINE 3 (on a third of the
    grid both take 1's path with float partials); for 4 also: the launch count advances once a launch, and a launch
    at full context over partials poisoned with NaN words of wrong tags (the last launch's, 0, the 16-bit epoch's
    aliases) still matches the reference."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference, verify
    from generator.loader import load
    cases, pairs = _ll_cases()
    twin_of = _ll_twin_of
    res = gcompile.build([c for c, _ in pairs], tmp_path, overrides={c.name: o for c, o in pairs})
    assert all(e["status"] == "ok" for e in res["entries"]), [e["name"] for e in res["entries"] if e["status"] != "ok"]
    _overrides_match_the_reference(tmp_path, cases, "ll", 19, {}, repeat=True)
    for i, (v, ov) in enumerate(cases):
        c, d = renamed(v, f"ll{i}"), renamed(v, f"lld{i}")  # (built above), and the same plan without the words
        W = reference.random_weights(v.model, seed=20, device="cuda")
        layer = load(c.name, W, build_dir=tmp_path)
        steps_track_the_reference(layer, W, v, 20)
        base = load(d.name, None, build_dir=tmp_path, packed=layer.packed, caches=(layer.k_cache, layer.v_cache))
        assert twin_of(layer.plan["consts"]) == twin_of(base.plan["consts"]), c.name
        twin = load(c.name, None, build_dir=tmp_path, packed=layer.packed, caches=(layer.k_cache, layer.v_cache),
                    share_workspace=layer)
        coop0 = not layer.plan["consts"]["COOP"]  # (asked for, or the default at batch 1 without grid barriers)
        assert layer.cooperative is not coop0 and base.cooperative, c.name
        assert not layer.pdl or layer._config.numAttrs == (1 if coop0 else 2), c.name  # (no cooperative attribute)
        g = torch.Generator(device="cuda").manual_seed(21)
        for trial in range(6):
            x = (torch.randn(v.batch, v.model.hidden, device="cuda", generator=g) * 2).to(layer.dtype)
            pos = torch.randint(0, v.seq_len, (v.batch,), device="cuda", generator=g, dtype=torch.int32)
            if trial == 1:
                pos.fill_(191)  # (a short context: attention's few busy blocks, o_proj's polls waiting longest)
            if trial == 4:
                pos[-1] = -1
            run = twin if trial == 5 else layer  # (the second layer on the first's workspace: its epoch goes on)
            if trial == 3:
                layer.grid = base.grid = base.grid // 3
            want = base(x, pos, validate=False)
            got = run(x, pos, validate=False)
            if trial == 3:
                layer.grid = base.grid = twin.grid
            torch.cuda.synchronize()
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), \
                (c.name, ov, trial)
            assert bool(got[-1].isnan().all()) == (trial == 4), (c.name, trial)
        xg = x.clone()
        pg = torch.full_like(pos, v.seq_len - 1)
        _replayed_then_checked(layer, lambda: twin(layer(xg, pg, validate=False), pg, validate=False), W, 22,
                               (c.name, ov))
        if coop0 and layer.plan["grid_syncs"]:  # every launch passed each barrier: no arrival left in the word
            (word,) = (int(t) & 0xFFFFFFFF for t in layer.buffer("gridbar"))
            assert word & 0x7FFFFFFF == 0, (c.name, hex(word))
        if coop0 and i == next(j for j, (_, o) in enumerate(cases) if o.get("COOP") == 0):
            import os  # (the plain launchKernel path: without PDL)
            os.environ["MEGAKERNEL_PDL"] = "0"
            try:
                plain = load(c.name, None, build_dir=tmp_path, packed=layer.packed,
                             caches=(layer.k_cache, layer.v_cache))
            finally:
                del os.environ["MEGAKERNEL_PDL"]
            assert not plain.pdl and not plain.cooperative
            x, pos = verify.random_inputs(layer, 23)
            want = base(x, pos, validate=False)
            assert torch.equal(plain(x, pos, validate=False), want), c.name
            del plain
        k = layer.plan["consts"]
        if k["ATT_COMBINE"] >= 4:  # the partials' tags: one launch count a launch, and stale or wrong tags ignored
            x, pos = verify.random_inputs(layer, 24)
            pos.fill_(v.seq_len - 1)  # (every split has rows: the combine polls all of them)
            e0 = int(layer.buffer("epoch")[0]) & 0xFFFFFFFF
            for _ in range(3):
                layer(x, pos, validate=False)
            torch.cuda.synchronize()
            assert (int(layer.buffer("epoch")[0]) & 0xFFFFFFFF) == e0 + 3, c.name
            # every word NaN, tagged with the last launch's count, 0 or this launch's count +- 2^16 (the 16-bit
            # epoch's aliases): none may be taken for this launch's partial
            e = e0 + 3
            words = layer.buffer("part").view(torch.int64).view(-1)
            tags = torch.tensor([e, 0, e + 1 + (1 << 16), e + 1 - (1 << 16)], device="cuda", dtype=torch.int64)
            words.copy_(tags[torch.arange(words.numel(), device="cuda") % 4] << 32 | 0x7FC00000)
            r = verify.check_step(layer, x, pos, weights=W)
            assert verify.passed(r, v.model.dtype), (c.name, r["rel_err"], r["first_bad_stage"])
        if k["H_LL"] and k["DOWN_FLOW"] == 1:  # the chunks' counters count on: launches so far x each chunk's tiles
            launches = int(layer.buffer("epoch")[0]) & 0xFFFFFFFF
            kt, step = k["INTER"] // 16, k["DOWN_NWG"] * k["DOWN_U"]
            got = layer.buffer("ready")[k["KV_HEADS"]::k["ACT_STRIDE"]][:k["ACT_CHUNKS"]].tolist()
            assert [g & 0xFFFFFFFF for g in got] == [launches * 2 * min(step, kt - ch * step) & 0xFFFFFFFF
                                                     for ch in range(k["ACT_CHUNKS"])], (c.name, launches, got)
        del layer, base, twin
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_down_weights_staged_in_shared_memory_match_the_reference(tmp_path):
    """DOWN_SMEM 1 (down_proj's first task's weights bulk-copied into shared memory from gate_up's start): bit-equal
    to the same plan without it over six trials (row 191, a refused position, a third of the grid: tasks past the
    first round from global memory), against the fp32 reference at two seeds, three launches back to back, and 300
    graph replays before a checked step; on Qwen2.5-0.5B b1 (its whole task staged, DOWN_FLOW 2), Llama-3.2-1B b1 (a
    part staged, DOWN_FLOW 1's counters) and Qwen2.5-0.5B b8 (the barrier, rows of 8)."""
    named = {v.name: v for v in declared()}
    cases = [(named[n], {"DOWN_SMEM": 1}) for n in ("qwen2.5-0.5b_decode_b1_s4096_bf16",
                                                      "llama3.2-1b_decode_b1_s4096_bf16",
                                                      "qwen2.5-0.5b_decode_b8_s4096_bf16")]
    _bit_equal_to_the_plan_without(tmp_path, cases, "ds", [{"DOWN_SMEM": 0}] * 3)


def _replayed_then_checked(layer, step, W, seed: int, tag) -> None:
    """`step` (a layer's launch, or launches) captured in a CUDA graph and replayed 300 times, then one checked
    step of `layer` on fresh inputs (`seed`) against the fp32 reference (verify.check_step; `tag` names it)."""
    import torch

    from bench.timing import graph_of
    from generator import verify
    graph = graph_of(step)
    for _ in range(300):
        graph.replay()
    torch.cuda.synchronize()
    x, pos = verify.random_inputs(layer, seed)
    r = verify.check_step(layer, x, pos, weights=W)
    assert verify.passed(r, layer.model.dtype), (*tag, r["rel_err"], r["first_bad_stage"])


def _bit_equal_to_the_plan_without(tmp_path, cases, tag: str, without: list[dict], grids=lambda v: [],
                                   check=None) -> None:
    """Each (variant, overrides) of `cases` (renamed `tag`<i>) against the fp32 reference
    (_overrides_match_the_reference, a repeat bit-equal, three launches back to back) and bit-equal to its twin
    planned with `without`[i] over six
    trials (random rows, row 191, a refused position, a third of the grid) and one more a grid of `grids`(variant)
    blocks, then 300 graph replays before a checked step; check(layer, twin): more asserts after the trials."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference
    from generator.loader import load
    twins = [(renamed(v, f"{tag}b{i}"), without[i]) for i, (v, _) in enumerate(cases)]
    res = gcompile.build([c for c, _ in twins], tmp_path, overrides={c.name: o for c, o in twins})
    assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
    for i, (v, ov) in enumerate(cases):
        _overrides_match_the_reference(tmp_path, [(v, ov)], f"{tag}{i}-", 41, ov, repeat=True)
        W = reference.random_weights(v.model, seed=42, device="cuda")
        layer = load(renamed(v, f"{tag}{i}-0").name, W, build_dir=tmp_path)
        steps_track_the_reference(layer, W, v, 42)
        base = load(twins[i][0].name, None, build_dir=tmp_path, packed=layer.packed,
                    caches=(layer.k_cache, layer.v_cache))
        g = torch.Generator(device="cuda").manual_seed(43)
        more = grids(v)
        for trial in range(6 + len(more)):
            x = (torch.randn(v.batch, v.model.hidden, device="cuda", generator=g) * 2).to(layer.dtype)
            pos = torch.randint(0, v.seq_len, (v.batch,), device="cuda", generator=g, dtype=torch.int32)
            if trial == 1:
                pos.fill_(191)
            if trial == 4:
                pos[-1] = -1
            full = (layer.grid, base.grid)
            if trial == 3:
                layer.grid = base.grid = base.grid // 3
            if trial >= 6:
                layer.grid = base.grid = more[trial - 6]
            want = base(x, pos, validate=False)
            got = layer(x, pos, validate=False)
            layer.grid, base.grid = full
            torch.cuda.synchronize()
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), \
                (v.name, ov, trial)
        if check is not None:
            check(layer, base)
        xg, pg = x.clone(), torch.full_like(pos, v.seq_len - 1)
        _replayed_then_checked(layer, lambda: layer(xg, pg, validate=False), W, 44, (v.name, ov))
        del layer, base
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_q_tiles_first_and_rotated_attention_tasks_match_the_reference(tmp_path):
    """QKV_QFIRST 1 (qkv's q tiles first) and ATT_ROT 1 (attention's static tasks from block qkv's tasks mod the grid
    on): the same tiles' and splits' sums on other blocks, so bit-equal to the plan without them (seven trials, a
    third of the grid and 100 blocks among them), against the fp32 reference, 300 graph replays: Llama-3.2-1B b1 at
    KV 4096 (192 qkv tiles on 132 blocks: rotated by 60) with ATT_C 512 and 256, with the splits' sliced combine
    (ATT_COMBINE 3: every split's block waits for its peers) and TMA tiles, with qkv split in two (QKV_KSPLIT 2:
    384 tasks), at KV 1024 (QKV_NWG 8: two groups a block), Qwen2.5-0.5B b1 (72 qkv tiles: attention's tasks on the
    blocks without one) and Llama-3-8B b8 (384 qkv tiles: rotated by 120); ATT_KVLAST 0 in all (the planner's pair
    with QKV_QFIRST where qkv takes two rounds: QKV_QFIRST alone here, and off in the plans without)."""
    named = {v.name: v for v in declared()}
    l1 = named["llama3.2-1b_decode_b1_s4096_bf16"]
    cases = [(l1, {"QKV_NWG": 16, "ATT_ROT": 1, "ATT_C": 512, "QKV_QFIRST": 1}), (l1, {"QKV_NWG": 16, "ATT_ROT": 1}),
             (l1, {"QKV_NWG": 16, "ATT_ROT": 1, "ATT_C": 512, "ATT_COMBINE": 3, "ATT_TMA": 1}),
             (l1, {"QKV_QFIRST": 1, "QKV_KSPLIT": 2, "ATT_ROT": 1}),
             (named["llama3.2-1b_decode_b1_s1024_bf16"], {"ATT_ROT": 1, "QKV_QFIRST": 1}),
             (named["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"ATT_ROT": 1}),
             (named["llama3-8b_decode_b8_s4096_bf16"], {"ATT_ROT": 1})]
    cases = [(v, {**ov, "ATT_KVLAST": 0}) for v, ov in cases]  # (QKV_QFIRST alone: decode.kvlast_rule's pair off)
    without = [{**{k: val for k, val in ov.items() if k != "QKV_QFIRST"}, "ATT_ROT": 0} for _, ov in cases]
    _bit_equal_to_the_plan_without(tmp_path, cases, "rot", without, grids=lambda v: [100])


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_new_row_last_matches_the_reference(tmp_path):
    """ATT_KVLAST 1 (the appending split walks its cached rows without the new k and v; two warps that do not walk
    poll, append and fold them in as one more warp state): against the fp32 reference (two seeds, a repeat
    bit-equal), three steps back to back, then at positions where the appending split holds row p alone (0, ATT_C,
    2 x ATT_C: nothing walked before it), one row or a tile before it, a whole split (ATT_C - 1), row 191 and the last
    row, one of them on a third of the grid (tasks in rounds), each judged by its attention step too (the layer's
    output alone hides a lost row: session 67's review, simulated on the CPU) and its caches bit-equal to the plan
    without it (the same k and v appended, nothing else touched); then 300 graph replays. Llama-3.2-1B b1 KV 4096
    with QKV_QFIRST, with ATT_C 512 and TMA tiles, with the sliced combine and k and v first (QKV_QFIRST 0); KV 1024 (two groups a block); Qwen2.5-0.5B
    b1's default (ATT_COMBINE 2) and tuned plan (4's tagged partials); Llama-3.2-1B b4 (an appending split a
    sequence); a Qwen3-0.6B-like b1 (the key's qk norm); a GQA group of 12 at head_dim 128 (ATT_QSMEM: the query
    fragments' block barrier before the walk); a sliding window; head_dim 80 with one query head a KV head."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference, verify
    from generator.loader import load
    named = {v.name: v for v in declared()}
    l1, qk = named["llama3.2-1b_decode_b1_s4096_bf16"], {"QKV_QFIRST": 1, "ATT_KVLAST": 1}
    q05 = named["qwen2.5-0.5b_decode_b1_s4096_bf16"]
    cases = [(l1, {"QKV_NWG": 16, **qk}), (l1, {"QKV_NWG": 16, **qk, "ATT_C": 512, "ATT_TMA": 1}),
             (l1, {"QKV_NWG": 16, "ATT_KVLAST": 1, "QKV_QFIRST": 0, "ATT_COMBINE": 3}),
             (named["llama3.2-1b_decode_b1_s1024_bf16"], qk), (q05, qk),
             (q05, {"ATT_COMBINE": 4, "GU_PRE": 1, "QKV_NWG": 16, **qk}),
             (named["llama3.2-1b_decode_b4_s4096_bf16"], qk), (named["ho-qwen3-0.6b_decode_b1_s4096_bf16"], qk),
             (named["ho-g12-hd128_decode_b2_s4096_bf16"], qk), (named["ho-mistral-swa_decode_b2_s8192_bf16"], qk),
             (named["ho-hd80-mha_decode_b1_s4096_bf16"], qk)]
    tol = verify.REL_TOL["bf16"]
    # every plan and its twin without ATT_KVLAST compiled at once, in parallel (22 kernels)
    built = {renamed(v, f"kvl{i}-0"): ov for i, (v, ov) in enumerate(cases)}
    built.update({renamed(v, f"kvl{i}t"): {**ov, "ATT_KVLAST": 0, "ATT_DYN": 0} for i, (v, ov) in enumerate(cases)})
    res = gcompile.build(list(built), tmp_path, overrides={c.name: o for c, o in built.items()})
    assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
    for i, (v, ov) in enumerate(cases):
        twin = renamed(v, f"kvl{i}t")
        _overrides_match_the_reference(tmp_path, [(v, ov)], f"kvl{i}-", 41, ov, repeat=True)
        W = reference.random_weights(v.model, seed=42, device="cuda")
        layer = load(renamed(v, f"kvl{i}-0").name, W, build_dir=tmp_path)
        assert layer.plan["consts"]["ATT_KVLAST"] == 1 and not layer.plan["consts"]["ATT_DYN"]
        steps_track_the_reference(layer, W, v, 42)
        base = load(twin.name, None, build_dir=tmp_path, packed=layer.packed)
        c = layer.plan["consts"]["ATT_C"]
        g = torch.Generator(device="cuda").manual_seed(43)
        for trial, p in enumerate((0, 1, 16, c - 1, c, c + 1, 2 * c, 191, v.seq_len - 1)):
            x = (torch.randn(v.batch, v.model.hidden, device="cuda", generator=g) * 2).to(layer.dtype)
            pos = (p + 37 * torch.arange(v.batch, dtype=torch.int32)) % v.seq_len  # (batch > 1: p and others)
            full = layer.grid
            if trial == 4:
                layer.grid = full // 3
            base.k_cache.copy_(layer.k_cache)
            base.v_cache.copy_(layer.v_cache)
            r = verify.check_step(layer, x, pos, weights=W)
            layer.grid = full
            assert verify.passed(r, v.model.dtype) and r["first_bad_stage"] is None \
                and r["stage_err"]["attention"] <= tol, (v.name, ov, p, r["rel_err"], r["stage_err"])
            base(x, pos.cuda(), validate=False)
            torch.cuda.synchronize()
            assert torch.equal(layer.k_cache, base.k_cache) and torch.equal(layer.v_cache, base.v_cache), (v.name, p)
        xg, pg = x.clone(), torch.full_like(pos, v.seq_len - 1).cuda()
        _replayed_then_checked(layer, lambda: layer(xg, pg, validate=False), W, 44, (v.name, ov))
        del layer, base
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gate_up_leaving_down_proj_blocks_free_matches_the_reference(tmp_path):
    """GU_SKIP 1 (down_proj's HIDDEN / 16 blocks take no gate_up task; gate_up's go round the others): bit-equal to
    the same gate_up groups without it (the tiles' sums are the same, only the blocks move) at seven trials, a third
    of the grid (fewer blocks than down_proj's tiles: no block skipped) and HIDDEN / 16 + 2 blocks (gate_up on two:
    many rounds) among them, against the fp32 reference, 300 graph replays; block 0 (a skipped block) spends next to
    no time in gate_up, where its twin's does (the skip happened); alone, with gate_up's first step pre-loaded (GU_PRE
    1 and 2: gemv_pre's mapping) and with DOWN_SMEM 1 (the skipped blocks' whole tile copied into shared memory), on
    Qwen2.5-0.5B b1 (56 of 132 blocks skipped), a SmolLM-360M-like b1 (60) and hidden 1440 (90)."""
    named = {v.name: v for v in declared()}
    q05 = named["qwen2.5-0.5b_decode_b1_s4096_bf16"]
    cases = [(q05, {"GU_SKIP": 1, "GU_NWG": 2}), (q05, {"GU_SKIP": 1, "GU_NWG": 8, "DOWN_SMEM": 1}),
             (q05, {"GU_SKIP": 1, "GU_PRE": 1}), (q05, {"GU_SKIP": 1, "GU_PRE": 2}),
             (named["ho-smol-360m_decode_b1_s2048_bf16"], {"GU_SKIP": 1, "DOWN_SMEM": 1}),
             (named["ho-h1440-hd80_decode_b1_s4096_bf16"], {"GU_SKIP": 1})]
    from generator import render
    without = []
    for v, ov in cases:
        c = render.plan(v, "90", overrides=ov)["consts"]
        without.append({k: val for k, val in {**ov, "GU_SKIP": 0, "GU_NWG": c["GU_NWG"], "GU_U": c["GU_U"]}.items()})
    def skipped(layer, twin):  # (block 0's step times: its gate_up is a block barrier with the skip)
        import torch
        x = torch.randn(1, layer.model.hidden, device="cuda").to(layer.dtype)
        pos = torch.tensor([191], dtype=torch.int32, device="cuda")
        for L in (layer, twin):
            L(x, pos, validate=False)
        mine, theirs = layer.stage_us()["gate_up"], twin.stage_us()["gate_up"]
        assert mine < 0.25 * theirs, (layer.variant.name, mine, theirs)
    _bit_equal_to_the_plan_without(tmp_path, cases, "gs", without, grids=lambda v: [v.model.hidden // 16 + 2],
                                   check=skipped)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_single_buffered_partial_sums_match_the_reference(tmp_path):
    """RED_DB 0 (one buffer of partial sums, each warp group meeting before a round writes it): Llama-3.2-1B b1 with
    two 8-warp groups in every projection (the group barrier with several groups a block) and with H_STATS (o_proj's
    own group barriers on the same ids), batch 5 with GEMV_PF 2 and split-K o_proj/down (the partials through the
    one buffer), batch 32 with NORM_FOLD (the planner's choice there), one-warp groups and many short rounds,
    Llama-3-8B's o_proj in two rounds with H_STATS; two consecutive steps bit-equal."""
    b5, b32 = _qwen15_like("rb", [5, 32])
    # short rows (hidden 512: a task is a few k-tiles, so a round's writes follow its epilogue closely) and a wide
    # MLP: gate_up in 2 rounds of 16 one-warp groups a block (the warp's own barrier), or 17 rounds of one
    # 16-warp group
    wide, = gvariants.parse("""
matrix: {mode: [decode], batch: [4], seq_len: [256]}
models:
  rbw: {hidden: 512, heads: 8, kv_heads: 2, head_dim: 64, intermediate: 17408, layers: 2, norm: rmsnorm,
        norm_eps: 1.0e-6, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "rbw.yaml")
    l1b = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    l8b = next(v for v in declared() if v.name == "llama3-8b_decode_b1_s4096_bf16")
    nwg8 = {"QKV_NWG": 8, "O_NWG": 8, "GU_NWG": 8, "DOWN_NWG": 8}
    cases = [(l1b, nwg8), (l1b, {"H_STATS": 1, "O_NWG": 4}), (b5, {"GEMV_PF": 2, "O_KSPLIT": 2, "DOWN_KSPLIT": 4}),
             (b32, {"NORM_FOLD": 1}), (wide, {"GU_NWG": 1}), (wide, {"GU_NWG": 16, "DOWN_NWG": 16}),
             (l8b, {"H_STATS": 1, "O_NWG": 16})]  # o_proj in 2 rounds: H_STATS's group barriers between them
    _overrides_match_the_reference(tmp_path, [(v, {"RED_DB": 0, **ov}) for v, ov in cases], "rb", 13,
                                   {"RED_DB": 0}, repeat=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_norm_cluster_matches_the_reference(tmp_path):
    """NORM_CLUSTER 2 (the kernel in clusters of 2 blocks, each norm's rows bulk-copied once a cluster by multicast):
    Llama-3.2-1B b1 (one row: only rank 0 copies) and b8, batch 5 (an odd row count), batch 32 with NORM_FOLD and one
    buffer of partial sums and with NORM_FOLD 2; two launches bit-equal."""
    b5, b32 = _qwen15_like("nc", [5, 32])
    l1b = {v.name: v for v in declared()}
    cases = [(l1b["llama3.2-1b_decode_b1_s4096_bf16"], {"NORM_CLUSTER": 2}),
             (l1b["llama3.2-1b_decode_b8_s4096_bf16"], {"NORM_CLUSTER": 2}), (b5, {"NORM_CLUSTER": 2}),
             (b32, {"NORM_CLUSTER": 2, "NORM_FOLD": 1, "RED_DB": 0}), (b32, {"NORM_CLUSTER": 2, "NORM_FOLD": 2})]
    _overrides_match_the_reference(tmp_path, cases, "nc", 17, {}, repeat=True)


def test_norm_cluster_is_refused_where_it_cannot_run():
    """NORM_CLUSTER > 1: bf16 on one GPU (the rows copied as T), no H_STATS, sm_90/sm_100 (clusters and multicast
    bulk copies); 1 or 2."""
    from generator.render import plan
    for v, arch, ov in ((_layer(2048, 8, tp=2), "90", {}), (_layer(2048, 8, dtype="fp16"), "90", {}),
                        (_layer(2048, 8), "90", {"H_STATS": 1}), (_layer(2048, 8), "86", {})):
        with pytest.raises(PlanError, match="NORM_CLUSTER=2: needs bf16 on one GPU"):
            plan(v, arch, overrides={"NORM_CLUSTER": 2, **ov})
    with pytest.raises(PlanError, match="NORM_CLUSTER=4: must be 1 or 2"):
        plan(_layer(2048, 8), "90", overrides={"NORM_CLUSTER": 4})
    assert plan(_layer(2048, 8), "90", overrides={"NORM_CLUSTER": 2})["consts"]["NORM_CLUSTER"] == 2
    assert plan(_layer(2048, 8), "90")["consts"]["NORM_CLUSTER"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_pre_loaded_weights_match_the_reference(tmp_path):
    """<P>_PRE (a projection's first weight step loaded before the barrier that precedes its stage; qkv's before the
    launch's wait): every projection at once on Llama-3.2-1B b1 (one round each but gate_up and down), with GEMV_PF 1
    (the later rounds' prefetch after the pre-loaded first) and GEMV_PF 2 (the pipeline starting from it) at batch 5
    (a partial n-tile), and with split-K o_proj and down (the pre-loaded task is a split); against the fp32
    reference, two consecutive steps (the next launch's pre-loads run before the previous one's end)."""
    b5, = _qwen15_like("pre", [5])
    l1b = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    every = {"QKV_PRE": 1, "O_PRE": 1, "GU_PRE": 1, "DOWN_PRE": 1}
    cases = [(l1b, every), (l1b, {**every, "GEMV_PF": 1}), (b5, {**every, "GEMV_PF": 2}),
             (b5, {**every, "O_KSPLIT": 2, "DOWN_KSPLIT": 4})]
    _overrides_match_the_reference(tmp_path, cases, "pre", 11, every)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_norm_global_matches_the_reference(tmp_path):
    """NORM_GLOBAL (each norm a step of its own: the rows normalised into global memory in fragment order, a grid
    barrier, qkv_proj and gate_up reading them as o_proj and down_proj read theirs): Llama-3.2-1B b1 and b8 forced
    on, the qkv-bias shape at batch 5 (a partial n-tile: rows past the batch never written), an fp16 LayerNorm GELU
    shape at batch 3 (fp32 h into the second norm, the mean), and Llama-3-8B at batch 32 where it is the default (its
    rows do not fit in shared memory: refused before); against the fp32 reference at two seeds, a second launch
    bit-equal."""
    b5, = _qwen15_like("ng", [5])
    ln = _decode_layer("ngln", 3, 512, "hidden: 512, heads: 8, kv_heads: 2, head_dim: 96, intermediate: 1376, "
                       "norm: layernorm, activation: gelu, qkv_bias: true, dtype: fp16")
    by = {v.name: v for v in declared()}
    l8b32 = dataclasses.replace(by["llama3-8b_decode_b8_s4096_bf16"], batch=32)
    assert render.plan(l8b32, "90")["consts"]["NORM_GLOBAL"] == 1
    on = {"NORM_GLOBAL": 1}
    cases = [(by["llama3.2-1b_decode_b1_s4096_bf16"], on), (by["llama3.2-1b_decode_b8_s4096_bf16"], on), (b5, on),
             (ln, on), (l8b32, {})]
    _overrides_match_the_reference(tmp_path, cases, "ng", 19, {"NORM_GLOBAL": 1}, repeat=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_attention_by_tma_equals_cp_async(tmp_path):
    """ATT_TMA's walk (tensor copies, the 128-byte swizzle, mbarrier phases over tasks, rows past the position
    zeroed, the appended row patched in) gives the same bits as the cp.async walk (ATT_TMA 0): out and both caches,
    at random positions (0 and the last included: partial last tiles) and at full context, on head_dim 64 (1B b1
    and b8, also 16 walker warps), 80 (two boxes, the second past the row), 96 and 128 with a group of 7 (Qwen2.5-7B
    b4, also 3 ring stages and 2 walker warps over 64-row splits: 8 tasks a block, the phases carried over), stream-K
    (ATT_DYN 2, pieces) at batch 20 and the run-time split (ATT_DYN 1) at batch 16, KV 8192; each also within
    tolerance of the fp32 reference. Then with NaN in every cache row past each position (rows a partial last tile
    brings in): the same bits and a finite output (V's rows past the position zeroed)."""
    import torch

    from bench.tune import renamed
    from generator import compile as gcompile, reference, verify
    from generator.loader import load
    by = {v.name: v for v in declared()}
    l1b = by["llama3.2-1b_decode_b8_s4096_bf16"]
    cases = [(by["llama3.2-1b_decode_b1_s4096_bf16"], {}), (l1b, {}), (l1b, {"ATT_WARPS": 16}),
             (next(v for v in declared() if v.name.startswith("ho-hd80") and v.mode == "decode"), {}),
             (next(v for v in declared() if v.model.head_dim == 96 and v.mode == "decode"), {}),
             (by["qwen2.5-7b_decode_b4_s4096_bf16"], {}),
             (by["qwen2.5-7b_decode_b4_s4096_bf16"], {"ATT_STAGES": 3, "ATT_WARPS": 2, "ATT_C": 64}),
             (dataclasses.replace(l1b, batch=20, seq_len=1024), {"ATT_DYN": 2}),
             (dataclasses.replace(l1b, batch=16, seq_len=8192), {"ATT_DYN": 1})]
    for i, (v, ov) in enumerate(cases):
        a, b = renamed(v, f"tma{i}"), renamed(v, f"cpa{i}")
        # everything else as the TMA plan has it (NORM_GLOBAL's batch rule goes with ATT_TMA)
        ov = {**ov, "NORM_GLOBAL": render.plan(v, "90", overrides={**ov, "ATT_TMA": 1})["consts"]["NORM_GLOBAL"]}
        res = gcompile.build([a, b], tmp_path, overrides={a.name: {**ov, "ATT_TMA": 1}, b.name: {**ov, "ATT_TMA": 0}})
        assert all(e["status"] == "ok" for e in res["entries"]), res["entries"]
        W = reference.random_weights(v.model, seed=29 + i, device="cuda")
        la = load(a.name, W, build_dir=tmp_path)
        lb = load(b.name, None, build_dir=tmp_path, packed=la.packed,
                  caches=(la.k_cache.clone(), la.v_cache.clone()))
        assert la.plan["consts"]["ATT_TMA"] == 1 and lb.plan["consts"]["ATT_TMA"] == 0
        for s, where in ((31 + i, "random"), (41 + i, "full")):
            x, pos = verify.random_inputs(la, s, positions=where)
            lb.k_cache.copy_(la.k_cache)
            lb.v_cache.copy_(la.v_cache)
            res = verify.check_step(la, x, pos, weights=W)
            assert verify.passed(res, v.model.dtype), (a.name, where, res["rel_err"], res["first_bad_stage"])
            out_b = lb(x, pos.to(lb.device))
            out_a = res["out"]
            assert torch.equal(out_a, out_b), (a.name, where, (out_a.float() - out_b.float()).abs().max().item())
            assert torch.equal(la.k_cache, lb.k_cache) and torch.equal(la.v_cache, lb.v_cache), (a.name, where)
        x, pos = verify.random_inputs(la, 51 + i)
        past = torch.arange(la.cache_len, device="cuda")[None, :] > pos.cuda().long()[:, None]  # [B, rows]
        for c in (la.k_cache, la.v_cache):
            c.permute(0, 2, 1, 3)[past] = float("nan")
        lb.k_cache.copy_(la.k_cache)
        lb.v_cache.copy_(la.v_cache)
        out_a, out_b = la(x, pos.cuda()), lb(x, pos.cuda())
        assert torch.isfinite(out_a).all() and torch.equal(out_a, out_b), a.name
        del la, lb
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_tiles_a_task_match_the_reference(tmp_path):
    """<P>_TM (TM 16-row tiles a task, each B fragment loaded once for all of them): every projection at TM 2 on
    Llama-3.2-1B b1 with every first step pre-loaded and QKV_FLOW (its per-tile counters, k/v tiles first), the
    qkv-bias shape at batch 5 (a partial n-tile) with GEMV_PF 2 (the pipelined loads) and o/down at TM 4, and
    NORM_GLOBAL at batch 8 (X from global memory for all four), also with one buffer of partial sums (RED_DB 0: the
    default from batch ~64) and GEMV_PF 1; against the fp32 reference at two seeds, a second launch bit-equal."""
    b5, = _qwen15_like("tm", [5])
    by = {v.name: v for v in declared()}
    two = {"QKV_TM": 2, "O_TM": 2, "GU_TM": 2, "DOWN_TM": 2}
    cases = [(by["llama3.2-1b_decode_b1_s4096_bf16"],  # (LL_OFF: qkv's counters, not the LL rule's words)
              {**two, **LL_OFF, "QKV_PRE": 1, "O_PRE": 1, "GU_PRE": 1, "DOWN_PRE": 1}),
             (b5, {**two, "O_TM": 4, "DOWN_TM": 4, "GEMV_PF": 2}),
             (by["llama3.2-1b_decode_b8_s4096_bf16"], {**two, "NORM_GLOBAL": 1}),
             (by["llama3.2-1b_decode_b8_s4096_bf16"], {**two, "NORM_GLOBAL": 1, "RED_DB": 0, "GEMV_PF": 1})]
    _overrides_match_the_reference(tmp_path, cases, "tm", 23, {}, repeat=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_h_stats_matches_the_reference(tmp_path):
    """H_STATS (o_proj writes the second norm's input times its gain and each row's sum of squares per tile; the norm
    makes no pass): Llama-3.2-1B b1 and b8 (with NORM_FOLD's first norm), a qkv-bias shape at batch 5 (a partial
    n-tile) with o_proj in 8-warp groups and split-K, and at batch 16 (rows in shared memory, o_proj at one and two
    tiles a task; NORM_GLOBAL with one and two o_proj groups a block), and a small shape at batch 65 with o_proj in
    2-warp groups (more rows than a group has threads; rows local and global); rows of different scales
    (verify.random_inputs) against the fp32 reference, and two launches on the same inputs bit-equal (the statistics'
    fixed order)."""
    b5, b16 = _qwen15_like("hs", [5, 16])
    b65 = _decode_layer("hw", 65, 128, "hidden: 256, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 512, "
                        "norm_eps: 1.0e-6")
    l1b = {v.name: v for v in declared()}
    cases = [(l1b["llama3.2-1b_decode_b1_s4096_bf16"], {}), (l1b["llama3.2-1b_decode_b8_s4096_bf16"], {"NORM_FOLD": 1}),
             (b5, {"O_NWG": 8, "O_KSPLIT": 2}), (b16, {"NORM_GLOBAL": 0}), (b65, {"NORM_GLOBAL": 0, "O_NWG": 2}),
             # o_proj at two tiles a task beside the rows; with NORM_GLOBAL (xn and the squares from o_proj's
             # epilogue, no second norm step): one group a block, two 8-warp groups, and 2-warp groups at batch 65
             (b16, {"NORM_GLOBAL": 0, "O_TM": 2}), (b16, {"NORM_GLOBAL": 1}), (b16, {"NORM_GLOBAL": 1, "O_NWG": 8}),
             (b65, {"NORM_GLOBAL": 1, "O_NWG": 2})]
    _overrides_match_the_reference(tmp_path, [(v, {"H_STATS": 1, **ov}) for v, ov in cases], "hs", 13,
                                   {"H_STATS": 1}, repeat=True)


def test_pre_loads_render_before_their_barrier_and_are_refused_under_tp():
    """The pre-loads are emitted where the issue says: qkv's before the launch's griddepcontrol.wait, the others
    between the previous stage and the grid barrier before theirs; off by default (nothing loaded); refused with
    tensor parallel and for values other than 0/1."""
    from generator.plan import PlanError
    from generator.render import plan, render
    v8 = next(v for v in declared() if v.name == "qwen2.5-7b_decode_b4_s4096_bf16")
    assert all(plan(v8, "90")["consts"][f"{p}_PRE"] == 0 for p in ("QKV", "O", "GU", "DOWN"))
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b1_s4096_bf16")
    # O_PRE by default at batch 2-8 on one GPU with the static split (bench/NOTES.md session 27); not at batch 1 (but
    # with GEMV_PF at B1_PRE_SHAPES: test_next_rounds_weight_loads_early_is_a_tuner_knob), 16, with ATT_DYN (KV 32768)
    # or tensor parallel, nor beside the LL hand-offs from batch 2 (decode.LL_BATCH_MAX); an override wins
    by = {v.name: v for v in declared()}
    for name, on in (("llama3.2-1b_decode_b8_s4096_bf16", 1), ("qwen3-1.7b_decode_b4_s4096_bf16", 1),
                     ("ho-h1536-g6_decode_b2_s4096_bf16", 0),  # (the LL hand-offs' O_PRE 0: decode.LL_BATCH_MAX)
                     ("llama3.2-1b_decode_b8_s32768_bf16", 0), ("ho-h3072-g3_decode_b16_s4096_bf16", 0),
                     ("llama3-70b_decode_b8_s4096_bf16_tp2", 0)):
        assert plan(by[name], "90")["consts"]["O_PRE"] == on, name
    assert plan(by["llama3.2-1b_decode_b8_s4096_bf16"], "90", overrides={"O_PRE": 0})["consts"]["O_PRE"] == 0
    src = render(v, plan(v, "90", overrides={"QKV_PRE": 1, "O_PRE": 1, "COOP": 1}))  # (COOP 1: grid.sync's text)
    body = src[src.index('extern "C" __global__'):]
    assert body.index("qkv_proj_pre(w_qkv") < body.index("griddepcontrol.wait") < body.index("qkv_proj(x")
    assert body.index("attention(pos") < body.index("o_proj_pre(w_o)") < body.index("grid.sync()", body.index(
        "o_proj_pre")) < body.index("o_proj(ws_attn")
    with pytest.raises(PlanError, match=r"O_PRE=3: must be 0, 1 or 2 \(2: the rest of the first task"):
        plan(v, "90", overrides={"O_PRE": 3})
    # 2: the rest of the first task into L2 as well (in the rendered source: the prefetches behind ON == 2)
    src2 = render(v, plan(v, "90", overrides={"QKV_PRE": 2}))
    assert "constexpr int QKV_PRE = 2;" in src2 and "prefetch.global.L2" in src2
    tp = next(v for v in declared() if v.tp > 1)
    with pytest.raises(PlanError, match="GU_PRE=1: not with tensor parallel"):
        plan(tp, "90", overrides={"GU_PRE": 1})
    # H_STATS: RMSNorm in bf16 on one GPU; o_proj's groups within the named barriers
    with pytest.raises(PlanError, match="H_STATS=1: needs RMSNorm, bf16 and one GPU"):
        plan(tp, "90", overrides={"H_STATS": 1})
    with pytest.raises(PlanError, match=r"H_STATS=1: needs o_proj in groups of >= 2 warps \(O_NWG=1: 16 warp"):
        plan(v, "90", overrides={"H_STATS": 1, "O_NWG": 1})
    p = plan(v, "90", overrides={"H_STATS": 1})
    assert p["workspace"]["buffers"]["hsq"]["shape"] == [2048 // 16, 1] and p["consts"]["SMEM_RS"] > 0
    assert plan(v, "90")["workspace"]["buffers"]["hsq"]["bytes"] == 0


def test_norm_fold_is_refused_for_layernorm_and_fp16():
    from generator.plan import PlanError
    from generator.render import plan
    from generator.variants import parse
    vs = parse("""
matrix: {mode: [decode], batch: [2], seq_len: [256]}
models:
  ln: {hidden: 512, heads: 8, kv_heads: 2, head_dim: 64, intermediate: 1024, layers: 2, norm: layernorm,
       norm_eps: 1.0e-5, rope_theta: 10000.0, activation: gelu, qkv_bias: true, qk_norm: false, dtype: bf16}
  h: {hidden: 512, heads: 8, kv_heads: 2, head_dim: 64, intermediate: 1024, layers: 2, norm: rmsnorm,
      norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: fp16}
""", "x.yaml")
    for v in vs:
        for f in (1, 3):
            with pytest.raises(PlanError, match=f"NORM_FOLD={f}: needs RMSNorm in bf16"):
                plan(v, "90", overrides={"NORM_FOLD": f})
    p = plan(vs[1], "90")
    assert p["consts"]["NORM_FOLD"] == 0 and p["consts"]["SMEM_GS"] == 0
    tp = next(v for v in declared() if v.tp > 1)
    for f in (1, 3):
        with pytest.raises(PlanError, match=f"NORM_FOLD={f}: not with tensor parallel"):
            plan(tp, "90", overrides={"NORM_FOLD": f})
    assert plan(tp, "90")["consts"]["NORM_FOLD"] == 0
    # the gain and 1/rms after the GEMV's partial sums, inside the block's budget
    v = next(v for v in declared() if v.name == "llama3-8b_decode_b8_s4096_bf16")
    off, on = plan(v, "90", overrides={"NORM_FOLD": 0}), plan(v, "90", overrides={"NORM_FOLD": 1})
    assert off["consts"]["NORM_FOLD"] == 0 and off["consts"]["SMEM_GS"] == 0
    c = on["consts"]
    assert c["SMEM_GS"] >= c["SMEM_RED"] + 2 * 16 * 16 * v.batch * 4 and c["SMEM_RS"] >= c["SMEM_GS"] + 4096 * 2
    assert on["smem_bytes"] >= max(off["smem_bytes"], c["SMEM_RS"] + v.batch * 4)
    # NORM_FOLD 2 (the gain read from L1): only 1/rms after the partial sums (with or without H_STATS, which keeps
    # the same), no gain in shared memory
    for ov in ({"NORM_FOLD": 2}, {"NORM_FOLD": 2, "H_STATS": 1}):
        two = plan(v, "90", overrides={**ov, "RED_DB": 1})
        off, one = (plan(v, "90", overrides={"NORM_FOLD": f, "RED_DB": 1}) for f in (0, 1))
        c2 = two["consts"]
        assert c2["NORM_FOLD"] == 2 and c2["SMEM_GS"] == 0, ov
        assert c2["SMEM_RS"] >= c2["SMEM_RED"] + 2 * 16 * 16 * v.batch * 4, ov
        assert c2["SMEM_RS"] == one["consts"]["SMEM_GS"], ov  # where fold 1 keeps its gain
        assert off["smem_bytes"] <= two["smem_bytes"] <= one["smem_bytes"], ov
        assert two["smem_bytes"] >= c2["SMEM_RS"] + v.batch * 4, ov


def test_gain_rows_fold_is_the_batch_1_default():
    """NORM_FOLD 3 (the norm multiplies the raw rows by the gain in its sums pass, the gain's copy started before the
    barrier or launch wait that precedes it; 1/rms in the projections' epilogues) is planned by default at batch 1
    only (sm_90, one GPU, RMSNorm in bf16: where measured), with the gain's room in shared memory as fold 1 keeps it;
    the tuner tries it at batch 2 and 0 where it is planned; the rendered kernel starts the gain's copies in the
    pre-steps."""
    from generator import tune
    from generator.render import plan, render
    named = {v.name: v for v in declared()}
    b1, b4 = named["llama3.2-1b_decode_b1_s4096_bf16"], named["llama3.2-1b_decode_b4_s4096_bf16"]
    c = plan(b1, "90")["consts"]
    assert c["NORM_FOLD"] == 3 and c["SMEM_GS"] > 0 and c["SMEM_RS"] >= c["SMEM_GS"] + 2048 * 2
    assert plan(b4, "90")["consts"]["NORM_FOLD"] == 0
    assert plan(b1, "100")["consts"]["NORM_FOLD"] == 0  # not measured on sm_100
    one = plan(b1, "90", overrides={"NORM_FOLD": 1})["consts"]
    assert (c["SMEM_GS"], c["SMEM_RS"]) == (one["SMEM_GS"], one["SMEM_RS"])
    assert {"NORM_FOLD": 0} in tune.candidates(b1, "90") and {"NORM_FOLD": 3} not in tune.candidates(b1, "90")
    b2 = next(v for v in _qwen15_like("g3", [2]))
    assert plan(b2, "90")["consts"]["NORM_FOLD"] == 0 and {"NORM_FOLD": 3} in tune.candidates(b2, "90")
    src = render(b1, plan(b1, "90", overrides={"COOP": 1}))  # (COOP 1: the barriers' text is grid.sync)
    body = src[src.index('extern "C" __global__'):]
    # the first norm's gain copy before the launch's wait; the second's after o_proj, before the barrier it waits at
    assert body.index("qkv_proj_pre(w_qkv, ln1_w, smem)") < body.index("griddepcontrol.wait") < body.index("qkv_proj(x")
    o = body.index("o_proj(ws_attn")
    assert o < body.index("gate_up_pre(w_gu, ln2_w, smem)") < body.index("grid.sync()", o) < body.index("gate_up(ws_h")


def test_a_broken_default_tuning_file_warns_once(tmp_path, tiny_variants_file):
    """A broken tuning file (the default one) is said once for the whole build, not once per variant, and fails
    --strict; an entry of --tuned-for's file naming no declared variant is warned (a typo, or a file tuned for
    another variants file: not a failure)."""
    tdir = tmp_path / "td"
    tdir.mkdir()
    (tdir / "x.json").write_text("[1]")
    import subprocess
    import sys
    from conftest import cli_env
    r = subprocess.run([sys.executable, "-m", "generator.cli", "build", "--variants", tiny_variants_file,
                        "--build-dir", tmp_path / "b", "--only", "tiny*", "-j", "2", "--strict"], cwd=tmp_path,
                       env={**cli_env(), "MEGAKERNEL_TUNING_DIR": str(tdir)}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1 and r.stderr.count("not a tuning file") == 1, r.stderr
    assert "--strict: exit 1 (1 tuning warning)" in r.stderr
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"no-such-variant_decode_b1_s4096_bf16": {"overrides": {}}}))
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--only", "tiny*",
                 "--tuned-for", typo, "--strict"], cwd=tmp_path)
    assert r.returncode == 0 and "no declared variant named no-such-variant" in r.stderr, r.stderr
    # an entry tuned on another architecture's GPU is not this build's plan: said once (a new user's trial)
    v = tiny(tiny_variants_file)
    a100 = tmp_path / "a100.json"
    a100.write_text(json.dumps({v.name: {"overrides": {"GEMV_PF": 1}, "gpu": "NVIDIA A100-SXM4-80GB",
                                         "identity": gmanifest.identity(v.params(), "80")}}))
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--only", v.name,
                 "--tuned-for", a100, "--no-report"], cwd=tmp_path)
    assert r.returncode == 0 and "its entries tuned on NVIDIA A100-SXM4-80GB (another architecture than sm_90) " \
        "are not used" in r.stderr, r.stderr
    assert gmanifest.read_manifest(tmp_path / "b")["variants"][v.name]["plan_source"] == "default"


def test_an_interrupted_build_leaves_sources_and_cubins_in_step(tmp_path, tiny_variants_file, monkeypatch):
    """kernel.cu is written with the manifest: a build stopped while compiling leaves the source that matches the
    recorded cubin (a user reading kernel.cu sees what runs)."""
    from generator import compile as gcompile
    v = tiny(tiny_variants_file)
    b = tmp_path / "b"
    gcompile.build([v], b, jobs=1)
    before = (b / v.name / "kernel.cu").read_text()

    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(gcompile, "_compile_object", stop)
    with pytest.raises(KeyboardInterrupt):
        gcompile.build([v], b, jobs=1, overrides={v.name: {"QKV_NWG": 2}})
    assert (b / v.name / "kernel.cu").read_text() == before
    e = gmanifest.read_manifest(b)["variants"][v.name]
    assert e["source_sha256"] == __import__("hashlib").sha256(before.encode()).hexdigest()


def test_a_broken_tuning_file_asked_for_by_name_is_an_error(tmp_path, tiny_variants_file):
    bad = tmp_path / "mine.json"
    bad.write_text("{not json")
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--tuned-for", bad],
                cwd=tmp_path)
    assert r.returncode == 2 and "is not a tuning file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()
    # any existing file is read as one (a GPU's name is never a path), whatever its suffix
    other = tmp_path / "mk.py"
    other.write_text("print('hello')\n")
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--tuned-for", other],
                cwd=tmp_path)
    assert r.returncode == 2 and f"{other} is not a tuning file" in r.stderr.replace("\n", " "), r.stderr
    other.write_text(json.dumps({"hidden_size": 64, "model_type": "llama"}))  # JSON, but a config.json's
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--tuned-for", other],
                cwd=tmp_path)
    assert r.returncode == 2 and 'none of its 2 keys is an entry with an "overrides" object' in r.stderr.replace(
        "\n", " ") and len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists(), r.stderr
    other.write_bytes(b"{\xff}")  # not UTF-8: the same one line
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--tuned-for", other],
                cwd=tmp_path)
    assert r.returncode == 2 and "not UTF-8 text" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()
    assert gtune.tuning_file("NVIDIA H200") == gtune.tuning_dir() / "nvidia-h200.json"


def test_strict_build_fails_on_a_refused_tuned_plan_and_names_unknown_entries(tmp_path, tiny_variants_file):
    name = gvariants.load(tiny_variants_file)[0].name
    tf = tmp_path / "mine.json"
    tf.write_text(json.dumps({name: {"overrides": {"QKV_NWG": 0}}, name + "x": {"overrides": {}}}))
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--only", name,
                 "--tuned-for", tf, "--strict"], cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"{name}: refused by the planner" in r.stderr and "default plan used" in r.stderr
    assert "--strict: exit 1 (1 flagged, 1 tuning warning)" in r.stderr
    assert f"no declared variant named {name}x (entries unused)" in r.stderr
    r = run_cli(["build", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--only", name,
                 "--tuned-for", tf], cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # without --strict: the default plan, warned
    r = run_cli(["report", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--no-gpu", "--wide"],
                cwd=tmp_path)
    assert "tuned-plan-unused" in r.stdout  # said again by the report, after the build's output has gone
    r = run_cli(["report", "--variants", tiny_variants_file, "--build-dir", tmp_path / "b", "--no-gpu", "--strict"],
                cwd=tmp_path)
    assert r.returncode == 1 and "--strict: exit 1 (1 flagged)" in r.stderr


def test_arch_90a_takes_the_tuned_plan_of_90():
    v = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.name == "llama3.2-1b_prefill_b1_s64_bf16")
    f = gtune.tuning_file("NVIDIA H200")
    assert gtune.resolve(v, "90a", f)[:2] == gtune.resolve(v, "90", f)[:2]
    assert gtune.resolve(v, "90a", f)[3] is None


def prefill_declared():
    vs = gvariants.load(ROOT / "variants.yaml") + gvariants.load(ROOT / "bench" / "heldout.yaml")
    return [v for v in vs if v.mode == "prefill"]


@pytest.mark.parametrize("v", prefill_declared()[:6] + prefill_declared()[-3:], ids=lambda v: v.name)
def test_prefill_candidates_plan_and_differ(v):
    cands = gtune.candidates(v)
    assert cands[0] == {} and len(cands) >= 3
    seen = set()
    for ov in cands:
        p = render.plan(v, overrides=ov)
        assert p["overrides"] == dict(sorted(ov.items()))
        key = gtune.knob_values(p)
        assert key not in seen
        seen.add(key)
        # the workspace holds every split tile's partials of the projection that has the most
        g = p["gemm"]
        need = max([(t["tiles"] - t["FULL"]) * t["KSPLIT"] * g["BM"] * g["BN"] for t in g.values()
                    if isinstance(t, dict) and t["KSPLIT"] > 1] or [0])
        assert p["sizes"]["SPLIT_FLOATS"] == need


def test_prefill_overrides_validated_and_in_source():
    from generator.modes.prefill import KNOBS as PKNOBS
    v = next(v for v in prefill_declared() if v.name == "llama3.2-1b_prefill_b1_s128_bf16")
    p = render.plan(v, overrides={"GU_KSPLIT": 1, "GEMM_GM": 3})
    assert p["consts"]["GU_KSPLIT"] == 1 and p["consts"]["GEMM_GM"] == 3
    assert "GU_KSPLIT = 1;" in render.render(v, p)
    assert "ATT_INLINE = 1;" in render.render(v, render.plan(v, overrides={"ATT_INLINE": 1}))
    assert {"ATT_INLINE": 1} in gtune.candidates(v)  # the tuner A/Bs the attention's call against inlining it
    for bad, why in (({"GU_KSPLIT": 0}, "must be in 1..32"), ({"GU_KSPLIT": 33}, "must be in 1..32"),
                     ({"ATT_INLINE": 2}, "must be in 0..1"),
                     ({"ATT_C": 64}, "unknown knob"), ({"O_KSPLIT": "2"}, "must be an integer")):
        with pytest.raises(PlanError, match=why) as e:
            render.plan(v, overrides=bad)
        assert "\n" not in str(e.value)
    assert set(PKNOBS) <= set(render.plan(v)["consts"])


def test_prefill_ring_depth_override_checked_against_shared_memory():
    v = next(v for v in prefill_declared() if v.name == "llama3-8b_prefill_b1_s512_bf16")
    base = render.plan(v)
    deeper = render.plan(v, overrides={"GEMM_STAGES": base["consts"]["GEMM_STAGES"] + 1})
    assert deeper["consts"]["GEMM_STAGES"] == base["consts"]["GEMM_STAGES"] + 1
    assert deeper["smem_bytes"] > base["smem_bytes"]
    for bad, why in (({"GEMM_STAGES": 2}, "must be in 3..8"), ({"GEMM_STAGES": 9}, "must be in 3..8"),
                     ({"GEMM_STAGES": 8}, r"shared memory.*at most 5 fit \(GEMM_STAGES\)")):
        with pytest.raises(PlanError, match=why) as e:
            render.plan(v, overrides=bad)
        assert "\n" not in str(e.value) and "sm_80, sm_90" not in str(e.value)
    # the tuner offers a stage more only where it fits (8 stages of 128-token tiles do not)
    for ov in gtune.candidates(v, limit=40):
        render.plan(v, overrides=ov)


def test_prefill_split_k_fills_the_sms_and_stays_whole_where_tiles_do():
    from generator.modes.prefill import split_k
    assert split_k(11, 32, 132) == (0, 8)      # one wave, >= 4 chunks a task
    assert split_k(86, 32, 132) == (0, 1)      # more waves only of long tasks (>= 32 chunks)
    assert split_k(88, 224, 132) == (0, 3)     # 2 waves of 75 chunks beat one of 224 on 88 of 132 SMs
    assert split_k(150, 64, 132) == (132, 7)   # a full wave whole, the 18 tiles past it split over the next
    assert split_k(1376, 32, 132) == (0, 1)    # 10.4 waves: splitting the last gains < 10 %
    # every tile of 2.7 waves split 3 ways: modelled -10 %, measured +5-6 % on the H200 (needs 15 % now)
    assert split_k(352, 224, 132) == (0, 1)
    assert split_k(704, 128, 132) == (660, 3)  # only the tiles past the full waves split: the 10 % rule
    assert split_k(1, 3, 132) == (0, 1)        # too few chunks to split


def test_prefill_full_waves_override_and_workspace():
    v = next(v for v in prefill_declared() if v.name == "llama3-8b_prefill_b1_s128_bf16")
    d = render.plan(v)
    g = d["gemm"]["gate_up"]
    assert (g["tiles"], g["FULL"], g["KSPLIT"]) == (150, 132, 7)
    assert d["sizes"]["SPLIT_FLOATS"] >= (150 - 132) * 7 * d["gemm"]["BM"] * d["gemm"]["BN"]
    every = render.plan(v, overrides={"GU_KSPLIT": 2})      # a KSPLIT alone splits every tile
    assert (every["consts"]["GU_FULL"], every["consts"]["GU_KSPLIT"]) == (0, 2)
    whole = render.plan(v, overrides={"GU_FULL": 0})       # no full wave: 150 tiles > 132 SMs, no split
    assert (whole["consts"]["GU_FULL"], whole["consts"]["GU_KSPLIT"]) == (0, 1)
    with pytest.raises(PlanError, match=r"GU_FULL=150: must be in 0\.\.149"):
        render.plan(v, overrides={"GU_FULL": 150})
    assert "GU_FULL = 132;" in render.render(v, d)


def test_prefill_full_override_that_plans_no_split_is_refused():
    v = next(v for v in prefill_declared() if v.name == "llama3-8b_prefill_b1_s128_bf16")
    for ov, why in (({"GU_FULL": 5}, "fill more than a wave of 132 SMs"),
                    ({"GU_FULL": 132, "GU_KSPLIT": 1}, "are not split")):
        with pytest.raises(PlanError, match=why) as e:
            render.plan(v, overrides=ov)
        assert "\n" not in str(e.value)


def test_fewest_rounds_smaller_groups_only_where_a_round_is_thin():
    """plan.fewest_rounds (measured on the H200, bench/NOTES.md session 13): 320 tiles of 16-warp groups on 132 SMs
    run 3 rounds filled 0.81 -> 4-warp groups in one round; 160 or 192 tiles -> 8 warps (one round); tiles that fill
    their rounds >= 0.9 (256, 1024, 1728, 1792) keep the planner's groups; a smaller group that would leave too few
    warps streaming (128 tiles) is never taken; tensor parallel plans keep 16 (rebalance=False)."""
    from generator.plan import MIN_WARPS, fewest_rounds, plan_gemv
    assert fewest_rounds(320, 16, 132) == 4 and fewest_rounds(448, 16, 132) == 4
    assert fewest_rounds(160, 16, 132) == 8 and fewest_rounds(192, 16, 132) == 8
    for tiles in (128, 256, 1024, 1728, 1792, 2368):
        assert fewest_rounds(tiles, 16, 132) == 16, tiles
    assert fewest_rounds(608, 8, 132) == 2  # Qwen2.5-0.5B gate_up: 3 rounds of 8-warp groups -> one of 2-warp
    assert fewest_rounds(40, 16, 132) == 16 and 40 * 8 < MIN_WARPS  # too few warps in flight: unchanged
    assert fewest_rounds(1060, 16, 132) == 16  # one round only with single warps (never measured to win): unchanged
    assert fewest_rounds(576, 16, 132) == 2  # 576 tasks (5 rounds filled 0.87) of 2 warps: one round
    assert fewest_rounds(128, 16, 148) == 16 and fewest_rounds(600, 4, 188) == 4  # one round already: unchanged
    p = plan_gemv(5120, 13824, 132)
    assert (p["NWG"], p["U"]) == (4, 8)  # 216 k-tiles a warp in steps of 8
    assert plan_gemv(5120, 13824, 132, rebalance=False)["NWG"] == 16
    v = next(v for v in declared() if v.name == "ho-h5120-g5_decode_b16_s4096_bf16")
    c = render.plan(v, overrides={"NORM_GLOBAL": 0})["consts"]  # one tile a task (NORM_GLOBAL's TM 2 halves them)
    assert (c["QKV_NWG"], c["O_NWG"], c["GU_NWG"], c["DOWN_NWG"]) == (4, 4, 16, 4)
    tp = next(v for v in gvariants.load(ROOT / "variants.yaml") if v.tp > 1 and v.mode == "decode")
    assert render.plan(tp)["consts"]["QKV_NWG"] == 16  # the 70B shard's qkv: 320 tiles, 4-warp groups on one GPU


def test_full_steps_where_a_divisor_allows_them():
    """plan.plan_gemv's U with full_steps (the decode planner's on one GPU and sm_90; measured on the H200,
    bench/NOTES.md session 27): where a warp's k-tiles split evenly over the group but not into steps of U, the largest
    divisor of them from 4 below U (20 k-tiles a warp: 7, 7, 6 -> four steps of 5; Qwen2.5-7B's down_proj, 148: 8 ->
    4); none from 4 (19 a warp) or an uneven split over the warps (317 k-tiles on 16) keeps the fewest steps, and so
    do tensor parallel and other architectures; the fewest-steps U is the tuner's first candidate, so a spilling
    default's first re-plan."""
    from generator.plan import plan_gemv
    assert [plan_gemv(3584, 18944, 132, full_steps=True)[k] for k in ("NWG", "U", "U_fewest_steps")] == [8, 4, 8]
    assert [plan_gemv(2560, 2560, 132, full_steps=True)[k] for k in ("NWG", "U", "U_fewest_steps")] == [8, 5, 7]
    assert plan_gemv(2560, 2560, 132)["U"] == 7  # without full_steps: the fewest steps
    assert plan_gemv(2048, 5072, 132)["U"] == plan_gemv(2048, 5072, 132, full_steps=True)["U"] == 7  # 317 on 16 warps
    for n, k in ((4096, 14336), (2048, 8192), (896, 4864)):  # 8 divides, 8 divides, 19 a warp
        p = plan_gemv(n, k, 132, full_steps=True)
        assert p["U"] == p["U_fewest_steps"], (n, k, p)
    v = next(v for v in declared() if v.name == "qwen2.5-7b_decode_b4_s4096_bf16")
    assert render.plan(v, overrides={})["consts"]["DOWN_U"] == 4
    assert render.plan(v, "80", overrides={})["consts"]["DOWN_U"] == 8  # measured on sm_90 only
    assert gtune.candidates(v)[1] == {"DOWN_U": 8, "DOWN_FLOW": 1}  # (the rule's counters need chunks of NWG x U
    # k-tiles that divide down_proj's 1184: at U 8 they do not, so the candidate keeps the default's DOWN_FLOW)
    tp = next(v for v in declared() if v.name.startswith("ho-tp-h5120"))
    assert render.plan(tp)["consts"]["GU_U"] == 7  # tensor parallel: as before (not run on 2 GPUs with it)


def test_q_tiles_first_with_the_new_row_last_by_default_where_qkv_takes_two_rounds():
    """decode.kvlast_rule (session 68): QKV_QFIRST + ATT_KVLAST by default at batch 1 on one sm_90 GPU where qkv's q
    tasks fit in its first round of warp groups and its k and v tasks make a second (Qwen3-1.7B: 128 + 128 tasks on
    132 groups; the Llama-3.2-1B shape with QKV_NWG 16: 128 + 64), not where one round holds them all (Qwen2.5-0.5B,
    the 1B at its default QKV_NWG 8), where q alone takes two (Llama-3-8B) or from batch 2; the pair or neither; where
    other overrides take its requirements, planned without it (no error); the report's plan column says KVLAST; the
    tuner flips the pair at batch 1."""
    from generator.report import path_cell
    named = {v.name: v for v in declared()}
    q17, l1 = named["qwen3-1.7b_decode_b1_s4096_bf16"], named["llama3.2-1b_decode_b1_s1024_bf16"]

    def pair(v, **ov):
        c = render.plan(v, overrides=ov)["consts"]
        return c["QKV_QFIRST"], c["ATT_KVLAST"]
    assert pair(q17) == (1, 1) and pair(l1, QKV_NWG=16) == (1, 1)
    for name in ("qwen2.5-0.5b_decode_b1_s4096_bf16", "llama3-8b_decode_b1_s4096_bf16",
                 "qwen3-1.7b_decode_b4_s4096_bf16"):
        assert pair(named[name]) == (0, 0), name
    # (QKV_NWG 16 by default where that makes qkv's second round >= NWG16_SECOND_MIN of the SMs: the 1B's 60 of 132,
    # not 28 of 132 at 4 KV heads)
    assert pair(l1) == (1, 1) and render.plan(l1)["consts"]["QKV_NWG"] == 16 and pair(l1, QKV_NWG=8) == (0, 0)
    kv4 = dataclasses.replace(l1, model=dataclasses.replace(l1.model, kv_heads=4))
    assert pair(kv4) == (0, 0) and render.plan(kv4)["consts"]["QKV_NWG"] == 8
    assert render.plan(l1, overrides={"QKV_FLOW": 1, "ATT_LL": 0, "H_LL": 0})["consts"]["QKV_NWG"] == 8
    assert pair(q17, ATT_KVLAST=0) == (0, 0) and pair(q17, QKV_QFIRST=0) == (0, 0)
    assert pair(q17, ATT_DYN=1) == (0, 0)  # (its requirements taken: planned without it)
    assert pair(named["llama3.2-1b_decode_b1_s4096_bf16"], QKV_NWG=16, ATT_WARPS=16) == (0, 0)
    assert pair(q17, QKV_FLOW=1, ATT_LL=0, H_LL=0) == (0, 0)
    assert pair(q17, QKV_QFIRST=1, ATT_DYN=1) == (1, 0)
    assert "KVLAST" in path_cell(render.plan(q17)["consts"]).split()
    assert "KVLAST" not in (path_cell(render.plan(l1, overrides={"QKV_NWG": 8})["consts"]) or "").split()
    cands = gtune.candidates(q17)
    assert {"QKV_QFIRST": 0, "ATT_KVLAST": 0} in cands and pair(q17, QKV_QFIRST=0, ATT_KVLAST=0) == (0, 0)
    assert {"QKV_QFIRST": 1, "ATT_KVLAST": 1} in gtune.candidates(named["qwen2.5-0.5b_decode_b1_s4096_bf16"], limit=99)


def test_single_knob_candidates_keep_the_defaults_they_do_not_tune():
    """A tuner candidate that moves ATT_DYN (an ATT_C override turns it off) keeps the default plan's O_PRE (whose
    default depends on ATT_DYN) and ATT_COMBINE: it changes the one knob it names."""
    v = next(v for v in declared() if v.name == "llama3.2-1b_decode_b8_s32768_bf16")
    d = render.plan(v)["consts"]
    assert d["ATT_DYN"] and d["O_PRE"] == 0
    cands = gtune.candidates(v)
    att_c = [ov for ov in cands if "ATT_C" in ov]
    assert att_c and all(render.plan(v, overrides=ov)["consts"]["O_PRE"] == 0 for ov in att_c)
    assert all(ov.get("O_PRE", 0) == 0 for ov in cands if "O_PRE" not in ov or len(ov) > 1)


def test_q_tiles_first_and_rotated_attention_tasks_are_refused_where_meaningless():
    """QKV_QFIRST (0 by default but beside ATT_KVLAST, the test before) and ATT_ROT (1 by default at batch 1 on one GPU with the static split
    and QKV_FLOW, session 67; 0 from batch 2, with ATT_DYN asked, without QKV_FLOW or with tensor parallel):
    QKV_QFIRST renders qkv's first tile 0 (q) instead of the first k tile; ATT_ROT's kernel starts attention's tasks
    at qkv's tasks mod the grid (on the launch's grid); ATT_ROT plans the static split where the planner would take
    ATT_DYN (as an ATT_C override does) and is refused in one line with ATT_DYN asked; either is refused without
    QKV_FLOW, or at a value other than 0 or 1."""
    named = {v.name: v for v in declared()}
    l1, q05 = named["llama3.2-1b_decode_b1_s4096_bf16"], named["qwen2.5-0.5b_decode_b1_s4096_bf16"]
    l1 = dataclasses.replace(l1, model=dataclasses.replace(l1.model, kv_heads=4))  # (160 qkv tasks: no pair)
    assert all(render.plan(v)["consts"]["QKV_QFIRST"] == 0 for v in (l1, q05))
    assert all(render.plan(v)["consts"]["ATT_ROT"] == 1 for v in (l1, q05))
    assert render.plan(named["llama3.2-1b_decode_b4_s4096_bf16"])["consts"]["ATT_ROT"] == 0
    assert render.plan(l1, overrides={"ATT_DYN": 1})["consts"]["ATT_ROT"] == 0
    assert render.plan(l1, overrides={"QKV_FLOW": 0, "ATT_LL": 0, "H_LL": 0})["consts"]["ATT_ROT"] == 0
    tp = next(v for v in declared() if v.mode == "decode" and v.tp > 1 and v.batch == 1)
    assert render.plan(tp)["consts"]["ATT_ROT"] == 0
    # ATT_KVLAST (off here: qkv in one round of QKV_NWG 8's groups, 28 tasks past one of 16-warp groups): the new row
    # folded in last; refused without QKV_FLOW 2's words or with ATT_DYN
    assert render.plan(l1)["consts"]["ATT_KVLAST"] == 0
    src = render.render(l1, render.plan(l1, overrides={"ATT_KVLAST": 1}))
    assert "constexpr int ATT_KVLAST = 1;" in src and "if constexpr (ATT_KVLAST) n -= appends;" in src
    with pytest.raises(PlanError, match=r"ATT_KVLAST=1 needs QKV_FLOW 2"):
        render.plan(l1, overrides={"ATT_KVLAST": 1, "QKV_FLOW": 1, "ATT_LL": 0, "H_LL": 0})
    with pytest.raises(PlanError, match=r"ATT_KVLAST=1 needs ATT_DYN 0"):
        render.plan(l1, overrides={"ATT_KVLAST": 1, "ATT_DYN": 1})
    q05_long = named["qwen2.5-0.5b_decode_b4_s32768_bf16"]  # (ATT_DYN 1 by default; the static split, as ATT_ROT)
    assert render.plan(q05_long)["consts"]["ATT_DYN"] and not render.plan(q05_long, overrides={"ATT_KVLAST": 1})[
        "consts"]["ATT_DYN"]
    with pytest.raises(PlanError, match=r"ATT_KVLAST=1 needs two warps besides the 16 walkers"):
        render.plan(l1, overrides={"ATT_KVLAST": 1, "ATT_WARPS": 16})
    src = render.render(l1, render.plan(l1, overrides={"QKV_QFIRST": 1, "ATT_ROT": 1}))
    assert "constexpr int QKV_QFIRST = 1;" in src and "QKV_FLOW && !QKV_QFIRST ? Q_DIM / 16 : 0" in src
    assert "constexpr int ATT_ROT = 1;" in src and "QKV_TASKS % (int)gridDim.x" in src
    long_kv = named["llama3.2-1b_decode_b8_s32768_bf16"]
    assert render.plan(long_kv)["consts"]["ATT_DYN"] and not render.plan(long_kv, overrides={"ATT_ROT": 1})["consts"][
        "ATT_DYN"]
    with pytest.raises(PlanError, match=r"ATT_ROT=1 needs ATT_DYN 0"):
        render.plan(long_kv, overrides={"ATT_ROT": 1, "ATT_DYN": 2})
    for knob in ("ATT_ROT", "QKV_QFIRST"):
        with pytest.raises(PlanError, match=rf"{knob}=1 needs QKV_FLOW 1 or 2"):
            render.plan(l1, overrides={knob: 1, "QKV_FLOW": 0, "ATT_LL": 0, "H_LL": 0})
        with pytest.raises(PlanError, match=rf"{knob}=2"):
            render.plan(l1, overrides={knob: 2})


def test_candidates_try_down_smem_where_the_planner_takes_it():
    """DOWN_SMEM 1 (down_proj's first task staged in shared memory; never planned) is a candidate, last of all, where
    down_proj's tiles are fewer than the SMs and the planner accepts it (Qwen2.5-0.5B b1, a SmolLM-360M-like b1); not
    at hidden >= 16 x SMs (Llama-3.2-1B: 128 tiles on 132 SMs is kept, Llama-3-8B's 256 is not), from batch 16,
    with tensor parallel or on sm_80; and it never pushes a winner of the tuning file out of a default tune's
    candidates (bench/tune.py --limit 28)."""
    named = {v.name: v for v in declared()}
    q05 = named["qwen2.5-0.5b_decode_b1_s4096_bf16"]
    for v in (q05, named["llama3.2-1b_decode_b1_s4096_bf16"]):
        cands = gtune.candidates(v, limit=100)
        assert cands[-1] == {"DOWN_SMEM": 1}, v.name
        assert render.plan(v, overrides={"DOWN_SMEM": 1})["consts"]["DOWN_SMEM"] == 1
    for v, arch in ((named["llama3-8b_decode_b1_s4096_bf16"], "90"), (_layer(2048, 16), "90"),
                    (_layer(4096, 1, tp=2), "90"), (q05, "80")):
        assert not any("DOWN_SMEM" in ov for ov in gtune.candidates(v, arch, limit=100)), (v.name, arch)
    # last of all: a limited tune (bench/tune.py's 28, the build's re-plan) cuts it before any other candidate
    for v in (v for v in declared() if v.mode == "decode" and v.batch <= 8 and v.tp == 1):
        full, cut = gtune.candidates(v, limit=200), gtune.candidates(v, limit=28)
        if {"DOWN_SMEM": 1} in full:
            assert full[-1] == {"DOWN_SMEM": 1}, v.name
            assert ({"DOWN_SMEM": 1} in cut) == (len(full) <= 28), v.name


def _layer(hidden, batch, norm="rmsnorm", dtype="bf16", qk_norm="false", tp=1):
    return gvariants.parse(f"""
matrix: {{mode: [decode], batch: [{batch}], seq_len: [1024], tp: [{tp}]}}
models:
  m: {{hidden: {hidden}, heads: {hidden // 128}, kv_heads: {max(1, hidden // 512)}, head_dim: 128, intermediate: 4096,
      layers: 2, norm: {norm}, norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false,
      qk_norm: {qk_norm}, dtype: {dtype}}}
""", "x.yaml")[0]


def test_candidates_try_every_norm_fold_and_clusters_at_large_batch():
    """At batch >= 16 the tuner's candidates plan every NORM_FOLD setting (0, 1, 2: the gain in shared memory or read
    from L1) and NORM_CLUSTER 2, whatever the default; below batch 16 neither fold 2 nor clusters."""
    for v in (_layer(2048, 32), _layer(3584, 24), _layer(5120, 16), _layer(4096, 8)):
        plans = [render.plan(v, overrides=ov)["consts"] for ov in gtune.candidates(v)]
        folds, clusters = {c["NORM_FOLD"] for c in plans}, {c["NORM_CLUSTER"] for c in plans}
        if v.batch >= 16:
            assert folds == {0, 1, 2} and clusters == {1, 2}, (v.name, folds, clusters)
        else:
            assert folds == {0, 1} and clusters == {1}, (v.name, folds, clusters)


def test_norm_fold_default_where_it_was_measured_to_win_and_fits():
    """NORM_FOLD's default (bench/NOTES.md sessions 13, 16): on from batch 8 (RMSNorm, bf16, one GPU, no q/k norm)
    where the block keeps >= L1_ENOUGH of L1 (or no plan does); off at batch 4, q/k norm, LayerNorm, fp16 and tensor
    parallel; NORM_FOLD 2 (the gain read from L1) where the gain in shared memory would cost L1 below L1_ENOUGH
    (Qwen2.5-7B-like hidden 3584 at batch 24: session 17); never on where its extra shared memory does not fit
    (sm_86 plans hidden 3072 x 14 rows without it)."""
    from generator.plan import l1_bytes
    from generator.modes.decode import L1_ENOUGH
    from generator.render import plan
    from generator.targets import arch as get_arch
    fold = lambda v, arch="90": plan(v, arch)["consts"]["NORM_FOLD"]  # noqa: E731
    local = {"NORM_GLOBAL": 0}  # (from batch 16 the rows default to global memory: the fold is the local plan's)
    for v in (_layer(4096, 8), _layer(2048, 16), _layer(4096, 16), _layer(5120, 16), _layer(2048, 32)):
        p = plan(v, "90", overrides=local if v.batch >= 16 else None)
        assert p["consts"]["NORM_FOLD"] == 1 and l1_bytes(get_arch("90"), p["smem_bytes"]) >= L1_ENOUGH, v.name
    for v in (_layer(4096, 4), _layer(4096, 8, qk_norm="true"), _layer(4096, 8, norm="layernorm"),
              _layer(4096, 8, dtype="fp16"), _layer(4096, 8, tp=2)):
        assert fold(v) == 0, v.name
    p, one = plan(_layer(3584, 24), "90", overrides=local), plan(_layer(3584, 24), "90", overrides={"NORM_FOLD": 1})
    assert p["consts"]["NORM_FOLD"] == 2 and p["consts"]["SMEM_GS"] == 0
    assert l1_bytes(get_arch("90"), one["smem_bytes"]) < L1_ENOUGH <= l1_bytes(get_arch("90"), p["smem_bytes"])
    with pytest.raises(PlanError, match="NORM_FOLD=4: must be 0, 1, 2 or 3"):
        plan(_layer(3584, 24), "90", overrides={"NORM_FOLD": 4})
    p = plan(_layer(3072, 14), "86")  # planned (the unfolded rows fit), unfolded
    assert p["consts"]["NORM_FOLD"] == 0
    with pytest.raises(PlanError, match="NORM_FOLD=1 keeps the gain"):
        plan(_layer(3072, 14), "86", overrides={"NORM_FOLD": 1})


def test_the_partial_sums_are_single_buffered_where_that_keeps_l1():
    """RED_DB (templates/gemv.cuh): double-buffered partial sums unless one buffer lifts the block's L1 to
    L1_ENOUGH (plan.l1_bytes: the smallest carveout holding the block and the 1 KB the system reserves) or makes the
    block fit; every batch-1 shape keeps it; an override is honoured either way."""
    from generator.plan import L1_ENOUGH, SMEM_RESERVED, l1_bytes
    from generator.render import plan
    from generator.targets import arch as get_arch
    h200 = get_arch("90")
    assert l1_bytes(h200, 164 * 1024 - SMEM_RESERVED) == 92 * 1024
    assert l1_bytes(h200, 164 * 1024 - SMEM_RESERVED + 1) == 60 * 1024
    assert l1_bytes(h200, 0) == 256 * 1024 - 8 * 1024 and l1_bytes(get_arch("86"), 100 * 1024) < 28 * 1024
    for v in (_layer(4096, 20), _layer(3584, 24)):  # double-buffered: 28 KB of L1 (rows in shared memory)
        d = plan(v, "90", overrides={"RED_DB": 1, "NORM_GLOBAL": 0})
        p = plan(v, "90", overrides={"NORM_GLOBAL": 0})  # (from batch 16 the default keeps the rows in global memory)
        assert l1_bytes(h200, d["smem_bytes"]) < L1_ENOUGH <= l1_bytes(h200, p["smem_bytes"]), v.name
        assert p["consts"]["RED_DB"] == 0 and d["consts"]["RED_DB"] == 1
    for v in (_layer(2048, 1), _layer(4096, 8), _layer(4096, 16)):
        assert plan(v, "90")["consts"]["RED_DB"] == 1, v.name
        assert plan(v, "90", overrides={"RED_DB": 0})["consts"]["RED_DB"] == 0
    with pytest.raises(PlanError, match="RED_DB=2: must be 0 or 1"):
        plan(_layer(2048, 1), "90", overrides={"RED_DB": 2})
    # tensor parallel keeps two buffers (one has not run on 2 GPUs); the smaller-L1 GPUs keep the planner's old
    # order where no plan leaves L1_ENOUGH (two buffers, no fold: sm_86 hidden 2048 x 16 rows)
    assert plan(_layer(4096, 20), "90", overrides={"NORM_GLOBAL": 0})["consts"]["RED_DB"] == 0
    assert plan(_layer(4096, 20, tp=2), "90")["consts"]["RED_DB"] == 1
    p86 = plan(_layer(2048, 16), "86")["consts"]
    assert (p86["NORM_FOLD"], p86["RED_DB"]) == (0, 1)
    # a refusal with two buffers forced names the way out
    with pytest.raises(PlanError, match="RED_DB=1 keeps two buffers of partial sums: .* with one the stage fits"):
        plan(_layer(8192, 13), "90", overrides={"RED_DB": 1, "NORM_GLOBAL": 0})


def test_dynamic_split_stays_off_for_caches_of_2_24_rows_and_more():
    """ATT_DYN's run-time division is exact below 2^24 rows (templates/stages/attention.cuh att_ceil_div): at a cache
    of 2^24 rows the planner keeps the static split (the kernel's static_assert would fail the build) and refuses
    the override in one line."""
    from generator.render import plan
    big = dataclasses.replace(_layer(2048, 2), seq_len=1 << 24)
    assert plan(big, "90")["consts"]["ATT_DYN"] == 0
    assert plan(dataclasses.replace(big, seq_len=(1 << 24) - 16), "90")["consts"]["ATT_DYN"] == 1
    with pytest.raises(PlanError, match="ATT_DYN=1: needs .* a cache under 2\\^24 rows"):
        plan(big, "90", overrides={"ATT_DYN": 1})


def test_a_record_without_red_db_was_measured_with_two_buffers():
    """tune.knobs_differ: a knob a record lacks is not a difference, except RED_DB (KNOBS_BEFORE), whose default
    can now be 0: a record made before it existed measured two buffers; a record's knob the planner no longer has
    is one, unless retired at the value that built today's kernel (KNOBS_RETIRED)."""
    from generator.tune import knobs_differ
    assert knobs_differ({"GEMV_PF": 0}, {"GEMV_PF": 0, "H_STATS": 1, "RED_DB": 1}) == []
    assert knobs_differ({"GEMV_PF": 0}, {"GEMV_PF": 0, "RED_DB": 0}) == ["RED_DB"]
    assert knobs_differ({"GEMV_PF": 0, "RED_DB": 0}, {"GEMV_PF": 0, "RED_DB": 0}) == []
    assert knobs_differ({}, {"RED_DB": 0}) == []  # nothing recorded: nothing to compare
    # a retired knob (L2_PF, session 25) at the value that built today's kernel is no difference; at another it is,
    # and so is a removed knob that was never retired
    assert knobs_differ({"GEMV_PF": 0, "L2_PF": 0}, {"GEMV_PF": 0, "RED_DB": 1}) == []
    assert knobs_differ({"GEMV_PF": 0, "L2_PF": 16}, {"GEMV_PF": 0, "RED_DB": 1}) == ["L2_PF"]
    assert knobs_differ({"OLD_KNOB": 0}, {"RED_DB": 1}) == ["OLD_KNOB"]
    # stream-K's piece charge is read only by a stream-K kernel: a record of another plan at any charge is current, a
    # stream-K record at another charge (or without one: the bytes model's) is not
    assert knobs_differ({"ATT_DYN": 0, "ATT_PIECE_TILES": 48}, {"ATT_DYN": 0, "ATT_PIECE_TILES": 0}) == []
    assert knobs_differ({"ATT_DYN": 2, "ATT_PIECE_TILES": 12}, {"ATT_DYN": 2, "ATT_PIECE_TILES": 48}) == \
        ["ATT_PIECE_TILES"]
    assert knobs_differ({"ATT_DYN": 2}, {"ATT_DYN": 2, "ATT_PIECE_TILES": 48}) == ["ATT_PIECE_TILES"]


@pytest.mark.parametrize("hidden", [1024, 2048, 3072, 4096, 8192])
@pytest.mark.parametrize("arch", ["90", "86"])
def test_shared_memory_refusal_names_the_largest_batch_that_plans(hidden, arch):
    """With the rows kept in shared memory (NORM_GLOBAL=0), the norm + projection stage's refusal names the largest
    batch that fits, as that batch would be planned (NORM_FOLD's default included): that batch plans with the rows
    in shared memory, the next is refused so and plans by default with NORM_GLOBAL (near the limit the default may
    take NORM_GLOBAL already: too little L1)."""
    from generator.render import plan
    local = {"NORM_GLOBAL": 0}
    with pytest.raises(PlanError) as info:
        plan(_layer(hidden, 200), arch, overrides=local)
    n = int(re.search(r"a batch of at most (\d+) fits", str(info.value)).group(1))
    plan(_layer(hidden, n), arch, overrides=local)
    with pytest.raises(PlanError, match="norm\\+projection.*NORM_GLOBAL=1 .the default where they do not fit."):
        plan(_layer(hidden, n + 1), arch, overrides=local)
    assert plan(_layer(hidden, n + 1), arch)["consts"]["NORM_GLOBAL"] == 1


def test_the_tuner_never_records_a_spilling_default_and_still_times_against_it():
    """bench/tune.pick: the default (rows[0]) wins unless another candidate beats it by MIN_GAIN; a default whose
    plan spills is only the baseline (the build re-plans it; `megakernel tune` must find a spill-free winner)."""
    from bench.tune import MIN_GAIN, pick
    rows = [{"name": "c00", "us": 10.0}, {"name": "c01", "us": 10.0 * (1 - MIN_GAIN / 2)},
            {"name": "c02", "us": None}]
    assert pick(rows)["name"] == "c00"  # within the margin: the default
    assert pick(rows, {"c00"})["name"] == "c01"  # a spilling default: the fastest other, whatever its gain
    assert pick([{"name": "c00", "us": 10.0}, {"name": "c01", "us": None}], {"c00"}) is None
    assert pick([{"name": "c00", "us": 10.0}, {"name": "c01", "us": 8.0}])["name"] == "c01"


def test_the_tuner_at_several_positions_picks_on_the_mean_and_never_a_plan_that_loses_at_one():
    """bench/tune.pick over candidates timed at several position sets (`tune --positions full,191`: "us" the
    geometric mean, "us_at" each set's): the fastest mean wins only where it is no slower than the default by more
    than MIN_GAIN at any set (a short-context plan must not lose at full context); a spilling default, only a
    baseline, does not hold the others back."""
    import math
    from bench.tune import MIN_GAIN, loses, pick

    def row(name, *at):
        return {"name": name, "us": math.exp(sum(map(math.log, at)) / len(at)), "us_at": list(at)}
    d = row("c00", 50.0, 40.0)
    short = row("c01", 50.0 * (1 + 2 * MIN_GAIN), 36.0)  # the best mean, but 2 % slower at full context
    both = row("c02", 50.0 * (1 + MIN_GAIN / 2), 38.0)  # a smaller gain, within the margin at full context
    assert short["us"] < both["us"] < d["us"] * (1 - MIN_GAIN)
    assert pick([d, short, both])["name"] == "c02"
    assert pick([d, short])["name"] == "c00"
    assert pick([d, short, both], {"c00"})["name"] == "c01"  # a spilling default: the fastest other
    assert loses(short, d) and not loses(both, d) and not loses(d, d)
    # one set: the rule of one position as before (no us_at)
    assert pick([{"name": "c00", "us": 10.0}, {"name": "c01", "us": 9.0, "us_at": [9.0]}])["name"] == "c01"


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_split_parallel_combine_matches_the_reference(tmp_path):
    """ATT_COMBINE 2 (the last split's combine spread over warps, merged in shared memory): runs of more than 32
    splits a warp (a group of 16: one warp a head, 64 splits), more query heads than warps (a group of 20: a warp
    takes two heads), head_dim 80 (a lane's dims past the head skipped) at batch 3, the Qwen2.5-1.5B-like shape
    at batch 5, and a group of 4 over at most 3 splits (warps whose run is empty); the sequence at the last position has every split, the one at 0 a single one; two launches
    bit-equal (runs and merge order are fixed)."""
    big, wide, hd80 = gvariants.parse("""
matrix: {mode: [decode], batch: [1], seq_len: [8192]}
models:
  cbg16: {hidden: 2048, heads: 32, kv_heads: 2, head_dim: 64, intermediate: 2048, layers: 2, norm: rmsnorm,
          norm_eps: 1.0e-5, rope_theta: 500000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
  cbg20: {hidden: 2560, heads: 40, kv_heads: 2, head_dim: 64, intermediate: 2048, layers: 2, norm: rmsnorm,
          norm_eps: 1.0e-5, rope_theta: 500000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16,
          matrix: {mode: [decode], batch: [1], seq_len: [4096]}}
  cbhd80: {hidden: 960, heads: 12, kv_heads: 4, head_dim: 80, intermediate: 2048, layers: 2, norm: rmsnorm,
           norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16,
           matrix: {mode: [decode], batch: [3], seq_len: [3000]}}
""", "cb.yaml")
    b5, = _qwen15_like("cb", [5])
    few, = gvariants.parse("""
matrix: {mode: [decode], batch: [2], seq_len: [384]}
models:
  cbfew: {hidden: 512, heads: 8, kv_heads: 2, head_dim: 64, intermediate: 1024, layers: 2, norm: rmsnorm,
          norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "cbfew.yaml")  # a group of 4 (4 warps a head) over at most 3 splits: warps with no split
    cases = [(v, {"ATT_COMBINE": 2, "ATT_C": 128, **({"NORM_FOLD": 1} if v is wide else {})})  # (its re-planned
             for v in (big, wide, hd80, b5, few)]                                               # default: no spills)
    _overrides_match_the_reference(tmp_path, cases, "cb", 19, {}, repeat=True)
    assert render.plan(big, overrides={"ATT_C": 128})["consts"]["ATT_NSPLIT"] == 64


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_combine_over_the_splits_blocks_matches_the_reference(tmp_path):
    """ATT_COMBINE 3 (every split's block combines a slice of the outputs once all splits have counted): 32 splits
    of a group of 7 (Qwen2.5-7B b1 with its bias, head_dim 128; Qwen2.5-0.5B b1, head_dim 64), a group of 4 over at
    most 3 splits at batch 2 (slices of uneven length), head_dim 80 at batch 3 (8 splits, 96 tasks: one round;
    more tasks than SMs are refused by the planner, test_split_parallel_combine_by_default...); random_inputs puts
    the sequences at different positions (different split counts), and a second launch on the same inputs is
    bit-equal (the counters were reset by the launch before). ATT_COMBINE 4 (the partials as tagged words, no
    counter) on the group of 4 and Qwen2.5-0.5B b1 the same way, and 3 and 4 at Qwen2.5-0.5B b1 KV 32768 (64 splits: a
    lane takes two in turn; the wider trials of 4: test_ll_hand_offs...)."""
    by_name = {v.name: v for v in declared()}
    few, = gvariants.parse("""
matrix: {mode: [decode], batch: [2], seq_len: [384]}
models:
  c3few: {hidden: 512, heads: 8, kv_heads: 2, head_dim: 64, intermediate: 1024, layers: 2, norm: rmsnorm,
          norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "c3few.yaml")
    hd80, = gvariants.parse("""
matrix: {mode: [decode], batch: [3], seq_len: [3000]}
models:
  c3hd80: {hidden: 960, heads: 12, kv_heads: 4, head_dim: 80, intermediate: 2048, layers: 2, norm: rmsnorm,
           norm_eps: 1.0e-5, rope_theta: 10000.0, activation: silu, qkv_bias: false, qk_norm: false, dtype: bf16}
""", "c3hd80.yaml")
    cases = [(by_name["qwen2.5-7b_decode_b1_s4096_bf16"], {"ATT_COMBINE": 3}),
             (by_name["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"ATT_COMBINE": 3}),
             (few, {"ATT_COMBINE": 3, "ATT_C": 128}), (hd80, {"ATT_COMBINE": 3}),
             (few, {"ATT_COMBINE": 4, "ATT_C": 128}), (by_name["qwen2.5-0.5b_decode_b1_s4096_bf16"], {"ATT_COMBINE": 4}),
             # more than 32 splits: a lane polls and combines several splits in turn (the loop over r0)
             (by_name["qwen2.5-0.5b_decode_b1_s32768_bf16"], {"ATT_COMBINE": 4}),
             (by_name["qwen2.5-0.5b_decode_b1_s32768_bf16"], {"ATT_COMBINE": 3})]
    _overrides_match_the_reference(tmp_path, cases, "c3", 23, {}, repeat=True)


def test_split_parallel_combine_by_default_where_the_online_pass_takes_three_batches():
    """The planner's ATT_COMBINE: 2 where the one online pass would take >= 3 dependent batches of loads (rounds of
    the group's outputs over the block x batches of 8 splits) on one GPU without ATT_DYN, else 1; an override of 0-4
    is taken (3 and 4 without ATT_DYN and tensor parallel, and with every attention task in one round), 5 refused;
    ATT_COMBINE 4's partials are 64-bit words (twice the buffer; their launches advance the epoch: the GPU
    test test_ll_hand_offs... asserts it)."""
    from generator.modes import decode
    assert decode.combine_default(4 * 64, 16) == 1 and decode.combine_default(7 * 64, 32) == 2
    assert decode.combine_default(7 * 128, 16) == 2 and decode.combine_default(7 * 128, 8) == 1
    assert decode.combine_default(4 * 128, 8) == 1
    by_name = {v.name: v for v in declared()}
    assert render.plan(by_name["qwen2.5-0.5b_decode_b1_s4096_bf16"])["consts"]["ATT_COMBINE"] == 2
    assert render.plan(by_name["llama3.2-1b_decode_b1_s4096_bf16"])["consts"]["ATT_COMBINE"] == 1
    dyn = render.plan(by_name["qwen2.5-7b_decode_b4_s32768_bf16"])["consts"]  # ATT_DYN: 1 (measured 5 % slower)
    assert dyn["ATT_DYN"] == 1 and dyn["ATT_COMBINE"] == 1
    v = by_name["llama3.2-1b_decode_b1_s4096_bf16"]
    assert render.plan(v, overrides={"ATT_COMBINE": 0})["consts"]["ATT_COMBINE"] == 0
    assert render.plan(v, overrides={"ATT_COMBINE": 3})["consts"]["ATT_COMBINE"] == 3
    with pytest.raises(render.PlanError, match="ATT_COMBINE=5: must be 0, 1, 2, 3 or 4"):
        render.plan(v, overrides={"ATT_COMBINE": 5})
    from generator.report import path_cell  # the report names the path
    for c in (3, 4):
        with pytest.raises(render.PlanError, match=f"ATT_COMBINE={c}: not with ATT_DYN=1 .*ATT_DYN=0"):
            render.plan(by_name["qwen2.5-7b_decode_b4_s32768_bf16"], overrides={"ATT_COMBINE": c})
        assert path_cell(render.plan(v, overrides={"ATT_COMBINE": c})["consts"]) == \
            f"ATT_COMBINE={c} LL KVLAST COOP=0"
    # (no grid barrier left at batch 1: launched without the cooperative attribute, COOP=0; the barriers back: COOP 1)
    assert path_cell(render.plan(v)["consts"]) == "LL KVLAST COOP=0"
    assert path_cell(render.plan(v, overrides=LL_OFF)["consts"]) is None
    assert path_cell(render.plan(v, overrides={"H_LL": 0})["consts"]) == "QKV_FLOW=2 ATT_LL KVLAST"
    part = {c: render.plan(v, overrides={"ATT_COMBINE": c})["workspace"]["buffers"]["part"]["bytes"] for c in (3, 4)}
    assert part[4] == 2 * part[3] > 0, part  # (value, launch count) words
    src = render.render(v, render.plan(v, overrides={"ATT_COMBINE": 4}))
    assert "constexpr int ATT_COMBINE = 4;" in src
    hd80 = _decode_layer("c3hd80", 3, 3000, "hidden: 960, heads: 12, kv_heads: 4, head_dim: 80, intermediate: 2048")
    assert render.plan(hd80, overrides={"ATT_COMBINE": 3})["consts"]["ATT_NSPLIT"] == 8  # 96 tasks: one round
    for c in (3, 4):
        with pytest.raises(render.PlanError, match=f"ATT_COMBINE={c}: 288 attention tasks on 132 SMs .*one round"):
            render.plan(hd80, overrides={"ATT_COMBINE": c, "ATT_C": 128})  # (no block may wait on its own later task)
    tp2 = next(v for v in gvariants.load(Path(__file__).resolve().parent.parent / "variants.yaml") if v.tp > 1)
    assert render.plan(tp2)["consts"]["ATT_COMBINE"] == 1
    for c in (2, 3, 4):
        with pytest.raises(render.PlanError, match=f"ATT_COMBINE={c}: not with tensor parallel"):
            render.plan(tp2, overrides={"ATT_COMBINE": c})


def test_candidates_that_move_the_split_keep_the_default_combine():
    """A candidate that changes the attention split (ATT_C, ATT_WARPS) plans the default plan's ATT_COMBINE (only the
    ATT_COMBINE candidates change it), so each candidate times one change."""
    for name in ("qwen2.5-7b_decode_b4_s32768_bf16", "qwen2.5-0.5b_decode_b1_s4096_bf16"):
        v = next(v for v in declared() if v.name == name)
        base = render.plan(v)["consts"]["ATT_COMBINE"]
        moved = [ov for ov in gtune.candidates(v) if {"ATT_C", "ATT_WARPS"} & set(ov)]
        assert moved and all(render.plan(v, overrides=ov)["consts"]["ATT_COMBINE"] == base for ov in moved), moved


def test_cache_tensor_maps_are_the_kernels_boxes(monkeypatch):
    """The loader's ATT_TMA cache maps (loader._cache_maps through _encode_tiled, cuTensorMapEncodeTiled captured
    here on the CPU): per cache a rank-2 16-bit tensor [batch x kv_heads x rows][head_dim] at the cache's address,
    the row stride head_dim x 2 B, a box of 64 dims x 16 rows (attention.cuh's tensor_copy2 at (64 h, row)), the
    128-byte swizzle (att_off's pattern), zeros out of bounds; K's map first, then V's (interface.KV_TENSOR_MAPS).
    A driver refusal is a one-line LoadError naming the variant."""
    import ctypes

    import torch

    from generator import loader
    from generator.manifest import LoadError
    calls = []

    class Fn:
        restype = None

        def __call__(self, out, dtype, rank, addr, sizes, strides, box, estr, inter, swz, l2, oob):
            r = rank.value
            calls.append(dict(dtype=dtype.value, rank=r, addr=addr.value, sizes=list(sizes)[:r],
                              strides=list(strides)[:r - 1], box=list(box)[:r], estr=list(estr)[:r],
                              interleave=inter.value, swizzle=swz.value, oob=oob.value))
            return self.rc
    fn = Fn()
    fn.rc = 0
    monkeypatch.setattr(ctypes, "CDLL", lambda name: type("Lib", (), {"cuTensorMapEncodeTiled": fn})())
    k = torch.zeros(3, 2, 40, 80, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    maps = loader._cache_maps("x_decode_b3", k, v, "cpu")
    assert tuple(maps.shape) == (2, 128) and maps.dtype == torch.uint8
    assert [c["addr"] for c in calls] == [k.data_ptr(), v.data_ptr()]
    for c in calls:
        assert c == dict(dtype=1, rank=2, addr=c["addr"], sizes=[80, 3 * 2 * 40], strides=[160], box=[64, 16],
                         estr=[1, 1], interleave=0, swizzle=3, oob=0), c
    fn.rc = 1
    with pytest.raises(LoadError, match="^x_decode_b3: cuTensorMapEncodeTiled refused k_cache") as ei:
        loader._cache_maps("x_decode_b3", k, v, "cpu")
    assert "\n" not in str(ei.value)


def test_candidates_off_full_context_add_to_the_full_context_ones():
    """Off full context (`tune --positions`) the candidates gain ATT_DYN 1 against a static plan and stream-K's
    piece charge halved / doubled where stream-K is planned; they lose none of the full-context ones (stream-K
    where its model gains STREAM_TRY_GAIN over a static plan: the TinyLlama-like b24)."""
    by = {v.name: v for v in declared()}
    v = by["ho-tinyllama-b24_decode_b24_s2048_bf16"]
    full, mixed = gtune.candidates(v, "90", 40, "full"), gtune.candidates(v, "90", 40, "mixed")
    assert {"ATT_DYN": 2} in full and {"ATT_DYN": 2} in mixed and {"ATT_DYN": 1} in mixed
    assert {"ATT_DYN": 1} not in full
    assert all(c in mixed for c in full)
    # ATT_ROT flipped (batch 1's default off, batch 2-8's on) only off full context, and only with the static split
    for name, flip in (("llama3.2-1b_decode_b1_s4096_bf16", 0), ("llama3.2-1b_decode_b4_s4096_bf16", 1)):
        full, short = gtune.candidates(by[name], "90", 60, "full"), gtune.candidates(by[name], "90", 60, "row 191")
        assert {"ATT_ROT": flip} in short and not any("ATT_ROT" in c for c in full)
    assert not any("ATT_ROT" in c for c in gtune.candidates(by["llama3.2-1b_decode_b8_s32768_bf16"], "90", 60, "mixed"))
