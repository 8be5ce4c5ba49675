"""Resource report: what each variant costs (binary, registers, spills, shared memory, load time), joined with the
latest benchmark figures where there are any. Terminal table + build/report.json + build/report.csv."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .compile import atomic_write, read_manifest
from .targets import DEFAULT_ARCH, arch as get_arch

COLUMNS = ["name", "status", "cubin_bytes", "ptx_bytes", "registers", "spill_stores", "spill_loads", "stack_frame",
           "static_smem", "dynamic_smem", "smem_total", "smem_pct", "blocks_per_sm", "compile_s", "load_ms",
           "flags"]
BENCH_COLUMNS = ["fused_us", "pct_bw", "speedup_torch_graph", "speedup_eager", "speedup_compile"]


def flags(entry: dict) -> list[str]:
    """What a user must not miss: spills, over-budget shared memory, a refused or failed build."""
    out = []
    if entry["status"] != "ok":
        out.append(entry["status"])
        return out
    r = entry["resources"]
    if r["spill_stores"] or r["spill_loads"]:
        out.append("spills")
    limit = r.get("smem_limit") or get_arch(entry.get("arch", DEFAULT_ARCH)).smem_per_block
    if r["smem_total"] > limit:
        out.append(f"smem>{limit // 1024}KB")
    if r["blocks_per_sm"] < 1:
        out.append("no-residency")
    return out


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
        k = mod.get_function("decoder_layer")
        _ = k.kernel
        ms = (time.perf_counter() - t0) * 1e3
        out[name] = {"load_ms": round(ms, 3), "attributes": {a: k.attributes[a] for a in
                     ("num_regs", "local_size_bytes", "shared_size_bytes", "max_threads_per_block")}}
    return out


def latest_bench(bench_dir: Path) -> dict[str, dict]:
    """Per variant: the fused provider's figures and speedups from the newest bench/results/*.json."""
    docs = []
    for p in bench_dir.glob("*.json"):
        try:
            doc = json.loads(p.read_text())
        except ValueError:
            continue
        if any("provider" in r for r in doc.get("rows", [])):  # benchmark files only (not gpu_check's)
            docs.append((p.stat().st_mtime, p, doc))
    if not docs:
        return {}
    _, path, doc = max(docs, key=lambda d: d[0])
    files = [path]
    out = {}
    for row in doc.get("rows", []):
        if row.get("provider") != "fused":
            continue
        out[row["variant"]] = {"fused_us": row.get("us_median"), "pct_bw": row.get("pct_bw"),
                               "speedup_torch_graph": row.get("speedup_vs_torch_graph"),
                               "speedup_eager": row.get("speedup_vs_eager"),
                               "speedup_compile": row.get("speedup_vs_compile"),
                               "bench_file": files[-1].name}
    return out


def build_report(build_dir: str | Path = "build", *, bench_dir: str | Path | None = None, gpu: bool = True) -> dict:
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    if not manifest["variants"]:
        raise FileNotFoundError(f"{build_dir}/manifest.json: nothing built yet (run `megakernel build`)")
    loads = measure_load_times(manifest, build_dir) if gpu else {}
    bench = latest_bench(Path(bench_dir)) if bench_dir else {}
    rows = []
    for name, e in sorted(manifest["variants"].items()):
        row = {"name": name, "status": e["status"], "flags": ",".join(flags(e))}
        if e["status"] == "ok":
            row.update({k: e["resources"].get(k) for k in COLUMNS if k in e["resources"]})
            row["cached"] = e["resources"].get("cached")
        else:
            row["error"] = e.get("error", "").splitlines()[0]
        if name in loads:
            row["load_ms"] = loads[name]["load_ms"]
            row["attributes"] = loads[name]["attributes"]
        row.update(bench.get(name, {}))
        rows.append(row)
    ok = [r for r in rows if r["status"] == "ok"]
    objects = {e["key"]: e["resources"]["cubin_bytes"] for e in manifest["variants"].values() if e["status"] == "ok"}
    compile_s = {e["key"]: e["resources"]["compile_s"] for e in manifest["variants"].values() if e["status"] == "ok"}
    totals = {
        "variants": len(rows), "built": len(ok),
        "distinct_binaries": len(objects),
        "binary_bytes": sum(objects.values()),
        "compile_s": round(sum(compile_s.values()), 1),
        "load_ms": round(sum(r["load_ms"] for r in ok if r.get("load_ms") is not None), 2) if loads else None,
        "flagged": sum(1 for r in rows if r["flags"]),
    }
    report = {"rows": rows, "totals": totals}
    atomic_write(build_dir / "report.json", json.dumps(report, indent=1))
    buf = io.StringIO()
    cols = COLUMNS + [c for c in BENCH_COLUMNS if any(c in r for r in rows)]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write(build_dir / "report.csv", buf.getvalue())
    return report


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    rows = report["rows"]
    bench_cols = [c for c in BENCH_COLUMNS if any(r.get(c) is not None for r in rows)]
    t = Table(title="megakernel: cost per variant", show_lines=False, header_style="bold")
    short = {"fused_us": "fused µs", "pct_bw": "% BW", "speedup_torch_graph": "× graph", "speedup_eager": "× eager",
             "speedup_compile": "× compile"}
    heads = ["variant", "cubin KB", "PTX KB", "regs", "spill B", "stack", "smem KB", "% of 227KB", "blk/SM",
             "compile s", "load ms"] + [short[c] for c in bench_cols] + ["flags"]
    for h in heads:
        t.add_column(h, justify="left" if h in ("variant", "flags") else "right", no_wrap=h == "variant")
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["name"], *["-"] * (len(heads) - 2), f"[red]{r['flags']}[/red]")
            continue
        spill = r["spill_stores"] + r["spill_loads"]
        cells = [r["name"], f"{r['cubin_bytes'] / 1024:.0f}", f"{r['ptx_bytes'] / 1024:.0f}", str(r["registers"]),
                 f"[red]{spill}[/red]" if spill else "0", str(r["stack_frame"]),
                 f"{r['smem_total'] / 1024:.1f}", f"{r['smem_pct']:.0f}", str(r["blocks_per_sm"]),
                 f"{r['compile_s']:.1f}", "-" if r.get("load_ms") is None else f"{r['load_ms']:.2f}"]
        cells += ["-" if r.get(c) is None else f"{r[c]:.1f}" if c in ("fused_us", "pct_bw") else f"{r[c]:.2f}"
                  for c in bench_cols]
        cells.append(f"[yellow]{r['flags']}[/yellow]" if r["flags"] else "")
        t.add_row(*cells)
    console.print(t)
    tot = report["totals"]
    console.print(f"{tot['built']}/{tot['variants']} built, {tot['distinct_binaries']} distinct binaries, "
                  f"{tot['binary_bytes'] / 2**20:.1f} MiB of cubins, {tot['compile_s']} s of compile time"
                  + (f", {tot['load_ms']} ms to load all" if tot["load_ms"] is not None else ", load time: no GPU")
                  + (f"; [yellow]{tot['flagged']} flagged[/yellow]" if tot["flagged"] else ""))
