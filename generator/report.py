"""Resource report: what each variant costs (binary, registers, spills, shared memory, load time), joined with the
latest benchmark figures where there are any, then the newest end-to-end result (bench/e2e.py) where it served one
of the report's variants (report.json keeps it either way). Terminal tables + build/report.json + build/report.csv."""
from __future__ import annotations

import csv
import io
import json
import re
import warnings
from collections import Counter
from pathlib import Path

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from .compile import atomic_write, read_manifest
from .interface import weight_shapes
from .manifest import build_dir_flag, cubin_problem, kernel_sources_digest, status as build_status, variant_from_entry
from .modes import decode
from .plan import L1_ENOUGH
from .targets import DEFAULT_ARCH, DTYPES, arch as get_arch, gpu_arch
from .tune import knob_dict, knobs_differ

COLUMNS = ["name", "status", "cubin_bytes", "ptx_bytes", "registers", "spill_stores", "spill_loads", "stack_frame",
           "static_smem", "dynamic_smem", "smem_total", "smem_pct", "l1_bytes", "blocks_per_sm", "compile_s",
           "load_ms",
           "plan", "overrides", "path", "tuned_gain", "split_k", "mma_sass", "tp", "gpu_bytes", "workspace_bytes",
           "flags"]
BENCH_COLUMNS = ["fused_us", "pct_bw", "tflops", "route", "speedup_best", "best_baseline", "speedup_torch_graph",
                 "speedup_eager", "speedup_compile"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """"1 binary", "3 binaries": n and the noun in the number it takes (plural: noun + "s" unless given)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def flags(entry: dict) -> list[str]:
    """What a user must not miss: spills, over-budget shared memory, less L1 than L1_ENOUGH beside the block on a GPU
    with room for more (its weight loads stream slower), a refused or failed build, wgmma serialised by ptxas (the
    prefill GEMM's tensor-core work waiting on itself: slower, not wrong), one layer's weights, KV cache
    and workspace over the largest GPU of its arch (mem>N GB: it cannot run), a tuning entry that was not used
    (tuned-plan-unused: the default plan was built; the build's warning said why)."""
    out = ["tuned-plan-unused"] if entry.get("tuning_warning") else []
    if entry["status"] != "ok":
        out.append(entry["status"])
        return out
    r = entry["resources"]
    if r["spill_stores"] or r["spill_loads"]:
        out.append("spills")
    if r.get("wgmma_serialized"):
        out.append("wgmma-serialized")
    limit = r.get("smem_limit") or get_arch(entry.get("arch", DEFAULT_ARCH)).smem_per_block
    if r["smem_total"] > limit:
        out.append(f"smem>{limit // 1024}KB")
    if r["blocks_per_sm"] < 1:
        out.append("no-residency")
    a = get_arch(entry.get("arch", DEFAULT_ARCH))
    # the weight streams slow down (plan.l1_bytes); flagged where the SM's storage (>= 192 KB) leaves room for more.
    # Decode only: prefill's GEMM brings its weights and tokens into shared memory by bulk copies, not through L1
    decode = (entry.get("plan") or {}).get("mode", "decode") == "decode"
    if decode and r.get("l1_bytes") is not None and r["l1_bytes"] < L1_ENOUGH and a.unified_kb >= 192:
        out.append(f"L1<{L1_ENOUGH // 1024}KB")
    try:
        g = gpu_fields(entry)
    except (KeyError, TypeError):  # an older build's entry without its parameters: nothing to add up
        g = {}
    if a.mem_bytes and g.get("gpu_bytes", 0) + (g.get("workspace_bytes") or 0) > a.mem_bytes:
        out.append(f"mem>{a.mem_bytes // 10**9}GB")
    return out


def plan_fields(entry: dict) -> dict:
    """"plan": which plan the build used ("default", "default (re-planned)": the default spilled, a spill-free
    tuner candidate was built, "tuned (<file>)", "override"; entries of older builds: "default"); "overrides": the
    plan overrides it was built with ({knob: value}, {} for the default plan); "tuned_gain": default_us / tuned_us
    the tuner measured for it (None where not known)."""
    src = entry.get("plan_source") or "default"
    fig = entry.get("tuned_figures") or {}
    gain = None
    if src.startswith("tuned") and fig.get("default_us") and fig.get("tuned_us"):
        gain = round(fig["default_us"] / fig["tuned_us"], 3)
    consts = (entry.get("plan") or {}).get("consts") or {}
    return {"plan": src, "overrides": dict((entry.get("plan") or {}).get("overrides") or {}), "tuned_gain": gain,
            "split_k": split_k_cell(consts), "path": path_cell(consts)}


def path_cell(c: dict) -> str | None:
    """The decode paths a plan takes that change the kernel's shape, named by their knobs: NORM_GLOBAL (the norms'
    rows in global memory, two more grid barriers; H_STATS with it: the second norm from o_proj's epilogue, one
    barrier), GEMM_PROJ (qkv_proj, o_proj and gate_up on the GEMM engine; GEMM_PROJ=qkv+gu and the like where some
    stay GEMVs: QKV_GEMM, O_GEMM, or with +down where down_proj is on it too: DOWN_GEMM; TOKEN_TILE=n where its
    token tiles are not the planner's 64 rows: GEMM_TOKEN_TILE), TM=n (n tiles a GEMV task, the largest of
    the GEMV projections'), BS=n (the GEMV's warp groups in n batch slices, the most of the projections'),
    ATT_DYN=2 (stream-K attention), ATT_TMA (attention's K/V tiles by TMA tensor copies), ATT_COMBINE=3 or 4
    (every split's block waits for its peers and combines a slice), LL (the hand-offs qkv -> attention -> o_proj ->
    the second norm as tagged words, no grid barrier between them: ATT_LL, QKV_FLOW 2 and H_LL; where only some,
    those), DOWN_FLOW=2 (gate_up -> down_proj as tagged words too), GU_SKIP (down_proj's blocks take no gate_up
    task), DOWN_SMEM (down_proj's first task copied into shared memory), KVLAST (ATT_KVLAST: the new row folded
    into attention last by two warps that do not walk, with qkv's q tiles first), WINDOW=n (a sliding window of n rows),
    COOP=0 (launched without the cooperative attribute); None where it takes none (or a prefill plan)."""
    parts = ["NORM_GLOBAL"] if c.get("NORM_GLOBAL") else []
    parts += ["H_STATS"] if c.get("NORM_GLOBAL") and c.get("H_STATS") else []
    engine = [p for p in ("QKV", "O", "GU", "DOWN") if decode.on_engine(c, p)]
    parts += (["GEMM_PROJ"] if engine == ["QKV", "O", "GU"] else [f"GEMM_PROJ={'+'.join(p.lower() for p in engine)}"]
              if engine else [])
    tt = c.get("GEMM_TOKEN_TILE", decode.GEMM_BN_MAX)
    parts += [f"TOKEN_TILE={tt}"] if engine and tt != decode.GEMM_BN_MAX else []
    gemv = [p for p in ("QKV", "O", "GU", "DOWN") if not decode.on_engine(c, p)]  # (the projections the GEMVs run)
    tm = max([c.get(f"{p}_TM", 1) for p in gemv], default=1)  # (none: every projection on the engine)
    parts += [f"TM={tm}"] if tm > 1 else []
    bs = max([c.get(f"{p}_BS", 1) for p in gemv], default=1)
    parts += [f"BS={bs}"] if bs > 1 else []
    parts += ["ATT_DYN=2"] if c.get("ATT_DYN") == 2 else []
    parts += ["ATT_TMA"] if c.get("ATT_TMA") else []
    parts += [f"ATT_COMBINE={c['ATT_COMBINE']}"] if c.get("ATT_COMBINE") in (3, 4) else []
    ll = [k for k, on in (("QKV_FLOW=2", c.get("QKV_FLOW") == 2), ("ATT_LL", c.get("ATT_LL")),
                          ("H_LL", c.get("H_LL"))) if on]
    parts += ["LL"] if len(ll) == 3 else ll
    parts += ["DOWN_FLOW=2"] if c.get("DOWN_FLOW") == 2 else []
    parts += ["GU_SKIP"] if c.get("GU_SKIP") else []
    parts += ["DOWN_SMEM"] if c.get("DOWN_SMEM") else []
    parts += ["KVLAST"] if c.get("ATT_KVLAST") else []
    parts += [f"WINDOW={c['WINDOW']}"] if c.get("WINDOW") else []
    parts += ["COOP=0"] if c.get("COOP") == 0 else []
    return " ".join(parts) or None


def split_k_cell(c: dict) -> str | None:
    """Each projection's split-K as planned, qkv/o/gate_up/down: K splits, or FULL:KSPLIT where the first FULL
    tiles run whole (prefill; decode GEMM_PROJ's GEMMs: <P>_GFULL, <P>_GSPLIT); None for plans that do not say (older
    builds)."""
    parts = []
    for p in ("QKV", "O", "GU", "DOWN"):
        if f"{p}_KSPLIT" not in c:
            return None
        g = "G" if decode.on_engine(c, p) else ""  # (decode GEMM_PROJ: the GEMM engine's split)
        full = c.get(f"{p}_{g}FULL", 0)
        parts.append(f"{full}:{c[f'{p}_{g}SPLIT' if g else f'{p}_KSPLIT']}" if full else
                     str(c[f"{p}_GSPLIT" if g else f"{p}_KSPLIT"]))
    return "/".join(parts)


def gpu_fields(entry: dict) -> dict:
    """"tp": GPUs per layer; "gpu_bytes": what one GPU holds for the layer and a decode step streams at most: its
    weights (its shard with tensor parallel) plus its KV cache full (decode: batch x seq_len rows; prefill: the
    chunk's rows); "workspace_bytes": the kernel's scratch (activations, split-K partials, counters), allocated
    once per variant and shared by its layers (None for older builds)."""
    v = variant_from_entry(entry)
    m, e = v.shard, DTYPES[v.model.dtype].bytes
    weights = sum(_numel(s) for s in weight_shapes(m).values()) * e
    kv = 2 * v.batch * v.seq_len * m.kv_heads * m.head_dim * e
    ws = ((entry.get("plan") or {}).get("workspace") or {}).get("bytes")
    return {"tp": v.tp, "gpu_bytes": weights + kv, "workspace_bytes": ws}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _plan_cell(r: dict, k: str) -> str:
    src = r.get("plan") or "default"
    other = " [yellow](timed: other plan)[/yellow]" if r.get("timed_plan") == "other" else ""
    ov = " ".join(f"{k}={v}" for k, v in sorted((r.get("overrides") or {}).items()))  # what was built
    path = f" [{r['path']}]" if r.get("path") else ""  # the paths the plan takes (path_cell)
    if not src.startswith("tuned"):
        return src + (f" ({ov})" if ov else "") + path + other
    # a tuning entry without the tuner's times (one written by hand) is built but was never timed
    head = f"tuned ×{r['tuned_gain']:.2f}" if r.get("tuned_gain") else "override, not timed"
    return head + (f" ({ov})" if ov else "") + path + other


def measure_load_times(manifest: dict, build_dir: Path) -> dict[str, dict]:
    """Cold module-load time (ms, context already created) and driver attributes, where a GPU is present."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(0).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # create the context first: it is not the module's cost
    except Exception:
        return {}
    import time
    out = {}
    for name, e in manifest["variants"].items():
        if e["status"] != "ok":
            continue
        t0 = time.perf_counter()
        mod = cupy.RawModule(path=str(build_dir / e["cubin"]), enable_cooperative_groups=True)
        k = mod.get_function(e["plan"].get("kernels", [{"name": "decoder_layer"}])[0]["name"])
        _ = k.kernel
        ms = (time.perf_counter() - t0) * 1e3
        out[name] = {"load_ms": round(ms, 3), "attributes": {a: k.attributes[a] for a in
                     ("num_regs", "local_size_bytes", "shared_size_bytes", "max_threads_per_block")}}
    return out


def natural_key(name: str) -> list:
    """Sort key that orders the numbers in variant names by value (s1024 < s4096 < s32768)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _bench_figures(doc: dict, arch: str | None) -> list[tuple[str, dict]]:
    """(variant, figures) of one results file's passing fused rows (latest_bench); [] where it was measured on
    another architecture. TypeError/ValueError where the file's rows are not the shape those tools write."""
    measured_on = str(doc.get("arch") or "") or gpu_arch(str(doc.get("gpu", "")))  # recorded, else by name
    if arch is not None and measured_on is not None and measured_on != str(arch).rstrip("a"):
        return []
    for key in ("rows", "prefill"):
        if not isinstance(doc.get(key, []), list):
            raise TypeError(f'its "{key}" is {type(doc[key]).__name__}, not a list of rows')
    rows = doc.get("rows", []) + doc.get("prefill", [])  # prefill: megakernel bench's prefill rows
    out = []
    for row in rows:
        if not isinstance(row, dict):
            raise TypeError(f"a row is {type(row).__name__}, not an object")
        name = row.get("variant")
        # a row that failed its run's check against the reference is not a figure to show
        failed = row.get("error") or row.get("status", "ok") != "ok" or row.get("pass") is False
        if not name or failed or row.get("provider", "fused") != "fused":
            continue
        if "provider" in row:  # megakernel bench
            fig = {"fused_us": row.get("us_median"), "pct_bw": row.get("pct_bw"),
                   "speedup_torch_graph": row.get("speedup_vs_torch_graph"),
                   "speedup_eager": row.get("speedup_vs_eager"), "speedup_compile": row.get("speedup_vs_compile"),
                   "speedup_best": row.get("speedup_vs_best"), "best_baseline": row.get("best_baseline")}
        elif "tp" in row and "us" in row:  # bench/tp_check.py: a tensor-parallel decode variant
            fig = {"fused_us": row.get("us"), "pct_bw": row.get("pct_bw"), "speedup_best": row.get("speedup"),
                   "best_baseline": row.get("best_baseline")}
        elif row.get("mode") == "prefill":  # gpu_check, prefill
            fig = {"fused_us": row.get("us"), "tflops": row.get("tflops"), "speedup_best": row.get("speedup"),
                   "best_baseline": "unfused", "route": row.get("route")}
        elif "us" in row:  # gpu_check, decode
            fig = {"fused_us": row.get("us"), "pct_bw": row.get("pct_bw"),
                   "speedup_torch_graph": row.get("speedup"), "speedup_best": row.get("speedup_vs_best"),
                   "best_baseline": row.get("best_baseline")}
        else:
            continue
        bad = [k for k, x in fig.items() if k not in ("best_baseline", "route") and x is not None
               and (isinstance(x, bool) or not isinstance(x, (int, float)))]
        if bad:
            raise ValueError(f"{name}: {bad[0]} {fig[bad[0]]!r} is not a number")
        if isinstance(row.get("knobs"), dict):  # the plan it timed (newer files)
            fig["timed_knobs"] = row["knobs"]
        out.append((str(name), fig))
    return out


def latest_bench(bench_dir: Path, arch: str | None = None) -> dict[str, dict]:
    """Per variant: the fused kernel's newest measured figures in bench/results/*.json, from `megakernel bench`
    files (every provider's row; its prefill rows, under "prefill", as gpu_check's), `bench/gpu_check.py` files
    (one row per variant: decode µs, % of bandwidth and speedups; prefill µs, TFLOP/s, × unfused and route) and
    `bench/tp_check.py` files (tensor parallel: per-layer µs, % of bandwidth outside the all-reduces, × the best TP
    baseline). arch: only files measured on a GPU of that architecture (by the GPU name they record; a name no
    target knows is kept), so an sm_80 build is not shown H200 figures. Newest = the file's recorded date, then its
    recorded time, then its name (deterministic in a fresh clone, where mtimes are the checkout's). Rows that
    errored or failed their run's check against the reference (`pass: false`) are skipped."""
    found: dict[str, tuple] = {}
    for p in sorted(bench_dir.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            warnings.warn(f"{p}: not read ({type(exc).__name__}: {str(exc).splitlines()[0][:80]}): skipped")
            continue
        if not isinstance(doc, dict):
            continue
        try:
            figs = _bench_figures(doc, arch)
        except (TypeError, ValueError, AttributeError) as exc:  # a file of another shape: said, not a traceback
            warnings.warn(f"{p}: not a results file this report reads ({exc}): skipped")
            continue
        when = (str(doc.get("date", "")), str(doc.get("time", "")), p.name)
        for name, fig in figs:
            if name not in found or when > found[name][0]:
                found[name] = (when, {**fig, "bench_file": p.name, "bench_gpu": str(doc.get("gpu") or "")})
    return {name: fig for name, (_, fig) in found.items()}


# bench/e2e.py's figures per provider (key, header, format), all ms: time to first token of a 128- and a 2048-token
# prompt, ms per output token at batch 1 and 8, at batch 1 near the end of the cache and sampled (temperature 0.8,
# top-k 50, top-p 0.9; and top-p 0.9 with top-k off at temperature 0.6) (newer runs only)
E2E_FIGURES = [("ttft_ms_128", "TTFT 128\nms", ".2f"), ("ttft_ms_2048", "TTFT 2048\nms", ".2f"),
               ("ms_per_token_b1", "ms/token\nb1", ".3f"), ("ms_per_token_b8", "ms/token\nb8", ".3f"),
               ("ms_per_token_b1_long", "ms/token\nb1 long", ".3f"),
               ("ms_per_token_b1_sampled", "ms/token\nb1 sampled", ".3f"),
               ("ms_per_token_b1_sampled_topp", "ms/token\nb1 top-p only", ".3f")]
E2E_AGREEMENT = {"agreement_fused_bf16_vs_hf_fp32": "fused bf16", "agreement_unfused_fp32_vs_hf_fp32": "unfused fp32",
                 "agreement_hf_bf16_vs_hf_fp32": "transformers bf16"}  # the last: the yardstick for bf16's rounding


def latest_e2e(bench_dir: Path, archs=None) -> dict | None:
    """The newest `bench/e2e.py` result among bench_dir/e2e-*.json, None where there is none: {"file", "gpu",
    "checkpoint" (the model directory it measured), "variants" (the fused decode variants it served; print_report
    tables it only where the report has one of them), "providers": {name: {E2E_FIGURES key: ms, only those recorded} or {"error": str}}, "agreement": {"fused bf16" /
    "unfused fp32" / "transformers bf16": {"greedy_tokens_equal_before_divergence", "of", "logits_rel_err", ...}}, "kernel_bound": {layers_us, lm_head_us
    (µs per decode step), bound_ms, ratio (measured ms/token at batch 1 over bound_ms), and one layer's call from
    Python: layer_kernel_us, layer_eager_call_us, layer_eager_call_unchecked_us (µs a call) where recorded} or None}.
    archs: only files measured on a GPU of one of these architectures (recorded arch, else by GPU name; a name no
    target knows is kept), as latest_bench. Newest = recorded date, else the one in
    the file name, then recorded time, then the name."""
    best = None
    for p in Path(bench_dir).glob("e2e-*.json"):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("providers"), dict):
            continue
        measured_on = str(doc.get("arch") or "").rstrip("a") or gpu_arch(str(doc.get("gpu", "")))
        if archs is not None and measured_on is not None and measured_on not in {str(a).rstrip("a") for a in archs}:
            continue
        named = re.search(r"\d{4}-\d{2}-\d{2}", p.name)
        when = (str(doc.get("date") or (named.group(0) if named else "")), str(doc.get("time", "")), p.name)
        if best is None or when > best[0]:
            best = (when, p, doc)
    if best is None:
        return None
    _, p, doc = best
    providers = {}
    for name, r in doc["providers"].items():
        if not isinstance(r, dict) or "error" in r:
            providers[name] = {"error": str(r.get("error") if isinstance(r, dict) else r)}
        else:
            providers[name] = {k: r[k] for k, _, _ in E2E_FIGURES  # (numbers only: a hand-edited "nan" is left out)
                               if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)}
    agreement = {label: doc[k] for k, label in E2E_AGREEMENT.items() if isinstance(doc.get(k), dict)}
    kb = doc.get("kernel_bound") if isinstance(doc.get("kernel_bound"), dict) else {}
    fused = [r.get(k) for r in doc["providers"].values() if isinstance(r, dict)
             for k in ("decode_path_b1", "decode_path_b8")] + [kb.get("variant")]
    return {"file": p.name, "gpu": doc.get("gpu"), "checkpoint": doc.get("checkpoint"), "providers": providers,
            "agreement": agreement, "variants": sorted({v for v in fused if isinstance(v, str) and v != "unfused"}),
            "kernel_bound": doc.get("kernel_bound") if isinstance(doc.get("kernel_bound"), dict) else None}


def totals_of(rows: list[dict], *, loads_measured: bool) -> dict:
    """Footer figures of exactly these rows: variants, built, distinct binaries (objects shared by identical
    sources count once), their bytes, their compile seconds, load ms (None where not measured), flagged."""
    ok = [r for r in rows if r["status"] == "ok"]
    objects = {r.get("key") or r["name"]: r for r in ok}
    return {
        "variants": len(rows), "built": len(ok),
        "distinct_binaries": len(objects),
        "binary_bytes": sum(r["cubin_bytes"] for r in objects.values()),
        "compile_s": round(sum(r["compile_s"] for r in objects.values()), 1),
        "load_ms": round(sum(r["load_ms"] for r in ok if r.get("load_ms") is not None), 2) if loads_measured else None,
        "flagged": sum(1 for r in rows if r["flags"]),
    }


def select(report: dict, names) -> dict:
    """The report restricted to `names` (rows kept in order), its totals recomputed over them."""
    names = set(names)
    rows = [r for r in report["rows"] if r["name"] in names]
    return {**report, "rows": rows,
            "totals": totals_of(rows, loads_measured=report["totals"]["load_ms"] is not None)}


def error_line(error: str | None) -> str:
    """A manifest entry's reason, one line: a compile failure's first line and the compiler's first line that says
    `error` (its whole output is in the manifest and was printed by the build), a refusal as it is."""
    lines = [ln.strip() for ln in (error or "no reason recorded").splitlines() if ln.strip()]
    said = next((ln for ln in lines[1:] if "error" in ln.lower()), lines[1] if len(lines) > 1 else "")
    return f"{lines[0]} {said}".strip()[:400]


def build_report(build_dir: str | Path = "build", *, bench_dir: str | Path | None = None, gpu: bool = True,
                 declared=None, write: bool = True, build_cmd: str | None = None, arch: str | None = None) -> dict:
    """The report of a build directory: {"rows": [one dict per variant], "totals": {...}, "not_declared": [...],
    "not_built": [declared names with no entry in the manifest],
    "e2e": the newest end-to-end result in bench_dir (latest_e2e) or None}.

    declared: variant names still in the variants file ({name: Variant} also checks each entry against the
    variant as declared now and the kernel sources: a stale build is flagged `stale (<field>)` / `stale
    (templates)`, as `megakernel list` says); manifest entries outside it are left out of rows and totals and listed
    in "not_declared" (None: every entry). gpu: measure module load times where CuPy sees a
    GPU. Writes build_dir/report.json and report.csv (every column) unless write=False.
    Raises FileNotFoundError when nothing is built (or nothing declared is), suggesting `build_cmd` (the CLI passes
    the user's --variants/--build-dir; default `megakernel build` with build_dir's flag). arch: the architecture just
    built for (`megakernel build --arch`): a row built for another (kept from an earlier build, where this one was
    refused) names its own, as rows do in a directory of several."""
    build_dir = Path(build_dir)
    build_cmd = build_cmd or f"megakernel build{build_dir_flag(build_dir)}"  # the command a refusal suggests
    manifest = read_manifest(build_dir)
    if not manifest["variants"]:
        raise FileNotFoundError(f"{build_dir}/manifest.json: nothing built yet (run `{build_cmd}`)")
    entries = manifest["variants"]
    not_declared, not_built = [], []
    now = declared if isinstance(declared, dict) else {}
    digest = kernel_sources_digest() if now else None
    if declared is not None:
        declared = set(declared)
        not_declared = sorted(n for n in entries if n not in declared)
        not_built = sorted((n for n in declared if n not in entries), key=natural_key)
        entries = {n: e for n, e in entries.items() if n in declared}
        if not entries:
            raise FileNotFoundError(f"{build_dir}/manifest.json: none of the declared variants is built yet "
                                    f"(run `{build_cmd}`, or pass the variants file it was built from: "
                                    "--variants)")
    loads = measure_load_times({"variants": entries}, build_dir) if gpu else {}
    # figures by the GPU's architecture (sm_90 builds run as sm_90a); labels by what was built (100 and 100a differ)
    label_of = {n: str(e.get("arch", DEFAULT_ARCH)) for n, e in entries.items()}
    arch_of = {n: a.rstrip("a") for n, a in label_of.items()}
    by_arch = {a: latest_bench(Path(bench_dir), a) for a in set(arch_of.values())} if bench_dir else {}
    built_for = sorted({a for n, a in label_of.items() if entries[n]["status"] == "ok"})
    # a directory holding builds for two architectures: each row names its own (not a flag: nothing is wrong)
    mixed = len(built_for) > 1
    rows = []
    for name, e in sorted(entries.items(), key=lambda kv: natural_key(kv[0])):
        st = build_status(e, now.get(name), digest) if now else "built"
        stale = [st] if st.startswith("stale") else []
        if e["status"] == "ok" and (bad := cubin_problem(e, build_dir)):
            stale.append(f"cubin-{bad}")  # as `megakernel list` says; `megakernel build` writes it again
        row = {"name": name, "status": e["status"], "flags": ",".join(flags(e) + stale)}
        if (mixed or (arch is not None and label_of[name] != str(arch))) and e["status"] == "ok":
            row["arch"] = f"sm_{label_of[name]}"
        row.update(plan_fields(e))
        row.update(gpu_fields(e))
        if e["status"] == "ok":
            row.update({k: e["resources"].get(k) for k in COLUMNS if k in e["resources"]})
            row["cached"] = e["resources"].get("cached")
            row["key"] = e.get("key")
            sass = e["resources"].get("sass")  # None: built before counting, or no cuobjdump/nvdisasm
            row["mma_sass"] = None if not sass else sass.get("HMMA", 0) + sass.get("HGMMA", 0)
        else:
            row["error"] = error_line(e.get("error"))
        if name in loads:
            row["load_ms"] = loads[name]["load_ms"]
            row["attributes"] = loads[name]["attributes"]
        row.update(by_arch.get(arch_of[name], {}).get(name, {}))
        timed = row.pop("timed_knobs", None)
        if timed is not None and e["status"] == "ok" and e.get("plan"):
            # the figures were measured with the plan the row's file records: say where this build plans otherwise
            row["timed_plan"] = "other" if knobs_differ(timed, knob_dict(e["plan"])) else "same"
        rows.append(row)
    e2e = latest_e2e(Path(bench_dir), set(arch_of.values())) if bench_dir else None
    report = {"rows": rows, "totals": totals_of(rows, loads_measured=bool(loads)), "archs": built_for,
              "not_declared": not_declared, "not_built": not_built, "e2e": e2e}
    if write:
        buf = io.StringIO()
        cols = COLUMNS + [c for c in BENCH_COLUMNS if any(c in r for r in rows)]
        w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        # (the overrides as the table writes them, KNOB=value: a dict's repr is no CSV cell)
        w.writerows({**r, "overrides": " ".join(f"{k}={x}" for k, x in sorted((r.get("overrides") or {}).items()))}
                    for r in rows)
        try:
            atomic_write(build_dir / "report.json", json.dumps(report, indent=1))
            atomic_write(build_dir / "report.csv", buf.getvalue())
        except OSError as exc:  # a read-only build directory (a shared or CI one) can still be read
            warnings.warn(f"{build_dir}: report.json and report.csv not written ({exc.strerror or exc}); the "
                          "report is shown all the same", stacklevel=2)
    return report


def _num(spec):
    return lambda r, k: "-" if r.get(k) is None else format(r[k], spec)


# (key, header, cell(row, key) -> str, keep): the terminal table's columns, every one shown with --wide. Without
# it, columns with keep=False are left out and the rest dropped in DROP_ORDER's order until the table fits.
TABLE_COLUMNS = [
    ("name", "variant", lambda r, k: r["name"] + (f" ({r['arch']})" if r.get("arch") else ""), True),
    ("gpu_bytes", "MB per\nGPU", lambda r, k: f"{r[k] / 1e6:.{0 if r[k] >= 1e7 else 1}f}"  # (a tiny layer: not 0)
     + (f" ×{r['tp']}" if r.get("tp", 1) > 1 else ""),
     True),
    ("cubin_bytes", "cubin\nKB", lambda r, k: f"{r[k] / 1024:.0f}", True),
    ("ptx_bytes", "PTX\nKB", lambda r, k: f"{r[k] / 1024:.0f}", False),
    ("registers", "regs", _num("d"), True),
    ("spill", "spill\nB", lambda r, k: (lambda s: f"[red]{s}[/red]" if s else "0")(
        r["spill_stores"] + r["spill_loads"]), True),
    ("stack_frame", "stack\nB", _num("d"), False),
    ("smem_total", "smem\nKB", lambda r, k: f"{r[k] / 1024:.1f}", True),
    ("smem_pct", "% of\nsmem", _num(".0f"), False),
    ("l1_bytes", "L1\nKB", lambda r, k: "-" if r.get(k) is None else f"{r[k] / 1024:.0f}", True),
    ("blocks_per_sm", "blk/\nSM", _num("d"), True),
    ("compile_s", "compile\ns", _num(".1f"), False),
    ("load_ms", "load\nms", _num(".2f"), True),
    ("plan", "plan", _plan_cell, True),
    ("split_k", "split-K\nq/o/gu/dn", lambda r, k: r.get(k) or "-", False),
    ("workspace_bytes", "wkspace\nMB", lambda r, k: "-" if r.get(k) is None else f"{r[k] / 1e6:.1f}", False),
    ("mma_sass", "mma\nSASS", _num("d"), False),
    ("fused_us", "fused\nµs", lambda r, k: _num(".1f")(r, k) + r.get("fused_us_mark", ""), True),  # (†: another GPU)
    ("pct_bw", "%\nBW", _num(".1f"), True),
    ("tflops", "TFLOP\n/s", _num(".0f"), True),
    ("route", "prefill\nroute", lambda r, k: r.get(k) or "-", True),
    ("speedup_best", "×\nbest", _num(".2f"), True),
    ("best_baseline", "best\nbaseline", lambda r, k: r.get(k) or "-", True),
    ("speedup_torch_graph", "×\ngraph", _num(".2f"), False),
    ("speedup_compile", "×\ncompile", _num(".2f"), False),
    ("speedup_eager", "×\neager", _num(".2f"), False),
    ("flags", "flags", lambda r, k: f"[yellow]{', '.join(r[k].split(','))}[/yellow]" if r[k] else "", True),
]
# what each flag means, printed under the table for the flags it shows (README.md has the longer story)
FLAG_HELP = [  # (the flag's prefix, its name in the legend, what it means)
    ("spills", "spills", "registers spilled to local memory (slower)"),
    ("refused", "refused", "the planner refused the variant (its reason is on stderr)"),
    ("error", "error", "the build failed (its error is on stderr)"),
    ("smem>", "smem>NKB", "over the block's shared-memory limit"),
    ("no-residency", "no-residency", "no block fits an SM"),
    ("L1<", "L1<NKB", "the block's shared memory leaves less L1 than the planner keeps (decode's weight streams "
                      "slow 3-11 %)"),
    ("wgmma-serialized", "wgmma-serialized", "ptxas serialised the prefill GEMM's wgmma (slower, not wrong)"),
    ("mem>", "mem>NGB", "one layer's weights, KV cache and workspace exceed the largest GPU of the arch"),
    ("tuned-plan-unused", "tuned-plan-unused", "the tuning entry was not used: the default plan was built (the "
                                               "build's warning says why)"),
    ("stale", "stale (...)", "the build no longer matches the declaration, the templates or (stale (tuning)) the "
     "tuning file it took its plan from: rebuild (with the same --tuned-for FILE where it used one)"),
    ("cubin-missing", "cubin-missing", "the manifest names a cubin that is not there: rebuild"),
    ("cubin-damaged", "cubin-damaged", "the cubin is not the size that was compiled: rebuild"),
]
# a table column whose cell is its row's value (or "-"): left out where no row has one
PLAIN_KEYS = {"gpu_bytes", "cubin_bytes", "ptx_bytes", "registers", "stack_frame", "smem_total", "smem_pct", "l1_bytes",
              "blocks_per_sm", "compile_s", "load_ms", "workspace_bytes", "mma_sass"}
# dropped first to last where the console is too narrow; variant, µs, ×, flags stay
DROP_ORDER = ["l1_bytes", "cubin_bytes", "load_ms", "gpu_bytes", "plan", "best_baseline", "route", "tflops", "pct_bw",
              "blocks_per_sm", "smem_total", "spill", "registers"]
BENCH_KEYS = {"fused_us", "pct_bw", "tflops", "route", "speedup_best", "best_baseline", "speedup_torch_graph",
              "speedup_compile",
              "speedup_eager"}


def _table(rows: list[dict], cols: list[tuple]) -> Table:
    t = Table(title="megakernel: cost per variant", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1))
    for key, head, _, _ in cols:
        if key == "name":
            t.add_column(head, justify="left", no_wrap=True)
        elif key in ("flags", "best_baseline", "plan", "route"):
            t.add_column(head, justify="left", no_wrap=True)
        else:
            t.add_column(head, justify="right", no_wrap=True)
    for r in rows:
        if r["status"] != "ok":
            cells = [r["name"] if k == "name" else f"[red]{r['flags']}[/red]" if k == "flags"
                     else "-" for k, _, _, _ in cols]
        else:
            cells = [cell(r, key) for key, _, cell, _ in cols]
        t.add_row(*cells)
    return t


def print_fitted(console: Console, make_table, cols: list[tuple], drop_order: list[str], wide: bool = False) -> None:
    """Print `make_table(cols)` (cols: tuples keyed by their first item, headed by their second). With `wide`, every
    column at its natural width, however wide the console; else at the console's width: the columns named in
    `drop_order` are dropped first to last until the table fits without cutting a cell, and a line under it names
    those not shown (`--wide` shows them)."""
    unbounded = console.options.update_width(100_000)
    natural = lambda t: Measurement.get(console, unbounded, t).maximum  # noqa: E731 - width with nothing cut
    t = make_table(cols)
    if wide:
        saved = console._width  # print's own width= is capped at the console's: widen the console for this table
        console.width = max(console.width, natural(t))
        try:
            console.print(t)
        finally:
            console._width = saved
        return
    drop, hidden = list(drop_order), []
    while drop and natural(t) > console.width:
        key = drop.pop(0)
        # (a header's lines joined: "TFLOP\n/s" as TFLOP/s, "blk/\nSM" as blk/SM, "×\nbest" as × best)
        hidden += [re.sub(r"\n(?=/)|(?<=/)\n", "", c[1]).replace("\n", " ") for c in cols if c[0] == key]
        cols = [c for c in cols if c[0] != key]
        t = make_table(cols)
    console.print(t)
    if hidden:
        console.print(f"not shown at this width: {', '.join(hidden)} (--wide shows every column)", highlight=False)


def print_report(report: dict, console: Console | None = None, *, wide: bool = False) -> None:
    """The terminal table of a report and its footer, then the end-to-end table where the report has one. Without
    `wide`, the columns that fit the console's width (variant, fused µs, × best and flags always); with it, every
    column at its natural width."""
    console = console or Console()
    rows = report["rows"]
    present = {k for r in rows for k, v in r.items() if v is not None}
    cols = [c for c in TABLE_COLUMNS if c[0] not in BENCH_KEYS or c[0] in present]
    if not wide:  # the columns kept with a figure in some row (load ms without a GPU is all "-")
        cols = [c for c in cols if c[3] and (c[0] not in PLAIN_KEYS or any(r.get(c[0]) is not None for r in rows))]
    files = sorted({r["bench_file"] for r in rows if r.get("bench_file")})
    if files:  # said above the table too: a quick reader takes the timings for this machine's
        console.print("timings: from a device run (its file named below), not from this machine", highlight=False)
    # each variant's newest run: where those were timed on more than one GPU, the rows of the others are marked
    gpus = Counter(r.get("bench_gpu") or "" for r in rows if r.get("bench_file"))
    most = max(gpus, key=lambda g: (gpus[g], g)) if len(gpus) > 1 else None  # (a tie: the last name, stable)
    marked = [{**r, "fused_us_mark": "†"} if most is not None and r.get("bench_file")
              and (r.get("bench_gpu") or "") != most else r for r in rows]
    print_fitted(console, lambda cs: _table(marked, cs), cols, DROP_ORDER, wide)
    if any(r.get("arch") for r in rows):
        console.print("(sm_N): the architecture a variant was built for (this build directory holds builds for more "
                      "than one, or the build just run was for another and kept this one; a kernel loads only on a "
                      "GPU of its architecture)", highlight=False)
    shown = {f.strip() for r in rows for f in (r.get("flags") or "").split(",") if f.strip()}
    for prefix, label, what in FLAG_HELP:
        if any(f.startswith(prefix) for f in shown):
            console.print(f"[yellow]{label}[/yellow]: {what}", highlight=False, markup=True)
    tot = report["totals"]
    archs = report.get("archs") or []  # one architecture other than the default: said (two: each row says its own)
    other = f" for sm_{archs[0]}" if len(archs) == 1 and archs[0] != DEFAULT_ARCH else ""
    console.print(f"{tot['built']}/{tot['variants']} built{other}, "
                  f"{counted(tot['distinct_binaries'], 'distinct binary', 'distinct binaries')}, "
                  f"{tot['binary_bytes'] / 2**20:.1f} MiB of cubins, {tot['compile_s']} s of compile time"
                  + (f", {tot['load_ms']} ms to load all" if tot["load_ms"] is not None else ", load time: no GPU")
                  + (f"; [yellow]{tot['flagged']} flagged[/yellow]" if tot["flagged"] else ""))
    if files:  # the benchmark columns are a device run's, read from bench/results, not this machine's
        console.print(f"fused µs, % BW, TFLOP/s, route and × columns: measured in {', '.join(files)} "
                      "(in --bench-dir, bench/results by default; their GPU is in the name), not on this machine", highlight=False)
        if most is not None:  # (each variant's newest run: a later check of a few rows on another GPU mixes them)
            for gpu in sorted(g for g in gpus if g != most):
                names = [r["name"] for r in rows if r.get("bench_file") and (r.get("bench_gpu") or "") == gpu]
                console.print(f"[yellow]† timed on {gpu or 'an unnamed GPU'}, not {most or 'an unnamed GPU'} as the "
                              f"others:[/yellow] {', '.join(names)}", highlight=False)
        other = [r["name"] for r in rows if r.get("timed_plan") == "other"]
        if other:  # said here too: a narrow table drops the plan column (after L1) first
            console.print(f"[yellow]timed with another plan than the one built:[/yellow] {', '.join(other)}",
                          highlight=False)
    e2e = report.get("e2e")
    # (another model's run is left out: a user's own build is not the benchmark's checkpoint; report.json keeps it)
    if e2e and (not e2e.get("variants") or {r["name"] for r in rows} & set(e2e["variants"])):
        print_e2e(e2e, console)


def print_e2e(e2e: dict, console: Console) -> None:
    """The end-to-end table (ms per provider: time to first token, ms per output token; the columns some provider
    recorded), its file as caption, then greedy agreement with transformers fp32 and, where measured, how far ms per
    token at batch 1 is above the kernels' own time."""
    provs = e2e["providers"]
    figs = [f for f in E2E_FIGURES if any(f[0] in r for r in provs.values())]
    # the benchmark's own checkpoint, whatever model the variants file declares: say which one was measured
    ck = f", checkpoint {Path(str(e2e['checkpoint'])).name}" if e2e.get("checkpoint") else ""
    # a terminal too narrow for every figure column gets the columns over several tables (never a cut number):
    # ~11 characters a figure, ~16 for the provider column (it wraps)
    per = max(1, (console.width - 16) // 11)
    parts = [figs[i:i + per] for i in range(0, len(figs), per)] or [[]]
    caption = f"{e2e['file']}" + (f", {e2e['gpu']}" if e2e.get("gpu") else "")
    for i, part in enumerate(parts):
        t = Table(title=f"end to end (bench/e2e.py{ck})" if i == 0 else None,
                  caption=caption if i == len(parts) - 1 else None, header_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 1))
        t.add_column("provider", justify="left", min_width=12)
        for _, head, _ in part:
            t.add_column(head, justify="right", no_wrap=True)
        for name, r in provs.items():
            if "error" in r:
                t.add_row(name, *(["[red]error[/red]"] + ["-"] * (len(part) - 1))[:len(part)])
            else:
                t.add_row(name, *["-" if r.get(k) is None else format(r[k], spec) for k, _, spec in part])
        console.print(t)
    for name, r in provs.items():
        if "error" in r:
            console.print(f"{name}: error: {r['error']}", markup=False, highlight=False)
    agree = [f"{label} {a.get('greedy_tokens_equal_before_divergence', '?')} of {a.get('of', '?')}"
             + (f" (logits {a['logits_rel_err']:.1e})" if isinstance(a.get("logits_rel_err"), float) else "")
             for label, a in e2e.get("agreement", {}).items()]
    kb = e2e.get("kernel_bound") or {}
    line = ("greedy tokens equal to transformers fp32 before divergence: " + ", ".join(agree)) if agree else ""
    if kb.get("ratio") is not None:
        line += ("; " if line else "") + f"ms/token b1 = {kb['ratio']:.2f} × the kernels' time" + (
            f" ({kb['bound_ms']:.3f} ms: layers + lm_head)" if kb.get("bound_ms") is not None else "")
    if kb.get("layer_eager_call_us") is not None:
        unchecked = kb.get("layer_eager_call_unchecked_us")
        line += (("; " if line else "") + f"one layer from Python: {kb['layer_eager_call_us']} µs a call"
                 + (f" ({unchecked} µs with validate=False)" if unchecked is not None else "")
                 + f", its kernel {kb.get('layer_kernel_us')} µs")
    if line:
        console.print(line, markup=False, highlight=False)
