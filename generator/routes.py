"""Measured routes: which path (the fused kernel or the unfused PyTorch layer) serves a variant on a GPU.

`megakernel bench` times every prefill variant against the unfused layer (cuBLAS + SDPA, CUDA graph) and records
the faster path here, per GPU: routes/<gpu-slug>.json = {"gpu": name, "date": ..., "routes": {variant: {"path":
"fused"|"unfused", "fused_us": float, "unfused_us": float}}}. The runtime reads it; MEGAKERNEL_ROUTE=fused|unfused
overrides every variant (a user who wants one path whatever was measured).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROUTES_DIR = Path(__file__).resolve().parent.parent / "routes"
PATHS = ("fused", "unfused")


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (file names of results and routes)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def routes_file(gpu: str, routes_dir: Path | None = None) -> Path:
    return Path(routes_dir or ROUTES_DIR) / f"{gpu_slug(gpu)}.json"


def read_routes(gpu: str, routes_dir: Path | None = None) -> dict:
    """{variant: {"path", "fused_us", "unfused_us"}} measured on `gpu` ({} where nothing was measured)."""
    try:
        doc = json.loads(routes_file(gpu, routes_dir).read_text())
    except (OSError, ValueError):
        return {}
    got = doc.get("routes") if isinstance(doc, dict) else None
    return {k: r for k, r in got.items() if isinstance(r, dict)} if isinstance(got, dict) else {}


# a recorded route changes only when the other path is faster by more than this fraction: the two paths' run-to-run
# spread on the H200 is ~1-2 % (8B 4 x 64 tokens measured 343.8 vs 344.3 us, then 347.2 vs 345.0)
ROUTE_MARGIN = 0.02


def record(gpu: str, rows: dict, routes_dir: Path | None = None, date: str = "", prior: dict | None = None) -> Path:
    """Merge {variant: {"fused_us", "unfused_us"}} (µs per layer; fused None: the fused kernel failed its check)
    into the GPU's routes file; path = the faster one, except that a variant already recorded keeps its path while
    the two are within ROUTE_MARGIN of each other (a tie must not flip the route from run to run). prior: the
    routes so far (read_routes' form) where not the file's own."""
    path = routes_file(gpu, routes_dir)
    doc = {"gpu": gpu, "date": date, "routes": dict(prior) if prior is not None else read_routes(gpu, routes_dir)}
    for name, r in rows.items():
        fused, unfused = r.get("fused_us"), r.get("unfused_us")
        best = "fused" if fused is not None and (unfused is None or fused <= unfused) else "unfused"
        prev = doc["routes"].get(name, {}).get("path")  # read_routes keeps dict entries only
        if prev in PATHS and fused is not None and unfused is not None and \
                abs(fused - unfused) <= ROUTE_MARGIN * min(fused, unfused):
            best = prev
        doc["routes"][name] = {"path": best, "fused_us": fused, "unfused_us": unfused}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def record_checked(gpu: str, rows: list[dict], routes_dir: Path | None = None, date: str = "",
                   seed_dir: Path | None = None) -> Path | None:
    """Record the routes of prefill rows as bench.measure.check_prefill returns them (the timed ones: "us" present):
    the faster path of a row that passed its reference check (record's margin kept); "unfused" for one that failed
    it (a wrong fused kernel must not keep an older "fused" route). Each timed row's "route" becomes the path
    recorded (what the runtime will take). seed_dir: where the routes so far live when routes_dir starts empty
    (gpu_check records into $OUT from routes/). Returns the routes file, or None when no row was timed."""
    timed = {r["variant"]: {"fused_us": r["us"] if r.get("pass") else None, "unfused_us": r["unfused_us"]}
             for r in rows if "us" in r}
    if not timed:
        return None
    fresh = seed_dir is not None and not routes_file(gpu, routes_dir).exists()
    path = record(gpu, timed, routes_dir, date, prior=read_routes(gpu, seed_dir) if fresh else None)
    now = read_routes(gpu, routes_dir)
    for r in rows:
        if "us" in r:
            r["route"] = now[r["variant"]]["path"]
    return path


def route(variant: str, gpu: str, routes_dir: Path | None = None) -> tuple[str, str]:
    """(path, why) for `variant` on `gpu`: the MEGAKERNEL_ROUTE override, else the measured route, else "fused"
    (not measured on this GPU). Raises ValueError for a bad override."""
    forced = os.environ.get("MEGAKERNEL_ROUTE", "")
    if forced:
        if forced not in PATHS:
            raise ValueError(f"MEGAKERNEL_ROUTE: must be one of {', '.join(PATHS)}, got {forced!r}")
        return forced, "MEGAKERNEL_ROUTE"
    r = read_routes(gpu, routes_dir).get(variant)
    if r is None:
        return "fused", f"no measurement for {gpu} in {routes_file(gpu, routes_dir)}"
    if r.get("fused_us") is None:
        return r["path"], f"measured on {gpu}: the fused kernel failed its reference check"
    return r["path"], (f"measured on {gpu}: fused {r['fused_us']} µs, unfused {r['unfused_us']} µs")
