"""Result files of `megakernel bench`: one row per (variant, provider), the fused row's speedups, and the
<gpu>-<date>.json / .csv files (plain Python, no GPU)."""
from __future__ import annotations

import csv
import io
import json
import re
import time
from pathlib import Path

from bench.providers import BASELINES

FIELDS = ["variant", "provider", "batch", "seq_len", "layers_timed", "us_median", "us_p10", "us_p90", "bytes",
          "gbps", "pct_bw", "floor_us", "tokens_per_s", "speedup_vs_best", "best_baseline",
          *[f"speedup_vs_{b}" for b in BASELINES], "status", "error"]
EXTRA_FIELDS = ["model", "rel_err", "compile_s", "compile_graphs"]
POSITIONS_NOTE = "every sequence at pos = seq_len-1 (full KV context, the worst case for decode)"


def make_row(variant: str, provider: str, *, model: str, batch: int, seq_len: int, model_layers: int,
             layers_timed: int | None, nbytes: int, copy_gbps: float, stats: dict | None = None,
             status: str = "ok", error: str | None = None, **extra) -> dict:
    """One (variant, provider) row (keys FIELDS + EXTRA_FIELDS + extra).

    stats: {"median", "p10", "p90"} in µs per layer where the provider was timed (None otherwise: only the floor is
    filled). nbytes: bytes one layer step must move; copy_gbps: the copy bandwidth (GB/s, read + write) the floor
    and % of bandwidth are measured against; model_layers: the model's depth, for tokens/s."""
    row = dict.fromkeys(FIELDS + EXTRA_FIELDS)
    row.update(variant=variant, provider=provider, model=model, batch=batch, seq_len=seq_len,
               layers_timed=layers_timed, bytes=int(nbytes), status=status, error=error)
    if copy_gbps:
        row["floor_us"] = round(nbytes / (copy_gbps * 1e9) * 1e6, 3)
    if stats is not None:
        us = stats["median"]
        row.update(us_median=round(us, 3), us_p10=round(stats["p10"], 3), us_p90=round(stats["p90"], 3))
        gbps = nbytes / (us * 1e-6) / 1e9
        row["gbps"] = round(gbps, 1)
        row["pct_bw"] = round(100 * gbps / copy_gbps, 1) if copy_gbps else None
        row["tokens_per_s"] = round(batch * 1e6 / (us * model_layers), 1)
    for key, value in extra.items():
        row[key] = value
    return row


def _timed(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok" and bool(r.get("us_median"))


def add_speedups(rows: list[dict]) -> list[dict]:
    """On each variant's fused row: speedup_vs_<baseline> = baseline median / fused median for every baseline
    (every registered baseline, and any other non-fused provider in the rows), and speedup_vs_best against the
    fastest baseline timed, named in best_baseline (None where the baseline or the fused provider was not timed).
    Other rows keep None. Returns `rows` (changed in place)."""
    by_variant: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], {})[r["provider"]] = r
    for provs in by_variant.values():
        fused = provs.get("fused")
        if fused is None:
            continue
        ok = _timed(fused)
        baselines = list(BASELINES) + [p for p in provs if p != "fused" and p not in BASELINES]
        for b in baselines:
            base = provs.get(b)
            fused[f"speedup_vs_{b}"] = round(base["us_median"] / fused["us_median"], 3) if ok and _timed(base) \
                else None
        timed = [provs[b] for b in baselines if _timed(provs.get(b))]
        best = min(timed, key=lambda r: r["us_median"]) if ok and timed else None
        fused["best_baseline"] = best["provider"] if best else None
        fused["speedup_vs_best"] = round(best["us_median"] / fused["us_median"], 3) if best else None
    return rows


def gpu_slug(name: str) -> str:
    """The GPU's name as a file-name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def result_stem(out_dir: Path, gpu: str, date: str, prefix: str = "") -> str:
    """<prefix><gpu>-<date>; a second run on the same day gets -HHMMSS so it does not overwrite the first."""
    stem = f"{prefix}{gpu_slug(gpu)}-{date}"
    if (Path(out_dir) / f"{stem}.json").exists():
        stem += time.strftime("-%H%M%S")
    return stem


def write_results(doc: dict, out_dir: Path, stem: str) -> tuple[Path, Path]:
    """<stem>.json (the whole document) and <stem>.csv (its rows, FIELDS then the EXTRA_FIELDS any row has; None is
    an empty cell), each written atomically. Returns (json path, csv path)."""
    from generator.compile import atomic_write
    out_dir = Path(out_dir)
    jpath, cpath = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    atomic_write(jpath, json.dumps(doc, indent=1, default=str) + "\n")
    buf = io.StringIO()
    cols = FIELDS + [c for c in EXTRA_FIELDS if any(r.get(c) is not None for r in doc["rows"])]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in doc["rows"]:
        w.writerow({k: ("" if r.get(k) is None else r[k]) for k in cols})
    atomic_write(cpath, buf.getvalue())
    return jpath, cpath
